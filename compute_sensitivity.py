"""Measure each point's sensitivity at checkpoints: `perinstance sensitivity`, under the paper repository's script name.

The code is perinstance/cli/sensitivity.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("sensitivity")
else:  # imported: the command's parser and main
    from perinstance.cli.sensitivity import build_parser, main  # noqa: F401

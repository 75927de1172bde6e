"""Audit per-instance privacy bounds from below: `perinstance audit`, under the paper repository's script name.

The code is perinstance/cli/audit.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("audit")
else:  # imported: the command's parser and main
    from perinstance.cli.audit import build_parser, main  # noqa: F401

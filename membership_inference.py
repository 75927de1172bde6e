"""Loss-threshold membership inference per class: `perinstance membership`, under the paper repository's script name.

The code is perinstance/cli/membership.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("membership")
else:  # imported: the command's parser and main
    from perinstance.cli.membership import build_parser, main  # noqa: F401

"""Per-instance privacy over a whole training run: `perinstance compose`, under the paper repository's script name.

The code is perinstance/cli/compose.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("compose")
else:  # imported: the command's parser and main
    from perinstance.cli.compose import build_parser, main  # noqa: F401

"""Per-step per-instance (ε, δ) guarantees: `perinstance eps-delta`, under the paper repository's script name.

The code is perinstance/cli/eps_delta.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("eps-delta")
else:  # imported: the command's parser and main
    from perinstance.cli.eps_delta import build_parser, main  # noqa: F401

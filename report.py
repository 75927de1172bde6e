"""Per-point privacy of one run: `perinstance report`, as a script of the repository.

The code is perinstance/cli/report.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("report")
else:  # imported: the command's parser and main
    from perinstance.cli.report import build_parser, main  # noqa: F401

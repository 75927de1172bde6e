"""Reproduce the papers' findings (the main job): `perinstance reproduce`, under the paper repository's script name.

The code is perinstance/cli/reproduce.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("reproduce")
else:  # imported: the command's parser and main
    from perinstance.cli.reproduce import build_parser, main  # noqa: F401

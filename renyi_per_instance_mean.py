"""Per-step per-instance Rényi DP of the mean rule: `perinstance renyi-mean`, under the paper repository's script name.

The code is perinstance/cli/renyi_mean.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("renyi-mean")
else:  # imported: the command's parser and main
    from perinstance.cli.renyi_mean import build_parser, main  # noqa: F401

"""Per-step per-instance Rényi DP of the sum rule: `perinstance renyi-sum`, under the paper repository's script name.

The code is perinstance/cli/renyi_sum.py; this script runs it after the process is set up (perinstance/cli/main.py).
"""

from perinstance.cli import main as cli

if __name__ == "__main__":
    cli.run_script("renyi-sum")
else:  # imported: the command's parser and main
    from perinstance.cli.renyi_sum import build_parser, main  # noqa: F401

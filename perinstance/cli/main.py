"""The `perinstance` command: every command of the suite under one name.

    perinstance reproduce                      # the main job: train, measure, account, draw, report
    perinstance train --sigma 1.0              # a command, with its own flags
    perinstance train --help

Each command is also a script of the paper repository with the same flags and outputs (train_dpsgd.py is
`perinstance train`, COMMANDS). Both entry points set up the process before they import a command, hence
torch: the shared-machine settings (perinstance.apply_shared_machine_settings) and matplotlib's Agg backend.
This module imports neither torch nor a command.
"""

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NoReturn

import perinstance
from perinstance.errors import EXIT_USAGE, run_main


@dataclass(frozen=True)
class Subcommand:
    """A command of `perinstance`: the module that holds its flags and `main`, and the paper repository's
    script that runs it."""

    module: str
    script: str

    def summary(self) -> str:
        """The first line of the command's docstring (its --help text), read without importing the command."""
        with open(importlib.util.find_spec(self.module).origin, encoding="utf-8") as handle:
            return ast.get_docstring(ast.parse(handle.read())).splitlines()[0]


COMMANDS = {
    "train": Subcommand("perinstance.cli.train", "train_dpsgd.py"),
    "sensitivity": Subcommand("perinstance.cli.sensitivity", "compute_sensitivity.py"),
    "eps-delta": Subcommand("perinstance.cli.eps_delta", "eps_delta.py"),
    "renyi-sum": Subcommand("perinstance.cli.renyi_sum", "renyi_per_instance_sum.py"),
    "renyi-mean": Subcommand("perinstance.cli.renyi_mean", "renyi_per_instance_mean.py"),
    "compose": Subcommand("perinstance.cli.compose", "renyi_per_instance_sum_compo.py"),
    "audit": Subcommand("perinstance.cli.audit", "audit.py"),
    "membership": Subcommand("perinstance.cli.membership", "membership_inference.py"),
    "report": Subcommand("perinstance.cli.report", "report.py"),
    "reproduce": Subcommand("perinstance.cli.reproduce", "reproduce.py"),
}


def overview() -> str:
    """`perinstance --help`: every command, its summary and its script."""
    lines = ["usage: perinstance COMMAND [FLAGS ...]",
             "       perinstance COMMAND --help      the command's flags",
             "",
             f"Per-instance privacy accounting of DP-SGD (perinstance {perinstance.__version__}). Every number it "
             "prints is a bound",
             "(under which δ) or an estimate (with its interval).",
             "",
             "commands (each also runs as the paper repository's script in brackets, with the same flags):"]
    width = max(map(len, COMMANDS))
    for name, command in COMMANDS.items():
        lines += [f"  {name:<{width}}  {command.summary()}", f"  {'':<{width}}  ({command.script})"]
    return "\n".join(lines)


def prepare_process() -> None:
    """What a command-line process sets before it imports a command (hence torch): the shared-machine settings,
    and matplotlib's Agg backend (figures go to files; the training machines have no display)."""
    perinstance.apply_shared_machine_settings()
    import matplotlib

    matplotlib.use("Agg")


def run_command(name: str, argv: Sequence[str] | None, prog: str | None) -> NoReturn:
    """The process set up, then the command `name`'s main(argv) under run_main (a one-line error and exit 2
    for bad input). `prog`: the name its --help shows (None: the running script's)."""
    prepare_process()
    module = importlib.import_module(COMMANDS[name].module)
    run_main(partial(module.main, prog=prog), None if argv is None else list(argv))


def run_script(name: str) -> NoReturn:
    """A top-level script of the paper repository (train_dpsgd.py ...): the command `name` on the script's
    command line."""
    run_command(name, None, None)


def script_mains() -> dict[str, Callable[[list[str]], object]]:
    """Every command's main but reproduce's, by its script's name: what a reproduction runs (in this process) and
    lists in its report as the scripts' command lines."""
    return {command.script: importlib.import_module(command.module).main
            for name, command in COMMANDS.items() if name != "reproduce"}


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The `perinstance` command (the console script, and `python -m perinstance`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(overview())
        sys.exit(0)
    if argv[:1] == ["--version"]:
        print(f"perinstance {perinstance.__version__}")
        sys.exit(0)
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"error: {given} (allowed: {', '.join(COMMANDS)}; perinstance --help describes them)", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    run_command(argv[0], argv[1:], f"perinstance {argv[0]}")

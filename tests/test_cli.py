"""The `perinstance` command (perinstance/cli/main.py): one name for every command of the suite, each the same
command as the paper repository's script of COMMANDS (same parser, same main), listed by `perinstance --help`."""

import importlib
import os
import subprocess
import sys

import pytest
from conftest import ROOT, load_script

import perinstance
from perinstance.cli import main as cli


def perinstance_command(*argv):
    return subprocess.run([sys.executable, "-m", "perinstance", *argv], cwd=ROOT, capture_output=True, text=True)


def test_help_lists_every_command_with_its_script_and_summary():
    result = perinstance_command("--help")
    assert result.returncode == 0, result.stderr
    for name, command in cli.COMMANDS.items():
        assert f"  {name}  " in result.stdout and f"({command.script})" in result.stdout
        docstring = importlib.import_module(command.module).__doc__
        assert command.summary() == docstring.splitlines()[0] and command.summary() in result.stdout
    assert perinstance_command("--version").stdout == f"perinstance {perinstance.__version__}\n"


@pytest.mark.parametrize("argv, message", [([], "no command given"), (["trian"], "unknown command 'trian'")])
def test_a_missing_or_unknown_command_is_one_line_naming_the_commands(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}") and "eps-delta, renyi-sum" in lines[0]


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_script_is_its_command(name):
    command = cli.COMMANDS[name]
    module = importlib.import_module(command.module)
    script = load_script(command.script)
    assert script.main is module.main and script.build_parser is module.build_parser
    # The same flags under both names; the command's --help names itself.
    flags = [action.option_strings for action in module.build_parser()._actions]
    named = module.build_parser(f"perinstance {name}")
    assert [action.option_strings for action in named._actions] == flags
    assert named.format_usage().startswith(f"usage: perinstance {name} ")
    assert os.path.isfile(os.path.join(ROOT, command.script))


def test_a_command_runs_with_its_own_name_and_the_accountants_import_no_torch():
    probe = ("import runpy, sys\nsys.argv = ['perinstance', 'eps-delta', '--res-name', 'missing']\n"
             "try:\n    runpy.run_module('perinstance', run_name='__main__', alter_sys=True)\n"
             "except SystemExit as stop:\n    print(stop.code, 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.stdout.split() == ["2", "False"], result.stderr
    assert result.stderr.startswith("error: --res-name: no result file at res/missing.csv")


def test_a_reproduction_runs_every_other_command_by_its_script_name():
    mains = cli.script_mains()
    assert set(mains) == {command.script for name, command in cli.COMMANDS.items() if name != "reproduce"}
    assert mains["eps_delta.py"] is importlib.import_module("perinstance.cli.eps_delta").main

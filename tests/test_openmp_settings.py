"""The shared-machine OpenMP setting (perinstance/openmp_settings.py): added unless the user chose a wait
policy, by the command line's entry points (the scripts and the `perinstance` command) before torch loads,
never by an import (tests/test_import_side_effects.py)."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

from perinstance import openmp_settings

SCRIPTS = sorted(name for name in os.listdir(ROOT) if name.endswith(".py"))
# Runs an entry point (a script's path, or a module run as `python -m`) with the given argv, and prints the wait
# policy as the first import of torch found it ("-" when torch was never imported), then as the process left it.
PROBE = """
import os, runpy, sys

class TorchImport:
    seen = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and TorchImport.seen is None:
            TorchImport.seen = os.environ.get("OMP_WAIT_POLICY", "unset")
        return None

sys.meta_path.insert(0, TorchImport())
entry, sys.argv = sys.argv[1], sys.argv[1:]
try:
    if entry.endswith(".py"):
        runpy.run_path(entry, run_name="__main__")
    else:
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(TorchImport.seen or "-", os.environ.get("OMP_WAIT_POLICY", "unset"))
"""


def entry_point_policy(entry, *argv, user=None):
    """(the wait policy when torch was first imported, or "-"; the policy at the end) of running `entry`."""
    environ = {name: value for name, value in os.environ.items() if name not in openmp_settings.WAIT_VARIABLES}
    output = subprocess.run([sys.executable, "-c", PROBE, entry, *argv], env={**environ, **(user or {})}, cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    return tuple(output.splitlines()[-1].split())


def test_the_passive_wait_policy_is_added_to_an_environment_without_one():
    assert openmp_settings.settings_to_add({"OMP_NUM_THREADS": "2"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"OMP_NUM_THREADS": "2"}
    assert openmp_settings.add_wait_policy(environ) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert environ == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("variable", openmp_settings.WAIT_VARIABLES)
def test_a_users_own_wait_setting_is_kept(variable):
    assert openmp_settings.settings_to_add({variable: "ACTIVE"}) == {}
    environ = {variable: "ACTIVE"}
    assert openmp_settings.add_wait_policy(environ) == {} and environ == {variable: "ACTIVE"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_sets_the_policy_before_torch_loads(script):
    seen, final = entry_point_policy(script, "--help")
    assert final == "PASSIVE" and seen in ("PASSIVE", "-"), (script, seen, final)


@pytest.mark.parametrize("argv", [["train", "--help"], ["eps-delta", "--help"]])
def test_the_perinstance_command_sets_the_policy_before_torch_loads(argv):
    seen, final = entry_point_policy("perinstance", *argv)
    assert final == "PASSIVE" and seen in ("PASSIVE", "-"), (argv, seen, final)
    if argv[0] == "train":
        assert seen == "PASSIVE"  # the training command imports torch: after the setting


def test_the_perinstance_command_keeps_a_users_policy():
    assert entry_point_policy("perinstance", "train", "--help", user={"OMP_WAIT_POLICY": "ACTIVE"}) == \
        ("ACTIVE", "ACTIVE")

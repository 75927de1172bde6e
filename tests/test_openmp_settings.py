"""The shared-machine OpenMP setting (perinstance/openmp_settings.py): added unless the user chose a wait
policy, in the environment before torch loads, and imported first by every script."""

import ast
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from perinstance import openmp_settings

SCRIPTS = sorted(name for name in os.listdir(ROOT) if name.endswith(".py"))


def test_the_passive_wait_policy_is_added_to_an_environment_without_one():
    assert openmp_settings.settings_to_add({"OMP_NUM_THREADS": "2"}) == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("variable", openmp_settings.WAIT_VARIABLES)
def test_a_users_own_wait_setting_is_kept(variable):
    assert openmp_settings.settings_to_add({variable: "ACTIVE"}) == {}


@pytest.mark.parametrize("user", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_importing_the_package_sets_the_policy_before_torch_loads(user):
    environ = {name: value for name, value in os.environ.items() if name not in openmp_settings.WAIT_VARIABLES}
    probe = "import perinstance, os, sys; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    output = subprocess.run([sys.executable, "-c", probe], env={**environ, **user}, cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    assert output == [user.get("OMP_WAIT_POLICY", "PASSIVE"), "False"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_imports_the_package_before_torch(script):
    with open(os.path.join(ROOT, script)) as handle:
        tree = ast.parse(handle.read())
    ordered = sorted((node.lineno, name) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                     for name in ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]))
    roots = [name.split(".")[0] for _, name in ordered if name and name.split(".")[0] in ("torch", "perinstance", "opacus")]
    assert roots and roots[0] == "perinstance", (script, roots)

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from perinstance.errors import run_main

# Tests run small batches, where a second thread costs more than it gives.
torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script, *args, cwd, timeout=600):
    """Run a top-level script as a user would, in `cwd`; returns the CompletedProcess."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(directory):
    """Every file below `directory` with its bytes, to show that nothing was written."""
    files = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, directory)] = handle.read()
    return files


def assert_usage_error(result, flag):
    """A bad input: exit 2, one line on stderr naming the flag, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), result.stderr
    assert flag in lines[0], (flag, result.stderr)
    assert "Traceback" not in result.stderr


def load_script(script):
    """A top-level script of the project as a module (the scripts are not part of the package: each is a shim of
    its command in perinstance/cli/, and imported, it holds the command's build_parser and main)."""
    spec = importlib.util.spec_from_file_location(f"script_{os.path.splitext(script)[0]}", os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_in_process(script, *args, cwd):
    """Like run_script, in this process (no interpreter start-up): the script's main() under run_main."""
    module = load_script(script)
    stdout, stderr = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                run_main(module.main, [str(arg) for arg in args])
                returncode = 0
            except SystemExit as stop:
                returncode = stop.code or 0
    finally:
        os.chdir(previous)
    return SimpleNamespace(returncode=returncode, stdout=stdout.getvalue(), stderr=stderr.getvalue())


@pytest.fixture
def run(tmp_path):
    """Run a script in `tmp_path` in-process; an uncaught exception fails the test with its traceback."""
    return lambda script, *args: run_in_process(script, *args, cwd=tmp_path)


def leave_one_out_statistics(gradients, point):
    """The mean rule's dataset statistics of accounting.md §2 by direct computation: the quantity
    names of the result rows with d* = ||h* − μ_X||, v_X and the exact b_X of X = the rows but `point`."""
    others = np.delete(gradients, point, axis=0)
    center = others.mean(axis=0)
    deviations = np.linalg.norm(others - center, axis=1)
    return (("center_distance", np.linalg.norm(gradients[point] - center)), ("spread", np.mean(deviations ** 2)),
            ("max_deviation", deviations.max()))


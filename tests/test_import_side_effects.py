"""A library is a guest in its user's process: importing `perinstance`, its API, any module of the package, or a
top-level script changes nothing in the process: no environment variable, no malloc setting (mallopt is never
called), no thread count, no global random generator (torch's, numpy's, Python's), no warning filter, no
matplotlib backend. The shared-machine settings are applied by the entry points alone
(tests/test_openmp_settings.py, tests/test_malloc_settings.py)."""

import json
import os
import subprocess
import sys

from conftest import ROOT

from perinstance import malloc_settings, openmp_settings

# In a fresh interpreter: the third-party libraries the package uses are imported first (their own import-time
# effects are not the package's), then the package, its API, every module of it and every script, one by one
# (MODULES); after each (and AFTER_EACH, which the test of the probe fills), whatever changed is printed as
# JSON, with the libc functions looked up among mallopt and malloc_trim.
MODULES = """names = ["perinstance", "perinstance.api"] + sorted(
    info.name for info in pkgutil.walk_packages(perinstance.__path__, "perinstance."))
scripts = sorted(str(path) for path in pathlib.Path(".").glob("*.py"))"""
PROBE = """
import ctypes, importlib, json, os, pathlib, pkgutil, random, runpy, sys, warnings

import dp_accounting, matplotlib, matplotlib.pyplot, numpy, opacus, pandas, pyarrow, scipy.stats, torch, torchvision, tqdm

looked_up = []


class WatchedCDLL(ctypes.CDLL):
    def __getattr__(self, name):
        if name in ("mallopt", "malloc_trim"):
            looked_up.append(name)
        return super().__getattr__(name)


ctypes.CDLL = WatchedCDLL


def state():
    return {"environment": dict(os.environ), "python random": random.getstate(),
            "numpy random": repr(numpy.random.get_state()), "torch random": torch.random.get_rng_state().tolist(),
            "torch threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
            "warning filters": repr(warnings.filters),
            "matplotlib backend": repr(dict.__getitem__(matplotlib.rcParams, "backend")), "libc": list(looked_up)}


import perinstance

MODULES
changed = []
before = state()
for name in names + scripts:
    if name.endswith(".py"):
        runpy.run_path(name, run_name="imported_script")
    else:
        importlib.import_module(name)
AFTER_EACH
    after = state()
    changed += [[name, kind] for kind in before if after[kind] != before[kind]]
    before = after
print(json.dumps({"changed": changed, "imported": len(names) + len(scripts)}))
"""


def changes(modules=MODULES, after_each=""):
    """[module or script, what its import changed] for every change the probe saw, and how many it imported."""
    probe = PROBE.replace("MODULES", modules).replace("AFTER_EACH", after_each)
    # Without the user's own wait policy and malloc tuning, so that the shared-machine settings would show.
    environ = {name: value for name, value in os.environ.items()
               if name not in (*openmp_settings.WAIT_VARIABLES, *malloc_settings.USER_VARIABLES, "GLIBC_TUNABLES")}
    output = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=environ, check=True, capture_output=True,
                            text=True).stdout
    result = json.loads(output.splitlines()[-1])
    return result["changed"], result["imported"]


def test_importing_any_module_changes_nothing_in_the_process():
    changed, imported = changes()
    assert changed == []
    assert imported > 100  # every module and script was imported


def test_the_probe_sees_every_kind_of_change():
    tampering = ["perinstance.apply_shared_machine_settings()", "random.seed(1)", "numpy.random.seed(1)",
                 "torch.manual_seed(1)", "torch.set_num_threads(torch.get_num_threads() + 1)",
                 "warnings.filterwarnings('ignore', message='x')", "matplotlib.use('Agg')"]
    changed, imported = changes('names, scripts = ["perinstance.errors"], []',
                                "".join(f"    {line}\n" for line in tampering))
    assert imported == 1
    assert {kind for _, kind in changed} == {"environment", "libc", "python random", "numpy random", "torch random",
                                             "torch threads", "warning filters", "matplotlib backend"}

"""glibc's malloc keeps freed memory for the next step (perinstance/malloc_settings.py) once the command line's
entry points (or perinstance.apply_shared_machine_settings) set it, unless the user tuned malloc through its
environment; importing the package leaves malloc alone."""

import ctypes
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from perinstance import malloc_settings

# Bytes of a 20 MiB block that malloc serves by mapping fresh pages (glibc's mallinfo2().hblkhd grows by them):
# all of them under glibc's default 128 KiB threshold, none under the package's 32 MiB one. SETUP runs first.
PROBE = """
import ctypes
import runpy
import sys

import perinstance
{setup}

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblkhd
block = libc.malloc(20 << 20)
print(libc.mallinfo2().hblkhd - before)
"""
APPLIED = "perinstance.apply_shared_machine_settings()"
# The `perinstance` command's entry point, to its end (`perinstance eps-delta --help` imports no torch).
COMMAND = """
sys.argv = ["perinstance", "eps-delta", "--help"]
try:
    runpy.run_module("perinstance", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
"""
BLOCK = 20 << 20


def glibc_with_mallinfo2():
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


def mapped_bytes(setup, user_environment):
    environ = {name: value for name, value in os.environ.items()
               if name not in malloc_settings.USER_VARIABLES and name != "GLIBC_TUNABLES"}
    output = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)], env={**environ, **user_environment},
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return int(output.splitlines()[-1])


needs_mallinfo2 = pytest.mark.skipif(not glibc_with_mallinfo2(), reason="needs glibc 2.33 or later (mallinfo2)")


@needs_mallinfo2
@pytest.mark.parametrize("setup", [APPLIED, COMMAND])
def test_the_settings_serve_a_large_block_from_the_heap(setup):
    assert mapped_bytes(setup, {}) == 0


@needs_mallinfo2
def test_importing_the_package_leaves_malloc_alone():
    assert mapped_bytes("", {}) >= BLOCK


@needs_mallinfo2
@pytest.mark.parametrize("user", [{"MALLOC_TOP_PAD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_a_users_own_malloc_tuning_is_left_alone(user):
    assert mapped_bytes(APPLIED, user) >= BLOCK


@pytest.mark.parametrize("environ,tuned", [({}, False), ({"MALLOC_MMAP_THRESHOLD_": "1"}, True),
                                           ({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, False),
                                           ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, True)])
def test_user_tuned_reads_the_malloc_variables(environ, tuned):
    assert malloc_settings.user_tuned(environ) is tuned
    if tuned:
        assert malloc_settings.keep_freed_memory(environ) is False

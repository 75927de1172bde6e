"""Handing freed memory back to the system (glibc only; a no-op elsewhere).

reproduce.py runs every step in one process. glibc keeps much of what a step frees (the heap top, and
holes between blocks that are still alive), so the next step's peak would stand on the last one's
leftovers. malloc_trim(0) returns every free page, wherever it lies in the heap; it walks the heap, so it
is called once per step, not inside a step's loops.
"""

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory():
    """Return the heap's free pages to the system; False where libc has no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

"""How much memory this process may fill, and handing freed memory back to the system (glibc only; a
no-op elsewhere).

reproduce.py runs every step in one process. glibc keeps much of what a step frees (the heap top, and
holes between blocks that are still alive), so the next step's peak would stand on the last one's
leftovers. malloc_trim(0) returns every free page, wherever it lies in the heap; it walks the heap, so it
is called once per step, not inside a step's loops.
"""

import ctypes
import ctypes.util
import functools
import gc
import os
import sys

import torch


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory() -> bool:
    """Free what only reference cycles still hold (a drawn figure's canvas, tens of MB at the report's resolution,
    lives in matplotlib's cycles until the collector runs: 40 MB after an audit), then return_free_pages."""
    gc.collect()
    return return_free_pages()


def return_free_pages() -> bool:
    """Return the heap's free pages to the system, and those that pyarrow's own allocator keeps (where pyarrow is
    imported: a Parquet table read or written, its buffers come from there, not from the heap); False where libc
    has no malloc_trim."""
    pyarrow = sys.modules.get("pyarrow")
    if pyarrow is not None:
        pyarrow.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def memory_budget(device: str | torch.device) -> int:
    """Bytes this process may fill: half of what is free on `device` now."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            available_kib = next(int(line.split()[1]) for line in handle if line.startswith("MemAvailable:"))
        return available_kib * 1024 // 2
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2

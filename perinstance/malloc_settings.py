"""How glibc's malloc keeps the memory a step frees, set once when the package is imported (a no-op on
another C library, or where the user has tuned malloc through its environment variables).

Why: by default glibc hands the top of its heap back to the system whenever more than twice its current
mmap threshold lies free there, and serves each block above that threshold with fresh pages. A training step
or a chunk of a norms pass allocates and frees tens of megabytes of tensors, so every step faulted the same
pages in again: on 2 CPU cores a sixth of a LeNet-5 training run's time was the kernel's (sys time 16 s of
70 s in benchmarks/bench_training.py), and ResNet-20's norms passes slowed 1.3-1.8× above 256 examples per
chunk. A fixed mmap threshold of 32 MiB (glibc's largest) and a trim threshold of 1 GiB keep those pages
for the next step. The memory is still returned at each reproduce.py step's end (train/memory.py's
malloc_trim), and blocks of 32 MiB or more still come from, and go back to, the system directly.
"""

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEPT_SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30}
# Environment variables through which a user tunes glibc's malloc; any of them leaves malloc as the user set it.
USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_tuned(environ: Mapping[str, str]) -> bool:
    """Whether `environ` tunes glibc's malloc itself."""
    return any(name in environ for name in USER_VARIABLES) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Set KEPT_SETTINGS in this process's malloc; False (nothing set) on another C library or where `environ`
    tunes malloc."""
    if user_tuned(environ):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return all(mallopt(parameter, value) == 1 for parameter, value in KEPT_SETTINGS.items())


keep_freed_memory()

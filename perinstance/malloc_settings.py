"""How glibc's malloc keeps the memory a step frees: a setting the command line makes once, at its start
(perinstance.apply_shared_machine_settings; importing the package changes nothing). A no-op on another C
library, or where the user has tuned malloc through its environment variables.

Why: by default glibc serves each block above its mmap threshold (128 KiB at first, raised to the size of
any such block freed, at most 32 MiB) with fresh pages, and hands the top of its heap back to the system
whenever more than twice that threshold lies free there. A training step or a chunk of a norms pass
allocates and frees tens of megabytes in blocks of a few MiB, so every step faulted the same pages in again.
A fixed mmap threshold of 32 MiB (glibc's largest) and a trim threshold of 1 GiB keep those pages for the
next step: ResNet-20 training at B = 128, the trainer alone in its process on 2 CPU cores, measured in
docs/reliability.md. (A process that has freed a 32 MiB block, as Opacus's per-sample gradients do, has
glibc's largest threshold anyway, so benchmarks/bench_training.py, which runs Opacus beside the trainer,
shows little of it.) The memory is still returned at each reproduce.py step's end (train/memory.py's
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

"""Keep the memory a step frees for the next step (glibc only).

glibc's malloc serves blocks above a threshold (128 KB to start with) from fresh mmap'd pages and
returns them to the system when freed, and trims the heap top above 128 KB free. Every training
step and every per-sample pass allocates and frees the same few large tensors, so each one
page-faults all of its memory back in: on a 2-core machine a third of the quick preset's CPU time
was the kernel zeroing pages (README, "Measured here"). Raising both thresholds once lets malloc
reuse the freed blocks instead. Results do not change (the same arithmetic runs on other addresses);
peak resident memory grows a little, by the blocks kept.
"""

import ctypes
import ctypes.util

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Blocks up to this size come from the heap and are reused when freed, instead of fresh pages each time.
MMAP_THRESHOLD = 1 << 30
# Free memory at the heap top kept before it is returned to the system.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory():
    """Raise glibc's mmap and trim thresholds for this process; a no-op where libc has no mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))

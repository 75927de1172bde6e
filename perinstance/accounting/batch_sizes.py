"""Batch sizes of the mean rule (docs/accounting.md §3.4): the Binomial law of the batch size, the
threshold below which rare small batches are charged to δ, and the grid of sizes accounted.

No I/O and no torch; vectorised over points; everything that can overflow is computed in log space.
"""

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import binom

from perinstance.accounting.numerics import check_sample_rate, log_sub

SIZE_TAIL = 1e-12


def size_log_pmf(sizes: ArrayLike, n: int, sample_rate: float) -> np.ndarray:
    """log π_k = log P(Bin(n, q) = k)."""
    return binom.logpmf(np.asarray(sizes), n, sample_rate)


def size_threshold(n: int, sample_rate: float, size_delta: float) -> int:
    """§3.4: k_min, the largest k with δ_size = P(Bin(n, q) < k) ≤ size_delta (0 if none)."""
    check_sample_rate(sample_rate)
    if not 0 <= size_delta < 1:
        raise ValueError(f"size_delta must be in [0, 1), not {size_delta!r}")
    if n < 0 or int(n) != n:
        raise ValueError(f"n must be a nonnegative integer, not {n!r}")
    if sample_rate == 0:
        return 0
    sizes = np.arange(int(n) + 2)
    below = np.concatenate([[0.0], binom.cdf(sizes[:-1], n, sample_rate)])  # P(k < size)
    return int(sizes[below <= size_delta].max())


def size_failure(n: int, sample_rate: float, k_min: int) -> float:
    """§3.4: δ_size = P(Bin(n, q) < k_min)."""
    return 0.0 if k_min <= 0 else float(binom.cdf(k_min - 1, n, sample_rate))


def size_upper(n: int, sample_rate: float) -> int:
    """k_hi: the smallest k with P(Bin(n, q) > k) ≤ SIZE_TAIL (§3.2)."""
    return int(binom.isf(SIZE_TAIL, n, sample_rate)) if sample_rate > 0 else 0


def size_grid(n: int, sample_rate: float, k_min: int, max_sizes: int) -> np.ndarray:
    """§3.2: the sizes at which the mean rule is evaluated: every size in [k_min, k_hi] if there are at
    most max_sizes of them, else max_sizes sizes, denser near k_min where the bound is decided."""
    k_hi = max(size_upper(n, sample_rate), k_min)
    if k_hi - k_min + 1 <= max_sizes:
        return np.arange(k_min, k_hi + 1)
    # Quadratic spacing rounds several sizes near k_min onto one: add points until max_sizes remain.
    count = max_sizes
    while True:
        spread = (np.linspace(0.0, 1.0, count) ** 2) * (k_hi - k_min)
        grid = np.unique(np.concatenate([[k_min, k_hi], k_min + np.floor(spread).astype(int)]))
        if len(grid) >= max_sizes:
            return grid
        count += max_sizes - len(grid)


def lumped_size_log_weights(grid_sizes: ArrayLike, n: int, sample_rate: float) -> np.ndarray:
    """log of each grid size's probability with the sizes up to the next grid size lumped onto it
    (the last takes the whole tail): a size is always evaluated at a grid size *below* it, where
    the sensitivity bound is larger, so the lumping keeps bounds valid (§3.2)."""
    grid_sizes = np.asarray(grid_sizes, dtype=int)
    below_next = binom.logcdf(np.append(grid_sizes[1:] - 1, n), n, sample_rate)
    below_this = binom.logcdf(grid_sizes - 1, n, sample_rate)
    below_this = np.where(grid_sizes > 0, below_this, -np.inf)
    return log_sub(below_next, below_this)

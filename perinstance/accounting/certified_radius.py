"""The mean rule's certified bound (docs/accounting.md §3.2, §7): the variance-aware certified radius,
the failure probability spent per size, and the mixture over sizes and tail levels.

No I/O and no torch; vectorised over points; everything that can overflow is computed in log space.
"""

import math

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import logsumexp

from perinstance.accounting.numerics import check_orders, check_positive, log_sub

# §7.2: the Pinelis radius is a minimum over λ of a closed form: λ·b_X runs over this grid, then a
# golden-section search between the best point's neighbours (every λ gives a valid radius; the search
# brings it to the minimum up to rounding).
RADIUS_LAMBDAS = np.geomspace(1e-4, 64.0, 128)
RADIUS_SEARCH_STEPS = 32
# §7.2: v_X/b_X² is rounded up onto a geometric grid with this relative step before the radius is
# computed (the radius grows with it, so the result stays a bound): a few radius tables serve every point.
RADIUS_RATIO_STEP = 1e-4
# §7.3: tail levels per grid size in the certified mixture.
CERTIFIED_LEVELS = 16
# §7.4: the largest failure probability one grid size is given.
SIZE_FAILURE_CAP = 0.5


def _pinelis_length(ratio, sizes, log_inverse, scaled_lambda):
    """§7.2 at one λ (scaled_lambda = λ·b): t/b with (1 + c·(e^{λb} − 1 − λb))^k / cosh(λt) = β."""
    growth = np.expm1(scaled_lambda) - scaled_lambda
    exponent = sizes * np.log1p(ratio * growth) + log_inverse
    # arccosh(e^x) = x + log(1 + sqrt(1 − e^{−2x})), accurate for every x >= 0.
    return (exponent + np.log1p(np.sqrt(-np.expm1(-2 * exponent)))) / scaled_lambda


def _unit_radius(variance_ratio, sizes, failure):
    """§7.2 r/b_X for a population with ||Y_i|| <= 1 and mean ||Y_i||² = c, at size k >= 1 and failure
    β: the smaller of McDiarmid's sqrt(c/k) + sqrt(2·log(1/β)/k) and Pinelis's radius, at most 1."""
    ratio, sizes, failure = (np.asarray(value, dtype=float) for value in
                             np.broadcast_arrays(variance_ratio, sizes, failure))
    log_inverse = -np.log(failure)
    mcdiarmid = np.sqrt(ratio / sizes) + np.sqrt(2 * log_inverse / sizes)
    on_grid = _pinelis_length(ratio[..., None], sizes[..., None], log_inverse[..., None], RADIUS_LAMBDAS)
    best = np.argmin(on_grid, axis=-1)
    length = np.min(on_grid, axis=-1)
    low = np.log(RADIUS_LAMBDAS[np.maximum(best - 1, 0)])
    high = np.log(RADIUS_LAMBDAS[np.minimum(best + 1, len(RADIUS_LAMBDAS) - 1)])
    ratio_golden = (math.sqrt(5) - 1) / 2
    for _ in range(RADIUS_SEARCH_STEPS):
        left, right = high - ratio_golden * (high - low), low + ratio_golden * (high - low)
        at_left = _pinelis_length(ratio, sizes, log_inverse, np.exp(left))
        at_right = _pinelis_length(ratio, sizes, log_inverse, np.exp(right))
        length = np.minimum(length, np.minimum(at_left, at_right))
        keep_left = at_left <= at_right
        high = np.where(keep_left, right, high)
        low = np.where(keep_left, low, left)
    return np.minimum(np.minimum(mcdiarmid, length / sizes), 1.0)


def concentration_radius(spread: ArrayLike, max_deviation: ArrayLike, sizes: ArrayLike, failure: float) -> np.ndarray:
    """§7.2: r with P(||m(B) − μ_X|| > r) <= β over uniform k-subsets B of X, for sizes k >= 1.

    spread v_X, max_deviation b_X: (P,) per point; sizes and failure β broadcast together to a shape S.
    Returns (P, *S); nonincreasing in k and in β.
    """
    spread, max_deviation = (np.atleast_1d(np.asarray(value, dtype=float)) for value in (spread, max_deviation))
    ratio = np.divide(spread, max_deviation**2, out=np.zeros_like(spread), where=max_deviation > 0)
    levels = geometric_levels(ratio, RADIUS_RATIO_STEP)
    shape = np.broadcast_shapes(np.shape(sizes), np.shape(failure))
    column = (-1,) + (1,) * len(shape)
    table = _unit_radius(levels.reshape(column), sizes, failure)
    return max_deviation.reshape(column) * table[np.searchsorted(levels, ratio, side="left")]


def certified_sensitivity(center_distance: ArrayLike, spread: ArrayLike, max_deviation: ArrayLike, clip_bound: float,
                          sizes: ArrayLike, failure: float) -> np.ndarray:
    """§3.2, §7.2 certified: Δ̄_k = min(2Γ, d* + r_k(β))/(k+1) with r_k(β) of concentration_radius, which
    bounds Δ_B with probability >= 1 − β over uniform k-subsets B; Δ̄_0 = Γ.

    center_distance d*, spread v_X, max_deviation b_X: (P,) per point; sizes and failure β (one, or
    one per size) broadcast together to a shape S. Returns (P, *S).
    """
    failure = np.asarray(failure, dtype=float)
    outside = failure[~((failure > 0) & (failure < 1))]
    if outside.size:
        raise ValueError(f"failure must be in (0, 1), not {outside[0]!r}")
    check_positive("clip_bound", clip_bound)
    statistics = [np.atleast_1d(np.asarray(value, dtype=float)) for value in (center_distance, spread, max_deviation)]
    for name, value in zip(("center_distance", "spread", "max_deviation"), statistics, strict=True):
        if np.any(~(value >= 0)):
            raise ValueError(f"{name} must be >= 0")
    center_distance, spread, max_deviation = statistics
    sizes = np.asarray(sizes, dtype=float)
    radius = concentration_radius(spread, max_deviation, np.maximum(sizes, 1.0), failure)
    shape = radius.shape[1:]
    bound = np.minimum(2 * clip_bound, center_distance.reshape((-1,) + (1,) * len(shape)) + radius) / (sizes + 1)
    return np.where(sizes > 0, bound, clip_bound)


def size_failures(log_weights: ArrayLike, failure: float) -> np.ndarray:
    """§7.4: a failure probability β_j per grid size with Σ_j Π_j·β_j <= β (Π_j = exp(log_weights)).

    Shares of β proportional to 1/(j+1), j = 0 at k_min: the smallest sizes, rare and where the bound
    is largest, get the most; no β_j above SIZE_FAILURE_CAP, and what a capped size cannot use goes
    to the others in proportion to their shares.
    """
    if not 0 < failure < 1:
        raise ValueError(f"failure must be in (0, 1), not {failure!r}")
    mass = np.exp(np.asarray(log_weights, dtype=float))
    share = 1.0 / np.arange(1, len(mass) + 1)
    capped = np.zeros(len(mass), dtype=bool)
    # Rounding in the sums below may not push Σ Π_j·β_j above β.
    budget = failure * (1 - 1e-9)
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(len(mass)):
            left = budget - np.sum(mass[capped]) * SIZE_FAILURE_CAP
            failures = np.where(capped, SIZE_FAILURE_CAP, left * share / (share[~capped].sum() * mass))
            newly = ~capped & (failures > SIZE_FAILURE_CAP)
            if not newly.any():
                return failures
            capped |= newly
    return np.full(len(mass), SIZE_FAILURE_CAP)


def certified_mixture(center_distance: ArrayLike, spread: ArrayLike, max_deviation: ArrayLike, clip_bound: float,
                      sizes: ArrayLike, log_weights: ArrayLike, failure: float,
                      levels: int = CERTIFIED_LEVELS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """§7.3-§7.4: the certified bound as a mixture over grid sizes × tail levels.

    Grid size j (lumped probability Π_j = exp(log_weights[j])) gets the failure β_j of size_failures
    and L = `levels` tails β_{j,l} = β_j^{(l/L)²}; component (j, l) is Δ̄ at β_{j,l}
    (certified_sensitivity) with probability Π_j·p_{j,l}, p_{j,l} = β_{j,l−1} − β_{j,l} (β_{j,0} = 1) for
    l < L and p_{j,L} = β_{j,L−1}. A mixture of §3.2 or §3.3 over these components in place of (Δ̄_k, π_k),
    with δ_fail = δ_size + β, is a bound.

    Returns the sensitivities (P, K·L), their log weights (K·L,) and sizes k (K·L,), size-major.
    """
    sizes = np.asarray(sizes)
    log_weights = np.asarray(log_weights, dtype=float)
    # Size 0 has Δ̄_0 = Γ whatever happens: it is given no failure mass (weight 0 in the allocation).
    log_size_failures = np.log(size_failures(np.where(sizes > 0, log_weights, -np.inf), failure))
    log_tails = log_size_failures[:, None] * ((np.arange(1, levels + 1) / levels) ** 2)[None, :]
    bound = certified_sensitivity(center_distance, spread, max_deviation, clip_bound, sizes[:, None],
                                  np.exp(log_tails))
    log_previous = np.concatenate([np.zeros((len(sizes), 1)), log_tails[:, :-1]], axis=1)
    log_share = log_sub(log_previous, log_tails)
    log_share[:, -1] = log_previous[:, -1]
    return (bound.reshape(len(bound), -1), (log_weights[:, None] + log_share).reshape(-1),
            np.repeat(sizes, levels))


def dominant_size(log_terms: ArrayLike, component_sizes: ArrayLike) -> np.ndarray:
    """§3.2 k*: per point (rows), the size k whose components carry the largest part of a mixture
    (log_terms: log of weight × term per component, columns labelled by component_sizes)."""
    log_terms = np.asarray(log_terms, dtype=float)
    sizes, position = np.unique(np.asarray(component_sizes), return_inverse=True)
    per_size = np.stack([logsumexp(log_terms[:, position == index], axis=1) for index in range(len(sizes))], axis=1)
    return sizes[np.argmax(per_size, axis=1)]


def baseline_mean_sensitivity(clip_bound: float, sizes: ArrayLike) -> np.ndarray:
    """§3.2 baseline of the mean rule: Δ̄_k = 2Γ/(k+1), Δ̄_0 = Γ (data-independent)."""
    check_positive("clip_bound", clip_bound)
    sizes = np.asarray(sizes, dtype=float)
    return np.where(sizes > 0, 2 * clip_bound / (sizes + 1), clip_bound)


def mixture_rdp(log_moments: ArrayLike, log_weights: ArrayLike, log_mass: ArrayLike, alpha: float) -> np.ndarray:
    """§3.2: (1/(α−1))·(log Σ_k w_k·exp(M_k) − log mass), with M_k = (α−1)·RDP_SGM at component k.

    log_moments (..., K), log_weights broadcastable to it, log_mass the log of the probability the
    weights are normalised by (P(k ≥ k_min) for the estimate, P(k ≥ k_min) − β certified).
    Floored at 0: every M_k ≥ 0 and the weights sum to at least the mass, so the exact value is ≥ 0
    (and a Rényi divergence is), while rounding can leave the difference of logs a few ulps below.
    """
    check_orders([alpha])
    return np.maximum((logsumexp(log_moments + log_weights, axis=-1) - log_mass) / (alpha - 1), 0.0)


def stratified_log_means(log_moments: ArrayLike, sizes: ArrayLike, grid_sizes: ArrayLike) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """§3.2 estimate: log Ê_k = log mean exp(M_b) over the samples b of each grid size k.

    log_moments (P, S, ...) with NaN for absent samples (trailing axes, e.g. orders, are carried along), sizes
    (S,) or (P, S). Returns (P, K, ...) and the number of samples per point and size (P, K); a size with no
    sample gives NaN. The sums of every size come from one product with the samples' size indicators, each
    point's terms shifted by its largest (a size whose every term is below e^−700 of that largest counts as
    −inf: it weighs nothing beside it).
    """
    log_moments = np.asarray(log_moments, dtype=float)
    present = ~np.isnan(log_moments.reshape(*log_moments.shape[:2], -1)[..., 0])
    sizes = np.broadcast_to(np.asarray(sizes), present.shape)
    grid_sizes = np.asarray(grid_sizes)
    indicator = (sizes[..., None] == grid_sizes) & present[..., None]  # (P, S, K)
    counts = indicator.sum(axis=1)
    extra = log_moments.shape[2:]
    values = np.where(present.reshape(*present.shape, *(1,) * len(extra)), log_moments, -np.inf)
    top = values.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore", under="ignore"):
        scaled = np.exp(values - np.where(np.isfinite(top), top, 0.0))
        sums = np.einsum("ps...,psk->pk...", np.nan_to_num(scaled, nan=0.0), indicator.astype(float))
        means = np.log(sums) + top - np.log(np.maximum(counts, 1)).reshape(*counts.shape, *(1,) * len(extra))
    means[counts == 0] = np.nan
    return means, counts


def add_direction_cap(sample_rate: float) -> float:
    """§3.2: D_α(Q||P) ≤ log(1/(1−q)) for every α, because P ≥ (1−q)·Q pointwise."""
    return -math.log1p(-sample_rate) if sample_rate < 1 else math.inf


def geometric_levels(sensitivity_ratio: ArrayLike, relative_step: float) -> np.ndarray:
    """§5: each Δ/Γ rounded up onto the grid (1 + relative_step)^j; the distinct levels used, plus 0.

    Rounding a sensitivity up keeps every bound valid; the grid makes a table of a few thousand
    levels serve millions of samples."""
    ratio = np.ravel(np.asarray(sensitivity_ratio, dtype=float))
    ratio = ratio[~np.isnan(ratio) & (ratio > 0)]
    if not len(ratio):
        return np.zeros(1)
    log_step = math.log1p(relative_step)
    exponent = np.ceil(np.log(ratio) / log_step - 1e-12).astype(np.int64)
    lowest = exponent.min()
    # One level per grid point used, counted rather than sorted (millions of mixture components): the grid
    # point itself, or the largest ratio it took where exp rounded the grid point just below it.
    level = np.exp(np.arange(lowest, exponent.max() + 1) * log_step)
    np.maximum.at(level, exponent - lowest, ratio)
    used = np.bincount(exponent - lowest, minlength=len(level)) > 0
    return np.concatenate([[0.0], level[used]])

"""Per-step Rényi DP (docs/accounting.md §3.1-§3.2): RDP_SGM of the Poisson-subsampled Gaussian, the sum
rule's and the mean rule's per-instance RDP.

"RDP_SGM" is the Rényi DP of the Poisson-subsampled Gaussian mechanism as computed by Opacus
(`opacus.accountants.analysis.rdp`). No I/O and no torch; vectorised over points; everything that
can overflow is computed in log space.
"""

import importlib.util
import math
import os
import sys

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import gammaln, gammasgn, log_ndtr, logsumexp

from perinstance.accounting.numerics import check_noise, check_orders, check_positive, check_sample_rate, log_sub


def _load_opacus_rdp():
    """Opacus's `opacus.accountants.analysis.rdp`, without importing the `opacus` package.

    `import opacus` imports torch (seconds at every script start, even to print a usage error);
    this one module needs only numpy and scipy.
    """
    name = "opacus.accountants.analysis.rdp"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("opacus")
    path = os.path.join(package.submodule_search_locations[0], "accountants", "analysis", "rdp.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


opacus_rdp = _load_opacus_rdp()
# Above this order Opacus's integer sum costs O(λ) terms and its binomials overflow near 1030;
# such orders (only reached by composition with a small Hölder exponent) get λ/(2z²) instead.
LARGEST_OPACUS_ORDER = 512


def rdp_sgm(sample_rate: float, noise_multiplier: float, orders: ArrayLike) -> np.ndarray:
    """RDP_SGM(q, z, λ) for one step at each order (§3, §9): rdp_sgm_levels at one noise multiplier."""
    check_sample_rate(sample_rate)
    check_noise(noise_multiplier)
    check_orders(orders)
    if np.isinf(noise_multiplier) or sample_rate == 0:
        return np.zeros(np.atleast_1d(np.asarray(orders, dtype=float)).shape)
    return rdp_sgm_levels(sample_rate, [noise_multiplier], orders)[0]


# Opacus stops the fractional-order series at the first term below e^-30 (both halves).
SERIES_TAIL = -30.0
# Terms of the fractional-order series evaluated per round, for every noise multiplier at once.
SERIES_ROUND = 256


def _integer_log_moments(sample_rate, noise_multipliers, order):
    """log A_λ at an integer order λ for every z of `noise_multipliers`: Opacus's finite sum
    (Mironov et al. 2019 §3.3), Σ_i C(λ,i) q^i (1−q)^(λ−i) exp((i²−i)/(2z²)), in log space."""
    index = np.arange(order + 1, dtype=float)
    log_coefficients = (gammaln(order + 1) - gammaln(index + 1) - gammaln(order - index + 1)
                        + index * math.log(sample_rate) + (order - index) * math.log1p(-sample_rate))
    # The terms of one z along the last axis: its sum is the same whatever the other z beside it.
    exponents = (index ** 2 - index)[None, :] / (2 * noise_multipliers[:, None] ** 2)
    return logsumexp(log_coefficients[None, :] + exponents, axis=1)


def _fractional_log_moments(sample_rate, noise_multipliers, order):
    """log A_λ at a fractional order λ for every z: Opacus's two-sided series (Mironov et al. 2019 §3.3), each
    z's terms up to and including the first whose two halves are both below e^SERIES_TAIL, as Opacus sums them.
    The positive and negative terms are summed apart and subtracted once: NaN where the difference is not
    positive (rdp_sgm_levels then takes the chord). Each z's terms lie along the last axis, so that its value
    does not depend on the other z evaluated with it."""
    sigma = noise_multipliers[:, None]
    center = sigma ** 2 * math.log(1 / sample_rate - 1) + 0.5
    positive = [np.full(len(sigma), -np.inf) for _ in range(2)]
    negative = [np.full(len(sigma), -np.inf) for _ in range(2)]
    running = np.ones(len(sigma), dtype=bool)
    start = 0
    while running.any():
        index = np.arange(start, start + SERIES_ROUND, dtype=float)
        complement = order - index
        # |C(λ, i)| = Γ(λ+1)/(Γ(i+1)·|Γ(λ−i+1)|), with the sign of Γ(λ−i+1).
        log_coefficient = gammaln(order + 1) - gammaln(index + 1) - gammaln(complement + 1)
        sign = gammasgn(complement + 1)
        halves = [(log_coefficient + index * math.log(sample_rate) + complement * math.log1p(-sample_rate))[None, :]
                  + (index ** 2 - index)[None, :] / (2 * sigma ** 2) + math.log(0.5)
                  + _log_erfc((index[None, :] - center) / (math.sqrt(2) * sigma)),
                  (log_coefficient + complement * math.log(sample_rate) + index * math.log1p(-sample_rate))[None, :]
                  + (complement ** 2 - complement)[None, :] / (2 * sigma ** 2) + math.log(0.5)
                  + _log_erfc((center - complement[None, :]) / (math.sqrt(2) * sigma))]
        small = np.maximum(*halves) < SERIES_TAIL
        # Each z takes the terms up to its first small one (inclusive), while it is still running.
        stop = np.where(small.any(axis=1), np.argmax(small, axis=1), SERIES_ROUND)
        taken = (np.arange(SERIES_ROUND)[None, :] <= stop[:, None]) & running[:, None]
        for half, terms in enumerate(halves):
            terms = np.where(taken, terms, -np.inf)
            positive[half] = np.logaddexp(positive[half], logsumexp(np.where(sign > 0, terms, -np.inf), axis=1))
            negative[half] = np.logaddexp(negative[half], logsumexp(np.where(sign < 0, terms, -np.inf), axis=1))
        running &= stop == SERIES_ROUND
        start += SERIES_ROUND
    halves = [np.where(total > minus, log_sub(total, np.minimum(minus, total)), np.nan)
              for total, minus in zip(positive, negative)]
    return np.logaddexp(*halves)


def _log_erfc(value):
    """log erfc(x), accurate for large x (as Opacus computes it)."""
    return math.log(2) + log_ndtr(-value * math.sqrt(2))


def rdp_sgm_levels(sample_rate: float, noise_multipliers: ArrayLike, orders: ArrayLike) -> np.ndarray:
    """RDP_SGM(q, z, λ) for many noise multipliers z at once (§3, §9): (Z, orders), as Opacus computes it
    (`opacus.accountants.analysis.rdp`), made robust and evaluated for every z together.

    Integer orders: Opacus's exact finite sum. Fractional orders: Opacus's series, which cancels
    catastrophically for large orders and sampling rates (q=0.5, z=20, λ=49.13 gives −0.65).
    log A_λ = (λ−1)·RDP is nondecreasing and convex in λ (van Erven & Harremoës 2014, Thm 3 and
    Cor. 2), so the exact value at a fractional λ lies between log A at ⌊λ⌋ and the chord from ⌊λ⌋
    to ⌈λ⌉ (log A_1 = 0). A fractional value outside that band is replaced by the chord: a valid
    upper bound, close to the exact value (§5: bounds may only be rounded up).
    Orders above LARGEST_OPACUS_ORDER get the unsubsampled Gaussian's λ/(2z²), an upper bound.
    Opacus evaluates one (z, λ) at a time, its series taking milliseconds at large q; the tables of §5 need
    thousands of z. tests/test_accounting.py holds every value to Opacus's own.
    """
    check_sample_rate(sample_rate)
    check_orders(orders)
    sigma = np.atleast_1d(np.asarray(noise_multipliers, dtype=float))
    if np.any(~(sigma > 0)):
        raise ValueError("noise multipliers must be > 0")
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    rdp = orders[None, :] / (2.0 * sigma[:, None] ** 2)
    live = np.isfinite(sigma)
    if sample_rate == 0 or not live.any():
        return np.where(live[:, None], 0.0 if sample_rate == 0 else rdp, 0.0)
    if sample_rate == 1:
        return np.where(live[:, None], rdp, 0.0)
    # Terms far below the sum vanish, as they should; a fractional series that comes out NaN (∞ − ∞ at tiny
    # levels) is outside the band and replaced by the chord.
    with np.errstate(under="ignore", divide="ignore", invalid="ignore"):
        return _rdp_of_live_levels(sample_rate, sigma, live, orders, rdp)


def _rdp_of_live_levels(sample_rate, sigma, live, orders, rdp):
    z = sigma[live]
    small = orders[orders <= LARGEST_OPACUS_ORDER]
    integers = np.unique(np.concatenate([np.floor(small), np.ceil(small)]))
    integer_moment = {n: np.zeros(len(z)) if n == 1 else _integer_log_moments(sample_rate, z, int(n))
                      for n in integers}
    for column in np.flatnonzero(orders <= LARGEST_OPACUS_ORDER):
        order = orders[column]
        low, high = math.floor(order), math.ceil(order)
        if low == high:
            rdp[live, column] = integer_moment[low] / (order - 1.0)
            continue
        floor_moment, ceil_moment = integer_moment[low], integer_moment[high]
        chord = floor_moment + (order - low) * (ceil_moment - floor_moment)
        moment = _fractional_log_moments(sample_rate, z, order)
        inside = (floor_moment - 1e-12 * np.abs(floor_moment) <= moment) & (moment <= chord * (1 + 1e-9) + 1e-300)
        rdp[live, column] = np.where(inside, np.minimum(moment, chord), chord) / (order - 1.0)
    rdp[~live] = 0.0
    return rdp


def rdp_sum_rule(grad_norm: ArrayLike, clip_bound: float, noise_multiplier: float, sample_rate: float,
                 orders: ArrayLike) -> np.ndarray:
    """§3.1: ρ(λ) = RDP_SGM(q, σ·Γ/Δ*, λ) per point (rows) and order (columns); 0 at Δ* = 0.

    Δ* above Γ by rounding only (the caller validates) is taken as Γ.
    """
    check_positive("clip_bound", clip_bound)
    if np.any(np.asarray(grad_norm, dtype=float) < 0):
        raise ValueError("grad_norm must be >= 0")
    grad_norm = np.minimum(np.atleast_1d(np.asarray(grad_norm, dtype=float)), clip_bound)
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    check_noise(noise_multiplier)
    distinct, position = np.unique(grad_norm, return_inverse=True)
    table = np.zeros((len(distinct), len(orders)))
    moving = distinct > 0
    if moving.any():
        table[moving] = rdp_sgm_levels(sample_rate, noise_multiplier * clip_bound / distinct[moving], orders)
    return table[position.reshape(-1)]


def renyi_statistic(sample_means: ArrayLike, target_mean: ArrayLike) -> np.ndarray:
    """§2: S = Σ_j ||m_j||² − (α−1)·||m_0||² − ||Σ_j m_j − (α−1)·m_0||².

    sample_means: (..., α, d) the updates m(B_1..B_α); target_mean: (..., d) the update m(B_0).
    """
    sample_means = np.asarray(sample_means, dtype=float)
    target_mean = np.asarray(target_mean, dtype=float)
    alpha = sample_means.shape[-2]
    spread = sample_means.sum(axis=-2) - (alpha - 1) * target_mean
    return (np.sum(sample_means**2, axis=(-2, -1)) - (alpha - 1) * np.sum(target_mean**2, axis=-1)
            - np.sum(spread**2, axis=-1))


def _log_mean_exp(log_terms):
    return logsumexp(log_terms) - math.log(log_terms.size)


def rdp_mean_rule(statistics: ArrayLike, noise_std: float, alpha: float, aggregate: str = "joint",
                  target_batch: ArrayLike | None = None) -> float:
    """§3.2: Monte-Carlo Rényi bound of the mean rule at integer order α from K values of S.

    aggregate="joint": ρ̂ = (logsumexp_k(−S_k/(2 s_m²)) − log K)/(α−1), the estimator of the bound.
    aggregate="per-target": GLA's published code's average over target batches B_0 (`target_batch`
    labels each S) of the per-B_0 value; by Jensen never larger, so *not* an upper bound.
    """
    check_positive("noise_std", noise_std)
    check_orders([alpha])
    log_terms = -np.asarray(statistics, dtype=float) / (2.0 * noise_std**2)
    if aggregate == "joint":
        return _log_mean_exp(log_terms) / (alpha - 1)
    if aggregate != "per-target":
        raise ValueError(f"aggregate must be 'joint' or 'per-target', not {aggregate!r}")
    _, group = np.unique(np.asarray(target_batch), return_inverse=True)
    per_target = [_log_mean_exp(log_terms[group == label]) for label in range(group.max() + 1)]
    return float(np.mean(per_target)) / (alpha - 1)

"""The accountants' mathematics (docs/accounting.md §3-§5): small pure functions on numpy arrays.

No I/O and no torch. Vectorised over points; everything that can overflow is computed in
log space. "RDP_SGM" is the Rényi DP of the Poisson-subsampled Gaussian mechanism as computed
by Opacus (`opacus.accountants.analysis.rdp`).
"""

import functools
import importlib.util
import math
import os
import sys
import warnings

import numpy as np
from scipy.special import gammaln, gammasgn, log_ndtr, logsumexp
from scipy.stats import binom


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

# Spacing of the orders at which composition evaluates RDP_SGM (§4, §5): consecutive orders
# λ have (λ−1) at most this factor apart. In between, the chord of log A_λ = (λ−1)·RDP is an
# upper bound (convexity), too high by about (ratio−1)²/8 relatively, i.e. ~0.03%.
COMPOSITION_ORDER_RATIO = 1.05
# From this order on the composition grid uses integer orders: Opacus's integer-order formula is
# an exact finite sum, cheaper than its fractional series and free of its cancellation.
INTEGER_ORDERS_FROM = 10.0
# Dense where the best order of ε ≈ 1..20 lies: this grid gives Opacus's default-grid ε.
COMPOSITION_ORDERS = [1.25, 1.5, 1.75, 2, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3, 3.25, 3.5, 3.75, 4,
                      4.5, 5, 5.5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 18, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96,
                      112, 128, 160, 192, 224, 256]
# Above this order Opacus's integer sum costs O(λ) terms and its binomials overflow near 1030;
# such orders (only reached by composition with a small Hölder exponent) get λ/(2z²) instead.
LARGEST_OPACUS_ORDER = 512


# --- §3: per-step RDP of the subsampled Gaussian --------------------------------------------

def rdp_sgm(sample_rate, noise_multiplier, orders):
    """RDP_SGM(q, z, λ) for one step at each order (§3, §9): rdp_sgm_levels at one noise multiplier."""
    _check_sample_rate(sample_rate)
    _check_noise(noise_multiplier)
    _check_orders(orders)
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
    halves = [np.where(total > minus, _log_sub(total, np.minimum(minus, total)), np.nan)
              for total, minus in zip(positive, negative)]
    return np.logaddexp(*halves)


def _log_erfc(value):
    """log erfc(x), accurate for large x (as Opacus computes it)."""
    return math.log(2) + log_ndtr(-value * math.sqrt(2))


def rdp_sgm_levels(sample_rate, noise_multipliers, orders):
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
    _check_sample_rate(sample_rate)
    _check_orders(orders)
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


def rdp_sum_rule(grad_norm, clip_bound, noise_multiplier, sample_rate, orders):
    """§3.1: ρ(λ) = RDP_SGM(q, σ·Γ/Δ*, λ) per point (rows) and order (columns); 0 at Δ* = 0.

    Δ* above Γ by rounding only (the caller validates) is taken as Γ.
    """
    _check_positive("clip_bound", clip_bound)
    if np.any(np.asarray(grad_norm, dtype=float) < 0):
        raise ValueError("grad_norm must be >= 0")
    grad_norm = np.minimum(np.atleast_1d(np.asarray(grad_norm, dtype=float)), clip_bound)
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    _check_noise(noise_multiplier)
    distinct, position = np.unique(grad_norm, return_inverse=True)
    table = np.zeros((len(distinct), len(orders)))
    moving = distinct > 0
    if moving.any():
        table[moving] = rdp_sgm_levels(sample_rate, noise_multiplier * clip_bound / distinct[moving], orders)
    return table[position.reshape(-1)]


def renyi_statistic(sample_means, target_mean):
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


def rdp_mean_rule(statistics, noise_std, alpha, aggregate="joint", target_batch=None):
    """§3.2: Monte-Carlo Rényi bound of the mean rule at integer order α from K values of S.

    aggregate="joint": ρ̂ = (logsumexp_k(−S_k/(2 s_m²)) − log K)/(α−1), the estimator of the bound.
    aggregate="per-target": GLA's published code's average over target batches B_0 (`target_batch`
    labels each S) of the per-B_0 value; by Jensen never larger, so *not* an upper bound.
    """
    _check_positive("noise_std", noise_std)
    _check_orders([alpha])
    log_terms = -np.asarray(statistics, dtype=float) / (2.0 * noise_std**2)
    if aggregate == "joint":
        return _log_mean_exp(log_terms) / (alpha - 1)
    if aggregate != "per-target":
        raise ValueError(f"aggregate must be 'joint' or 'per-target', not {aggregate!r}")
    _, group = np.unique(np.asarray(target_batch), return_inverse=True)
    per_target = [_log_mean_exp(log_terms[group == label]) for label in range(group.max() + 1)]
    return float(np.mean(per_target)) / (alpha - 1)


# --- §3.3: (ε, δ) per step ----------------------------------------------------------------------

def _gaussian_log_delta(eps, ratio):
    """log δ(ε) of the Gaussian mechanism with Δ/s = ratio (Balle & Wang 2018, Thm 8)."""
    upper = log_ndtr(ratio / 2 - eps / ratio)
    lower = eps + log_ndtr(-ratio / 2 - eps / ratio)
    return upper + np.log(-np.expm1(np.minimum(lower - upper, -1e-300)))


def _analytic_gaussian_eps(ratio, delta):
    """Smallest ε with δ(ε) ≤ δ, by bisection (δ(ε) decreases in ε); returns the safe end."""
    low = np.zeros_like(ratio)
    # δ(ε) ≤ P[L > ε] for the privacy loss L ~ N(r²/2, r²), which is ≤ δ at this ε.
    high = ratio**2 / 2 + ratio * math.sqrt(2 * max(math.log(1 / delta), 0.0)) + 1.0
    log_delta = math.log(delta)
    for _ in range(200):
        middle = (low + high) / 2
        too_small = _gaussian_log_delta(middle, ratio) > log_delta
        low = np.where(too_small, middle, low)
        high = np.where(too_small, high, middle)
        if np.all(high - low <= 1e-12 * np.maximum(high, 1.0)):
            break
    return high


def gaussian_eps(sensitivity, noise_std, delta, method="analytic"):
    """§3.3 ε_G(Δ): the Gaussian mechanism's ε at δ for sensitivity Δ and noise std s (vectorised).

    method="analytic": exact (Balle & Wang 2018). method="classic": Δ·sqrt(2 ln(1.25/δ))/s, valid
    only below 1. Δ = 0, or δ at least the mechanism's δ(0), gives 0. NaN stays NaN.
    """
    _check_positive("noise_std", noise_std)
    _check_probability("delta", delta)
    if np.any(np.asarray(sensitivity, dtype=float) < 0):
        raise ValueError("sensitivity must be >= 0")
    ratio = np.asarray(sensitivity, dtype=float) / noise_std
    if method == "classic":
        return ratio * math.sqrt(2 * max(math.log(1.25 / delta), 0.0))
    if method != "analytic":
        raise ValueError(f"method must be 'analytic' or 'classic', not {method!r}")
    eps = np.where(np.isnan(ratio), np.nan, 0.0)
    # δ(0) = Φ(r/2) − Φ(−r/2); at or below δ every ε ≥ 0 works.
    needs_search = (ratio > 0) & (2 * np.exp(log_ndtr(ratio / 2)) - 1 > delta)
    eps[needs_search] = _analytic_gaussian_eps(ratio[needs_search], delta)
    return eps


def eps_delta_holder(sensitivities, noise_std, sample_rate, delta, holder_p, method="analytic"):
    """§3.3: per-step (ε, δ) of one point from its sensitivity samples Δ_1..Δ_n (last axis).

    p < ∞: δ_G = δ/(2q), δ' = δ/2, M = logsumexp_i(p·ε_G(Δ_i)) − log n,
           ε = log(1 − q + q·exp((M + log q − log δ')/(p−1))).
    p = ∞: δ_G = δ/q, ε = log(1 − q + q·exp(max_i ε_G(Δ_i))).
    sensitivities: (..., n); NaN entries are absent samples (unequal n per point).
    """
    if not holder_p > 1:
        raise ValueError(f"holder_p must be > 1, not {holder_p!r}")
    _check_probability("delta", delta)
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], not {sample_rate!r}")
    sensitivities = np.asarray(sensitivities, dtype=float)
    present = ~np.isnan(sensitivities)
    if np.isinf(holder_p):
        eps_gaussian = gaussian_eps(sensitivities, noise_std, delta / sample_rate, method)
        exponent = np.nanmax(eps_gaussian, axis=-1)
    else:
        eps_gaussian = gaussian_eps(sensitivities, noise_std, delta / (2 * sample_rate), method)
        weighted = np.where(present, holder_p * eps_gaussian, 0.0)
        log_mean = logsumexp(weighted, b=present, axis=-1) - np.log(present.sum(axis=-1))
        exponent = (log_mean + math.log(sample_rate) - math.log(delta / 2)) / (holder_p - 1)
    return np.logaddexp(np.log1p(-sample_rate) if sample_rate < 1 else -np.inf, math.log(sample_rate) + exponent)


def baseline_eps_delta(noise_multiplier, sample_rate, delta, method="analytic"):
    """§3.3 baseline: Δ = Γ, s = σΓ, p = ∞, i.e. log(1 + q·(exp(ε_G) − 1)) with ε_G at δ/q."""
    return float(eps_delta_holder([1.0], noise_multiplier, sample_rate, delta, math.inf, method))


# --- §3.3: exact per-step (ε, δ) of the subsampled Gaussian, by convexity --------------------

def _log_sub(log_large, log_small):
    """log(exp(a) − exp(b)) for a ≥ b, −inf where they are equal."""
    gap = np.minimum(log_small - log_large, 0.0)
    with np.errstate(divide="ignore"):
        return log_large + np.log(-np.expm1(gap))


def delta_remove(eps, mu, sample_rate):
    """§3.3 remove direction: H_{e^ε}((1−q)N(0,1) + qN(μ,1) || N(0,1)), elementwise.

    δ = q·Φ̄(x₀ − μ) − (e^ε − 1 + q)·Φ̄(x₀), x₀ = log((e^ε − 1 + q)/q)/μ + μ/2; 0 at μ = 0.
    """
    eps, mu = np.broadcast_arrays(np.asarray(eps, dtype=float), np.asarray(mu, dtype=float))
    _check_sample_rate(sample_rate)
    if sample_rate == 0:
        return np.zeros(eps.shape)
    # log(e^ε − 1 + q) = ε + log(1 − (1−q)·e^{−ε}): finite for every ε ≥ 0 (expm1 overflows above ~709).
    log_factor = eps + np.log1p(-(1 - sample_rate) * np.exp(-eps))
    moving = mu > 0
    safe_mu = np.where(moving, mu, 1.0)
    threshold = (log_factor - math.log(sample_rate)) / safe_mu + safe_mu / 2
    log_delta = _log_sub(math.log(sample_rate) + log_ndtr(safe_mu - threshold), log_factor + log_ndtr(-threshold))
    return np.where(moving, np.exp(log_delta), 0.0)


def delta_add(eps, mu, sample_rate):
    """§3.3 add direction: H_{e^ε}(N(0,1) || (1−q)N(0,1) + qN(μ,1)), elementwise.

    c = 1 − e^ε(1−q); δ = 0 if c ≤ 0, else c·Φ(x₁) − e^ε·q·Φ(x₁ − μ), x₁ = log(c/(e^ε q))/μ + μ/2.
    """
    eps, mu = np.broadcast_arrays(np.asarray(eps, dtype=float), np.asarray(mu, dtype=float))
    _check_sample_rate(sample_rate)
    if sample_rate == 0:
        return np.zeros(eps.shape)
    log_keep = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        # log c = log(1 − e^{ε + log(1−q)}); −inf where c ≤ 0; 0 at q = 1 (the Gaussian mechanism).
        log_c = np.log(-np.expm1(np.minimum(eps + log_keep, 0.0)))
    live = (mu > 0) & np.isfinite(log_c)
    safe_mu = np.where(live, mu, 1.0)
    safe_log_c = np.where(live, log_c, 0.0)
    threshold = (safe_log_c - eps - math.log(sample_rate)) / safe_mu + safe_mu / 2
    log_delta = _log_sub(safe_log_c + log_ndtr(threshold), eps + math.log(sample_rate) + log_ndtr(threshold - safe_mu))
    return np.where(live, np.exp(log_delta), 0.0)


DIRECTION_DELTAS = {"remove": delta_remove, "add": delta_add}


def mixture_delta(eps, mu, weights, sample_rate, direction):
    """Σ_j w_j·δ_direction(ε; μ_j) over the last axis (absent samples: NaN μ or weight 0)."""
    mu = np.asarray(mu, dtype=float)
    present = ~np.isnan(mu)
    terms = DIRECTION_DELTAS[direction](np.asarray(eps, dtype=float)[..., None], np.where(present, mu, 0.0),
                                        sample_rate)
    return np.sum(np.where(present, weights * terms, 0.0), axis=-1)


# per_step_eps works on blocks of about this many (row, component) values at a time: its memory
# stays near a hundred MiB whatever the number of points and mixture components.
EPS_CHUNK_ELEMENTS = 1 << 20


def per_step_eps(mu, delta, sample_rate, weights=None, delta_fail=0.0, direction="max"):
    """§3.3, §7.6: the smallest ε ≥ 0 with δ(ε) ≤ δ, by a bracketing search (δ(ε) is nonincreasing).

    δ(ε) = Σ_j w_j·δ_dir(ε; μ_j) + δ_fail for direction "remove" or "add"; "max" takes the larger
    of the two sums. mu: (..., S) values Δ/s of the one-dimensional pair for each batch (mixture
    component; NaN = absent); weights: (..., S), the probability of each component (default 1/S
    over the present ones; they may sum to less than 1 when the rest is in δ_fail). Returns (...):
    ε, or inf where δ ≤ δ_fail leaves nothing to spend.
    """
    _check_probability("delta", delta)
    _check_sample_rate(sample_rate)
    if not 0 <= delta_fail < 1 or not math.isfinite(delta_fail):
        raise ValueError(f"delta_fail must be in [0, 1), not {delta_fail!r}")
    if direction not in ("remove", "add", "max"):
        raise ValueError(f"direction must be 'remove', 'add' or 'max', not {direction!r}")
    mu = np.asarray(mu, dtype=float)
    if mu.ndim == 0:
        mu = mu[None]
    if np.any(mu < 0):
        raise ValueError("mu (sensitivity / noise std) must be >= 0")
    present = ~np.isnan(mu)
    if weights is None:
        weights = present / np.maximum(present.sum(axis=-1, keepdims=True), 1)
    weights = np.broadcast_to(np.asarray(weights, dtype=float), mu.shape)
    budget = delta - delta_fail
    shape = mu.shape[:-1]
    if budget <= 0:
        return np.full(shape, np.inf)
    chosen = ("remove", "add") if direction == "max" else (direction,)
    rows, components = mu.reshape(-1, mu.shape[-1]), weights.reshape(-1, mu.shape[-1])
    step = max(1, EPS_CHUNK_ELEMENTS // max(mu.shape[-1], 1))
    eps = [_smallest_eps(rows[start:start + step], components[start:start + step], budget, sample_rate, chosen)
           for start in range(0, len(rows), step)]
    return np.concatenate(eps).reshape(shape) if eps else np.zeros(shape)


def _smallest_eps(mu, weights, budget, sample_rate, directions):
    """per_step_eps on (R, S) rows: the smallest ε with Σ_j w_j·δ(ε; μ_j) <= budget, to 1e-9 relatively.

    A bracket [low, high] with δ(low) above the budget and δ(high) at or below it shrinks by the Illinois
    variant of regula falsi on log δ(ε) − log budget (close to linear in ε), bisecting where the secant
    falls outside the bracket; only `high` is returned, an ε whose δ was seen at or below the budget.
    A δ that cannot be evaluated (NaN) counts as above the budget, and a row whose δ stays above it up
    to ε = 2^64 gets ε = inf.
    """
    log_budget = math.log(budget)

    def log_excess(eps, rows):
        with np.errstate(divide="ignore"):
            delta = np.max([mixture_delta(eps, mu[rows], weights[rows], sample_rate, name) for name in directions],
                           axis=0)
            excess = np.log(delta) - log_budget
        return np.where(np.isnan(excess), np.inf, excess)

    every = np.arange(len(mu))
    needs = log_excess(np.zeros(len(mu)), every) > 0
    rows = every[needs]
    low, high = np.zeros(len(rows)), np.ones(len(rows))
    low_excess, high_excess = log_excess(low, rows), log_excess(high, rows)
    for _ in range(64):
        above = high_excess > 0
        if not above.any():
            break
        low, low_excess = np.where(above, high, low), np.where(above, high_excess, low_excess)
        high = np.where(above, 2 * high, high)
        high_excess[above] = log_excess(high[above], rows[above])
    unresolved = high_excess > 0
    last_moved = np.zeros(len(rows), dtype=int)  # −1: low moved last, +1: high did
    for _ in range(200):
        active = np.flatnonzero(~unresolved & (high - low > 1e-9 * np.maximum(high, 1e-3)))
        if not len(active):
            break
        lower, upper = low[active], high[active]
        with np.errstate(divide="ignore", invalid="ignore"):
            secant = lower + (upper - lower) * low_excess[active] / (low_excess[active] - high_excess[active])
        trial = np.where((secant > lower) & (secant < upper), secant, (lower + upper) / 2)
        excess = log_excess(trial, rows[active])
        raise_low = excess > 0
        # Illinois: an end that stays put twice in a row has its value halved, so the next secant crosses over.
        high_excess[active] = np.where(raise_low & (last_moved[active] == -1), high_excess[active] / 2,
                                       high_excess[active])
        low_excess[active] = np.where(~raise_low & (last_moved[active] == 1), low_excess[active] / 2,
                                      low_excess[active])
        low[active] = np.where(raise_low, trial, lower)
        low_excess[active] = np.where(raise_low, excess, low_excess[active])
        high[active] = np.where(raise_low, upper, trial)
        high_excess[active] = np.where(raise_low, high_excess[active], excess)
        last_moved[active] = np.where(raise_low, -1, 1)
    eps = np.zeros(len(mu))
    eps[rows] = np.where(unresolved, np.inf, high)
    return eps


# --- §3.4: batch sizes of the mean rule ------------------------------------------------------

SIZE_TAIL = 1e-12


def size_log_pmf(sizes, n, sample_rate):
    """log π_k = log P(Bin(n, q) = k)."""
    return binom.logpmf(np.asarray(sizes), n, sample_rate)


def size_threshold(n, sample_rate, size_delta):
    """§3.4: k_min, the largest k with δ_size = P(Bin(n, q) < k) ≤ size_delta (0 if none)."""
    _check_sample_rate(sample_rate)
    if not 0 <= size_delta < 1:
        raise ValueError(f"size_delta must be in [0, 1), not {size_delta!r}")
    if n < 0 or int(n) != n:
        raise ValueError(f"n must be a nonnegative integer, not {n!r}")
    if sample_rate == 0:
        return 0
    sizes = np.arange(int(n) + 2)
    below = np.concatenate([[0.0], binom.cdf(sizes[:-1], n, sample_rate)])  # P(k < size)
    return int(sizes[below <= size_delta].max())


def size_failure(n, sample_rate, k_min):
    """§3.4: δ_size = P(Bin(n, q) < k_min)."""
    return 0.0 if k_min <= 0 else float(binom.cdf(k_min - 1, n, sample_rate))


def size_upper(n, sample_rate):
    """k_hi: the smallest k with P(Bin(n, q) > k) ≤ SIZE_TAIL (§3.2)."""
    return int(binom.isf(SIZE_TAIL, n, sample_rate)) if sample_rate > 0 else 0


def size_grid(n, sample_rate, k_min, max_sizes):
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


def lumped_size_log_weights(grid_sizes, n, sample_rate):
    """log of each grid size's probability with the sizes up to the next grid size lumped onto it
    (the last takes the whole tail): a size is always evaluated at a grid size *below* it, where
    the sensitivity bound is larger, so the lumping keeps bounds valid (§3.2)."""
    grid_sizes = np.asarray(grid_sizes, dtype=int)
    below_next = binom.logcdf(np.append(grid_sizes[1:] - 1, n), n, sample_rate)
    below_this = binom.logcdf(grid_sizes - 1, n, sample_rate)
    below_this = np.where(grid_sizes > 0, below_this, -np.inf)
    return _log_sub(below_next, below_this)


# --- §3.2, §7: the mean rule's certified bound -----------------------------------------------

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


def concentration_radius(spread, max_deviation, sizes, failure):
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


def certified_sensitivity(center_distance, spread, max_deviation, clip_bound, sizes, failure):
    """§3.2, §7.2 certified: Δ̄_k = min(2Γ, d* + r_k(β))/(k+1) with r_k(β) of concentration_radius, which
    bounds Δ_B with probability >= 1 − β over uniform k-subsets B; Δ̄_0 = Γ.

    center_distance d*, spread v_X, max_deviation b_X: (P,) per point; sizes and failure β (one, or
    one per size) broadcast together to a shape S. Returns (P, *S).
    """
    failure = np.asarray(failure, dtype=float)
    outside = failure[~((failure > 0) & (failure < 1))]
    if outside.size:
        raise ValueError(f"failure must be in (0, 1), not {outside[0]!r}")
    _check_positive("clip_bound", clip_bound)
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


def size_failures(log_weights, failure):
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


def certified_mixture(center_distance, spread, max_deviation, clip_bound, sizes, log_weights, failure,
                      levels=CERTIFIED_LEVELS):
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
    log_share = _log_sub(log_previous, log_tails)
    log_share[:, -1] = log_previous[:, -1]
    return (bound.reshape(len(bound), -1), (log_weights[:, None] + log_share).reshape(-1),
            np.repeat(sizes, levels))


def dominant_size(log_terms, component_sizes):
    """§3.2 k*: per point (rows), the size k whose components carry the largest part of a mixture
    (log_terms: log of weight × term per component, columns labelled by component_sizes)."""
    log_terms = np.asarray(log_terms, dtype=float)
    sizes, position = np.unique(np.asarray(component_sizes), return_inverse=True)
    per_size = np.stack([logsumexp(log_terms[:, position == index], axis=1) for index in range(len(sizes))], axis=1)
    return sizes[np.argmax(per_size, axis=1)]


def baseline_mean_sensitivity(clip_bound, sizes):
    """§3.2 baseline of the mean rule: Δ̄_k = 2Γ/(k+1), Δ̄_0 = Γ (data-independent)."""
    _check_positive("clip_bound", clip_bound)
    sizes = np.asarray(sizes, dtype=float)
    return np.where(sizes > 0, 2 * clip_bound / (sizes + 1), clip_bound)


def mixture_rdp(log_moments, log_weights, log_mass, alpha):
    """§3.2: (1/(α−1))·(log Σ_k w_k·exp(M_k) − log mass), with M_k = (α−1)·RDP_SGM at component k.

    log_moments (..., K), log_weights broadcastable to it, log_mass the log of the probability the
    weights are normalised by (P(k ≥ k_min) for the estimate, P(k ≥ k_min) − β certified).
    Floored at 0: every M_k ≥ 0 and the weights sum to at least the mass, so the exact value is ≥ 0
    (and a Rényi divergence is), while rounding can leave the difference of logs a few ulps below.
    """
    _check_orders([alpha])
    return np.maximum((logsumexp(log_moments + log_weights, axis=-1) - log_mass) / (alpha - 1), 0.0)


def stratified_log_means(log_moments, sizes, grid_sizes):
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


def add_direction_cap(sample_rate):
    """§3.2: D_α(Q||P) ≤ log(1/(1−q)) for every α, because P ≥ (1−q)·Q pointwise."""
    return -math.log1p(-sample_rate) if sample_rate < 1 else math.inf


def geometric_levels(sensitivity_ratio, relative_step):
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


# --- domain checks (the math refuses nonsense at its boundary, as dp_accounting does) --------

def _check_sample_rate(sample_rate):
    if not 0 <= sample_rate <= 1:
        raise ValueError(f"sample_rate must be in [0, 1], not {sample_rate!r}")


def _check_probability(name, value):
    if not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), not {value!r}")


def _check_positive(name, value):
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, not {value!r}")


def _check_noise(noise_multiplier):
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, not {noise_multiplier!r}")


def _check_holder_b(holder_b):
    if not holder_b > 1:
        raise ValueError(f"holder_b must be > 1, not {holder_b!r}")


def _check_orders(orders):
    orders = np.asarray(orders, dtype=float)
    if orders.size and not np.all(orders > 1):
        raise ValueError(f"orders must be > 1, not {orders[~(orders > 1)][0]!r}")


# --- §4: composition over a training run ----------------------------------------------------

def holder_orders(alpha, steps, holder_b):
    """§4: λ_k = 1 + (λ−1)·a^k for k = 0..steps−1 with a = b/(b−1); b = ∞ gives λ_k = λ."""
    _check_holder_b(holder_b)
    _check_orders([alpha])
    growth = 1.0 if np.isinf(holder_b) else holder_b / (holder_b - 1)
    # Written so that λ_0 is exactly λ (it must match the grid order λ bit for bit).
    return alpha + (alpha - 1.0) * (growth ** np.arange(steps) - 1.0)


def composition_orders(orders, total_steps, holder_b):
    """The orders at which composition evaluates RDP_SGM: the requested ones and, for finite b,
    a geometric grid (COMPOSITION_ORDER_RATIO) up to the largest λ_k (§4), integer from
    INTEGER_ORDERS_FROM on. Between two of them the chord of log A_λ is used (compose_rdp)."""
    orders = np.unique(np.asarray(orders, dtype=float))
    if np.isinf(holder_b) or total_steps <= 1:
        return orders
    largest = holder_orders(orders[-1], total_steps, holder_b)[-1]
    count = math.ceil(math.log((largest - 1) / (orders[0] - 1)) / math.log(COMPOSITION_ORDER_RATIO)) + 1
    grid = 1 + (orders[0] - 1) * COMPOSITION_ORDER_RATIO ** np.arange(count + 1)
    grid = np.where(grid >= INTEGER_ORDERS_FROM, np.ceil(grid), grid)
    return np.unique(np.concatenate([orders, grid]))


def sensitivity_levels(rounding, sensitivity_ratio):
    """§5: the Δ/Γ values at which composition computes RDP: each observed ratio rounded up to a
    multiple of `rounding` (0: the ratios themselves), plus 0 and 1 (the worst case Γ)."""
    if not 0 <= rounding <= 1:
        raise ValueError(f"rounding must be in [0, 1], not {rounding!r}")
    observed = np.ravel(np.asarray(sensitivity_ratio, dtype=float))
    observed = np.clip(observed[~np.isnan(observed)], 0.0, 1.0)
    if rounding == 0:
        return np.unique(np.concatenate([[0.0, 1.0], observed]))
    grid = np.minimum(np.arange(math.ceil(1 / rounding - 1e-9) + 1) * rounding, 1.0)
    used = np.bincount(np.searchsorted(grid, observed, side="left"), minlength=len(grid)) > 0
    used[[0, -1]] = True
    return grid[used]


# RDP_SGM rows already computed, per (q, σ, orders): the tables of one mechanism (a run's checkpoints, the
# certified bound and the estimate of one file) share most of their levels, which lie on one geometric grid
# (geometric_levels). A few mechanisms, each up to REMEMBERED_LEVELS levels, are kept.
REMEMBERED_MECHANISMS = 8
REMEMBERED_LEVELS = 1 << 14
_remembered = {}


def _remembered_rdp(sample_rate, noise_multiplier, orders, levels):
    """rdp_sgm_levels(q, σ/levels, orders), each level computed once per (q, σ, orders) while it is remembered:
    the same numbers, since rdp_sgm_levels treats every level on its own."""
    key = (float(sample_rate), float(noise_multiplier), orders.tobytes())
    known_levels, known_rdp = _remembered.pop(key, (np.zeros(0), np.zeros((0, len(orders)))))
    position = np.minimum(np.searchsorted(known_levels, levels), max(len(known_levels) - 1, 0))
    found = (known_levels[position] == levels) if len(known_levels) else np.zeros(len(levels), dtype=bool)
    result = np.empty((len(levels), len(orders)))
    result[found] = known_rdp[position[found]]
    missing = np.unique(levels[~found])
    if len(missing):
        fresh = rdp_sgm_levels(sample_rate, noise_multiplier / missing, orders)
        result[~found] = fresh[np.searchsorted(missing, levels[~found])]
        known_levels = np.concatenate([known_levels, missing])
        order = np.argsort(known_levels, kind="stable")
        known_levels, known_rdp = known_levels[order], np.concatenate([known_rdp, fresh])[order]
    if len(known_levels) <= REMEMBERED_LEVELS:
        _remembered[key] = (known_levels, known_rdp)  # the most recently used mechanism last
    while len(_remembered) > REMEMBERED_MECHANISMS:
        _remembered.pop(next(iter(_remembered)))
    return result


class RdpTable:
    """RDP_SGM(q, σ·Γ/Δ, λ) precomputed on a grid of Δ/Γ levels × orders (§4, §5).

    Lookups round Δ/Γ up to the next level; RDP_SGM is nondecreasing in Δ, so the result is an
    upper bound. Level 0 (Δ = 0) costs nothing.
    """

    def __init__(self, sample_rate, noise_multiplier, orders, levels):
        _check_orders(orders)
        if np.any(~(np.asarray(levels, dtype=float) >= 0)):
            raise ValueError("levels must be >= 0")
        self.orders = np.unique(np.asarray(orders, dtype=float))
        self.levels = np.asarray(levels, dtype=float)
        self.rdp = np.zeros((len(self.levels), len(self.orders)))
        moving = self.levels > 0
        if moving.any():
            self.rdp[moving] = _remembered_rdp(sample_rate, noise_multiplier, self.orders, self.levels[moving])
        self.log_moment = self.rdp * (self.orders - 1.0)


    def level_index(self, sensitivity_ratio):
        """Index of the smallest level ≥ Δ/Γ (ratios above the largest level by rounding map to it)."""
        ratio = np.minimum(np.asarray(sensitivity_ratio, dtype=float), self.levels[-1])
        return np.searchsorted(self.levels, ratio, side="left")

    def log_moments(self, sensitivity_ratio):
        """(λ−1)·RDP_SGM at the level rounded up from each Δ/Γ: shape (*ratio.shape, orders)."""
        return self.log_moment[self.level_index(sensitivity_ratio)]


def carry_forward(sensitivity_ratio):
    """§4 for several runs whose checkpoints differ: (R, C, P) Δ/Γ at the union of checkpoint
    steps, NaN where a run has no checkpoint. Each run keeps its latest earlier checkpoint;
    before its first one, the worst case Δ = Γ (ratio 1)."""
    ratio = np.asarray(sensitivity_ratio, dtype=float)
    has_checkpoint = ~np.isnan(ratio).all(axis=2)
    latest = np.maximum.accumulate(np.where(has_checkpoint, np.arange(ratio.shape[1]), -1), axis=1)
    carried = np.take_along_axis(ratio, np.maximum(latest, 0)[:, :, None], axis=1)
    return np.where((latest < 0)[:, :, None], 1.0, carried)


def step_segments(checkpoint_steps, total_steps):
    """§4: steps 1..T grouped by the checkpoint they use, the latest one ≤ t−1.

    Returns (first_step, last_step, checkpoint_index) triples; index None marks the steps before
    the first checkpoint, which use the worst case Γ.
    """
    steps = [int(step) for step in checkpoint_steps if step < total_steps]
    segments = []
    first_covered = steps[0] + 1 if steps else total_steps + 1
    if first_covered > 1:
        segments.append((1, first_covered - 1, None))
    for index, step in enumerate(steps):
        following = steps[index + 1] if index + 1 < len(steps) else total_steps
        segments.append((step + 1, following, index))
    return segments


def _chord_weights(anchors, orders, total_steps, holder_b):
    """Per order o and k = T−t: the two grid orders bracketing λ_k and the Hölder weight a^{−k}
    split linearly between them (arrays of shape (O, T))."""
    low = np.empty((len(orders), total_steps), dtype=np.int64)
    high = np.empty_like(low)
    low_weight = np.empty((len(orders), total_steps))
    high_weight = np.empty_like(low_weight)
    growth = 1.0 if np.isinf(holder_b) else holder_b / (holder_b - 1)
    decay = growth ** -np.arange(total_steps)
    for row, alpha in enumerate(orders):
        lambdas = holder_orders(alpha, total_steps, holder_b)
        if lambdas[0] < anchors[0] or lambdas[-1] > anchors[-1]:
            raise ValueError(f"the table's orders do not cover {lambdas[0]:g}..{lambdas[-1]:g} "
                             "(build it with composition_orders)")
        high[row] = np.searchsorted(anchors, lambdas, side="left")
        exact = anchors[high[row]] == lambdas
        low[row] = np.where(exact, high[row], high[row] - 1)
        span = np.where(exact, 1.0, anchors[high[row]] - anchors[low[row]])
        share = np.where(exact, 1.0, (lambdas - anchors[low[row]]) / span)
        high_weight[row] = decay * share
        low_weight[row] = decay * (1 - share)
    return low, high, low_weight, high_weight


def _segment_weights(chord_weights, k_first, k_last, anchor_count):
    """(J, O) weights of each grid order in one segment (k from k_first to k_last)."""
    low, high, low_weight, high_weight = (array[:, k_first:k_last + 1] for array in chord_weights)
    order_count = low.shape[0]
    column = np.arange(order_count)[:, None]
    index = np.concatenate([(low * order_count + column).ravel(), (high * order_count + column).ravel()])
    weight = np.concatenate([low_weight.ravel(), high_weight.ravel()])
    return np.bincount(index, weights=weight, minlength=anchor_count * order_count).reshape(anchor_count, order_count)


def _holder_mean(moment, holder_b):
    """(1/b)·log((1/R) Σ_r exp(b·moment_r)) over the first axis (runs), in place on `moment`.

    Written out rather than scipy's logsumexp, which is 2-3x slower on these (R, P, J) arrays.
    """
    largest = moment.max(axis=0)
    moment -= largest
    moment *= holder_b
    np.exp(moment, out=moment)
    return largest + np.log(moment.mean(axis=0)) / holder_b


def compose_rdp(table, sensitivity_ratio, checkpoint_steps, total_steps, orders, holder_b):
    """§4: per point, an upper bound on D_λ(P||Q) over the T steps, at each order λ in `orders`.

    (λ−1)·D_λ ≤ Σ_t a^{−(T−t)}·(1/b)·log((1/R) Σ_r exp(b·(λ_{T−t}−1)·ρ_{r,t}(λ_{T−t}))),
    b = ∞: D_λ ≤ Σ_t max_r ρ_{r,t}(λ). ρ_{r,t} uses Δ at run r's latest checkpoint ≤ t−1.

    table: RdpTable whose orders include composition_orders(orders, T, b). Each λ_k lies between
    two table orders; since (λ−1)·ρ(λ) is convex in λ and (1/b)·log mean exp(b·x) is convex and
    increasing in x, the chord between them bounds every step's term. With one run the result
    is exactly Σ_t ρ_t(λ_{T−t}) with ρ at the chord.
    sensitivity_ratio: (R, C, P) Δ/Γ per run, checkpoint (checkpoint_steps, sorted) and point,
    without gaps (see carry_forward). Returns (P, O).
    """
    _check_holder_b(holder_b)
    _check_orders(orders)
    orders = np.asarray(orders, dtype=float)
    runs, _, points = sensitivity_ratio.shape
    chord_weights = _chord_weights(table.orders, orders, total_steps, holder_b)
    worst_case = np.full((runs, points), len(table.levels) - 1)
    total = np.zeros((points, len(orders)))
    for first, last, checkpoint in step_segments(checkpoint_steps, total_steps):
        level = worst_case if checkpoint is None else table.level_index(sensitivity_ratio[:, checkpoint])
        weights = _segment_weights(chord_weights, total_steps - last, total_steps - first, len(table.orders))
        used = np.flatnonzero(weights.any(axis=1))
        if runs == 1 or np.isinf(holder_b):
            # One run, or b = ∞: the max over runs of a quantity nondecreasing in Δ is its value
            # at the largest Δ, so sum over the grid per level first, then look up each point.
            total += (table.log_moment[:, used] @ weights[used])[level.max(axis=0)]
        else:
            total += _holder_mean(table.log_moment[:, used][level], holder_b) @ weights[used]
    return total / (orders - 1.0)


def rdp_to_eps(orders, rdp, delta):
    """RDP curve(s) → (ε, δ) with Opacus's get_privacy_spent (§4); rdp: (..., O).

    Returns (eps, best_order) arrays of shape (...). ε is floored at 0.
    """
    _check_probability("delta", delta)
    _check_orders(orders)
    rdp = np.asarray(rdp, dtype=float)
    if np.any(rdp < 0):
        raise ValueError("rdp must be >= 0")
    flat = rdp.reshape(-1, rdp.shape[-1])
    eps = np.empty(len(flat))
    best_order = np.empty(len(flat))
    with warnings.catch_warnings():
        # Opacus warns when the best order is at an end of the grid; callers report that once.
        warnings.simplefilter("ignore", UserWarning)
        for row, curve in enumerate(flat):
            eps[row], best_order[row] = opacus_rdp.get_privacy_spent(orders=orders, rdp=curve, delta=delta)
    return np.maximum(eps, 0.0).reshape(rdp.shape[:-1]), best_order.reshape(rdp.shape[:-1])


def baseline_rdp(noise_multiplier, sample_rate, orders, steps=1):
    """Data-independent baseline (§3.1, §4): Opacus's RDP for (q, σ) over `steps` steps."""
    return steps * _remembered_rdp_sgm(float(sample_rate), float(noise_multiplier),
                                       tuple(np.atleast_1d(np.asarray(orders, dtype=float)).tolist()))


@functools.lru_cache(maxsize=1024)
def _remembered_rdp_sgm(sample_rate, noise_multiplier, orders):
    """rdp_sgm for the few (q, σ) a run's baselines ask for again and again (figure 4 asks at every step)."""
    result = rdp_sgm(sample_rate, noise_multiplier, orders)
    result.flags.writeable = False
    return result

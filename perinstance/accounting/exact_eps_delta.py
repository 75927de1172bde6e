"""Per-step (ε, δ) (docs/accounting.md §3.3): the Gaussian's ε, the Hölder bound, the baseline, and the
exact per-step (ε, δ) of the subsampled Gaussian by convexity, per direction.

No I/O and no torch; vectorised over points; everything that can overflow is computed in log space.
"""

import math

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import log_ndtr, logsumexp

from perinstance.accounting.numerics import check_positive, check_probability, check_sample_rate, log_sub


def gaussian_log_delta(eps: float | np.ndarray, ratio: float | np.ndarray) -> float | np.ndarray:
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
        too_small = gaussian_log_delta(middle, ratio) > log_delta
        low = np.where(too_small, middle, low)
        high = np.where(too_small, high, middle)
        if np.all(high - low <= 1e-12 * np.maximum(high, 1.0)):
            break
    return high


def gaussian_eps(sensitivity: ArrayLike, noise_std: float, delta: float, method: str = "analytic") -> np.ndarray:
    """§3.3 ε_G(Δ): the Gaussian mechanism's ε at δ for sensitivity Δ and noise std s (vectorised).

    method="analytic": exact (Balle & Wang 2018). method="classic": Δ·sqrt(2 ln(1.25/δ))/s, valid
    only below 1. Δ = 0, or δ at least the mechanism's δ(0), gives 0. NaN stays NaN.
    """
    check_positive("noise_std", noise_std)
    check_probability("delta", delta)
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


def eps_delta_holder(sensitivities: ArrayLike, noise_std: float, sample_rate: float, delta: float, holder_p: float,
                     method: str = "analytic") -> np.ndarray:
    """§3.3: per-step (ε, δ) of one point from its sensitivity samples Δ_1..Δ_n (last axis).

    p < ∞: δ_G = δ/(2q), δ' = δ/2, M = logsumexp_i(p·ε_G(Δ_i)) − log n,
           ε = log(1 − q + q·exp((M + log q − log δ')/(p−1))).
    p = ∞: δ_G = δ/q, ε = log(1 − q + q·exp(max_i ε_G(Δ_i))).
    sensitivities: (..., n); NaN entries are absent samples (unequal n per point).
    """
    if not holder_p > 1:
        raise ValueError(f"holder_p must be > 1, not {holder_p!r}")
    check_probability("delta", delta)
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


def baseline_eps_delta(noise_multiplier: float, sample_rate: float, delta: float, method: str = "analytic") -> float:
    """§3.3 baseline: Δ = Γ, s = σΓ, p = ∞, i.e. log(1 + q·(exp(ε_G) − 1)) with ε_G at δ/q."""
    return float(eps_delta_holder([1.0], noise_multiplier, sample_rate, delta, math.inf, method))


def delta_remove(eps: ArrayLike, mu: ArrayLike, sample_rate: float) -> np.ndarray:
    """§3.3 remove direction: H_{e^ε}((1−q)N(0,1) + qN(μ,1) || N(0,1)), elementwise.

    δ = q·Φ̄(x₀ − μ) − (e^ε − 1 + q)·Φ̄(x₀), x₀ = log((e^ε − 1 + q)/q)/μ + μ/2; 0 at μ = 0.
    """
    eps, mu = np.broadcast_arrays(np.asarray(eps, dtype=float), np.asarray(mu, dtype=float))
    check_sample_rate(sample_rate)
    if sample_rate == 0:
        return np.zeros(eps.shape)
    # log(e^ε − 1 + q) = ε + log(1 − (1−q)·e^{−ε}): finite for every ε ≥ 0 (expm1 overflows above ~709).
    log_factor = eps + np.log1p(-(1 - sample_rate) * np.exp(-eps))
    moving = mu > 0
    safe_mu = np.where(moving, mu, 1.0)
    threshold = (log_factor - math.log(sample_rate)) / safe_mu + safe_mu / 2
    log_delta = log_sub(math.log(sample_rate) + log_ndtr(safe_mu - threshold), log_factor + log_ndtr(-threshold))
    return np.where(moving, np.exp(log_delta), 0.0)


def delta_add(eps: ArrayLike, mu: ArrayLike, sample_rate: float) -> np.ndarray:
    """§3.3 add direction: H_{e^ε}(N(0,1) || (1−q)N(0,1) + qN(μ,1)), elementwise.

    c = 1 − e^ε(1−q); δ = 0 if c ≤ 0, else c·Φ(x₁) − e^ε·q·Φ(x₁ − μ), x₁ = log(c/(e^ε q))/μ + μ/2.
    """
    eps, mu = np.broadcast_arrays(np.asarray(eps, dtype=float), np.asarray(mu, dtype=float))
    check_sample_rate(sample_rate)
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
    log_delta = log_sub(safe_log_c + log_ndtr(threshold), eps + math.log(sample_rate) + log_ndtr(threshold - safe_mu))
    return np.where(live, np.exp(log_delta), 0.0)


DIRECTION_DELTAS = {"remove": delta_remove, "add": delta_add}


def mixture_delta(eps: ArrayLike, mu: ArrayLike, weights: ArrayLike, sample_rate: float, direction: str) -> np.ndarray:
    """Σ_j w_j·δ_direction(ε; μ_j) over the last axis (absent samples: NaN μ or weight 0)."""
    mu = np.asarray(mu, dtype=float)
    present = ~np.isnan(mu)
    terms = DIRECTION_DELTAS[direction](np.asarray(eps, dtype=float)[..., None], np.where(present, mu, 0.0),
                                        sample_rate)
    return np.sum(np.where(present, weights * terms, 0.0), axis=-1)


# per_step_eps works on blocks of about this many (row, component) values at a time: its memory
# stays near a hundred MiB whatever the number of points and mixture components.
EPS_CHUNK_ELEMENTS = 1 << 20


def per_step_eps(mu: ArrayLike, delta: float, sample_rate: float, weights: ArrayLike | None = None,
                 delta_fail: float = 0.0, direction: str = "max") -> np.ndarray:
    """§3.3, §7.6: the smallest ε ≥ 0 with δ(ε) ≤ δ, by a bracketing search (δ(ε) is nonincreasing).

    δ(ε) = Σ_j w_j·δ_dir(ε; μ_j) + δ_fail for direction "remove" or "add"; "max" takes the larger
    of the two sums. mu: (..., S) values Δ/s of the one-dimensional pair for each batch (mixture
    component; NaN = absent); weights: (..., S), the probability of each component (default 1/S
    over the present ones; they may sum to less than 1 when the rest is in δ_fail). Returns (...):
    ε, or inf where δ ≤ δ_fail leaves nothing to spend.
    """
    check_probability("delta", delta)
    check_sample_rate(sample_rate)
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

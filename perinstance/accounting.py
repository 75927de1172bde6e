"""The accountants' mathematics (docs/accounting.md §3-§5): small pure functions on numpy arrays.

No I/O and no torch. Vectorised over points; everything that can overflow is computed in
log space. "RDP_SGM" is the Rényi DP of the Poisson-subsampled Gaussian mechanism as computed
by Opacus (`opacus.accountants.analysis.rdp`).
"""

import importlib.util
import math
import os
import sys
import warnings

import numpy as np
from scipy.special import log_ndtr, logsumexp


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

def _opacus_log_moment(sample_rate, noise_multiplier, order):
    """(λ−1)·RDP_SGM(q, z, λ) at one order from Opacus; NaN where its fractional series fails."""
    try:
        rdp = opacus_rdp.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=float(order))
    except (ValueError, OverflowError):
        return math.nan
    return (order - 1.0) * float(rdp)


def rdp_sgm(sample_rate, noise_multiplier, orders):
    """RDP_SGM(q, z, λ) for one step at each order (§3), as Opacus computes it, made robust.

    Integer orders: Opacus's exact finite sum. Fractional orders: Opacus's series, which cancels
    catastrophically for large orders and sampling rates (q=0.5, z=20, λ=49.13 gives −0.65).
    log A_λ = (λ−1)·RDP is nondecreasing and convex in λ (van Erven & Harremoës 2014, Thm 3 and
    Cor. 2), so the exact value at a fractional λ lies between log A at ⌊λ⌋ and the chord from ⌊λ⌋
    to ⌈λ⌉ (log A_1 = 0). A fractional value outside that band is replaced by the chord: a valid
    upper bound, close to the exact value (§5: bounds may only be rounded up).
    Orders above LARGEST_OPACUS_ORDER get the unsubsampled Gaussian's λ/(2z²), an upper bound.
    """
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    if np.isinf(noise_multiplier) or sample_rate == 0:
        return np.zeros_like(orders)
    rdp = orders / (2.0 * noise_multiplier**2)
    small = orders[orders <= LARGEST_OPACUS_ORDER]
    integers = np.unique(np.concatenate([np.floor(small), np.ceil(small)]))
    integer_moment = {n: 0.0 if n == 1 else _opacus_log_moment(sample_rate, noise_multiplier, n) for n in integers}
    for index in np.flatnonzero(orders <= LARGEST_OPACUS_ORDER):
        order = orders[index]
        low, high = math.floor(order), math.ceil(order)
        if low == high:
            rdp[index] = integer_moment[low] / (order - 1.0)
            continue
        floor_moment, ceil_moment = integer_moment[low], integer_moment[high]
        chord = floor_moment + (order - low) * (ceil_moment - floor_moment)
        moment = _opacus_log_moment(sample_rate, noise_multiplier, order)
        inside = floor_moment - 1e-12 * abs(floor_moment) <= moment <= chord * (1 + 1e-9) + 1e-300
        rdp[index] = (min(moment, chord) if inside else chord) / (order - 1.0)
    return rdp


def rdp_sum_rule(grad_norm, clip_bound, noise_multiplier, sample_rate, orders):
    """§3.1: ρ(λ) = RDP_SGM(q, σ·Γ/Δ*, λ) per point (rows) and order (columns); 0 at Δ* = 0.

    Δ* above Γ by rounding only (the caller validates) is taken as Γ.
    """
    grad_norm = np.minimum(np.atleast_1d(np.asarray(grad_norm, dtype=float)), clip_bound)
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    distinct, position = np.unique(grad_norm, return_inverse=True)
    table = np.zeros((len(distinct), len(orders)))
    for row, norm in enumerate(distinct):
        if norm > 0:
            table[row] = rdp_sgm(sample_rate, noise_multiplier * clip_bound / norm, orders)
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
    aggregate="per-target": the seed scripts' average over target batches B_0 (`target_batch`
    labels each S) of the per-B_0 value; by Jensen never larger, so *not* an upper bound.
    """
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


# --- §4: composition over a training run ----------------------------------------------------

def holder_orders(alpha, steps, holder_b):
    """§4: λ_k = 1 + (λ−1)·a^k for k = 0..steps−1 with a = b/(b−1); b = ∞ gives λ_k = λ."""
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
    observed = np.ravel(np.asarray(sensitivity_ratio, dtype=float))
    observed = np.clip(observed[~np.isnan(observed)], 0.0, 1.0)
    if rounding == 0:
        return np.unique(np.concatenate([[0.0, 1.0], observed]))
    grid = np.minimum(np.arange(math.ceil(1 / rounding - 1e-9) + 1) * rounding, 1.0)
    used = np.bincount(np.searchsorted(grid, observed, side="left"), minlength=len(grid)) > 0
    used[[0, -1]] = True
    return grid[used]


class RdpTable:
    """RDP_SGM(q, σ·Γ/Δ, λ) precomputed on a grid of Δ/Γ levels × orders (§4, §5).

    Lookups round Δ/Γ up to the next level; RDP_SGM is nondecreasing in Δ, so the result is an
    upper bound. Level 0 (Δ = 0) costs nothing.
    """

    def __init__(self, sample_rate, noise_multiplier, orders, levels):
        self.orders = np.unique(np.asarray(orders, dtype=float))
        self.levels = np.asarray(levels, dtype=float)
        self.rdp = np.zeros((len(self.levels), len(self.orders)))
        for row, level in enumerate(self.levels):
            if level > 0:
                self.rdp[row] = rdp_sgm(sample_rate, noise_multiplier / level, self.orders)
        self.log_moment = self.rdp * (self.orders - 1.0)

    def level_index(self, sensitivity_ratio):
        """Index of the smallest level ≥ Δ/Γ (ratios above 1 by rounding map to level 1)."""
        ratio = np.minimum(np.asarray(sensitivity_ratio, dtype=float), 1.0)
        return np.searchsorted(self.levels, ratio, side="left")


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
    rdp = np.asarray(rdp, dtype=float)
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
    return steps * rdp_sgm(sample_rate, noise_multiplier, orders)

"""Composition over a training run (docs/accounting.md §4-§5): the orders composed, the RDP_SGM table on a
grid of sensitivity levels, the Hölder composition over checkpoint segments and the conversion to ε.

No I/O and no torch; vectorised over points; everything that can overflow is computed in log space.
"""

import functools
import math
import warnings

import numpy as np
from numpy.typing import ArrayLike

from perinstance.accounting.numerics import check_holder_b, check_orders, check_probability
from perinstance.accounting.renyi_step import opacus_rdp, rdp_sgm, rdp_sgm_levels

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


def holder_orders(alpha: float, steps: int, holder_b: float) -> np.ndarray:
    """§4: λ_k = 1 + (λ−1)·a^k for k = 0..steps−1 with a = b/(b−1); b = ∞ gives λ_k = λ."""
    check_holder_b(holder_b)
    check_orders([alpha])
    growth = 1.0 if np.isinf(holder_b) else holder_b / (holder_b - 1)
    # Written so that λ_0 is exactly λ (it must match the grid order λ bit for bit).
    return alpha + (alpha - 1.0) * (growth ** np.arange(steps) - 1.0)


def composition_orders(orders: ArrayLike, total_steps: int, holder_b: float) -> np.ndarray:
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


def sensitivity_levels(rounding: float, sensitivity_ratio: ArrayLike) -> np.ndarray:
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

    def __init__(self, sample_rate: float, noise_multiplier: float, orders: ArrayLike, levels: ArrayLike) -> None:
        check_orders(orders)
        if np.any(~(np.asarray(levels, dtype=float) >= 0)):
            raise ValueError("levels must be >= 0")
        self.orders = np.unique(np.asarray(orders, dtype=float))
        self.levels = np.asarray(levels, dtype=float)
        self.rdp = np.zeros((len(self.levels), len(self.orders)))
        moving = self.levels > 0
        if moving.any():
            self.rdp[moving] = _remembered_rdp(sample_rate, noise_multiplier, self.orders, self.levels[moving])
        self.log_moment = self.rdp * (self.orders - 1.0)


    def level_index(self, sensitivity_ratio: ArrayLike) -> np.ndarray:
        """Index of the smallest level ≥ Δ/Γ (ratios above the largest level by rounding map to it)."""
        ratio = np.minimum(np.asarray(sensitivity_ratio, dtype=float), self.levels[-1])
        return np.searchsorted(self.levels, ratio, side="left")

    def log_moments(self, sensitivity_ratio: ArrayLike) -> np.ndarray:
        """(λ−1)·RDP_SGM at the level rounded up from each Δ/Γ: shape (*ratio.shape, orders)."""
        return self.log_moment[self.level_index(sensitivity_ratio)]


def carry_forward(sensitivity_ratio: ArrayLike) -> np.ndarray:
    """§4 for several runs whose checkpoints differ: (R, C, P) Δ/Γ at the union of checkpoint
    steps, NaN where a run has no checkpoint. Each run keeps its latest earlier checkpoint;
    before its first one, the worst case Δ = Γ (ratio 1)."""
    ratio = np.asarray(sensitivity_ratio, dtype=float)
    has_checkpoint = ~np.isnan(ratio).all(axis=2)
    latest = np.maximum.accumulate(np.where(has_checkpoint, np.arange(ratio.shape[1]), -1), axis=1)
    carried = np.take_along_axis(ratio, np.maximum(latest, 0)[:, :, None], axis=1)
    return np.where((latest < 0)[:, :, None], 1.0, carried)


def step_segments(checkpoint_steps: ArrayLike, total_steps: int) -> list[tuple[int, int, int | None]]:
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


def compose_rdp(table: RdpTable, sensitivity_ratio: ArrayLike, checkpoint_steps: ArrayLike, total_steps: int,
                orders: ArrayLike, holder_b: float) -> np.ndarray:
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
    check_holder_b(holder_b)
    check_orders(orders)
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


def running_composition(table: RdpTable, sensitivity_ratio: ArrayLike, checkpoint_steps: ArrayLike, total_steps: int,
                        orders: ArrayLike) -> np.ndarray:
    """§4 with b = ∞ after every step: (T, P, O) whose row h − 1 bounds D_λ of the first h steps,
    Σ_{t≤h} max_r ρ_{r,t}(λ) (compose_rdp's value for total_steps = h), from one running sum over the steps.

    table: RdpTable whose orders include `orders`; sensitivity_ratio: (R, C, P) as for compose_rdp. Holds T·P·O
    values: for curves over training of a few points."""
    check_orders(orders)
    orders = np.asarray(orders, dtype=float)
    columns = np.searchsorted(table.orders, orders)
    if np.any(columns >= len(table.orders)) or np.any(table.orders[np.minimum(columns, len(table.orders) - 1)] != orders):
        raise ValueError("the table's orders must include every order composed")
    ratio = np.asarray(sensitivity_ratio, dtype=float)
    per_step = np.empty((total_steps, ratio.shape[2], len(orders)))
    for first, last, checkpoint in step_segments(checkpoint_steps, total_steps):
        level = len(table.levels) - 1 if checkpoint is None else table.level_index(ratio[:, checkpoint]).max(axis=0)
        per_step[first - 1:last] = table.log_moment[level][..., columns]
    return np.cumsum(per_step, axis=0) / (orders - 1.0)


def rdp_to_eps(orders: ArrayLike, rdp: ArrayLike, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """RDP curve(s) → (ε, δ) with Opacus's get_privacy_spent (§4); rdp: (..., O).

    Returns (eps, best_order) arrays of shape (...). ε is floored at 0.
    """
    check_probability("delta", delta)
    check_orders(orders)
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


def baseline_rdp(noise_multiplier: float, sample_rate: float, orders: ArrayLike, steps: int = 1) -> np.ndarray:
    """Data-independent baseline (§3.1, §4): Opacus's RDP for (q, σ) over `steps` steps."""
    return steps * _remembered_rdp_sgm(float(sample_rate), float(noise_multiplier),
                                       tuple(np.atleast_1d(np.asarray(orders, dtype=float)).tolist()))


@functools.lru_cache(maxsize=1024)
def _remembered_rdp_sgm(sample_rate, noise_multiplier, orders):
    """rdp_sgm for the few (q, σ) a run's baselines ask for again and again (figure 4 asks at every step)."""
    result = rdp_sgm(sample_rate, noise_multiplier, orders)
    result.flags.writeable = False
    return result

"""The one-run audit against a claimed trade-off curve (docs/accounting.md §11.7-§11.9): pure numpy/scipy (and
dp_accounting's discretisation, through pld_grid).

A claim is a symmetric trade-off curve f, given by (ε_i, δ_i) pairs that hold in both directions; Mahloujifar,
Melis and Chaudhuri's one-run test ("Auditing f-differential privacy in one run", 2024) uses it only through its
inverse blow-up F(x) = f(1 − x), the smallest probability under one law of an event whose probability under the
other is x (its recursion: one_run_audit.fdp_margins). The guesses are counted at the grid of guess counts
fixed before any score is seen (one_run_audit.GUESS_FRACTIONS, §11.7): a union bound over them covers the
choice of the best one.

- subsampled_gaussian_curve: the curve the suite's accountant claims for T steps of the Poisson-subsampled
  Gaussian at one noise multiplier (its PLD, §8, both directions);
- curve_rejected: the verdict of the scores against one claimed curve;
- family_lower_bound: the least private curve of the subsampled Gaussian's shape (same q and T, any noise) that
  the scores reject, and its ε at δ (the largest ε refuted);
- canaries_to_reject: the fewest canaries whose perfectly separated scores reject a curve.
"""

import functools
import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy import fft, signal

from perinstance.accounting.numerics import check_probability
from perinstance.accounting.one_run_audit import GUESS_FRACTIONS, fdp_margins, top_guesses
from perinstance.accounting.pld_grid import (
    CHERNOFF_ORDERS,
    DEFAULT_INTERVAL,
    DIRECTIONS,
    ROUNDING,
    LossPmf,
    epsilon_for_delta,
    mass_above,
    subsampled_gaussian_pmfs,
    window_bounds,
)

# §11.8: the ε of the (ε_i, δ(ε_i)) pairs that describe a claimed curve: from 0 to one step past where δ(ε) falls
# below CURVE_FLOOR (or ε reaches CURVE_TOP), about CURVE_POINTS of them on the PLD's loss grid, at most
# CURVE_EPSILON_STEP apart (a coarser set of pairs only weakens the claim).
CURVE_POINTS = 1000
CURVE_EPSILON_STEP = 0.02
CURVE_FLOOR = 1e-12
CURVE_TOP = 50.0
# §11.8: the composed mass a Chernoff bound leaves outside the window on each side (folded upward below it, added
# to +∞ above it): far below CURVE_FLOOR.
CURVE_TAIL = 1e-15
# §11.8: canaries_to_reject looks no further than this many canaries.
SEPARATED_LIMIT = 2**24
# §11.9: the noise multipliers of the family tried, z_k = FAMILY_RATIO^k (k an integer), and the search's range.
FAMILY_RATIO = 1.005
FAMILY_RANGE = (0.25, 1000.0)


@dataclass(frozen=True)
class TradeOffCurve:
    """A symmetric trade-off curve through its inverse blow-up F(x) = f(1 − x) on [0, 1] (§11.8).

    F is convex, nondecreasing and piecewise linear: knots_x (increasing, from 0 to 1) and knots_y are its
    corners, so np.interp evaluates it exactly.
    """

    knots_x: np.ndarray
    knots_y: np.ndarray

    def inverse_blow_up(self, x: ArrayLike) -> np.ndarray:
        return np.interp(x, self.knots_x, self.knots_y)

    @classmethod
    def from_epsilon_delta(cls, epsilons: ArrayLike, deltas: ArrayLike) -> "TradeOffCurve":
        """The curve of a mechanism that is (ε_i, δ_i)-DP in both directions for every i:
        F(x) = max(0, max_i e^{−ε_i}(x − δ_i), max_i 1 − δ_i − e^{ε_i}(1 − x))."""
        epsilons, deltas = np.asarray(epsilons, dtype=float), np.asarray(deltas, dtype=float)
        if epsilons.shape != deltas.shape or epsilons.ndim != 1 or epsilons.size == 0:
            raise ValueError("epsilons and deltas must be two 1-d arrays of the same length")
        if not (np.all(epsilons >= 0) and np.all(np.isfinite(epsilons))):
            raise ValueError("epsilons must be finite and >= 0")
        if not np.all((deltas >= 0) & (deltas <= 1)):
            raise ValueError("deltas must be in [0, 1]")
        slopes = np.concatenate([np.exp(-epsilons), np.exp(epsilons), [0.0]])
        intercepts = np.concatenate([-np.exp(-epsilons) * deltas, 1 - deltas - np.exp(epsilons), [0.0]])
        corners = _envelope_corners(slopes, intercepts)
        knots_x = np.unique(np.concatenate([[0.0, 1.0], corners[(corners > 0) & (corners < 1)]]))
        # The value at each corner from every line, the steep ones written around x = 1: no cancellation.
        below = np.exp(-epsilons)[None, :] * (knots_x[:, None] - deltas[None, :])
        above = 1 - deltas[None, :] - np.exp(epsilons)[None, :] * (1 - knots_x)[:, None]
        # Lowered by a relative 1e-9, far above the float rounding of the corners (1.6e-11 measured near x = 1):
        # the curve used is never above the claimed one.
        knots_y = np.clip(np.maximum(below.max(axis=1), above.max(axis=1)), 0.0, 1.0) * (1 - 1e-9)
        return cls(knots_x=knots_x, knots_y=knots_y)


def _envelope_corners(slopes: np.ndarray, intercepts: np.ndarray) -> np.ndarray:
    """The x of every corner of the upper envelope of the lines y = slope·x + intercept (a monotone chain over the
    lines sorted by slope, on Python floats)."""
    order = np.lexsort((intercepts, slopes))
    slope, intercept = slopes[order].tolist(), intercepts[order].tolist()
    hull: list[int] = []
    for line in range(len(order)):
        if hull and slope[hull[-1]] == slope[line]:
            hull.pop()  # same slope, intercept no larger (sorted): the new line is above it
        while len(hull) >= 2:
            first, middle = hull[-2], hull[-1]
            # The middle line is never on top when the outer two cross at or left of its crossing with the first.
            if ((intercept[first] - intercept[line]) * (slope[middle] - slope[first])
                    > (intercept[first] - intercept[middle]) * (slope[line] - slope[first])):
                break
            hull.pop()
        hull.append(line)
    kept = np.asarray(hull)
    chosen_slopes, chosen_intercepts = slopes[order][kept], intercepts[order][kept]
    return (chosen_intercepts[:-1] - chosen_intercepts[1:]) / (chosen_slopes[1:] - chosen_slopes[:-1])


@dataclass(frozen=True)
class ComposedLoss:
    """One direction's PLD after T steps on the grid of `interval`: probs[i] at loss (lower + i)·interval, and the
    mass at +∞ (§8.1)."""

    lower: int
    probs: np.ndarray
    infinity_mass: float


@dataclass(frozen=True)
class ClaimedCurve:
    """What the accountant claims for T steps at one noise multiplier: the trade-off curve, and ε at any δ."""

    noise_multiplier: float
    curve: TradeOffCurve
    composed: tuple[ComposedLoss, ComposedLoss]
    interval: float

    def epsilon(self, delta: float) -> float:
        """The larger direction's ε at δ, read off the composed PMFs as §8.1 reads it."""
        return max(float(epsilon_for_delta(loss.probs[None, max(-loss.lower, 0):], max(loss.lower, 0), self.interval,
                                           [loss.infinity_mass], delta)[0])
                   for loss in self.composed)


@functools.lru_cache(maxsize=128)
def subsampled_gaussian_curve(noise_multiplier: float, sample_rate: float, steps: int,
                              interval: float = DEFAULT_INTERVAL) -> ClaimedCurve:
    """§11.8: the curve of T steps of the Poisson-subsampled Gaussian (sensitivity 1, noise std z): each direction's
    pessimistic PMF of one step (pld_grid, §8.1: dominating pairs) composed as §8.3 composes it, read at about
    CURVE_POINTS ε of its loss grid from 0 to where δ(ε) < CURVE_FLOOR (or ε = CURVE_TOP), the larger
    direction's δ."""
    pmfs = subsampled_gaussian_pmfs([noise_multiplier], sample_rate, interval)
    composed = tuple(_self_composed(pmfs[direction][0], steps, interval) for direction in DIRECTIONS)
    partial = ClaimedCurve(noise_multiplier, TradeOffCurve(np.array([0.0, 1.0]), np.zeros(2)), composed, interval)
    top = min(partial.epsilon(CURVE_FLOOR), CURVE_TOP)
    stride = min(max(1, math.ceil(top / (interval * CURVE_POINTS))), max(1, round(CURVE_EPSILON_STEP / interval)))
    count = math.floor(top / (stride * interval)) + 2
    deltas = np.max([_deltas_on_grid(loss, interval, stride, count) for loss in composed], axis=0)
    epsilons = np.arange(count) * stride * interval
    return ClaimedCurve(noise_multiplier, TradeOffCurve.from_epsilon_delta(epsilons, deltas), composed, interval)


def _self_composed(pmf: LossPmf, steps: int, interval: float) -> ComposedLoss:
    """§8.3 for one level and T steps: the PMF folded onto a circle that spans the Chernoff window of the T-fold
    sum (outside it at most CURVE_TAIL of the mass on each side), raised to the T-th power in Fourier space; mass
    below the window folds upward, the bound on the mass above it and the FFT's rounding go to +∞."""
    log_mgf = steps * pmf.log_mgf(CHERNOFF_ORDERS, interval)[None, :]
    hard_lower, hard_upper = np.array([steps * pmf.lower]), np.array([steps * pmf.upper])
    lower, upper = window_bounds(log_mgf, hard_lower, hard_upper, interval, CURVE_TAIL)
    length = fft.next_fast_len(int(upper[0] - lower[0] + 1), real=True)
    composed = fft.irfft(fft.rfft(pmf.folded(length)) ** steps, n=length)
    start = int(lower[0]) % length
    window = np.roll(composed, -start)[:int(upper[0] - lower[0]) + 1]
    infinity = (-math.expm1(steps * math.log1p(-pmf.infinity_mass)) + ROUNDING * math.sqrt(length) * steps
                + float(mass_above(log_mgf, hard_upper, upper, interval)[0]))
    return ComposedLoss(lower=int(lower[0]), probs=np.maximum(window, 0.0), infinity_mass=infinity)


def _deltas_on_grid(loss: ComposedLoss, interval: float, stride: int, count: int) -> np.ndarray:
    """δ(ε) = m_∞ + Σ_{ℓ > ε} p_ℓ·(1 − e^{ε−ℓ}) at ε = k·stride·interval, k < count: the mass above each grid loss
    and its discounted sum D_k = e^{−h}(p_{k+1} + D_{k+1}), both accumulated from the top."""
    length = count * stride
    masses = np.zeros(length)  # losses 0 .. (length − 1)·h; those above are summed apart
    first = max(loss.lower, 0)
    inside = loss.probs[first - loss.lower:max(length - loss.lower, 0)]
    masses[first:first + inside.size] = inside
    above_top = loss.probs[max(length - loss.lower, 0):]
    decay = math.exp(-interval)
    offsets = (np.arange(above_top.size) + max(length, loss.lower) - length) * interval
    mass_over = np.cumsum(masses[::-1])[::-1] - masses + above_top.sum()
    discounted = (signal.lfilter([0.0, decay], [1.0, -decay], masses[::-1])[::-1]
                  + decay ** (length - np.arange(length)) * float(np.dot(above_top, np.exp(-offsets))))
    return np.clip(loss.infinity_mass + mass_over - discounted, 0.0, 1.0)[::stride][:count]


def curve_rejected(curve: TradeOffCurve, in_scores: ArrayLike, out_scores: ArrayLike, *,
                   significance: float) -> bool:
    """§11.8: whether the scores reject "the run is f-DP for this curve" at `significance` (Bonferroni over the
    guess counts)."""
    check_probability("significance", significance)
    return _rejects(curve, in_scores, out_scores, *top_guesses(in_scores, out_scores), significance)


def _rejects(curve: TradeOffCurve, in_scores: ArrayLike, out_scores: ArrayLike, guesses: np.ndarray,
             correct: np.ndarray, significance: float) -> bool:
    """§11.8's test of the grid's guesses (top_guesses of the scores), Bonferroni over the guess counts."""
    canaries = np.size(in_scores) + np.size(out_scores)
    return bool(np.any(fdp_margins(curve.inverse_blow_up, canaries, guesses, correct,
                                   significance / len(GUESS_FRACTIONS)) > 0))


@dataclass(frozen=True)
class FamilyBound:
    """§11.9: the least private curve of the subsampled Gaussian's shape that the scores reject (every more private
    one, at a larger z, is rejected too).

    noise_multiplier: its z (every z at or above it is rejected too; None: none is, in FAMILY_RANGE);
    epsilon: its ε at δ (0 when none is rejected); at_range_end: the smallest z tried is rejected already, so the
    bound is only a floor.
    """

    noise_multiplier: float | None
    epsilon: float
    at_range_end: bool


def family_lower_bound(in_scores: ArrayLike, out_scores: ArrayLike, *, sample_rate: float, steps: int,
                       delta: float, significance: float, interval: float = DEFAULT_INTERVAL) -> FamilyBound:
    """§11.9: the smallest z_k = FAMILY_RATIO^k whose curve (T steps at q) the scores reject: down from the top
    of FAMILY_RANGE by halving z while it is rejected (large z are cheap to compose), then bisection in k."""
    check_probability("significance", significance)
    check_probability("delta", delta)
    guesses, correct = top_guesses(in_scores, out_scores)

    def rejected(index: int) -> bool:
        curve = subsampled_gaussian_curve(FAMILY_RATIO ** index, sample_rate, steps, interval).curve
        return _rejects(curve, in_scores, out_scores, guesses, correct, significance)

    floor, high = (round(math.log(end) / math.log(FAMILY_RATIO)) for end in FAMILY_RANGE)
    if not rejected(high):
        return FamilyBound(noise_multiplier=None, epsilon=0.0, at_range_end=False)
    halving = round(math.log(2) / math.log(FAMILY_RATIO))
    low = max(high - halving, floor)
    while rejected(low):
        if low == floor:
            claim = subsampled_gaussian_curve(FAMILY_RATIO ** floor, sample_rate, steps, interval)
            return FamilyBound(noise_multiplier=claim.noise_multiplier, epsilon=claim.epsilon(delta),
                               at_range_end=True)
        high, low = low, max(low - halving, floor)
    while high - low > 1:  # rejected(high), not rejected(low)
        middle = (low + high) // 2
        low, high = (low, middle) if rejected(middle) else (middle, high)
    claim = subsampled_gaussian_curve(FAMILY_RATIO ** high, sample_rate, steps, interval)
    return FamilyBound(noise_multiplier=claim.noise_multiplier, epsilon=claim.epsilon(delta), at_range_end=False)


def canaries_to_reject(curve: TradeOffCurve, *, significance: float, limit: int = SEPARATED_LIMIT) -> int | None:
    """§11.8: the fewest canaries m, m // 2 of them in, whose perfectly separated scores (every member above every
    non-member) make the verdict reject `curve` at `significance`: below it no outcome of half-in canaries refutes
    the claim. None when no m up to `limit` does.

    Rejection is not monotone in m: at an odd m whose m // 2 is odd the guesser of half the canaries makes
    round(m/2) = m // 2 + 1 guesses (halves round to even), one of them wrong, which can undo the rejection of
    m − 1. Over even m it rises (a test checks every count below by brute force), so the even threshold is found by
    doubling and bisection, and m − 1 is taken when it rejects too.
    """
    check_probability("significance", significance)

    def rejects(canaries: int) -> bool:
        members = canaries // 2
        return curve_rejected(curve, np.ones(members), np.zeros(canaries - members), significance=significance)

    low, high = 0, 2  # even counts: rejects(high) is tried, rejects(low) is false (no canary rejects nothing)
    while not rejects(high):
        if high >= limit:
            return None
        low, high = high, 2 * high
    while high - low > 2:
        middle = (low + high) // 4 * 2
        low, high = (low, middle) if rejects(middle) else (middle, high)
    return high - 1 if high > 2 and rejects(high - 1) else high

"""Empirical lower bounds on ε from canary scores (docs/accounting.md §11): pure numpy/scipy.

Scores follow the ecosystem's convention (jax_privacy's CanaryScoreAuditor): a higher score means
"member", a guess is "in" when the score is at least a threshold, and the significance is split over
the thresholds tried (Bonferroni): by default a grid of guess counts fixed before the scores are seen
(§11.7), or, to compare with jax_privacy, every vertex of the ROC curve's concave frontier (§11.1),
whose number is read off the scores. Three bounds, each the largest ε that the scores reject at the
significance level:

- one_run_epsilon: Steinke, Nasr, Jagielski, "Privacy auditing with one (1) training run"
  (NeurIPS 2023), (ε, δ)-DP with m canaries each included with probability 1/2 (§11.2);
- one_run_fdp_epsilon: its f-DP version for the Gaussian trade-off curve of (ε, δ) (Mahloujifar,
  Melis, Chaudhuri, "Auditing f-differential privacy in one run", 2024) (§11.3), whose recursion
  (fdp_margins) takes any claimed curve (one_run_fdp.py);
- clopper_pearson_epsilon: ε ≥ log((TPR − δ)/FPR) with Clopper–Pearson bounds on both rates (§11.4).

one_run_cap and canaries_needed say what m canaries can show at most, and how many it takes (§11.6).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import expit, ndtr, ndtri
from scipy.stats import binom

from perinstance.accounting.audit_bounds import epsilon_lower_bound
from perinstance.accounting.exact_eps_delta import gaussian_log_delta
from perinstance.accounting.numerics import check_probability

# Root finding in ε stops when the bracket is this narrow: far below the 1e-6 the results are quoted to.
EPS_TOLERANCE = 1e-10


@dataclass(frozen=True)
class Frontier:
    """The thresholds on the concave frontier of the ROC curve, as counts of guesses "in".

    true_positives[j], false_positives[j]: in-canaries and out-canaries scoring >= threshold j,
    thresholds decreasing from +∞ (no guess) to the lowest score (every canary guessed in).
    """

    true_positives: np.ndarray
    false_positives: np.ndarray
    members: int
    non_members: int

    @property
    def canaries(self) -> int:
        return self.members + self.non_members


def check_level(*, significance: float, delta: float) -> None:
    """ValueError (one line) unless 0 < significance < 1 and 0 < delta < 1."""
    check_probability("significance", significance)
    check_probability("delta", delta)


def roc_frontier(in_scores: np.ndarray, out_scores: np.ndarray) -> Frontier:
    """§11.1: counts (TP, FP) at every threshold on the ROC curve's concave frontier.

    The thresholds are +∞ and every distinct score; a threshold strictly inside a chord of the
    curve (below it or on it) is dominated by randomising between the chord's ends and is dropped,
    so the Bonferroni split counts only the thresholds that can matter.
    """
    members, non_members = np.sort(_finite(in_scores)), np.sort(_finite(out_scores))
    thresholds = np.concatenate([[np.inf], np.unique(np.concatenate([members, non_members]))[::-1]])
    true_positives = members.size - np.searchsorted(members, thresholds, side="left")
    false_positives = non_members.size - np.searchsorted(non_members, thresholds, side="left")
    hull = _upper_hull(false_positives, true_positives)
    return Frontier(true_positives=true_positives[hull], false_positives=false_positives[hull],
                    members=members.size, non_members=non_members.size)


def _upper_hull(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the upper concave hull of points sorted by x, points on a chord excluded."""
    hull: list[int] = []
    for index in range(x.size):
        while len(hull) >= 2:
            first, middle = hull[-2], hull[-1]
            turn = (x[middle] - x[first]) * (y[index] - y[first]) - (y[middle] - y[first]) * (x[index] - x[first])
            if turn < 0:
                break
            hull.pop()
        hull.append(index)
    return np.asarray(hull)


# --- §11.2: Steinke, Nasr, Jagielski ------------------------------------------------------------

def one_run_p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """§11.2: the largest probability, under an (ε, δ)-DP run, of `correct` or more right out of `guesses`.

    P[Binomial(r, e^ε/(1+e^ε)) >= v] + 2mδ · max_{1<=i<=v} (P[Binomial(r, ·) >= v−i] − P[... >= v])/i.
    """
    if correct == 0:
        return 1.0
    success = expit(epsilon)
    tail = binom.sf(correct - 1, guesses, success)
    shifts = np.arange(1, correct + 1)
    excess = np.max((binom.sf(correct - shifts - 1, guesses, success) - tail) / shifts)
    return min(tail + 2 * canaries * delta * excess, 1.0)


def one_run_epsilon_at(*, canaries: int, guesses: int, correct: int, significance: float, delta: float,
                       floor: float = 0.0) -> float:
    """§11.2: the largest ε >= floor whose (ε, δ) claim the outcome rejects at `significance` (floor if none)."""

    def rejection_margin(epsilon: float) -> float:
        return significance - one_run_p_value(canaries=canaries, guesses=guesses, correct=correct,
                                              epsilon=epsilon, delta=delta)

    return _largest_rejected(rejection_margin, floor)


# --- §11.3: Mahloujifar, Melis, Chaudhuri (Gaussian trade-off curve) ---------------------------

def gaussian_noise_for(*, epsilon: float, delta: float) -> float:
    """§11.3: σ of the Gaussian mechanism (sensitivity 1) that is exactly (ε, δ)-DP (Balle & Wang's curve)."""
    log_delta = math.log(delta)

    def log_delta_gap(log_sigma: float) -> float:
        return float(gaussian_log_delta(epsilon, math.exp(-log_sigma))) - log_delta

    low, high = -1.0, 1.0
    while log_delta_gap(low) < 0:
        low -= 2.0
    while log_delta_gap(high) > 0:
        high += 2.0
    return math.exp(brentq(log_delta_gap, low, high, xtol=1e-14, rtol=1e-15))


def fdp_margins(inverse_blow_up: Callable[[float], float], canaries: int, guesses: np.ndarray,
                correct: np.ndarray, significance: float) -> np.ndarray:
    """§11.3, for any claimed trade-off curve f given by its inverse blow-up F(x) = f(1 − x): per (guesses r,
    correct v) pair, positive when v right out of r is too many for the claim at `significance`.

    Walks the bound on the probability of i or more right guesses down from i = v: starting from a = α·v/m,
    b = α·(r − v)/m, each step raises b' = max(b, F(a)) and a' = min(a + i/(r − i)·(b' − b), 1), until b stops
    moving; the margin is a + b − r/m. a and b never decrease, so the walk also stops once a + b > r/m: the
    margin returned is then positive (the claim is rejected) but may be below the full walk's.
    """
    margins = []
    for count, right_count in zip(np.asarray(guesses).tolist(), np.asarray(correct).tolist(), strict=True):
        right, wrong = significance * right_count / canaries, significance * (count - right_count) / canaries
        total = count / canaries
        for remaining in range(right_count - 1, -1, -1):
            raised = max(wrong, float(inverse_blow_up(right)))
            if raised == wrong:
                break
            right = min(right + remaining / (count - remaining) * (raised - wrong), 1.0)
            wrong = raised
            if right + wrong > total:
                break
        margins.append(right + wrong - total)
    return np.array(margins)


def one_run_fdp_margin(*, canaries: int, guesses: int, correct: int, significance: float,
                        mu: float) -> float:
    """§11.3: positive when `correct` of `guesses` right is too many for μ-GDP at `significance`: fdp_margins
    with the Gaussian's F(x) = Φ(Φ⁻¹(x) − μ)."""
    return float(fdp_margins(lambda x: ndtr(ndtri(x) - mu), canaries, np.array([guesses]), np.array([correct]),
                             significance)[0])


def one_run_fdp_epsilon_at(*, canaries: int, guesses: int, correct: int, significance: float, delta: float,
                           floor: float = 0.0) -> float:
    """§11.3: the largest ε >= floor whose Gaussian trade-off curve at (ε, δ) the outcome rejects."""

    def rejection_margin(epsilon: float) -> float:
        mu = 1.0 / gaussian_noise_for(epsilon=epsilon, delta=delta)
        return one_run_fdp_margin(canaries=canaries, guesses=guesses, correct=correct,
                                   significance=significance, mu=mu)

    return _largest_rejected(rejection_margin, floor)


def _largest_rejected(rejection_margin: Callable[[float], float], floor: float) -> float:
    """The root of a margin decreasing in ε (positive: rejected), or `floor` when floor is not rejected."""
    if rejection_margin(floor) <= 0:
        return floor
    low, high = floor, max(1.0, 2 * floor)
    while rejection_margin(high) > 0:
        low, high = high, 2 * high
    return brentq(rejection_margin, low, high, xtol=EPS_TOLERANCE)


# --- the thresholds: a pre-registered grid (§11.7) or jax_privacy's frontier (§11.1), Bonferroni ----------

# §11.7: the numbers of guesses "in" tried, as fractions of the canaries, fixed before any score is seen. The
# guesser says "in" for the round(fraction·m) highest scores (at least one); the union bound is over these 8.
GUESS_FRACTIONS = (1 / 256, 1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)
THRESHOLD_STRATEGIES = ("grid", "frontier")


def top_guesses(in_scores: np.ndarray, out_scores: np.ndarray,
                fractions: tuple[float, ...] = GUESS_FRACTIONS) -> tuple[np.ndarray, np.ndarray]:
    """§11.7: (guesses r, correct v) per fraction: "in" for the round(fraction·m) highest scores (at least 1).

    Scores tied across the cut count their out-canaries first (the fewest right): the count is then at most what
    any tie-breaking that does not look at the labels would give.
    """
    members, non_members = _finite(in_scores), _finite(out_scores)
    scores = np.concatenate([members, non_members])
    member = np.concatenate([np.ones(members.size, dtype=bool), np.zeros(non_members.size, dtype=bool)])
    ranked = member[np.lexsort((member, -scores))]
    guesses = np.array([max(1, round(fraction * scores.size)) for fraction in fractions])
    return guesses, np.cumsum(ranked)[guesses - 1]


def _finite(scores):
    scores = np.asarray(scores, dtype=float).ravel()
    if scores.size == 0:
        raise ValueError("need at least one in-score and one out-score")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores must be finite numbers")
    return scores


@dataclass(frozen=True)
class Guesses:
    """The thresholds tried: (guesses r, correct v) at each, the canaries m, and the number of thresholds K that
    the significance is split over."""

    guesses: np.ndarray
    correct: np.ndarray
    members: int
    non_members: int
    thresholds: int

    @property
    def canaries(self) -> int:
        return self.members + self.non_members


def guesses_of(in_scores: np.ndarray, out_scores: np.ndarray, thresholds: str = "grid") -> Guesses:
    """The guesses of a threshold strategy: "grid" (§11.7, GUESS_FRACTIONS, K fixed before the scores are seen) or
    "frontier" (§11.1, jax_privacy's: every vertex of the ROC frontier, K read off the scores; for comparison)."""
    if thresholds == "grid":
        guesses, correct = top_guesses(in_scores, out_scores)
        return Guesses(guesses=guesses, correct=correct, members=np.size(in_scores), non_members=np.size(out_scores),
                       thresholds=len(GUESS_FRACTIONS))
    if thresholds == "frontier":
        frontier = roc_frontier(in_scores, out_scores)
        return Guesses(guesses=frontier.true_positives + frontier.false_positives, correct=frontier.true_positives,
                       members=frontier.members, non_members=frontier.non_members,
                       thresholds=frontier.true_positives.size)
    raise ValueError(f"thresholds must be one of {', '.join(THRESHOLD_STRATEGIES)}, not {thresholds!r}")


def _best_over_thresholds(tried: Guesses, significance: float, delta: float,
                          epsilon_at: Callable[..., float]) -> float:
    """max over the thresholds of epsilon_at(significance / thresholds), 0 when none rejects.

    A threshold whose raw precision v/r is at most e^ε/(1+e^ε) of the best ε so far cannot beat it
    (its one-sided binomial tail at that ε is at least 1/2), so it is skipped.
    """
    level = significance / tried.thresholds
    best = 0.0
    for correct, guesses in zip(tried.correct.tolist(), tried.guesses.tolist(), strict=True):
        if guesses == 0 or correct / guesses <= expit(best):
            continue
        best = epsilon_at(canaries=tried.canaries, guesses=guesses, correct=correct, significance=level,
                          delta=delta, floor=best)
    return best


def one_run_epsilon(in_scores: np.ndarray, out_scores: np.ndarray, *, significance: float, delta: float,
                    thresholds: str = "grid") -> float:
    """§11.2: Steinke et al.'s ε lower bound from the canaries' scores (higher = member), Bonferroni thresholds."""
    check_level(significance=significance, delta=delta)
    return _best_over_thresholds(guesses_of(in_scores, out_scores, thresholds), significance, delta,
                                 one_run_epsilon_at)


def one_run_fdp_epsilon(in_scores: np.ndarray, out_scores: np.ndarray, *, significance: float,
                        delta: float, thresholds: str = "grid") -> float:
    """§11.3: the f-DP (Gaussian trade-off) one-run ε lower bound, Bonferroni thresholds."""
    check_level(significance=significance, delta=delta)
    return _best_over_thresholds(guesses_of(in_scores, out_scores, thresholds), significance, delta,
                                 one_run_fdp_epsilon_at)


def clopper_pearson_epsilon(in_scores: np.ndarray, out_scores: np.ndarray, *, significance: float,
                            delta: float, thresholds: str = "grid") -> float:
    """§11.4: max over the thresholds of log((TPR_low − δ)/FPR_high), Bonferroni over both rates and thresholds.

    Each rate's one-sided Clopper–Pearson end is at level significance/(2·thresholds): one end of
    audit_bounds.epsilon_lower_bound's two-sided intervals at confidence 1 − 2·level.
    """
    check_level(significance=significance, delta=delta)
    tried = guesses_of(in_scores, out_scores, thresholds)
    confidence = 1 - significance / tried.thresholds
    return float(np.max(epsilon_lower_bound(tried.correct, tried.guesses - tried.correct, tried.members,
                                            tried.non_members, delta, confidence)))


# --- §11.6: what m canaries can show -----------------------------------------------------------

def one_run_cap(*, members: int, non_members: int, significance: float, delta: float,
                thresholds: str = "frontier") -> float:
    """§11.6: the largest §11.2 bound `members` in-canaries and `non_members` out-canaries can give.

    It is the bound of perfectly separated scores (every in-canary above every out-canary). With the frontier the
    thresholds are then (0, 0), (0, members), (non_members, members), K = 3, and every guess at the middle one is
    right; with the grid (§11.7) the largest fraction whose guesses are all members decides.
    """
    check_level(significance=significance, delta=delta)
    if members < 1 or non_members < 1:
        raise ValueError(f"need at least one in-canary and one out-canary, got {members} and {non_members}")
    return one_run_epsilon(np.ones(members), np.zeros(non_members), significance=significance, delta=delta,
                           thresholds=thresholds)


def canaries_needed(*, epsilon: float, significance: float, delta: float) -> int | None:
    """§11.6: the fewest canaries m (half in: m // 2 members) whose cap exceeds `epsilon`; None if no m does.

    Necessary, not sufficient: m canaries can show more than `epsilon` only if their scores
    separate perfectly or nearly. The cap rises with m until the 2mδ term of §11.2 takes over and
    it falls again, so m is searched by doubling from 2 (None once a positive cap stops rising), then
    bisected inside the first bracket that exceeds `epsilon`.
    """
    check_level(significance=significance, delta=delta)

    def cap(canaries: int) -> float:
        members = canaries // 2
        return one_run_cap(members=members, non_members=canaries - members, significance=significance, delta=delta)

    low, high, previous = 1, 2, -math.inf
    while (current := cap(high)) <= epsilon:
        if 0 < current <= previous:
            return None
        low, high, previous = high, 2 * high, current
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if cap(middle) > epsilon else (middle, high)
    return high

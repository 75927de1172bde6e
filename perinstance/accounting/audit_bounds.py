"""Empirical lower bounds on privacy, and the loss-threshold membership attack (docs/audit.md).

Pure numpy/scipy: no torch, no I/O. An (ε, δ) guarantee of the pair (P, Q) says that every
event E has P(E) ≤ e^ε·Q(E) + δ (accounting.md §3.3, hockey-stick divergence). So a test
that fires on E with true rate TPR under P and FPR under Q proves ε ≥ log((TPR − δ)/FPR).
With Monte-Carlo trials the rates are only estimated: Clopper–Pearson bounds (TPR from
below, FPR from above) turn the estimate into a bound that holds with stated confidence,
provided the event E was fixed before the trials that are counted (halves below).
"""

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import beta

CONFIDENCE = 0.95
# Thresholds tried on the selection half: event counts on a geometric grid, so that the
# far tail (large ε, few events) and the bulk (small ε, many events) are both covered.
THRESHOLD_GRID = 400
DIRECTIONS = ("remove", "add")
# The selection half ranks thresholds by their bound at this stricter confidence: it favours
# events with more hits, whose count on the evaluation half varies less (the best of ~800 noisy
# candidates is otherwise often a lucky far-tail one). On the one-dimensional pair of §3.3 with
# 10⁶ trials (μ = 0.8, 1.46, 1.79; q = 0.032; 8 seeds) it raised the mean and the worst
# eps_lower over 0.95 (e.g. worst 0.84 → 0.91 at μ = 1.46); 0.99999 was worse again.
SELECTION_CONFIDENCE = 0.999


# --- Clopper–Pearson and the ε conversion ---------------------------------------------------

def clopper_pearson(successes: ArrayLike, trials: ArrayLike, confidence: float = CONFIDENCE) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
    """Exact two-sided binomial interval (Clopper & Pearson 1934), elementwise.

    Each end alone is a one-sided bound at level (1 + confidence)/2; this module uses the
    lower end of one rate and the upper end of another, so both hold together with
    probability ≥ confidence (union bound). Returns (lower, upper) float arrays.
    """
    successes = np.asarray(successes, dtype=float)
    trials = np.asarray(trials, dtype=float)
    if np.any(successes < 0) or np.any(successes > trials) or np.any(trials <= 0):
        raise ValueError("need 0 <= successes <= trials and trials > 0")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), not {confidence!r}")
    tail = (1 - confidence) / 2
    with np.errstate(invalid="ignore"):
        lower = np.where(successes > 0, beta.ppf(tail, successes, trials - successes + 1), 0.0)
        upper = np.where(successes < trials, beta.ppf(1 - tail, successes + 1, trials - successes), 1.0)
    return lower, upper


def epsilon_from_rates(rate_in: ArrayLike, rate_out: ArrayLike, delta: float) -> np.ndarray:
    """ε ≥ log((rate_in − δ)/rate_out): the ε an event with these rates proves (§3.3's
    hockey-stick inequality solved for ε), floored at 0 (ε ≥ 0 always holds). `rate_in` is
    the event's probability under the law it favours, `rate_out` under the other."""
    rate_in = np.asarray(rate_in, dtype=float)
    rate_out = np.asarray(rate_out, dtype=float)
    excess = rate_in - delta
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.log(excess / rate_out)
    return np.where(excess > 0, np.maximum(eps, 0.0), 0.0)


def epsilon_lower_bound(hits_in: ArrayLike, hits_out: ArrayLike, trials_in: ArrayLike, trials_out: ArrayLike,
                        delta: float, confidence: float = CONFIDENCE) -> np.ndarray:
    """ε ≥ log((TPR_lo − δ)/FPR_hi) with Clopper–Pearson ends: holds with probability
    ≥ `confidence` for an event fixed before these trials were drawn."""
    rate_in, _ = clopper_pearson(hits_in, trials_in, confidence)
    _, rate_out = clopper_pearson(hits_out, trials_out, confidence)
    return epsilon_from_rates(rate_in, rate_out, delta)


# --- choosing the event on one half, counting it on the other --------------------------------

@dataclass(frozen=True)
class Outcome:
    """The audit of one point: the event chosen on the selection half, counted on the other.

    direction "remove": E = {T > threshold}, bounds D(P||Q) (P: x* in the training set);
    direction "add": E = {T < threshold}, bounds D(Q||P).
    hits_in / hits_out: E's count under the law it favours / the other, out of `trials` each.
    """

    eps_lower: float
    direction: str
    threshold: float
    hits_in: int
    hits_out: int
    trials: int


def _count_grid(size):
    """0, 1, 2, ... up to size − 1 on a geometric grid of about THRESHOLD_GRID counts."""
    grid = np.unique(np.round(np.geomspace(1, size, THRESHOLD_GRID)).astype(np.int64))
    return np.concatenate([[0], grid[grid < size]])


def _candidates(scores_in, scores_out, delta, confidence):
    """Every (direction, threshold) of the grid with the lower bound it gives on these scores."""
    size_in, size_out = len(scores_in), len(scores_out)
    sorted_in, sorted_out = np.sort(scores_in), np.sort(scores_out)
    # remove: the c largest scores under Q lie above τ = the (c+1)-th largest.
    above = sorted_out[size_out - 1 - _count_grid(size_out)]
    remove_in = size_in - np.searchsorted(sorted_in, above, side="right")
    remove_out = size_out - np.searchsorted(sorted_out, above, side="right")
    # add: the c smallest scores under P lie below τ = the (c+1)-th smallest.
    below = sorted_in[_count_grid(size_in)]
    add_in = np.searchsorted(sorted_out, below, side="left")  # favoured law of {T < τ} is Q
    add_out = np.searchsorted(sorted_in, below, side="left")
    return {
        "remove": (above, epsilon_lower_bound(remove_in, remove_out, size_in, size_out, delta, confidence)),
        "add": (below, epsilon_lower_bound(add_in, add_out, size_out, size_in, delta, confidence)),
    }


def event_counts(scores_in: ArrayLike, scores_out: ArrayLike, direction: str, threshold: float) -> tuple[int, int]:
    """(hits under the favoured law, hits under the other) of the event of `direction`."""
    if direction == "remove":
        return int(np.sum(scores_in > threshold)), int(np.sum(scores_out > threshold))
    return int(np.sum(scores_out < threshold)), int(np.sum(scores_in < threshold))


def audit_scores(scores_in: ArrayLike, scores_out: ArrayLike, delta: float, confidence: float = CONFIDENCE) -> Outcome:
    """The ε lower bound of a threshold test on a statistic T (docs/audit.md).

    scores_in: T over trials with x* in the training set (law P); scores_out: without it
    (law Q); equal lengths, independent trials. The first half of each chooses the
    direction and the threshold with the largest lower bound (at SELECTION_CONFIDENCE); the
    second half, untouched by that choice, gives the reported bound at `confidence`, so that
    confidence is honest.
    """
    scores_in = np.asarray(scores_in)
    scores_out = np.asarray(scores_out)
    if scores_in.shape != scores_out.shape or scores_in.ndim != 1 or len(scores_in) < 4:
        raise ValueError("need two 1-D score arrays of the same length >= 4")
    half = len(scores_in) // 2
    candidates = _candidates(scores_in[:half], scores_out[:half], delta, SELECTION_CONFIDENCE)
    direction = max(DIRECTIONS, key=lambda name: candidates[name][1].max())
    thresholds, bounds = candidates[direction]
    threshold = float(thresholds[int(np.argmax(bounds))])
    evaluation_in, evaluation_out = scores_in[half:], scores_out[half:]
    hits_in, hits_out = event_counts(evaluation_in, evaluation_out, direction, threshold)
    trials = len(evaluation_in)
    eps = float(epsilon_lower_bound(hits_in, hits_out, trials, trials, delta, confidence))
    return Outcome(eps, direction, threshold, hits_in, hits_out, trials)


# --- the released update, projected -------------------------------------------------------

def projected_release(others_sum: ArrayLike, others_count: ArrayLike, joined: ArrayLike, own_value: ArrayLike,
                      noise: ArrayLike, rule: str) -> np.ndarray:
    """⟨ũ, e⟩ of one DP-SGD step (accounting.md §1) from its parts, elementwise.

    others_sum: Σ_{i∈B} ⟨h_i, e⟩ over the other points' batch B, of size others_count;
    joined: whether x* is in the batch; own_value: ⟨h*, e⟩; noise: the noise already
    projected and scaled (N(0, (σΓ)²) sum rule, N(0, (σΓ/B_exp)²) mean rule).
    Sum rule: Σ + joined·own. Mean rule: (Σ + joined·own)/|B ∪ x*|, 0 for an empty batch.
    """
    total = others_sum + np.where(joined, own_value, 0.0)
    if rule == "sum":
        return total + noise
    if rule != "mean":
        raise ValueError(f"rule must be 'sum' or 'mean', not {rule!r}")
    size = others_count + joined
    return total / np.maximum(size, 1) + noise


def fisher_directions(targets: ArrayLike, basis: ArrayLike, variances: ArrayLike, noise_var: float) -> np.ndarray:
    """Unit directions Σ⁻¹t/||Σ⁻¹t|| for Σ = noise_var·I + V·diag(variances)·Vᵀ (rows of `targets`).

    The shift t that x* adds, against Gaussian noise of covariance Σ, is best detected by
    projecting on Σ⁻¹t (Fisher's linear discriminant); V (d × k, orthonormal columns) and
    `variances` describe the spread of the other points' batch sum (docs/audit.md). Any fixed
    direction gives a valid test; this one only makes it stronger. Zero targets give zero rows.
    """
    targets = np.asarray(targets, dtype=float)
    basis = np.asarray(basis, dtype=float)
    shrink = np.asarray(variances, dtype=float) / (noise_var + np.asarray(variances, dtype=float))
    solved = (targets - ((targets @ basis) * shrink) @ basis.T) / noise_var
    norms = np.linalg.norm(solved, axis=1, keepdims=True)
    return np.divide(solved, norms, out=np.zeros_like(solved), where=norms > 0)


# --- which points to audit -------------------------------------------------------------------

def spread_points(sensitivities: ArrayLike, correct: ArrayLike, count: int,
                  misclassified_share: float = 0.2) -> np.ndarray:
    """`count` point indices spanning the range of Δ* (hence of the per-step ε, which grows
    with it): evenly spaced ranks among correctly classified points (easy to typical to
    hard), and a `misclassified_share` of them among misclassified points. Sorted."""
    sensitivities = np.asarray(sensitivities, dtype=float)
    correct = np.asarray(correct, dtype=bool)
    wrong = np.flatnonzero(~correct)
    right = np.flatnonzero(correct)
    count = min(count, len(sensitivities))
    wrong_count = min(len(wrong), round(count * misclassified_share)) if len(right) else min(len(wrong), count)
    right_count = min(len(right), count - wrong_count)

    def by_rank(indices, how_many):
        if how_many == 0:
            return np.zeros(0, dtype=np.int64)
        ordered = indices[np.argsort(sensitivities[indices], kind="stable")]
        return ordered[np.unique(np.round(np.linspace(0, len(ordered) - 1, how_many)).astype(np.int64))]

    return np.sort(np.concatenate([by_rank(right, right_count), by_rank(wrong, wrong_count)]))


def point_groups(eps_upper: ArrayLike, correct: ArrayLike) -> dict[str, np.ndarray]:
    """The audited points' groups (docs/audit.md, "Output"), as boolean masks: "easy" and "hard", the correctly
    classified points whose eps_upper is below / at or above the median eps_upper of the correctly classified points
    audited, and "misclassified"."""
    eps_upper = np.asarray(eps_upper, dtype=float)
    correct = np.asarray(correct, dtype=bool)
    cut = np.median(eps_upper[correct]) if correct.any() else np.inf
    return {"easy": correct & (eps_upper < cut), "hard": correct & (eps_upper >= cut), "misclassified": ~correct}


# --- Appendix D of Yu et al.: loss-threshold membership inference ------------------------------

def best_loss_threshold(member_losses: ArrayLike, nonmember_losses: ArrayLike) -> float:
    """The τ maximising the balanced accuracy of "member iff loss < τ" on these losses
    (Sablayrolles et al. 2019's loss attack); the smallest such τ among the observed values."""
    member_losses = np.sort(np.asarray(member_losses, dtype=float))
    nonmember_losses = np.sort(np.asarray(nonmember_losses, dtype=float))
    candidates = np.concatenate([np.unique(np.concatenate([member_losses, nonmember_losses])), [np.inf]])
    true_positive = np.searchsorted(member_losses, candidates, side="left") / len(member_losses)
    false_positive = np.searchsorted(nonmember_losses, candidates, side="left") / len(nonmember_losses)
    return float(candidates[int(np.argmax(true_positive - false_positive))])


def attack_rates(member_losses: ArrayLike, nonmember_losses: ArrayLike, threshold: float) -> tuple[float, float]:
    """(TPR, FPR) of "member iff loss < threshold"."""
    return (float(np.mean(np.asarray(member_losses) < threshold)),
            float(np.mean(np.asarray(nonmember_losses) < threshold)))


def loss_threshold_attack(member_losses: ArrayLike, nonmember_losses: ArrayLike, rng: np.random.Generator,
                          splits: int) -> tuple[float, float, float]:
    """Balanced accuracy and advantage (TPR − FPR) of the loss-threshold attack, the threshold
    chosen on a random half of each set and evaluated on the other half, over `splits`
    random splits. Returns (mean accuracy, mean advantage, standard deviation of the accuracy
    over the splits)."""
    member_losses = np.asarray(member_losses, dtype=float)
    nonmember_losses = np.asarray(nonmember_losses, dtype=float)
    if min(len(member_losses), len(nonmember_losses)) < 2:
        raise ValueError("need at least two members and two non-members to split in halves")
    advantages = np.empty(splits)
    for split in range(splits):
        members = rng.permutation(member_losses)
        nonmembers = rng.permutation(nonmember_losses)
        member_half, nonmember_half = len(members) // 2, len(nonmembers) // 2
        threshold = best_loss_threshold(members[:member_half], nonmembers[:nonmember_half])
        true_positive, false_positive = attack_rates(members[member_half:], nonmembers[nonmember_half:], threshold)
        advantages[split] = true_positive - false_positive
    accuracies = (1 + advantages) / 2
    return float(accuracies.mean()), float(advantages.mean()), float(accuracies.std())


def pearson(x: ArrayLike, y: ArrayLike) -> float:
    """Pearson r; nan for fewer than two values or a constant input."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])

"""The one-run auditor (docs/accounting.md §11): jax_privacy's test vectors, edge cases, exact enumeration."""

import math
from fractions import Fraction

import dp_accounting
import numpy as np
import pytest
from scipy.special import logit
from scipy.stats import norm

from perinstance.accounting import one_run_audit

SIGNIFICANCE = 0.05
DELTA = 1e-6


def quantile_scores(shift, n=10_000):
    """n out-scores at the normal quantiles (i + 1/2)/n, and the same shifted by `shift` as in-scores."""
    out_scores = norm.ppf((np.arange(n) + 0.5) / n)
    return out_scores + shift, out_scores


# jax_privacy's CanaryScoreAuditor: epsilon_one_run and epsilon_one_run_fdp on these scores.
@pytest.mark.parametrize("shift, one_run, fdp", [(1, 1.13346, 2.164749), (2, 2.311945, 4.7218075),
                                                 (4, 4.395568, 9.133752)])
def test_reproduces_the_ecosystem_vectors(shift, one_run, fdp):
    in_scores, out_scores = quantile_scores(shift)
    assert one_run_audit.one_run_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=DELTA,
                                         thresholds="frontier") == pytest.approx(one_run, abs=1e-6)
    assert one_run_audit.one_run_fdp_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=DELTA,
                                             thresholds="frontier") == pytest.approx(fdp, abs=1e-6)


def exact_tail(guesses, correct, epsilon):
    """P[Binomial(r, e^ε/(1+e^ε)) >= v] by enumerating the binomial terms with exact binomial coefficients."""
    success = math.exp(epsilon) / (1 + math.exp(epsilon))
    return sum(math.comb(guesses, k) * success ** k * (1 - success) ** (guesses - k) for k in range(correct, guesses + 1))


@pytest.mark.parametrize("guesses, correct, epsilon, delta", [(12, 9, 0.3, 0.0), (12, 12, 1.0, 1e-3), (7, 4, 0.0, 1e-2),
                                                              (20, 15, 0.7, 1e-4), (5, 1, 2.0, 0.1)])
def test_p_value_is_the_enumerated_binomial_tail(guesses, correct, epsilon, delta):
    canaries = 30
    tails = [exact_tail(guesses, correct - i, epsilon) for i in range(correct + 1)]
    excess = max((tails[i] - tails[0]) / i for i in range(1, correct + 1))
    expected = min(tails[0] + 2 * canaries * delta * excess, 1.0)
    got = one_run_audit.one_run_p_value(canaries=canaries, guesses=guesses, correct=correct, epsilon=epsilon, delta=delta)
    assert got == pytest.approx(expected, rel=1e-10, abs=1e-14)


def test_epsilon_at_is_where_the_p_value_meets_the_significance():
    kwargs = dict(canaries=1000, guesses=200, correct=170, delta=DELTA)
    epsilon = one_run_audit.one_run_epsilon_at(significance=SIGNIFICANCE, **kwargs)
    assert one_run_audit.one_run_p_value(epsilon=epsilon, **kwargs) == pytest.approx(SIGNIFICANCE, rel=1e-6)
    assert one_run_audit.one_run_p_value(epsilon=epsilon + 1e-3, **kwargs) > SIGNIFICANCE


def test_all_guesses_right_is_capped_by_the_number_of_canaries():
    # δ → 0: the best threshold guesses every member, v = r = m/2, and rejects while q^r <= α/thresholds.
    in_scores, out_scores = np.arange(500) + 1000.0, np.arange(500, dtype=float)
    frontier = one_run_audit.roc_frontier(in_scores, out_scores)
    assert frontier.true_positives.size == 3  # +∞, the lowest member, everything
    cap = logit((SIGNIFICANCE / 3) ** (1 / 500))
    epsilon = one_run_audit.one_run_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=1e-12,
                                            thresholds="frontier")
    assert epsilon == pytest.approx(cap, rel=1e-6)
    assert one_run_audit.one_run_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=1e-3,
                                         thresholds="frontier") < cap
    assert 0 < one_run_audit.one_run_fdp_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=DELTA)
    assert 0 < one_run_audit.clopper_pearson_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=DELTA)


@pytest.mark.parametrize("bound", [one_run_audit.one_run_epsilon, one_run_audit.one_run_fdp_epsilon,
                                   one_run_audit.clopper_pearson_epsilon])
def test_no_guess_right_proves_nothing(bound):
    in_scores, out_scores = np.arange(500, dtype=float), np.arange(500) + 1000.0
    assert bound(in_scores, out_scores, significance=SIGNIFICANCE, delta=DELTA) == 0.0


def test_one_canary_proves_nothing():
    # m = 1: one right guess has probability e^ε/(1+e^ε) >= 1/2 > α under any ε.
    assert one_run_audit.one_run_epsilon_at(canaries=1, guesses=1, correct=1, significance=SIGNIFICANCE,
                                            delta=DELTA) == 0.0
    assert one_run_audit.one_run_fdp_epsilon_at(canaries=1, guesses=1, correct=1, significance=SIGNIFICANCE,
                                                delta=DELTA) == 0.0
    assert one_run_audit.one_run_epsilon([1.0], [0.0], significance=SIGNIFICANCE, delta=DELTA) == 0.0
    with pytest.raises(ValueError, match="at least one in-score and one out-score"):
        one_run_audit.one_run_epsilon([1.0], [], significance=SIGNIFICANCE, delta=DELTA)


@pytest.mark.parametrize("significance, delta, message", [(0.0, DELTA, "significance"), (1.0, DELTA, "significance"),
                                                          (float("nan"), DELTA, "significance"),
                                                          (0.05, 0.0, "delta"), (0.05, 1.0, "delta"),
                                                          (0.05, -1e-6, "delta")])
@pytest.mark.parametrize("bound", [one_run_audit.one_run_epsilon, one_run_audit.one_run_fdp_epsilon,
                                   one_run_audit.clopper_pearson_epsilon])
def test_invalid_levels_are_one_line_errors(bound, significance, delta, message):
    with pytest.raises(ValueError, match=message) as error:
        bound([1.0, 2.0], [0.0, 0.5], significance=significance, delta=delta)
    assert "\n" not in str(error.value)


def test_non_finite_scores_are_refused():
    with pytest.raises(ValueError, match="finite"):
        one_run_audit.one_run_epsilon([1.0, np.nan], [0.0], significance=SIGNIFICANCE, delta=DELTA)


@pytest.mark.parametrize("epsilon, delta", [(0.5, 1e-6), (2.0, 1e-5), (8.0, 1e-3), (0.05, 0.1)])
def test_gaussian_noise_matches_dp_accounting(epsilon, delta):
    assert one_run_audit.gaussian_noise_for(epsilon=epsilon, delta=delta) == pytest.approx(
        dp_accounting.get_sigma_gaussian(epsilon, delta), rel=1e-9)


def test_frontier_is_the_concave_hull_by_brute_force():
    rng = np.random.default_rng(5)
    in_scores, out_scores = rng.normal(1, 1, 40).round(1), rng.normal(0, 1, 30).round(1)
    thresholds = np.concatenate([[np.inf], np.unique(np.concatenate([in_scores, out_scores]))[::-1]])
    points = [(Fraction(int((out_scores >= t).sum())), Fraction(int((in_scores >= t).sum()))) for t in thresholds]

    def on_hull(j):
        # No chord between a point left of j and one right of j passes on or above it.
        x, y = points[j]
        for a in range(j):
            for b in range(j + 1, len(points)):
                (xa, ya), (xb, yb) = points[a], points[b]
                if xa <= x <= xb and xa < xb and ya + (yb - ya) * (x - xa) / (xb - xa) >= y:
                    return False
        return True

    frontier = one_run_audit.roc_frontier(in_scores, out_scores)
    expected = [points[j] for j in range(len(points)) if j in (0, len(points) - 1) or on_hull(j)]
    assert list(zip(frontier.false_positives.tolist(), frontier.true_positives.tolist(), strict=True)) == expected


def test_clopper_pearson_epsilon_by_hand():
    # Two frontier thresholds besides +∞ … : all 50 members above all 50 non-members; at the middle
    # threshold TP = 50/50, FP = 0/50, each end at level α/(2·3).
    in_scores, out_scores = np.arange(50) + 100.0, np.arange(50, dtype=float)
    level = SIGNIFICANCE / (2 * 3)
    tpr_low = level ** (1 / 50)  # Clopper–Pearson lower end at 50/50: p^50 = level
    fpr_high = 1 - level ** (1 / 50)  # upper end at 0/50: (1 − p)^50 = level
    expected = math.log((tpr_low - DELTA) / fpr_high)
    assert one_run_audit.clopper_pearson_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=DELTA,
                                                 thresholds="frontier") == pytest.approx(expected, rel=1e-9)


def test_cap_is_the_bound_of_perfectly_separated_scores():
    # δ → 0 and K = 3 thresholds: every member guessed right rejects while (e^ε/(1+e^ε))^members <= α/3.
    cap = one_run_audit.one_run_cap(members=33, non_members=40, significance=SIGNIFICANCE, delta=1e-12)
    assert cap == pytest.approx(logit((SIGNIFICANCE / 3) ** (1 / 33)), rel=1e-6)
    # δ only lowers it: 2mδ is added to every p-value.
    assert one_run_audit.one_run_cap(members=500, non_members=500, significance=0.05, delta=1e-5) < logit(
        (0.05 / 3) ** (1 / 500))
    with pytest.raises(ValueError, match="at least one in-canary"):
        one_run_audit.one_run_cap(members=0, non_members=4, significance=SIGNIFICANCE, delta=DELTA)


@pytest.mark.parametrize("epsilon", [0.5, 2.0, 4.0])
def test_canaries_needed_by_hand(epsilon):
    # By hand, δ → 0: m // 2 members must satisfy (e^ε/(1+e^ε))^(m//2) <= α/3, i.e. m // 2 >= log(α/3)/log(expit(ε)).
    members = math.ceil(math.log(SIGNIFICANCE / 3) / math.log(1 / (1 + math.exp(-epsilon))))
    needed = one_run_audit.canaries_needed(epsilon=epsilon, significance=SIGNIFICANCE, delta=1e-12)
    assert needed == 2 * members
    # ε = 2: log(0.05/3)/log(0.8808) = 32.26, so 33 members, 66 canaries.
    if epsilon == 2.0:
        assert needed == 66


def test_canaries_needed_is_none_past_what_delta_allows():
    # At δ = 1e-5 the cap peaks near 6.4 (around m = 16,000: 2mδ grows with m), so ε = 8.69 is out of reach; at
    # δ = 1e-7 it is reached, and the m found is the first whose cap passes it.
    assert one_run_audit.canaries_needed(epsilon=8.69, significance=0.05, delta=1e-5) is None
    needed = one_run_audit.canaries_needed(epsilon=8.69, significance=0.05, delta=1e-7)
    cap = [one_run_audit.one_run_cap(members=m // 2, non_members=m - m // 2, significance=0.05, delta=1e-7)
           for m in (needed - 1, needed)]
    assert cap[0] <= 8.69 < cap[1]


def test_canaries_needed_refuses_invalid_levels():
    with pytest.raises(ValueError, match="significance"):
        one_run_audit.canaries_needed(epsilon=1.0, significance=1.5, delta=DELTA)

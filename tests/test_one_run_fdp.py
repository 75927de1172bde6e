"""The f-DP one-run test against the accountant's own curve (docs/accounting.md §11.7-§11.11): the claimed curve
against dp_accounting and brute force, the recursion against a plain walk, the pre-registered guesses, the family
bound, the statistics, and the test's level measured on the idealised mechanism."""

import dataclasses
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution
from scipy.special import logit
from scipy.stats import norm

from perinstance.accounting import one_run_audit, one_run_fdp, one_run_ideal, pld

SIGNIFICANCE, DELTA = 0.05, 1e-5


def brute_inverse_blow_up(x, epsilons, deltas):
    """F(x) = max(0, max_i e^{−ε_i}(x − δ_i), max_i 1 − δ_i − e^{ε_i}(1 − x)), every pair at every x."""
    x = np.asarray(x)[:, None]
    low = np.exp(-epsilons)[None, :] * (x - deltas[None, :])
    high = 1 - deltas[None, :] - np.exp(epsilons)[None, :] * (1 - x)
    return np.maximum(0.0, np.maximum(low.max(axis=1), high.max(axis=1)))


PROBES = np.concatenate([np.geomspace(1e-12, 1, 3000), 1 - np.geomspace(1e-12, 0.5, 500)])


def test_a_curve_of_pairs_is_their_envelope_and_never_above_it():
    rng = np.random.default_rng(1)
    for _ in range(5):
        epsilons = np.sort(rng.uniform(0, 12, 60))
        deltas = np.sort(rng.uniform(0, 0.3, 60))[::-1] * np.exp(-epsilons / 3)
        curve = one_run_fdp.TradeOffCurve.from_epsilon_delta(epsilons, deltas)
        exact = brute_inverse_blow_up(PROBES, epsilons, deltas)
        got = curve.inverse_blow_up(PROBES)
        assert np.all(got <= exact + 1e-20) and np.allclose(got, exact, rtol=1e-8, atol=1e-14)


def test_the_pure_dp_curve_by_hand():
    # (ε, 0)-DP: F(x) = e^{−ε}·x below the corner 1/(1 + e^ε)... and 1 − e^ε(1 − x) above it.
    curve = one_run_fdp.TradeOffCurve.from_epsilon_delta([1.0], [0.0])
    corner = 1 / (1 + math.e)
    np.testing.assert_allclose(curve.inverse_blow_up([0.1, corner, 0.9]),
                               [0.1 / math.e, corner / math.e, 1 - math.e * 0.1], rtol=1e-8)
    with pytest.raises(ValueError, match="deltas"):
        one_run_fdp.TradeOffCurve.from_epsilon_delta([1.0], [1.5])


@pytest.mark.parametrize("noise_multiplier, sample_rate, steps", [(0.6, 0.032, 125), (3.0, 0.5, 40), (40.0, 0.1, 10)])
def test_the_claimed_curve_is_dp_accountings_composition(noise_multiplier, sample_rate, steps):
    claim = one_run_fdp.subsampled_gaussian_curve(noise_multiplier, sample_rate, steps)
    reference = privacy_loss_distribution.from_gaussian_mechanism(
        noise_multiplier, sampling_prob=sample_rate, pessimistic_estimate=True,
        value_discretization_interval=1e-3).self_compose(steps)
    # δ(ε) of the composition, on every loss of the grid up to where it is 1e-13: dp_accounting's within the
    # rounding allowance that §8.3 adds at +∞, and never below it.
    count = round(reference.get_epsilon_for_delta(1e-13) / 1e-3) + 1
    epsilons = np.arange(count) * 1e-3
    deltas = np.asarray(reference.get_delta_for_epsilon(epsilons))
    ours = np.max([one_run_fdp._deltas_on_grid(loss, 1e-3, 1, count) for loss in claim.composed], axis=0)
    assert np.all(ours >= deltas * (1 - 1e-9)) and np.all(ours <= deltas + 1e-10)
    # The curve never claims more than all those pairs together allow.
    probes = PROBES[::7]
    assert np.all(claim.curve.inverse_blow_up(probes) <= brute_inverse_blow_up(probes, epsilons, deltas) + 1e-12)
    # ε at δ is the suite's own PLD accountant's (§8.2) for a point at Γ at every step.
    suite = pld.sum_rule_eps([[1.0]], [0], steps, sample_rate=sample_rate, noise_multiplier=noise_multiplier,
                             delta=DELTA).max[0]
    assert claim.epsilon(DELTA) == pytest.approx(suite, rel=1e-6)
    assert claim.epsilon(DELTA) == pytest.approx(reference.get_epsilon_for_delta(DELTA), rel=1e-6)


def plain_walk(inverse_blow_up, canaries, guesses, correct, significance):
    """The recursion of §11.3 walked to the end, one pair at a time, as the paper writes it."""
    right = significance * correct / canaries
    wrong = significance * (guesses - correct) / canaries
    for remaining in range(correct - 1, -1, -1):
        raised = max(wrong, inverse_blow_up(right))
        if raised == wrong:
            break
        right, wrong = min(right + remaining / (guesses - remaining) * (raised - wrong), 1.0), raised
    return right + wrong - guesses / canaries


def test_the_recursion_stops_early_only_where_its_sign_is_known():
    rng = np.random.default_rng(2)
    for mu in (0.5, 1.5, 3.0):
        curve = lambda x, mu=mu: float(norm.cdf(norm.ppf(x) - mu))  # noqa: E731
        guesses = rng.integers(1, 400, 200)
        correct = np.minimum(guesses, (guesses * rng.uniform(0.5, 1.0, 200)).astype(int))
        margins = one_run_audit.fdp_margins(curve, 1000, guesses, correct, 0.01)
        full = np.array([plain_walk(curve, 1000, r, v, 0.01) for r, v in zip(guesses, correct)])
        assert np.array_equal(margins > 0, full > 0)
        np.testing.assert_allclose(margins[full <= 0], full[full <= 0], rtol=1e-12)
        assert np.all(margins <= full + 1e-15)


def test_top_guesses_count_ties_against_the_guesser():
    in_scores, out_scores = np.array([5.0, 3.0, 3.0, 1.0]), np.array([3.0, 3.0, 2.0, 0.0])
    guesses, correct = one_run_audit.top_guesses(in_scores, out_scores, fractions=(1 / 8, 1 / 4, 1 / 2, 1.0))
    # The cut at 2 and at 4 guesses falls inside the four-way tie at 3: its out-canaries count first.
    assert guesses.tolist() == [1, 2, 4, 8] and correct.tolist() == [1, 1, 2, 4]


def test_the_grid_splits_the_significance_over_a_number_fixed_in_advance():
    # Perfectly separated scores, δ → 0: the grid's largest all-right count r = m/2 rejects while
    # (e^ε/(1+e^ε))^r <= α/8, whatever the scores' frontier.
    in_scores, out_scores = np.arange(512) + 1000.0, np.arange(512, dtype=float)
    epsilon = one_run_audit.one_run_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=1e-12)
    assert epsilon == pytest.approx(logit((SIGNIFICANCE / len(one_run_audit.GUESS_FRACTIONS)) ** (1 / 512)),
                                    rel=1e-6)
    with pytest.raises(ValueError, match="thresholds must be one of grid, frontier"):
        one_run_audit.one_run_epsilon(in_scores, out_scores, significance=SIGNIFICANCE, delta=DELTA, thresholds="all")


def test_the_family_bound_is_where_rejection_starts():
    rng = np.random.default_rng(3)
    included = rng.random(4000) < 0.5
    scores = one_run_ideal.likelihood_ratio_scores(
        one_run_ideal.simulated_projections(rng, included, steps=40, norm=1.0, noise_multiplier=1.5,
                                            sample_rate=0.25),
        norm=1.0, noise_multiplier=1.5, sample_rate=0.25)
    bound = one_run_fdp.family_lower_bound(scores[included], scores[~included], sample_rate=0.25, steps=40,
                                           delta=DELTA, significance=SIGNIFICANCE)
    assert 0 < bound.epsilon and not bound.at_range_end
    # The scores reject the curve of z and not the next one below on the grid of z.
    below = bound.noise_multiplier / one_run_fdp.FAMILY_RATIO
    for z, rejected in ((bound.noise_multiplier, True), (below, False)):
        curve = one_run_fdp.subsampled_gaussian_curve(z, 0.25, 40).curve
        assert one_run_fdp.curve_rejected(curve, scores[included], scores[~included],
                                          significance=SIGNIFICANCE) == rejected
    assert bound.epsilon == pytest.approx(
        one_run_fdp.subsampled_gaussian_curve(bound.noise_multiplier, 0.25, 40).epsilon(DELTA))
    # The true mechanism's curve is not rejected here (it holds), so the bound is below its ε.
    assert bound.epsilon < one_run_fdp.subsampled_gaussian_curve(1.5, 0.25, 40).epsilon(DELTA)
    nothing = one_run_fdp.family_lower_bound(rng.normal(size=500), rng.normal(size=500), sample_rate=0.25, steps=40,
                                             delta=DELTA, significance=SIGNIFICANCE)
    assert (nothing.epsilon, nothing.noise_multiplier) == (0.0, None)


def test_likelihood_ratio_scores_by_hand():
    projections = np.array([[0.0, 1.0, -2.0], [30.0, 0.5, 700.0]])
    expected = np.log(1 - 0.1 + 0.1 * np.exp((0.5 * projections[0] - 0.125) / 0.64)).sum()
    scores = one_run_ideal.likelihood_ratio_scores(projections, norm=0.5, noise_multiplier=0.8, sample_rate=0.1)
    assert scores[0] == pytest.approx(expected, rel=1e-12)
    # No overflow where exp would: log q + (c·x − c²/2)/σ² when the exponent is large.
    assert scores[1] == pytest.approx(np.log(0.1) + (0.5 * 700 - 0.125) / 0.64 + np.log(
        1 - 0.1 + 0.1 * np.exp((0.5 * 30 - 0.125) / 0.64)) + np.log(1 - 0.1 + 0.1 * np.exp((0.25 - 0.125) / 0.64)),
                                  rel=1e-9)


def test_the_idealised_mechanism_by_its_moments():
    rng = np.random.default_rng(4)
    included = np.repeat([True, False], 2000)
    projections = one_run_ideal.simulated_projections(rng, included, steps=50, norm=0.7, noise_multiplier=0.9,
                                                      sample_rate=0.2)
    assert projections[~included].mean() == pytest.approx(0.0, abs=0.01)
    assert projections[~included].std() == pytest.approx(0.9, rel=0.01)
    assert projections[included].mean() == pytest.approx(0.7 * 0.2, abs=0.01)


def test_the_idealised_mean_rule_by_its_moments():
    # A drawn canary adds signal·B_exp/|B_t|, |B_t| the real points drawn (Binomial(80, q)) and every canary drawn at
    # step t, in both groups; noise added before the division by |B_t| is scaled with it.
    run = one_run_ideal.IdealisedRun(signals=(1.0, 0.5), members=(200, 200), steps=2000, noise_multiplier=0.0,
                                     sample_rate=0.1, expected_batch=8.0, other_examples=80)
    first, second = run.projections(np.random.default_rng(7))
    assert first.shape == second.shape == (400, 2000) and not first[200:].any() and not second[200:].any()
    seen = first[:200].any(axis=0) & second[:200].any(axis=0)  # steps with a canary of each group drawn
    size = 8.0 / first[:200, seen].max(axis=0)  # |B_t|
    np.testing.assert_allclose(size, np.round(size), atol=1e-9)
    np.testing.assert_allclose(second[:200, seen].max(axis=0), 0.5 * 8.0 / size)
    real = size - (first[:200, seen] > 0).sum(axis=0) - (second[:200, seen] > 0).sum(axis=0)
    assert real.min() >= 0 and real.mean() == pytest.approx(8.0, abs=0.2) and real.var() == pytest.approx(7.2, rel=0.1)
    noisy = dataclasses.replace(run, noise_multiplier=1.0, noise_before_division=2.0)
    first, _ = noisy.projections(np.random.default_rng(7))  # the same draws, noise added
    out = first[200:, seen]
    assert out.var(axis=0).mean() == pytest.approx(np.mean(1.0 + (2.0 * 8.0 / size) ** 2), rel=0.05)


def test_the_audit_flags_an_idealised_run_that_meets_the_claim_at_most_alpha_of_the_time():
    # 1,000 idealised runs (two groups of 300 canaries, half in): the verdict, each group at α/2, is a false alarm
    # in at most α of them, with a binomial margin (3 standard deviations above α would be 0.071).
    rate = one_run_ideal.false_alarm_rate(np.random.default_rng(5), [0.5, 1.0], [150, 150], steps=30,
                                          noise_multiplier=1.0, sample_rate=0.1, significance=SIGNIFICANCE,
                                          replicates=1000)
    assert rate <= SIGNIFICANCE


def test_the_verdict_has_power_against_a_mechanism_with_half_the_noise():
    # The same test fails where it must: half the stated noise is flagged in most idealised runs.
    rng = np.random.default_rng(6)
    curve = one_run_fdp.subsampled_gaussian_curve(6.0, 0.5, 40).curve
    included = np.repeat([True, False], 10000)
    flagged = 0
    for _ in range(10):
        projections = one_run_ideal.simulated_projections(rng, included, steps=40, norm=1.0, noise_multiplier=3.0,
                                                          sample_rate=0.5)
        scores = one_run_ideal.likelihood_ratio_scores(projections, norm=1.0, noise_multiplier=6.0, sample_rate=0.5)
        flagged += one_run_fdp.curve_rejected(curve, scores[included], scores[~included], significance=SIGNIFICANCE)
    assert flagged >= 8


def separated_rejects(curve, canaries, significance):
    members = canaries // 2
    return one_run_fdp.curve_rejected(curve, np.ones(members), np.zeros(canaries - members), significance=significance)


@pytest.mark.parametrize("noise_multiplier, sample_rate, steps, significance", [
    (1.0, 4 / 64, 32, 0.05),  # the gap run's sum-rule claim (ε = 2.80 at δ = 1e-5, one group): 40 canaries
    (3.0, 0.25, 80, 0.05 / 3),  # the self-test's c = 1 claim (ε = 3.38), one of three groups
    (1.2, 0.2, 20, 0.01)])
def test_the_canaries_needed_to_reject_a_curve_by_brute_force(noise_multiplier, sample_rate, steps, significance):
    curve = one_run_fdp.subsampled_gaussian_curve(noise_multiplier, sample_rate, steps).curve
    needed = one_run_fdp.canaries_to_reject(curve, significance=significance)
    assert not any(separated_rejects(curve, count, significance) for count in range(2, needed))
    assert separated_rejects(curve, needed, significance)
    # Over even counts rejection only rises (which the search assumes); an odd count can fall back.
    assert all(separated_rejects(curve, count, significance) for count in range(needed + needed % 2, 2 * needed, 2))
    if noise_multiplier == 1.0:
        assert needed == 40


def test_a_curve_no_canaries_can_reject():
    # A pure-DP curve at ε = 20 is beyond what a few canaries can refute; with a limit the search gives up.
    curve = one_run_fdp.TradeOffCurve.from_epsilon_delta(np.array([20.0]), np.array([0.0]))
    assert one_run_fdp.canaries_to_reject(curve, significance=0.05, limit=64) is None

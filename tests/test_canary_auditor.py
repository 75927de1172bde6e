"""The one-run auditor's Python API (perinstance.api.CanaryScoreAuditor, docs/api.md): jax_privacy's vectors through
it, its defaults against the accounting functions, the verdict against a claim, and one-line errors."""

import numpy as np
import pytest
from scipy.stats import norm

from perinstance.accounting import one_run_audit, one_run_fdp, one_run_ideal
from perinstance.api import CanaryScoreAuditor


def quantile_scores(shift, n=10_000):
    out_scores = norm.ppf((np.arange(n) + 0.5) / n)
    return out_scores + shift, out_scores


@pytest.mark.parametrize("shift, one_run, fdp", [(1, 1.13346, 2.164749), (2, 2.311945, 4.7218075)])
def test_jax_privacys_numbers_with_its_threshold_strategy(shift, one_run, fdp):
    auditor = CanaryScoreAuditor(*quantile_scores(shift))
    assert auditor.epsilon_one_run(0.05, 1e-6, threshold_strategy="frontier") == pytest.approx(one_run, abs=1e-6)
    assert auditor.epsilon_one_run_fdp(0.05, 1e-6, threshold_strategy="frontier") == pytest.approx(fdp, abs=1e-6)
    # The default grid splits the significance over 8 fixed counts instead of the frontier's thousands.
    assert auditor.epsilon_one_run(0.05, 1e-6) > one_run


def test_defaults_are_the_accountings_functions():
    rng = np.random.default_rng(0)
    members, non_members = rng.normal(1.5, 1, 400), rng.normal(0, 1, 400)
    auditor = CanaryScoreAuditor(members, non_members)
    assert auditor.epsilon_one_run(0.05, 1e-5) == one_run_audit.one_run_epsilon(members, non_members,
                                                                                 significance=0.05, delta=1e-5)
    assert auditor.epsilon_clopper_pearson(0.05, 1e-5) == one_run_audit.clopper_pearson_epsilon(
        members, non_members, significance=0.05, delta=1e-5)
    assert auditor.epsilon_lower_bound(0.05, 1e-5, sample_rate=0.5, steps=10) == one_run_fdp.family_lower_bound(
        members, non_members, sample_rate=0.5, steps=10, delta=1e-5, significance=0.05).epsilon


def test_the_verdict_against_a_claim():
    rng = np.random.default_rng(1)
    included = np.repeat([True, False], 5000)
    projections = one_run_ideal.simulated_projections(rng, included, steps=40, norm=1.0, noise_multiplier=1.0,
                                                      sample_rate=0.5)
    scores = one_run_ideal.likelihood_ratio_scores(projections, norm=1.0, noise_multiplier=4.0, sample_rate=0.5)
    auditor = CanaryScoreAuditor(scores[included], scores[~included])
    # Noise 1 in fact: a claim of 4 is refuted, a claim of 0.5 (less private than the truth) is not.
    assert auditor.rejects(0.05, noise_multiplier=4.0, sample_rate=0.5, steps=40)
    assert not auditor.rejects(0.05, noise_multiplier=0.5, sample_rate=0.5, steps=40)


@pytest.mark.parametrize("call, error, name", [
    (lambda: CanaryScoreAuditor([], [1.0]), ValueError, "in_canary_scores"),
    (lambda: CanaryScoreAuditor([1.0], [[0.0, 1.0]]), ValueError, "out_canary_scores"),
    (lambda: CanaryScoreAuditor([1.0, np.nan], [0.0]), ValueError, "in_canary_scores"),
    (lambda: CanaryScoreAuditor(["a"], [0.0]), TypeError, "in_canary_scores"),
    (lambda: CanaryScoreAuditor([1.0], [0.0]).epsilon_one_run(1.5, 1e-5), ValueError, "significance"),
    (lambda: CanaryScoreAuditor([1.0], [0.0]).epsilon_one_run(0.05, "x"), TypeError, "delta"),
    (lambda: CanaryScoreAuditor([1.0], [0.0]).epsilon_one_run(0.05, 1e-5, threshold_strategy="all"), ValueError,
     "threshold_strategy"),
    (lambda: CanaryScoreAuditor([1.0], [0.0]).epsilon_lower_bound(0.05, 1e-5, sample_rate=0, steps=3), ValueError,
     "sample_rate"),
    (lambda: CanaryScoreAuditor([1.0], [0.0]).epsilon_lower_bound(0.05, 1e-5, sample_rate=0.1, steps=2.5),
     ValueError, "steps"),
    (lambda: CanaryScoreAuditor([1.0], [0.0]).rejects(0.05, noise_multiplier=-1, sample_rate=0.1, steps=3),
     ValueError, "noise_multiplier"),
])
def test_bad_arguments_are_one_line_errors_naming_them(call, error, name):
    with pytest.raises(error, match=name) as raised:
        call()
    assert "\n" not in str(raised.value)

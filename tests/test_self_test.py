"""audit.py --self-test's controls (docs/audit.md §1d): its configuration is one where each planted fault is real
(2q a true doubling, canaries of several norms, both update rules), each fault's idealised mechanism is what the
trainer plants, and the detection rates the docs claim hold at a size CI affords."""

import dataclasses

import numpy as np
import pytest

from perinstance.accounting import one_run_ideal
from perinstance.audit import self_test
from perinstance.cli import options
from perinstance.train import runs

SIGNIFICANCE = 0.05
# Replicates of the idealised mechanism per control here (benchmarks/bench_self_test.py runs the docs' table).
REPLICATES = 16


@pytest.fixture(scope="module")
def training_flags():
    return options.parse_training_flags([*self_test.SELF_TEST_FLAGS, "--data-root", "./data"])


@pytest.fixture(scope="module")
def configs(training_flags, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("models"))
    return {control: self_test.planned_run(control, training_flags, folder)[0] for control in self_test.CONTROLS}


def test_the_configuration_makes_each_fault_real(configs):
    rules = {control.rule for control in self_test.CONTROLS}
    assert rules == {"sum", "mean"}
    assert {control.fault for control in self_test.CONTROLS} == {None, *runs.PLANTED_FAULTS}
    for control, config in configs.items():
        assert config.update_rule == control.rule and config.planted_fault == control.fault
        assert config.sample_rate <= 1 / 4  # 2q is a true doubling, not min(1, 2q) = 1
        assert len(config.canary_norms) >= 2 and min(config.canary_norms) < 1  # σ·c and σ/c differ
        assert config.input_canaries > 0  # the clipping is seen only by them


def test_each_faults_idealised_mechanism(configs):
    by_fault = {control.fault: self_test.idealised_run(config) for control, config in configs.items()
                if control.rule == "sum"}
    config = configs[self_test.Control("sum", None)]
    claim = self_test.idealised_claim(config)
    assert claim.signals == (0.5, 1.0, 1.0) and claim.members == (7500, 7500, 500)
    assert (claim.steps, claim.noise_multiplier, claim.sample_rate) == (80, 3.0, 0.25)
    assert by_fault[None] == claim
    assert by_fault["half_noise"] == dataclasses.replace(claim, noise_multiplier=1.5)
    assert by_fault["double_rate"] == dataclasses.replace(claim, sample_rate=0.5)
    assert by_fault["inverted_norm"] == dataclasses.replace(claim, signals=(2.0, 1.0, 1.0))
    assert by_fault["no_clipping"] == dataclasses.replace(claim, signals=(0.5, 1.0, self_test.UNCLIPPED_NORM))
    mean = {control.fault: self_test.idealised_run(config) for control, config in configs.items()
            if control.rule == "mean"}
    assert mean[None] == dataclasses.replace(claim, expected_batch=16.0, other_examples=64)
    assert mean["noise_before_division"] == dataclasses.replace(claim, expected_batch=16.0, other_examples=64,
                                                                 noise_multiplier=0.0, noise_before_division=3 / 16)


def test_the_detection_rates_behind_the_docs(training_flags):
    # docs/audit.md §1d: every planted fault flagged in (nearly) every idealised run, the correct runs at most at the
    # significance. At 16 replicates a share's 95% interval starts above 0.6 only with 14 or more flagged.
    rows = self_test.detection_rates(self_test.CONTROLS, training_flags=training_flags, replicates=REPLICATES,
                                     significance=SIGNIFICANCE)
    assert [(row["rule"], row["fault"]) for row in rows] == [(c.rule, c.fault) for c in self_test.CONTROLS]
    for row in rows:
        assert row["replicates"] == REPLICATES and row["low"] <= row["rate"] <= row["high"]
        if row["fault"] is None:
            assert row["low"] <= SIGNIFICANCE, row
        else:
            assert row["low"] > 0.6, row


def test_the_mean_rule_hides_what_the_sum_rule_shows(training_flags):
    # The canaries join the mean rule's batches (about 3,900 a step against 16 real points), so half the noise,
    # flagged under the sum rule, is not under the mean rule: the self-test claims no such control.
    rows = self_test.detection_rates([self_test.Control("mean", "half_noise")], training_flags=training_flags,
                                     replicates=4, significance=SIGNIFICANCE)
    assert rows[0]["flagged"] == 0


def test_an_idealised_claim_is_the_sum_rules_with_the_actual_runs_groups():
    claim = one_run_ideal.IdealisedRun(signals=(1.0,), members=(10,), steps=5, noise_multiplier=1.0, sample_rate=0.5)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="sum rule"):
        one_run_ideal.flagged_runs(rng, dataclasses.replace(claim, expected_batch=4.0), claim, significance=0.05,
                                   replicates=1)
    with pytest.raises(ValueError, match="same groups"):
        one_run_ideal.flagged_runs(rng, claim, dataclasses.replace(claim, members=(11,)), significance=0.05,
                                   replicates=1)

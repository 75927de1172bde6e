"""One meaning per kind word (docs/accounting.md §3.5, §4): every accountant labels each number it writes with the
kind it is. `estimate` is a Monte Carlo value with its spread (or a composition of such values), never a
composition that holds measured values between checkpoints: that is a `held_estimate`. `certified` is a bound,
only from every-step values once composed.

Each accountant runs on the golden inputs (tests/golden: a sum-rule run measured at checkpoints 0, 8, 16 and at
every step by --track-points, and a mean-rule run at checkpoints), in every mode of tests/test_golden.py and by
privacy loss distributions."""

import numpy as np
import pandas as pd
import pytest
import test_golden
from test_golden import CASES, account

from perinstance import IndividualAccountant
from perinstance.accounting.guarantees import Kind

PER_STEP_SUM = {Kind.CERTIFIED, Kind.BASELINE}
PER_STEP_MEAN = {Kind.ESTIMATE, Kind.CERTIFIED, Kind.BASELINE}
# The kinds each mode writes, by what its input holds.
KINDS = {
    "eps_delta_sum_exact": PER_STEP_SUM, "eps_delta_sum_points": PER_STEP_SUM, "eps_delta_sum_holder": PER_STEP_SUM,
    "eps_delta_sum_holder_classic": PER_STEP_SUM, "renyi_sum": PER_STEP_SUM,
    "eps_delta_mean": PER_STEP_MEAN, "eps_delta_mean_failure": PER_STEP_MEAN, "eps_delta_mean_histogram": PER_STEP_MEAN,
    "renyi_mean_coupling": PER_STEP_MEAN, "renyi_mean_coupling_failure": PER_STEP_MEAN,
    "renyi_mean_histogram": PER_STEP_MEAN,
    "renyi_mean_jensen_joint": {Kind.GLA_STATISTIC}, "renyi_mean_jensen_per_target": {Kind.GLA_STATISTIC},
    # Δ* at three checkpoints, held between them; the tracked norms hold it at every step.
    "compo_sum_inf": {Kind.HELD_ESTIMATE, Kind.BASELINE}, "compo_sum_3T": {Kind.HELD_ESTIMATE, Kind.BASELINE},
    "compo_sum_exact_levels": {Kind.HELD_ESTIMATE, Kind.BASELINE},
    "compo_tracked_inf": {Kind.CERTIFIED, Kind.BASELINE}, "compo_tracked_3T": {Kind.CERTIFIED, Kind.BASELINE},
    # The mean rule's certified per-step values held between checkpoints; its Monte Carlo ones stay an estimate.
    "compo_mean_certified": {Kind.HELD_ESTIMATE, Kind.BASELINE},
    "compo_mean_statistics": {Kind.HELD_ESTIMATE, Kind.BASELINE},
    "compo_mean_estimate": {Kind.ESTIMATE, Kind.BASELINE},
}
PLD_CASES = {
    "compo_pld_sum": (["--res-name", "sum"], {Kind.HELD_ESTIMATE, Kind.BASELINE}),
    "compo_pld_tracked": (["--res-file", "res/tracked_norms.csv"], {Kind.CERTIFIED, Kind.BASELINE}),
    "compo_pld_mean_certified": (["--res-name", "mean"], {Kind.HELD_ESTIMATE, Kind.BASELINE}),
    "compo_pld_mean_estimate": (["--res-name", "mean", "--kind", "estimate"], {Kind.ESTIMATE, Kind.BASELINE}),
}


def test_every_golden_mode_states_its_kinds():
    assert set(KINDS) == set(CASES)


def written(case, tmp_path):
    table, text = account(case, tmp_path)
    return pd.read_csv(tmp_path / "res" / f"{case}.csv"), text.decode()


def check_words(frame, text, expected):
    assert set(frame["kind"]) == {kind.value for kind in expected}
    for kind in expected:
        assert f"{kind.value} = " in text  # the printed kinds line names it, with its label
    if "samples" in frame and Kind.ESTIMATE in expected:
        # A per-step estimate is Monte Carlo: it has draws and the columns of their spread; a bound has none.
        assert {"eps_min", "eps_max"} <= set(frame.columns) or {"rdp_min", "rdp_max"} <= set(frame.columns)
        assert np.all(frame.loc[frame["kind"] == Kind.ESTIMATE, "samples"] > 0)
        assert np.all(frame.loc[frame["kind"].isin([Kind.CERTIFIED, Kind.BASELINE]), "samples"] == 0)
    if Kind.ESTIMATE in expected and frame.columns.isin(["steps"]).any():
        assert "Monte Carlo" in text


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_accountant_labels_its_numbers_with_their_kind(case, tmp_path):
    frame, text = written(case, tmp_path)
    check_words(frame, text, KINDS[case])


@pytest.mark.parametrize("case", sorted(PLD_CASES))
def test_the_pld_composition_labels_alike(case, tmp_path, monkeypatch):
    flags, expected = PLD_CASES[case]
    monkeypatch.setitem(test_golden.CASES, case, ("renyi_per_instance_sum_compo.py", [*flags, "--accountant", "pld"]))
    frame, text = written(case, tmp_path)
    check_words(frame, text, expected)
    assert set(frame["accountant"]) == {"pld"}


def test_the_api_uses_the_scripts_words():
    accountant = IndividualAccountant(2)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, sensitivity_ratios=[0.5, 0.2], measured=True)
    assert accountant.kind == Kind.CERTIFIED.value
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, sensitivity_ratios=[0.5, 0.2], measured=False)
    assert accountant.kind == Kind.HELD_ESTIMATE.value

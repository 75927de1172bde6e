"""The report's findings carry 95% intervals and verdicts drawn from them (docs/accounting.md §10), checked on
fixtures whose answer is known: clearly separated samples, identical ones, and reversed ones; their tables hold the
intervals and their takeaways say what the verdicts say."""

import math

import numpy as np
import pandas as pd
import pytest

from perinstance.accounting import intervals
from perinstance.accounting.intervals import FALLS, NO_DIFFERENCE, RISES
from perinstance.audit import membership
from perinstance.experiments import report_audits, report_cells, report_privacy, report_rates
from perinstance.experiments.config import PRESETS
from perinstance.experiments.sampling_rates import DESIGN_MATCHED, adjacent_rate_verdicts, design_verdicts
from perinstance.plots import plots, sampling_rate_plots

POINTS = 200


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def spread(rng, median, points=POINTS):
    """Positive values whose median is close to `median`, a factor of about 1.2 either way."""
    return median * np.exp(rng.normal(0.0, 0.2, points))


def test_clearly_separated_rates_fall_and_the_change_is_the_log_ratio_of_medians(rng):
    high, low = spread(rng, 1.0), spread(rng, 0.25)
    (pair,) = adjacent_rate_verdicts({0.1: high, 0.2: low}, paired=False)
    assert (pair["from"], pair["to"], pair["verdict"]) == (0.1, 0.2, FALLS)
    assert pair["change"].estimate == pytest.approx(math.log(np.median(low) / np.median(high)), rel=1e-12)
    assert pair["change"].high < 0 and pair["change"].count == POINTS
    (reverse,) = adjacent_rate_verdicts({0.1: low, 0.2: high}, paired=False)
    assert reverse["verdict"] == RISES


def test_identical_samples_give_no_difference(rng):
    same = spread(rng, 1.0)
    for paired in (True, False):
        (pair,) = adjacent_rate_verdicts({0.1: same, 0.2: same.copy()}, paired=paired)
        assert pair["verdict"] == NO_DIFFERENCE
        assert pair["change"].low <= 0 <= pair["change"].high


def test_paired_verdicts_leave_out_points_without_a_positive_finite_value_at_either_rate(rng):
    before, after = spread(rng, 1.0), spread(rng, 0.25)
    before[:3], after[3:6] = np.inf, 0.0
    (pair,) = adjacent_rate_verdicts({0.1: before, 0.2: after}, paired=True)
    assert pair["change"].count == POINTS - 6 and pair["verdict"] == FALLS


def designs_fixture(rng):
    """One design whose per-step ratio to the baseline falls from q=0.01 to 0.1 and is the same from 0.1 to 1
    (per step the values fall less than the baseline), and its whole run."""
    baselines = {0.01: 10.0, 0.1: 5.0, 1.0: 2.5}
    ratios = {0.01: 0.5, 0.1: 0.1, 1.0: 0.1}
    noise = spread(rng, 1.0)
    per_step = {rate: {"certified": ratios[rate] * baselines[rate] * noise,
                       "estimate": 0.8 * ratios[rate] * baselines[rate] * noise,
                       "baseline": baselines[rate], "sum_rule": noise, "sum_baseline": 3.0} for rate in ratios}
    whole_run = {rate: {"certified": 5.0 * noise, "estimate": 4.0 * noise, "baseline": 20.0, "sum_baseline": 10.0}
                 for rate in ratios}
    facts = {rate: {"sigma": 1.0, "steps": 10, "batch_size": int(rate * 1000), "checkpoint": 5, "k_min": 1,
                    "points": POINTS, "estimate_samples": 64, "dominated_by_k_min": 0.0} for rate in ratios}
    return per_step, whole_run, facts


def test_design_verdicts_judge_ratio_value_and_whole_run(rng):
    per_step, whole_run, _ = designs_fixture(rng)
    verdicts = design_verdicts(per_step, whole_run, paired=True)
    for series in ("certified", "estimate"):
        assert [pair["verdict"] for pair in verdicts["ratio"][series]] == [FALLS, NO_DIFFERENCE]
        # The values themselves fall at both steps (the baseline halves from 0.1 to 1), the whole run stays.
        assert [pair["verdict"] for pair in verdicts["per_step"][series]] == [FALLS, FALLS]
        assert [pair["verdict"] for pair in verdicts["whole_run"][series]] == [NO_DIFFERENCE, NO_DIFFERENCE]
        assert verdicts["ratio"][series][0]["change"].estimate == pytest.approx(math.log(0.1 / 0.5), rel=1e-9)


def test_mean_rule_findings_carry_intervals_verdicts_and_one_claim(rng, tmp_path):
    per_step, whole_run, facts = designs_fixture(rng)
    designs = {"(a) one checkpoint": (per_step, whole_run), DESIGN_MATCHED: (per_step, whole_run)}
    drawn = sampling_rate_plots.plot_sampling_rate_designs(
        designs, 8, 1e-5, {quantity: tmp_path / f"{quantity}.png" for quantity in sampling_rate_plots.QUANTITIES})
    rates = {design: {**values, "facts": facts, "verdicts": design_verdicts(*designs[design],
                                                                           paired=design != DESIGN_MATCHED)}
             for design, values in drawn.items()}
    (*found, claim), headlines = report_rates.rates_findings(PRESETS["tiny"], rates)
    assert len(found) == 2
    # A row per rate: the certified ratio's median with its 95% interval, in the cell of its rate.
    interval = drawn[DESIGN_MATCHED]["ratios_intervals"]["certified"][0.01]
    one_step = found[1].extra_tables[0]
    assert one_step.rows[0][0] == "0.01"
    assert one_step.rows[0][one_step.columns.index("certified ÷ baseline")] == plots.interval_text(interval)
    expected = np.median(per_step[0.01]["certified"]) / per_step[0.01]["baseline"]
    assert interval.estimate == pytest.approx(expected, rel=1e-12)
    assert interval.low < expected < interval.high and interval.count == POINTS
    # The verdicts between adjacent rates: a column per pair, a row per judged quantity.
    changes = {row[0]: row[1:] for row in found[0].extra_tables[2].rows}
    assert found[0].extra_tables[2].columns == ("as q grows", "0.01→0.1", "0.1→1")
    assert changes["certified ÷ baseline, one step"][0].startswith(f"{FALLS} ×0.2 [")
    assert changes["certified ÷ baseline, one step"][1].startswith(NO_DIFFERENCE)
    assert "resampled together" in found[0].extra_tables[2].title
    assert "each resampled on its own" in found[1].extra_tables[2].title
    assert found[0].takeaway == ("Per step ÷ the mean rule's baseline, the certified bound falls at 1 of 2 steps up in "
                                 "q and rises at 0, 1 unclear at this precision; the Monte Carlo estimate falls at 1 "
                                 "and rises at 0, 1 unclear at this precision.")
    assert claim.takeaway.count("GLA's claim") == 1 and "holds at 2 of 4 steps up in q; both ratios rise at 0, and " \
                                                        "at 2 they are" in claim.takeaway
    assert (DESIGN_MATCHED, "0.01→0.1", FALLS, FALLS, FALLS) in claim.table.rows
    assert (DESIGN_MATCHED, "0.1→1", NO_DIFFERENCE, NO_DIFFERENCE, NO_DIFFERENCE) in claim.table.rows
    (headline,) = headlines
    assert report_cells.table_cell(claim, headline.row, headline.column) == "2 of 4"
    assert "REPRODUCED" not in claim.takeaway and "NOT reproduced" not in claim.takeaway


def correctness(tmp_path, correct_values, misclassified_values):
    """plot_correct_vs_misclassified's numbers, with each group's median interval as figures.py adds them."""
    values = np.concatenate([correct_values, misclassified_values])
    correct = np.arange(len(values)) < len(correct_values)
    found = plots.plot_correct_vs_misclassified(values, correct, 1.0, tmp_path / "cdf.png", "ε", delta=1e-5)
    found["median_intervals"] = {group: intervals.median_interval(group_values) if len(group_values) else None
                                 for group, group_values in (("correct", correct_values),
                                                             ("misclassified", misclassified_values))}
    return found


def test_correctness_finding_from_the_ratio_interval(rng, tmp_path):
    findings = {"total_steps": 10}
    more = correctness(tmp_path, spread(rng, 0.1), spread(rng, 1.0, 40))
    finding = report_privacy.correctness_finding(more, findings)
    assert more["ratio_interval"].low > 1 and finding.takeaway.startswith("Misclassified points pay more")
    assert ("misclassified ÷ correct", "", plots.interval_text(more["ratio_interval"])) in finding.table.rows
    assert ("misclassified", "40", plots.interval_text(more["median_intervals"]["misclassified"])) in finding.table.rows
    same = spread(rng, 1.0)
    alike = report_privacy.correctness_finding(correctness(tmp_path, same, same), findings)
    assert alike.takeaway.startswith(f"NOT borne out by this run: {NO_DIFFERENCE}")
    none = report_privacy.correctness_finding(correctness(tmp_path, same, np.zeros(0)), findings)
    assert "undefined" in none.takeaway and ("misclassified", "0", "undefined") in none.table.rows


def membership_rows(accuracies):
    classes = len(accuracies)
    return pd.DataFrame({"model": "DP", "class": range(classes), "members": 100, "nonmembers": 90,
                         "attack_accuracy": accuracies, "mean_eps": np.linspace(1.0, 2.0, classes),
                         "test_accuracy": np.linspace(0.9, 0.8, classes)})


def test_membership_attack_against_chance():
    chance = membership.membership_summary(membership_rows(0.5 + 0.01 * np.array([-2, 1, 0, 2, -1, 1, -1, 0, 2, -2])))
    assert chance["DP"]["points"] == 1900 and chance["DP"]["attack_accuracy_interval"].count == 10
    finding = report_audits.membership_finding(chance)
    assert finding.takeaway == "The loss-threshold attack does not beat chance at this precision, with or without DP."
    assert finding.table.rows[0][3:6] == ("no difference at this precision", "10", "1,900")
    above = membership.membership_summary(membership_rows(np.linspace(0.7, 0.8, 10)))
    finding = report_audits.membership_finding(above)
    assert finding.table.rows[0][1].startswith("0.75 [") and finding.table.rows[0][3] == "above chance"
    assert finding.takeaway.endswith("is above chance on the DP model.")
    # Attack accuracy rises with ε exactly: r is 1 on every resample.
    assert above["DP"]["pearson_attack_interval"].low == pytest.approx(1.0)


def test_pearson_text_names_interval_and_pairs(rng, tmp_path):
    truth = rng.normal(size=60)
    drawn = plots.plot_estimate_accuracy(truth + 0.3 * rng.normal(size=60), truth, tmp_path / "estimate.png", 1.0,
                                         delta=1e-5)
    interval = drawn["pearson_interval"]
    assert interval.low < drawn["pearson"] < interval.high < 1 and interval.count == 60
    assert report_cells.pearson(drawn["pearson"], interval) == (
        f"{drawn['pearson']:.3f} [{interval.low:.3f}, {interval.high:.3f}]")
    assert report_cells.pearson(float("nan"), None).startswith("undefined")


def test_claim_steps_name_both_series_where_they_disagree(rng):
    fall, same = spread(rng, 1.0), spread(rng, 1.0)
    ratio_verdicts = {"certified": adjacent_rate_verdicts({0.1: fall, 0.2: 0.25 * fall}, paired=True),
                      "estimate": adjacent_rate_verdicts({0.1: same, 0.2: 4.0 * same}, paired=True)}
    assert report_rates.claim_steps(ratio_verdicts) == [(0.1, 0.2, f"mixed (certified {FALLS}, Monte Carlo {RISES})")]

import warnings

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from perinstance.accounting import intervals
from perinstance.plots import audit_plots, one_run_plots, plots, sampling_rate_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLASS_NAMES = ["cat", "dog", "ship", "truck"]


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def panels(monkeypatch):
    """What each saved figure shows, per panel: axis scales and legend texts."""
    recorded = []
    save = plots._save

    def recording_save(fig, path):
        recorded.append([{"xscale": ax.get_xscale(), "yscale": ax.get_yscale(),
                          "legend": [text.get_text() for text in ax.get_legend().get_texts()]
                          if ax.get_legend() else []} for ax in fig.axes])
        save(fig, path)

    for module in (plots, sampling_rate_plots):  # each module holds its own reference to _save
        monkeypatch.setattr(module, "_save", recording_save)
    return recorded


@pytest.fixture(autouse=True)
def no_figure_left_open():
    before = plt.get_fignums()
    yield
    assert plt.get_fignums() == before


def assert_png(path):
    """A non-empty PNG that matplotlib reads back as a colour image of a plausible size."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] >= 300 and image.shape[1] >= 500
    # Something was drawn: a blank canvas has no dark pixels (text and axes are black).
    assert (image[..., :3].max(axis=2) < 0.3).mean() > 0.001


def png_text_keys(data):
    """Keywords of the PNG's text chunks (tEXt, zTXt, iTXt), where writers put versions and dates."""
    keys, offset = [], len(PNG_SIGNATURE)
    while offset < len(data):
        length = int.from_bytes(data[offset:offset + 4], "big")
        kind = data[offset + 4:offset + 8]
        if kind in (b"tEXt", b"zTXt", b"iTXt"):
            keys.append(data[offset + 8:offset + 8 + length].split(b"\0", 1)[0].decode("latin-1"))
        offset += 12 + length  # length, type, data, CRC
    return keys


def draw_checked(tmp_path, draw):
    """Draw the same inputs into two files: valid PNGs, identical bytes, no temp file left behind.

    Returns the numbers returned by the first drawing.
    """
    first, second = tmp_path / "first.png", tmp_path / "second.png"
    result = draw(first)
    draw(second)
    assert_png(first)
    assert first.read_bytes() == second.read_bytes()
    # Identical within one process is not enough: a library version would differ elsewhere.
    assert "Software" not in png_text_keys(first.read_bytes())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["first.png", "second.png"]
    return result


def assert_baseline_in_legend(panel):
    assert any(text.startswith(plots.BASELINE_LABEL) for text in panel["legend"]), panel["legend"]


def draw_without_warnings(draw):
    """Degenerate inputs must not crash and must not warn (nan results are silent)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return draw()


# plot_per_step_histogram

def test_histogram_numbers_and_file(tmp_path, rng, panels):
    eps = rng.gamma(2.0, 0.05, size=500)
    result = draw_checked(tmp_path, lambda path: plots.plot_per_step_histogram(eps, 0.4, path))
    assert result["median"] == pytest.approx(np.median(eps))
    assert result["baseline"] == 0.4
    assert result["share_2x_below"] == pytest.approx(np.count_nonzero(eps <= 0.2) / eps.size)
    assert_baseline_in_legend(panels[0][0])


def test_histogram_constant_values_at_half_the_baseline(tmp_path):
    # Values exactly at baseline/2 count as "2x below" (≤, not <).
    path = tmp_path / "hist.png"
    result = draw_without_warnings(lambda: plots.plot_per_step_histogram(np.full(20, 0.2), 0.4, path))
    assert_png(path)
    assert result == {"median": 0.2, "median_interval": intervals.Interval(0.2, 0.2, 0.2, 20), "baseline": 0.4,
                      "share_2x_below": 1.0}


def test_histogram_rejects_non_finite_values(tmp_path):
    with pytest.raises(ValueError, match="eps contains non-finite"):
        plots.plot_per_step_histogram(np.array([0.1, np.nan]), 0.4, tmp_path / "hist.png")
    assert list(tmp_path.iterdir()) == []


# plot_correct_vs_misclassified

def test_correct_vs_misclassified_numbers_and_file(tmp_path, rng, panels):
    correct = rng.random(400) < 0.8
    values = np.where(correct, rng.gamma(2.0, 0.05, 400), rng.gamma(4.0, 0.06, 400))
    result = draw_checked(
        tmp_path, lambda path: plots.plot_correct_vs_misclassified(values, correct, 0.5, path, "per-step ε"))
    median_correct, median_wrong = np.median(values[correct]), np.median(values[~correct])
    assert result["median_correct"] == pytest.approx(median_correct)
    assert result["median_misclassified"] == pytest.approx(median_wrong)
    assert result["count_correct"] == np.count_nonzero(correct)
    assert result["count_misclassified"] == np.count_nonzero(~correct)
    assert result["ratio"] == pytest.approx(median_wrong / median_correct)
    assert_baseline_in_legend(panels[0][0])


def test_correct_vs_misclassified_without_misclassified_points(tmp_path, rng, panels):
    values = rng.gamma(2.0, 0.05, 50)
    path = tmp_path / "cdf.png"
    result = draw_without_warnings(
        lambda: plots.plot_correct_vs_misclassified(values, np.ones(50, dtype=bool), 0.5, path, "ε"))
    assert_png(path)
    assert "no misclassified points" in panels[0][0]["legend"]
    assert (result["count_correct"], result["count_misclassified"]) == (50, 0)
    assert result["median_correct"] == pytest.approx(np.median(values))
    assert np.isnan(result["median_misclassified"]) and np.isnan(result["ratio"])


def test_correct_vs_misclassified_zero_correct_median_gives_infinite_ratio(tmp_path):
    values = np.array([0.0, 0.0, 0.0, 0.2])
    correct = np.array([True, True, True, False])
    result = draw_without_warnings(
        lambda: plots.plot_correct_vs_misclassified(values, correct, 0.5, tmp_path / "cdf.png", "ε"))
    assert result["ratio"] == np.inf


def test_correct_vs_misclassified_rejects_bad_masks(tmp_path):
    with pytest.raises(ValueError, match="same length"):
        plots.plot_correct_vs_misclassified(np.ones(3), np.ones(2, dtype=bool), 1.0, tmp_path / "c.png", "ε")
    # An integer mask would index positions instead of selecting points.
    with pytest.raises(ValueError, match="boolean"):
        plots.plot_correct_vs_misclassified(np.ones(3), np.array([1, 0, 1]), 1.0, tmp_path / "c.png", "ε")


# plot_sampling_rate_designs

def mean_rule_inputs(rng):
    rates = (0.008, 0.032, 0.128)
    per_step = {q: {"certified": rng.lognormal(np.log(q), 0.5, 80), "estimate": rng.lognormal(np.log(q / 10), 0.5, 20),
                    "baseline": 5 * q, "sum_rule": rng.lognormal(np.log(q / 3), 0.5, 80), "sum_baseline": 2 * q}
                for q in rates}
    composed = {q: {"certified": rng.lognormal(np.log(3 / q), 0.3, 80), "baseline": 40.0, "sum_baseline": 8.0}
                for q in rates}
    return per_step, composed


def test_sampling_rate_designs_numbers_and_file(tmp_path, rng, panels):
    per_step, composed = mean_rule_inputs(rng)
    designs = {"(a) fixed checkpoint": (per_step, composed), "(b) matched steps": mean_rule_inputs(rng)}
    result = draw_checked(tmp_path, lambda path: sampling_rate_plots.plot_sampling_rate_designs(designs, 8, 1e-5, path))
    drawn = result["(a) fixed checkpoint"]
    for series in ("certified", "estimate", "sum_rule"):
        assert drawn["per_step"][series] == pytest.approx({q: np.median(v[series]) for q, v in per_step.items()})
    assert drawn["composed"]["baseline"] == pytest.approx({q: 40.0 for q in composed})
    assert drawn["ratios"]["certified"] == pytest.approx({q: np.median(v["certified"]) / v["baseline"]
                                                          for q, v in per_step.items()})
    step_panel, composed_panel, ratio_panel = panels[0][:3]
    # Every estimate is labelled as one; the value panels carry a baseline, the ratio panel the baseline itself.
    assert any("estimate (Monte Carlo" in text for text in step_panel["legend"])
    assert any("baseline" in text for text in composed_panel["legend"])
    assert any("Monte Carlo" in text for text in ratio_panel["legend"])
    assert (step_panel["xscale"], step_panel["yscale"]) == ("log", "log")
    assert len(panels[0]) == 6


def test_sampling_rate_designs_with_zeros_and_missing_series(tmp_path, panels):
    per_step = {0.01: {"certified": np.zeros(4), "baseline": 0.5}, 0.1: {"certified": np.array([0.0, 0.2]),
                                                                         "baseline": 1.0}}
    composed = {0.01: {"certified": np.ones(4)}, 0.1: {"certified": np.full(2, 2.0)}}
    path = tmp_path / "rates.png"
    result = draw_without_warnings(lambda: sampling_rate_plots.plot_sampling_rate_designs({"d": (per_step, composed)}, 2, 1e-5,
                                                                            path))
    assert_png(path)
    assert result["d"]["per_step"]["certified"] == pytest.approx({0.01: 0.0, 0.1: 0.1})
    assert "estimate" not in result["d"]["per_step"] and result["d"]["ratios"]["estimate"] == {}
    assert panels[0][0]["yscale"] == "symlog"


def test_sampling_rate_designs_require_the_same_rates(tmp_path):
    with pytest.raises(ValueError, match="different rates"):
        sampling_rate_plots.plot_sampling_rate_designs({"d": ({0.1: {"baseline": 1.0}}, {0.2: {"baseline": 1.0}})}, 2, 1e-5,
                                         tmp_path / "r.png")


# plot_composed_over_training

def test_composed_over_training_numbers_and_file(tmp_path, panels):
    steps = np.arange(0, 501, 10)
    curves = {"easy (point 12)": (steps, 0.002 * steps), "hard (point 7)": (steps, 0.005 * steps),
              "misclassified (point 3)": (steps, 0.006 * steps)}
    result = draw_checked(
        tmp_path, lambda path: plots.plot_composed_over_training(curves, (steps, 0.008 * steps), path, 1e-5))
    assert result["final"] == pytest.approx({"easy (point 12)": 1.0, "hard (point 7)": 2.5,
                                             "misclassified (point 3)": 3.0})
    assert result["baseline_final"] == pytest.approx(4.0)
    assert_baseline_in_legend(panels[0][0])


def test_composed_over_training_draws_the_bound_and_the_checkpoint_estimate(tmp_path, panels):
    steps = np.arange(0, 101)
    curves = {"easy (point 12)": (steps, 0.02 * steps), "hard (point 7)": (steps, 0.05 * steps)}
    held = {"easy (point 12)": (steps, 0.018 * steps), "hard (point 7)": (steps, 0.05 * steps)}
    result = draw_checked(tmp_path, lambda path: plots.plot_composed_over_training(
        curves, (steps, 0.08 * steps), path, 1e-5, checkpoint_steps=(0, 10, 50), estimates=held))
    assert result["final"] == pytest.approx({"easy (point 12)": 2.0, "hard (point 7)": 5.0})
    assert result["estimate_final"] == pytest.approx({"easy (point 12)": 1.8, "hard (point 7)": 5.0})
    legend = panels[0][0]["legend"]
    assert "easy (point 12), bound (Δ* at every step): final ε = 2" in legend
    assert "easy (point 12), held-Δ* estimate: final ε = 1.8" in legend
    assert_baseline_in_legend(panels[0][0])


def test_composed_over_training_constant_and_empty_curves(tmp_path):
    steps = np.arange(5)
    curves = {"flat": (steps, np.zeros(5)), "unmeasured": (np.array([]), np.array([]))}
    path = tmp_path / "compo.png"
    result = draw_without_warnings(
        lambda: plots.plot_composed_over_training(curves, (steps, np.ones(5)), path, 1e-5))
    assert_png(path)
    assert result["final"]["flat"] == 0.0
    assert np.isnan(result["final"]["unmeasured"])
    assert result["baseline_final"] == 1.0


# plot_individual_accounting

def individual_inputs(rng, size=400):
    labels = rng.integers(0, len(CLASS_NAMES), size)
    loss = np.exp(rng.normal(-3 + labels, 1.5))
    loss[:3] = 0.0  # perfectly fitted points: the log axis must survive them
    eps = np.clip(5 + 0.8 * np.log(np.maximum(loss, 1e-8)) + rng.normal(0, 0.3, size), 0.5, 7.8)
    accuracy = np.array([0.6, 0.7, 0.9, 0.8])
    return eps, loss, labels, accuracy


def test_individual_accounting_numbers_and_file(tmp_path, rng, panels):
    eps, loss, labels, accuracy = individual_inputs(rng)
    result = draw_checked(tmp_path, lambda path: plots.plot_individual_accounting(
        eps, loss, labels, CLASS_NAMES, accuracy, 7.8, path))
    log_loss = np.log(np.maximum(loss, 1e-8))
    assert result["pearson_log_loss"] == pytest.approx(np.corrcoef(eps, log_loss)[0, 1])
    slope, intercept = np.polyfit(log_loss, eps, 1)
    assert (result["fit_slope"], result["fit_intercept"]) == pytest.approx((slope, intercept))
    class_means = [eps[labels == index].mean() for index in range(len(CLASS_NAMES))]
    assert result["class_mean_eps"] == pytest.approx(dict(zip(CLASS_NAMES, class_means, strict=True)))
    assert result["class_accuracy"] == pytest.approx(dict(zip(CLASS_NAMES, accuracy, strict=True)))
    assert result["pearson_class"] == pytest.approx(np.corrcoef(class_means, accuracy)[0, 1])
    loss_panel, class_panel = panels[0]
    assert loss_panel["xscale"] == "log"
    assert_baseline_in_legend(loss_panel)
    assert_baseline_in_legend(class_panel)


def test_individual_accounting_by_accountant_panel(tmp_path, rng, panels):
    eps, loss, labels, accuracy = individual_inputs(rng)
    tighter = eps * 0.8
    result = draw_checked(tmp_path, lambda path: plots.plot_individual_accounting(
        eps, loss, labels, CLASS_NAMES, accuracy, 7.8, path, by_accountant={"RDP": (eps, 7.8), "PLD": (tighter, 6.9)}))
    summary = result["accountants"]
    assert summary["PLD"]["median"] == pytest.approx(np.median(tighter))
    assert (summary["RDP"]["q10"], summary["RDP"]["q90"]) == pytest.approx(tuple(np.quantile(eps, [0.1, 0.9])))
    assert summary["PLD"]["share_below_half"] == pytest.approx(np.mean(tighter <= 6.9 / 2))
    assert summary["RDP"]["worst"] == 7.8 and summary["RDP"]["points"] == len(eps)
    assert len(panels[0]) == 3
    # An estimate next to the bound: summarised alike, its worst case (the RDP one) drawn once.
    held = np.minimum(eps * 0.97, 7.8)
    result = draw_checked(tmp_path / "held", lambda path: plots.plot_individual_accounting(
        eps, loss, labels, CLASS_NAMES, accuracy, 7.8, path, by_accountant={
            "RDP": (eps, 7.8), "PLD": (tighter, 6.9), "RDP, Δ* held between checkpoints (held-Δ* estimate)": (held, 7.8)},
        eps_label="per-instance composed ε (bound: Δ* at every step)"))
    assert result["accountants"]["RDP, Δ* held between checkpoints (held-Δ* estimate)"]["median"] == pytest.approx(
        np.median(held))
    legend = panels[-1][2]["legend"]
    assert sum("worst case" in text for text in legend) == 2 and any("estimate): median" in text for text in legend)


def test_individual_accounting_degenerate_inputs(tmp_path):
    # Constant ε, every loss zero (clipped to one value), and one class without points
    # leaves two classes: too few for a class correlation. Accuracy given by class name.
    accuracy = {"c": 0.7, "b": 0.8, "a": 0.9}
    path = tmp_path / "individual.png"
    result = draw_without_warnings(lambda: plots.plot_individual_accounting(
        np.full(6, 2.0), np.zeros(6), np.array([0, 0, 0, 1, 1, 1]), ["a", "b", "c"], accuracy, 3.0, path))
    assert_png(path)
    assert np.isnan(result["pearson_log_loss"])
    assert np.isnan(result["fit_slope"]) and np.isnan(result["fit_intercept"])
    assert np.isnan(result["pearson_class"])
    assert result["class_accuracy"] == accuracy
    assert result["class_mean_eps"]["a"] == 2.0
    assert np.isnan(result["class_mean_eps"]["c"])


# plot_estimate_accuracy

def test_estimate_accuracy_numbers_and_file(tmp_path, rng, panels):
    truth = rng.uniform(1, 7.8, 200)
    estimate = truth + rng.normal(0, 0.1, 200)
    result = draw_checked(tmp_path, lambda path: plots.plot_estimate_accuracy(estimate, truth, path, 7.8))
    assert result["pearson"] == pytest.approx(np.corrcoef(truth, estimate)[0, 1])
    assert result["mean_abs_error"] == pytest.approx(np.mean(np.abs(estimate - truth)))
    assert result["max_abs_error"] == pytest.approx(np.max(np.abs(estimate - truth)))
    assert_baseline_in_legend(panels[0][0])


def test_estimate_accuracy_says_how_far_the_estimate_is_from_the_bound(tmp_path, panels):
    bound = np.array([2.0, 4.0, 5.0, 8.0, 1.0])
    estimate = np.array([2.1, 3.0, 5.0, 8.0, 0.9])
    result = draw_checked(tmp_path, lambda path: plots.plot_estimate_accuracy(estimate, bound, path, 9.0))
    relative = (estimate - bound) / bound  # +5%, −25%, 0, 0, −10%
    assert result["relative_median"].estimate == pytest.approx(np.median(relative))
    assert result["relative_largest"].estimate == pytest.approx(0.25)
    assert result["relative_largest_signed"] == pytest.approx(-0.25)
    assert result["share_below"].estimate == pytest.approx(0.4) and result["count_below"] == 2
    assert result["relative_largest"].high == pytest.approx(0.25)  # a resampled maximum is one of the points
    legend = panels[0][0]["legend"]
    assert ("2 points: held-Δ* estimate BELOW the bound" in legend
            and "3 points: held-Δ* estimate at or above the bound" in legend)


def test_estimate_accuracy_constant_input(tmp_path):
    path = tmp_path / "estimate.png"
    result = draw_without_warnings(
        lambda: plots.plot_estimate_accuracy(np.array([1.0, 2.0, 3.0]), np.full(3, 2.0), path, 4.0))
    assert_png(path)
    assert np.isnan(result["pearson"])
    assert result["mean_abs_error"] == pytest.approx(2 / 3)
    assert result["max_abs_error"] == 1.0


# audit_plots.plot_audit_gap

def test_audit_gap_numbers_and_file(tmp_path):
    lower = np.array([3.0, 0.0, 20.0, 0.5, 2.0])
    upper = np.array([13.0, 4.0, 13.0, 4.0, 13.0])
    correct = np.array([False, True, True, True, False])
    result = draw_checked(tmp_path, lambda path: audit_plots.plot_audit_gap(lower, upper, correct, 1.2, 16.0, path))
    assert result == {"count": 5, "above_sum_rule": 3, "above_baseline": 1, "median_lower": 2.0, "max_lower": 20.0}


def test_audit_gap_without_points_and_bad_input(tmp_path):
    path = tmp_path / "gap.png"
    result = draw_without_warnings(
        lambda: audit_plots.plot_audit_gap(np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool), 1.2, 16.0, path))
    assert_png(path)
    assert result["count"] == 0 and np.isnan(result["median_lower"]) and np.isnan(result["max_lower"])
    with pytest.raises(ValueError, match="boolean"):
        audit_plots.plot_audit_gap(np.ones(2), np.ones(2), np.ones(2), 1.2, 16.0, path)
    with pytest.raises(ValueError, match="same length"):
        audit_plots.plot_audit_gap(np.ones(2), np.ones(3), np.ones(2, dtype=bool), 1.2, 16.0, path)


# one_run_plots.plot_one_run_audit

def test_one_run_audit_numbers_and_file(tmp_path):
    norms = np.array([0.1, 0.3, 1.0])
    lower, rdp, pld = np.array([0.0, 0.5, 9.0]), np.array([0.3, 1.0, 10.0]), np.array([0.25, 0.9, 8.5])
    summed, ideal, cap = np.array([0.0, 0.2, 3.0]), np.array([0.0, 0.4, 3.0]), np.array([4.7, 4.8, 4.75])
    result = draw_checked(tmp_path, lambda path: one_run_plots.plot_one_run_audit(norms, lower, summed, ideal, rdp,
                                                                                   pld, cap, path))
    # The upper bound is the smaller of RDP and PLD; 9 > 8.5 is a violation even though it is below the RDP bound.
    assert result["upper"] == [0.25, 0.9, 8.5]
    assert result["ratio"] == pytest.approx([0.0, 0.5 / 0.9, 9.0 / 8.5], rel=1e-12)
    assert result["violated"] == [False, False, True]
    # lower/ideal where the idealised bound is positive, NaN where it is 0.
    assert np.isnan(result["ideal_ratio"][0]) and result["ideal_ratio"][1:] == pytest.approx([1.25, 3.0], rel=1e-12)


def test_one_run_audit_bad_input(tmp_path):
    path = tmp_path / "one_run.png"
    with pytest.raises(ValueError, match="same length"):
        one_run_plots.plot_one_run_audit(np.ones(2), np.ones(3), np.ones(3), np.ones(3), np.ones(3), np.ones(3),
                                         np.ones(3), path)
    with pytest.raises(ValueError, match="fdp_cap"):
        one_run_plots.plot_one_run_audit(np.ones(2), np.ones(2), np.ones(2), np.ones(2), np.ones(2), np.ones(2),
                                         np.array([1.0, np.nan]), path)
    assert not path.exists()

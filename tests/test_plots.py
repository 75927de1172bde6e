import warnings

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from perinstance.accounting import intervals
from perinstance.audit import audit_simulation
from perinstance.experiments.commands import CAPTIONS, FIGURES
from perinstance.plots import audit_plots, individual_plots, one_run_plots, plots, sampling_rate_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CLASS_NAMES = ["cat", "dog", "ship", "truck"]
DRAWING_MODULES = (plots, sampling_rate_plots, individual_plots, audit_plots, one_run_plots)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def legend_texts(ax):
    """The texts of the legend that explains `ax`: its own, else its (sub)figure's."""
    legends = [ax.get_legend()] if ax.get_legend() else ax.get_figure(root=False).legends
    return [text.get_text() for legend in legends for text in legend.get_texts()]


def overlap(first, second):
    """Whether two window extents (display pixels) share more than a pixel's width."""
    return (min(first.x1, second.x1) - max(first.x0, second.x0) > 1
            and min(first.y1, second.y1) - max(first.y0, second.y0) > 1)


def shown_tick_labels(ax):
    """The tick labels an axes draws: those of ticks inside its view limits."""
    shown = []
    for labels, (low, high), coordinate in ((ax.get_xticklabels(), sorted(ax.get_xlim()), 0),
                                            (ax.get_yticklabels(), sorted(ax.get_ylim()), 1)):
        shown += [label for label in labels if low <= label.get_position()[coordinate] <= high]
    return shown


def layout_problems(fig):
    """What a reader at 100% would see wrong in a drawn figure: a title, axis label, tick label or legend that reaches
    past the canvas (clipped), or a legend that covers any axes (the data of its panel or a neighbour's)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    problems = []
    texts = [text for ax in fig.axes for text in (ax.title, ax.xaxis.label, ax.yaxis.label, *shown_tick_labels(ax))
             if text.get_visible() and text.get_text()]
    texts += [text for sub in (fig, *fig.subfigs) for text in (sub._suptitle, sub._supxlabel) if text is not None]
    legends = [legend for ax in fig.axes for legend in [ax.get_legend()] if legend is not None]
    legends += [legend for sub in (fig, *fig.subfigs) for legend in sub.legends]
    for artist in (*texts, *legends):
        box = artist.get_window_extent(renderer)
        if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1:
            problems.append(f"clipped: {getattr(artist, 'get_text', lambda: 'a legend')()!r}")
    for legend in legends:
        box = legend.get_window_extent(renderer)
        problems += [f"a legend covers the axes titled {ax.get_title()!r}" for ax in fig.axes
                     if overlap(box, ax.get_window_extent(renderer))]
    return problems


@pytest.fixture
def panels(monkeypatch):
    """What each saved figure shows, per panel: axis scales, labels and legend texts; and that nothing in it is clipped
    or covered by a legend."""
    recorded = []
    save = plots._save

    def recording_save(fig, path):
        assert layout_problems(fig) == []
        recorded.append([{"xscale": ax.get_xscale(), "yscale": ax.get_yscale(), "xlabel": ax.get_xlabel(),
                          "ylabel": ax.get_ylabel(), "title": ax.get_title(), "legend": legend_texts(ax), "axes": ax}
                         for ax in fig.axes])
        save(fig, path)

    for module in DRAWING_MODULES:  # each module holds its own reference to _save
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
    result = draw_checked(tmp_path, lambda path: plots.plot_per_step_histogram(eps, 0.4, path, delta=1e-5))
    assert result["median"] == pytest.approx(np.median(eps))
    assert result["baseline"] == 0.4
    assert result["share_2x_below"] == pytest.approx(np.count_nonzero(eps <= 0.2) / eps.size)
    assert_baseline_in_legend(panels[0][0])


def test_histogram_is_on_a_log_axis_and_marks_the_share_at_the_worst_case(tmp_path, rng, panels):
    # 30 points at the worst case, 10 a float32 rounding below it (Δ* one ulp under Γ), the rest far below.
    worst = 3.046224409
    eps = np.concatenate([np.full(30, worst), np.full(10, worst * (1 - 1.5e-7)), np.full(5, worst * 0.99),
                          rng.lognormal(np.log(0.01), 1.5, 155)])
    result = draw_checked(tmp_path, lambda path: plots.plot_per_step_histogram(eps, worst, path, delta=1e-5))
    assert result["share_at_worst"] == pytest.approx(40 / 200)
    (panel,) = panels[0]
    assert panel["xscale"] == "log"
    assert "40 points at the worst case" in panel["legend"]
    notes = [text.get_text() for text in panel["axes"].texts]
    assert notes == ["20.0% of points\nat the worst case"]
    assert "20.0% at it" in panel["title"]


def test_histogram_constant_values_at_half_the_baseline(tmp_path):
    # Values exactly at baseline/2 count as "2x below" (≤, not <).
    path = tmp_path / "hist.png"
    result = draw_without_warnings(lambda: plots.plot_per_step_histogram(np.full(20, 0.2), 0.4, path, delta=1e-5))
    assert_png(path)
    assert result == {"median": 0.2, "median_interval": intervals.Interval(0.2, 0.2, 0.2, 20), "baseline": 0.4,
                      "share_2x_below": 1.0, "share_at_worst": 0.0}


def test_histogram_with_zeros_keeps_them_on_the_axis(tmp_path, panels):
    eps = np.array([0.0, 0.0, 0.001, 0.01, 0.4, 0.4])
    result = draw_without_warnings(lambda: plots.plot_per_step_histogram(eps, 0.4, tmp_path / "hist.png", delta=1e-5))
    assert result["share_at_worst"] == pytest.approx(2 / 6)
    assert panels[0][0]["xscale"] == "symlog"


def test_histogram_rejects_non_finite_values(tmp_path):
    with pytest.raises(ValueError, match="eps contains non-finite"):
        plots.plot_per_step_histogram(np.array([0.1, np.nan]), 0.4, tmp_path / "hist.png", delta=1e-5)
    assert list(tmp_path.iterdir()) == []


# plot_correct_vs_misclassified

def test_correct_vs_misclassified_numbers_and_file(tmp_path, rng, panels):
    correct = rng.random(400) < 0.8
    values = np.where(correct, rng.gamma(2.0, 0.05, 400), rng.gamma(4.0, 0.06, 400))
    result = draw_checked(
        tmp_path, lambda path: plots.plot_correct_vs_misclassified(values, correct, 0.5, path, "per-step ε", delta=1e-5))
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
        lambda: plots.plot_correct_vs_misclassified(values, np.ones(50, dtype=bool), 0.5, path, "ε", delta=1e-5))
    assert_png(path)
    assert "no misclassified points" in panels[0][0]["legend"]
    assert (result["count_correct"], result["count_misclassified"]) == (50, 0)
    assert result["median_correct"] == pytest.approx(np.median(values))
    assert np.isnan(result["median_misclassified"]) and np.isnan(result["ratio"])


def test_correct_vs_misclassified_zero_correct_median_gives_infinite_ratio(tmp_path):
    values = np.array([0.0, 0.0, 0.0, 0.2])
    correct = np.array([True, True, True, False])
    result = draw_without_warnings(
        lambda: plots.plot_correct_vs_misclassified(values, correct, 0.5, tmp_path / "cdf.png", "ε", delta=1e-5))
    assert result["ratio"] == np.inf


def test_correct_vs_misclassified_rejects_bad_masks(tmp_path):
    with pytest.raises(ValueError, match="same length"):
        plots.plot_correct_vs_misclassified(np.ones(3), np.ones(2, dtype=bool), 1.0, tmp_path / "c.png", "ε", delta=1e-5)
    # An integer mask would index positions instead of selecting points.
    with pytest.raises(ValueError, match="boolean"):
        plots.plot_correct_vs_misclassified(np.ones(3), np.array([1, 0, 1]), 1.0, tmp_path / "c.png", "ε", delta=1e-5)


# plot_sampling_rate_designs

def mean_rule_inputs(rng):
    rates = (0.008, 0.032, 0.128)
    per_step = {q: {"certified": rng.lognormal(np.log(q), 0.5, 80), "estimate": rng.lognormal(np.log(q / 10), 0.5, 20),
                    "baseline": 5 * q, "sum_rule": rng.lognormal(np.log(q / 3), 0.5, 80), "sum_baseline": 2 * q}
                for q in rates}
    composed = {q: {"certified": rng.lognormal(np.log(3 / q), 0.3, 80), "baseline": 40.0, "sum_baseline": 8.0}
                for q in rates}
    return per_step, composed


def rate_paths(folder):
    folder.mkdir()
    return {quantity: folder / f"{quantity}.png" for quantity in sampling_rate_plots.QUANTITIES}


def test_sampling_rate_designs_numbers_and_files(tmp_path, rng, panels):
    per_step, composed = mean_rule_inputs(rng)
    designs = {"(a) fixed checkpoint": (per_step, composed), "(b) matched steps": mean_rule_inputs(rng)}
    first, second = rate_paths(tmp_path / "first"), rate_paths(tmp_path / "second")
    result = sampling_rate_plots.plot_sampling_rate_designs(designs, 8, 1e-5, first)
    sampling_rate_plots.plot_sampling_rate_designs(designs, 8, 1e-5, second)
    for quantity in sampling_rate_plots.QUANTITIES:
        assert_png(first[quantity])
        assert first[quantity].read_bytes() == second[quantity].read_bytes()
    drawn = result["(a) fixed checkpoint"]
    for series in ("certified", "estimate", "sum_rule"):
        assert drawn["per_step"][series] == pytest.approx({q: np.median(v[series]) for q, v in per_step.items()})
    assert drawn["composed"]["baseline"] == pytest.approx({q: 40.0 for q in composed})
    assert drawn["ratios"]["certified"] == pytest.approx({q: np.median(v["certified"]) / v["baseline"]
                                                          for q, v in per_step.items()})
    # One figure per quantity, a panel per design each.
    step_figure, composed_figure, ratio_figure = panels[:3]
    assert [len(figure) for figure in panels[:3]] == [2, 2, 2]
    assert [panel["title"] for panel in step_figure] == list(designs)
    # Every estimate is labelled as one; the value panels carry a baseline, the ratio panel the baseline itself.
    assert any("estimate (Monte Carlo" in text for text in step_figure[0]["legend"])
    assert any("baseline" in text for text in composed_figure[0]["legend"])
    assert any("Monte Carlo" in text for text in ratio_figure[0]["legend"])
    assert (step_figure[0]["xscale"], step_figure[0]["yscale"]) == ("log", "log")
    assert all("δ = 1e-05" in panel["ylabel"] for panel in composed_figure)


def test_sampling_rate_designs_with_zeros_and_missing_series(tmp_path, panels):
    per_step = {0.01: {"certified": np.zeros(4), "baseline": 0.5}, 0.1: {"certified": np.array([0.0, 0.2]),
                                                                         "baseline": 1.0}}
    composed = {0.01: {"certified": np.ones(4)}, 0.1: {"certified": np.full(2, 2.0)}}
    paths = rate_paths(tmp_path / "rates")
    result = draw_without_warnings(
        lambda: sampling_rate_plots.plot_sampling_rate_designs({"d": (per_step, composed)}, 2, 1e-5, paths))
    for path in paths.values():
        assert_png(path)
    assert result["d"]["per_step"]["certified"] == pytest.approx({0.01: 0.0, 0.1: 0.1})
    assert "estimate" not in result["d"]["per_step"] and result["d"]["ratios"]["estimate"] == {}
    assert panels[0][0]["yscale"] == "symlog"


def test_sampling_rate_designs_require_the_same_rates_and_every_path(tmp_path):
    with pytest.raises(ValueError, match="different rates"):
        sampling_rate_plots.plot_sampling_rate_designs({"d": ({0.1: {"baseline": 1.0}}, {0.2: {"baseline": 1.0}})}, 2,
                                                       1e-5, rate_paths(tmp_path / "r"))
    with pytest.raises(ValueError, match="paths must name the figures"):
        sampling_rate_plots.plot_sampling_rate_designs({}, 2, 1e-5, {"per_step": tmp_path / "p.png"})
    assert list((tmp_path / "r").iterdir()) == []


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
    result = draw_checked(tmp_path, lambda path: individual_plots.plot_individual_accounting(
        eps, loss, labels, CLASS_NAMES, accuracy, 7.8, path, delta=1e-5))
    log_loss = np.log(np.maximum(loss, 1e-8))
    assert result["pearson_log_loss"] == pytest.approx(np.corrcoef(eps, log_loss)[0, 1])
    class_means = [eps[labels == index].mean() for index in range(len(CLASS_NAMES))]
    assert result["class_mean_eps"] == pytest.approx(dict(zip(CLASS_NAMES, class_means, strict=True)))
    assert result["class_accuracy"] == pytest.approx(dict(zip(CLASS_NAMES, accuracy, strict=True)))
    assert result["pearson_class"] == pytest.approx(np.corrcoef(class_means, accuracy)[0, 1])
    loss_panel, class_panel = panels[0]
    assert loss_panel["xscale"] == "log"
    assert_baseline_in_legend(loss_panel)
    assert_baseline_in_legend(class_panel)


def plotted_medians(ax):
    """The (loss, ε) points of the loss panel's median line: its only line with round markers."""
    (line,) = [line for line in ax.get_lines() if line.get_marker() == "o"]
    return line.get_xdata(), line.get_ydata()


def test_individual_accounting_draws_group_medians_inside_the_data(tmp_path, rng, panels):
    # ε rises with the loss and stops at the worst case, as a run's does: a line fitted through them would leave
    # the data at both ends and pass above the worst case; the medians of groups by loss cannot.
    loss = np.exp(rng.uniform(np.log(1e-4), np.log(10.0), 2000))
    worst = 10.0
    eps = np.clip(11.0 + 0.6 * np.log(loss) + rng.normal(0, 0.4, 2000), 4.0, worst)
    labels = rng.integers(0, len(CLASS_NAMES), 2000)
    result = individual_plots.plot_individual_accounting(eps, loss, labels, CLASS_NAMES, [0.6, 0.7, 0.9, 0.8], worst,
                                                         tmp_path / "individual.png", delta=1e-5)
    groups = result["loss_groups"]
    assert len(groups) == individual_plots.LOSS_GROUPS and sum(group["points"] for group in groups) == 2000
    order = np.argsort(loss, kind="stable")
    for group, members in zip(groups, np.array_split(order, len(groups)), strict=True):
        assert group["eps_median"].estimate == pytest.approx(np.median(eps[members]))
        assert group["loss_median"] == pytest.approx(np.median(loss[members]))
    x, y = plotted_medians(panels[0][0]["axes"])
    assert y == pytest.approx([group["eps_median"].estimate for group in groups])
    assert np.all(y <= worst) and np.all((y >= eps.min()) & (y <= eps.max()))
    assert np.all((x >= loss.min()) & (x <= loss.max()))
    lows = np.array([group["eps_median"].low for group in groups])
    highs = np.array([group["eps_median"].high for group in groups])
    assert np.all(lows >= eps.min()) and np.all(highs <= worst)
    # The fit this replaces: through the same points it runs above the worst case at the highest losses.
    slope, intercept = np.polyfit(np.log(loss), eps, 1)
    assert intercept + slope * np.log(loss.max()) > worst


def test_individual_accounting_by_accountant_panel(tmp_path, rng, panels):
    eps, loss, labels, accuracy = individual_inputs(rng)
    tighter = eps * 0.8
    result = draw_checked(tmp_path, lambda path: individual_plots.plot_individual_accounting(
        eps, loss, labels, CLASS_NAMES, accuracy, 7.8, path, delta=1e-5,
        by_accountant={"RDP": (eps, 7.8), "PLD": (tighter, 6.9)}))
    summary = result["accountants"]
    assert summary["PLD"]["median"] == pytest.approx(np.median(tighter))
    assert (summary["RDP"]["q10"], summary["RDP"]["q90"]) == pytest.approx(tuple(np.quantile(eps, [0.1, 0.9])))
    assert summary["PLD"]["share_below_half"] == pytest.approx(np.mean(tighter <= 6.9 / 2))
    assert summary["RDP"]["worst"] == 7.8 and summary["RDP"]["points"] == len(eps)
    assert len(panels[0]) == 3
    # An estimate next to the bound: summarised alike, its worst case (the RDP one) drawn once.
    held = np.minimum(eps * 0.97, 7.8)
    result = draw_checked(tmp_path / "held", lambda path: individual_plots.plot_individual_accounting(
        eps, loss, labels, CLASS_NAMES, accuracy, 7.8, path, delta=1e-5, by_accountant={
            "RDP": (eps, 7.8), "PLD": (tighter, 6.9), "RDP, Δ* held between checkpoints (held-Δ* estimate)": (held, 7.8)},
        what="per-instance composed ε (bound: Δ* at every step)"))
    assert result["accountants"]["RDP, Δ* held between checkpoints (held-Δ* estimate)"]["median"] == pytest.approx(
        np.median(held))
    legend = panels[-1][2]["legend"]
    assert sum("worst case" in text for text in legend) == 2 and any("estimate): median" in text for text in legend)
    assert panels[-1][0]["ylabel"] == "per-instance composed ε (bound: Δ* at every step) at δ = 1e-05"


def test_individual_accounting_degenerate_inputs(tmp_path):
    # Constant ε, every loss zero (clipped to one value), and one class without points
    # leaves two classes: too few for a class correlation. Accuracy given by class name.
    accuracy = {"c": 0.7, "b": 0.8, "a": 0.9}
    path = tmp_path / "individual.png"
    result = draw_without_warnings(lambda: individual_plots.plot_individual_accounting(
        np.full(6, 2.0), np.zeros(6), np.array([0, 0, 0, 1, 1, 1]), ["a", "b", "c"], accuracy, 3.0, path, delta=1e-5))
    assert_png(path)
    assert np.isnan(result["pearson_log_loss"])
    assert [group["eps_median"].estimate for group in result["loss_groups"]] == [2.0] * 6
    assert np.isnan(result["pearson_class"])
    assert result["class_accuracy"] == accuracy
    assert result["class_mean_eps"]["a"] == 2.0
    assert np.isnan(result["class_mean_eps"]["c"])


# plot_estimate_accuracy

def test_estimate_accuracy_numbers_and_file(tmp_path, rng, panels):
    truth = rng.uniform(1, 7.8, 200)
    estimate = truth + rng.normal(0, 0.1, 200)
    result = draw_checked(tmp_path, lambda path: plots.plot_estimate_accuracy(estimate, truth, path, 7.8, delta=1e-5))
    assert result["pearson"] == pytest.approx(np.corrcoef(truth, estimate)[0, 1])
    assert result["mean_abs_error"] == pytest.approx(np.mean(np.abs(estimate - truth)))
    assert result["max_abs_error"] == pytest.approx(np.max(np.abs(estimate - truth)))
    assert_baseline_in_legend(panels[0][0])


def test_estimate_accuracy_says_how_far_the_estimate_is_from_the_bound(tmp_path, panels):
    bound = np.array([2.0, 4.0, 5.0, 8.0, 1.0])
    estimate = np.array([2.1, 3.0, 5.0, 8.0, 0.9])
    result = draw_checked(tmp_path, lambda path: plots.plot_estimate_accuracy(estimate, bound, path, 9.0, delta=1e-5))
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
        lambda: plots.plot_estimate_accuracy(np.array([1.0, 2.0, 3.0]), np.full(3, 2.0), path, 4.0, delta=1e-5))
    assert_png(path)
    assert np.isnan(result["pearson"])
    assert result["mean_abs_error"] == pytest.approx(2 / 3)
    assert result["max_abs_error"] == 1.0


# audit_plots.plot_audit_gap

def test_audit_gap_numbers_and_file(tmp_path):
    lower = np.array([3.0, 0.0, 20.0, 0.5, 2.0])
    upper = np.array([13.0, 4.0, 13.0, 4.0, 13.0])
    correct = np.array([False, True, True, True, False])
    result = draw_checked(tmp_path, lambda path: audit_plots.plot_audit_gap(lower, upper, correct, 1.2, 16.0, path,
                                                                             delta=1e-5))
    assert result == {"count": 5, "above_sum_rule": 3, "above_baseline": 1, "median_lower": 2.0, "max_lower": 20.0}


def test_audit_gap_without_points_and_bad_input(tmp_path):
    path = tmp_path / "gap.png"
    result = draw_without_warnings(
        lambda: audit_plots.plot_audit_gap(np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool), 1.2, 16.0, path,
                                           delta=1e-5))
    assert_png(path)
    assert result["count"] == 0 and np.isnan(result["median_lower"]) and np.isnan(result["max_lower"])
    with pytest.raises(ValueError, match="boolean"):
        audit_plots.plot_audit_gap(np.ones(2), np.ones(2), np.ones(2), 1.2, 16.0, path, delta=1e-5)
    with pytest.raises(ValueError, match="same length"):
        audit_plots.plot_audit_gap(np.ones(2), np.ones(3), np.ones(2, dtype=bool), 1.2, 16.0, path, delta=1e-5)


# one_run_plots.plot_one_run_audit

def test_one_run_audit_numbers_and_file(tmp_path):
    norms = np.array([0.1, 0.3, 1.0])
    lower, rdp, pld = np.array([0.0, 0.5, 9.0]), np.array([0.3, 1.0, 10.0]), np.array([0.25, 0.9, 8.5])
    summed, ideal, cap = np.array([0.0, 0.2, 3.0]), np.array([0.0, 0.4, 3.0]), np.array([4.7, 4.8, 4.75])
    free = np.array([0.0, 0.1, 1.5])
    result = draw_checked(tmp_path, lambda path: one_run_plots.plot_one_run_audit(
        norms, lower, summed, ideal, rdp, pld, cap, path, assumption_free=free, delta=1e-5))
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
                                         np.ones(3), path, assumption_free=np.ones(3), delta=1e-5)
    with pytest.raises(ValueError, match="fdp_cap"):
        one_run_plots.plot_one_run_audit(np.ones(2), np.ones(2), np.ones(2), np.ones(2), np.ones(2), np.ones(2),
                                         np.array([1.0, np.nan]), path, assumption_free=np.ones(2), delta=1e-5)
    with pytest.raises(ValueError, match="assumption_free"):
        one_run_plots.plot_one_run_audit(np.ones(2), np.ones(2), np.ones(2), np.ones(2), np.ones(2), np.ones(2),
                                         np.ones(2), path, assumption_free=np.array([1.0, np.nan]), delta=1e-5)
    assert not path.exists()


# audit_plots.plot_audit_bounds

def test_audit_bounds_names_the_groups_as_the_report_does(tmp_path, panels):
    upper = np.array([0.001, 0.002, 0.01, 0.2, 0.3, 3.0, 3.0])
    lower = np.array([0.0, 0.0, 0.0, 0.01, 0.02, 0.3, 0.1])
    correct = np.array([True, True, True, True, True, False, False])
    result = draw_checked(tmp_path, lambda path: audit_plots.plot_audit_bounds(lower, upper, correct, path, delta=1e-5,
                                                                                upper_kind="exact"))
    # The same split as audit_summary's: correct points below / at or above their median eps_upper (0.01).
    assert result["groups"] == {"easy": 2, "hard": 3, "misclassified": 2}
    rows = pd.DataFrame({"step": 5, "rule": "sum", "upper_kind": "exact", "trials": 100, "delta": 1e-5, "violated": 0,
                         "correct": correct.astype(int), "eps_lower": lower, "eps_upper": upper, "ratio": lower / upper})
    summary = audit_simulation.audit_summary(rows)[5]["groups"]
    assert {name: summary[name]["points"] for name in result["groups"]} == result["groups"]
    assert summary["easy"]["median_upper"] == pytest.approx(0.0015)
    legend = panels[0][0]["legend"]
    assert [text.split(":")[0] for text in legend[:3]] == [
        "easy (correct, eps_upper below the correct points' median)", "hard (correct, eps_upper at or above that median)",
        "misclassified"]
    assert not any(text.startswith("correct") for text in legend)


def test_audit_figures_carry_their_note_below_everything(tmp_path, panels):
    note = "Why most points are misclassified: " + "the model is at chance. " * 8
    audit_plots.plot_audit_gap(np.array([1.0, 2.0]), np.array([13.0, 13.0]), np.array([False, True]), 1.2, 16.0,
                               tmp_path / "gap.png", delta=1e-5, note=note)
    audit_plots.plot_audit_bounds(np.array([1.0, 2.0]), np.array([13.0, 13.0]), np.array([False, True]),
                                  tmp_path / "bounds.png", delta=1e-5, note=note)
    for figure in panels:
        fig = figure[0]["axes"].get_figure(root=True)
        (written,) = [text.get_text() for sub in fig.subfigs for text in sub.texts]
        assert " ".join(written.split()) == " ".join(note.split())


# audit_plots.plot_class_attack

def test_class_attack_states_both_models_accuracy(tmp_path, panels):
    eps = np.array([6.0, 7.0, 8.0])
    attack = {"DP": np.array([0.52, 0.5, 0.49]), "non-private": np.array([0.53, 0.5, 0.48])}
    spread = {model: np.full(3, 0.01) for model in attack}
    tests = {"DP": np.array([0.95, 0.9, 0.85]), "non-private": np.array([0.97, 0.93, 0.9])}
    descriptions = {"DP": "lr 2, test accuracy 0.900", "non-private": "lr 0.4, test accuracy 0.933"}
    pearsons = draw_checked(tmp_path, lambda path: audit_plots.plot_class_attack(
        ["a", "b", "c"], eps, attack, spread, tests, path, delta=1e-5, descriptions=descriptions))
    assert pearsons["DP"]["test"] == pytest.approx(np.corrcoef(eps, tests["DP"])[0, 1])
    for panel in panels[0]:
        assert any("DP, lr 2, test accuracy 0.900" in text for text in panel["legend"])
        assert any("non-private, lr 0.4, test accuracy 0.933" in text for text in panel["legend"])


# every figure: δ on every ε axis, nothing clipped or covered

def draw_every_figure(tmp_path, rng):
    """Each drawing function once, on inputs like a run's."""
    eps = rng.gamma(2.0, 0.3, 300)
    correct = rng.random(300) < 0.8
    plots.plot_per_step_histogram(eps, 3.0, tmp_path / "1.png", delta=1e-5)
    plots.plot_correct_vs_misclassified(eps, correct, 3.0, tmp_path / "2.png", "per-step ε", delta=1e-5)
    per_step, composed = mean_rule_inputs(rng)
    sampling_rate_plots.plot_sampling_rate_designs({"(a) fixed": (per_step, composed), "(b) matched": (per_step, composed)},
                                                   8, 1e-5, rate_paths(tmp_path / "3"))
    steps = np.arange(0, 101)
    plots.plot_composed_over_training({"easy (point 1)": (steps, 0.02 * steps)}, (steps, 0.08 * steps),
                                      tmp_path / "4.png", 1e-5, checkpoint_steps=(0, 50),
                                      estimates={"easy (point 1)": (steps, 0.018 * steps)})
    individual_eps, loss, labels, accuracy = individual_inputs(rng)
    individual_plots.plot_individual_accounting(individual_eps, loss, labels, CLASS_NAMES, accuracy, 7.8,
                                                tmp_path / "5.png", delta=1e-5,
                                                by_accountant={"RDP": (individual_eps, 7.8)})
    plots.plot_estimate_accuracy(eps * 1.01, eps, tmp_path / "6.png", 3.0, delta=1e-5)
    audit_plots.plot_audit_bounds(eps[:20] / 10, eps[:20], correct[:20], tmp_path / "7.png", delta=1e-5)
    audit_plots.plot_class_attack(["a", "b", "c"], np.array([6.0, 7.0, 8.0]), {"DP": np.array([0.5, 0.52, 0.49])},
                                  {"DP": np.full(3, 0.01)}, {"DP": np.array([0.9, 0.8, 0.7])}, tmp_path / "8.png",
                                  delta=1e-5, descriptions={"DP": "lr 2, test accuracy 0.800"})
    audit_plots.plot_audit_gap(eps[:20] / 10, eps[:20], correct[:20], 1.2, 16.0, tmp_path / "9.png", delta=1e-5,
                               note="A note. " * 30)
    one_run_plots.plot_one_run_audit(np.array([0.1, 1.0]), np.array([0.0, 2.0]), np.array([0.0, 1.0]),
                                     np.array([0.0, 2.5]), np.array([0.3, 10.0]), np.array([0.25, 8.5]),
                                     np.array([9.0, 10.0]), tmp_path / "10.png",
                                     assumption_free=np.array([0.0, 1.2]), delta=1e-5)


def test_every_eps_axis_states_its_delta(tmp_path, rng, panels):
    draw_every_figure(tmp_path, rng)
    assert len(panels) == 12  # every figure was recorded (figure 3 is three), its layout checked by the fixture
    labels = [label for figure in panels for panel in figure for label in (panel["xlabel"], panel["ylabel"])]
    eps_labels = [label for label in labels if "ε" in label or "eps_" in label]
    assert len(eps_labels) >= 15
    assert [label for label in eps_labels if "δ" not in label] == []


def test_layout_check_sees_a_clipped_title_and_a_covering_legend():
    fig, (left, right) = plt.subplots(1, 2, figsize=(4, 3))
    left.plot([0, 1], [0, 1], label="a series")
    left.legend(loc="upper left", bbox_to_anchor=(0.5, 1.0))  # reaches into the right panel
    right.set_title("a title far too long for its panel, let alone for this small figure")
    problems = layout_problems(fig)
    plt.close(fig)
    assert any(problem.startswith("clipped: 'a title far too long") for problem in problems)
    assert any("covers the axes titled 'a title far" in problem for problem in problems)


def test_every_figure_has_a_title_and_a_caption():
    assert sorted(CAPTIONS) == sorted(FIGURES)
    for figure, (title, caption) in CAPTIONS.items():
        assert title and not title.endswith("."), figure
        assert len(caption.split()) >= 20 and caption.endswith("."), figure

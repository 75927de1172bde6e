"""Figures for the per-instance accounting results of GLA (Thudi et al., "Gradients Look Alike:
Sensitivity is Often Overestimated in DP-SGD", USENIX Security 2024) and Yu et al. ("Individual
Privacy Accounting for Differentially Private Stochastic Gradient Descent", TMLR 2023).

Pure plotting: every function takes arrays the caller already computed, draws one
figure, writes it atomically as a PNG and returns the numbers it displayed, so a
report can quote exactly what the figure shows. Nothing here reads files or computes
privacy guarantees. Every privacy plot carries the data-independent DP-SGD baseline.
"""

import matplotlib.pyplot as plt
import numpy as np
from numpy.typing import ArrayLike

from perinstance.accounting import intervals
from perinstance.files.fileio import atomic_path

DPI = 120
SINGLE_PANEL = (6.4, 4.4)
# A single panel with its legend below it (_legend_below).
SINGLE_PANEL_LEGEND_BELOW = (6.8, 5.6)
WIDE_PANEL = (11.5, 4.8)
TWO_PANELS = (12.0, 4.6)
BASELINE_LABEL = "worst-case baseline (DP-SGD)"
# Δ* is computed in float32: the norm of a clipped gradient can come out one float32 ulp (6e-8) below Γ, which puts its
# per-step ε about 1e-7 (relative) below the worst case. Within this relative tolerance a point is at the worst case.
WORST_CASE_RTOL = 1e-6
HISTOGRAM_BINS = 40
BASELINE_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.5, "label": BASELINE_LABEL}
# No "Software" entry: matplotlib would write its version there, so bytes would
# differ between installations; the PNG writer adds no timestamp of its own.
PNG_METADATA = {"Software": None}


def _as_1d(name, values):
    """A finite float vector, or a ValueError naming the argument (clearer than matplotlib's)."""
    array = np.asarray(values, dtype=float)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} contains non-finite values")
    return array


def _same_length(**arrays):
    lengths = {name: len(array) for name, array in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"arrays must have the same length, got {lengths}")


def _median(values):
    """Median, nan for an empty array (numpy would warn)."""
    return float(np.median(values)) if len(values) else float("nan")


def _pearson(x, y):
    """Pearson r; nan when it is undefined (fewer than two points or a constant input)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _ratio(numerator, denominator):
    """numerator / denominator with IEEE semantics (inf, nan) instead of a warning."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(numerator) / np.float64(denominator))


def _fmt(value):
    return f"{value:.3g}"


def interval_text(interval: intervals.Interval, digits: int = 3) -> str:
    """'0.123 [0.101, 0.14]': an estimate with its 95% interval (accounting.md §10), `digits` significant."""
    return f"{interval.estimate:.{digits}g} [{interval.low:.{digits}g}, {interval.high:.{digits}g}]"


def _median_interval(values):
    """§10: the median and its 95% bootstrap interval over the points; None without points."""
    return intervals.median_interval(values) if len(values) else None


def _pearson_interval(x, y):
    """§10: Pearson r over paired points with its 95% bootstrap interval; None where r is undefined."""
    if np.isnan(_pearson(x, y)):
        return None
    return intervals.pearson_interval(np.asarray(x, dtype=float), np.asarray(y, dtype=float))


def _draw_interval_band(ax, interval, color):
    """The 95% interval of a median drawn as a shaded band across a value axis."""
    if interval is not None and np.isfinite(interval.low) and np.isfinite(interval.high):
        ax.axvspan(interval.low, interval.high, color=color, alpha=0.2, linewidth=0)


def _fmt_r(pearson, interval=None):
    """r, with its 95% interval where it has one."""
    if np.isnan(pearson) or interval is None:
        return "undefined" if np.isnan(pearson) else f"{pearson:.3f}"
    return f"{pearson:.3f} [{interval.low:.3f}, {interval.high:.3f}]"


def _save(fig, path):
    """Write the figure atomically with reproducible bytes, then free it."""
    try:
        with atomic_path(path) as temp_path:
            fig.savefig(temp_path, format="png", dpi=DPI, metadata=PNG_METADATA)
    finally:
        plt.close(fig)


def eps_label(what: str, delta: float | None) -> str:
    """An ε axis label: what the values are, and the δ they hold at (None: a δ their source does not record)."""
    return f"{what} at δ = {delta:g}" if delta is not None else f"{what} (δ not recorded)"


def at_worst_case(values: ArrayLike, worst: float) -> np.ndarray:
    """Which values are at the worst case `worst`: at or above it within WORST_CASE_RTOL (relative)."""
    return np.asarray(values, dtype=float) >= float(worst) * (1 - WORST_CASE_RTOL)


def _legend_below(figure, axes, ncols=1, fontsize="small", frameon=None):
    """One legend under the panels of `figure` (a figure or a subfigure, constrained layout), of every labelled
    artist of `axes` (each label once): outside the axes, so that it covers no data and no neighbouring panel;
    `frameon` False draws it without a frame (None: matplotlib's default)."""
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    figure.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=fontsize, frameon=frameon)


def _side_by_side(fig, count):
    """`count` panels side by side in `fig` (constrained layout), each an axes in a subfigure of its own, so that
    each can have its own legend under it (_legend_under_each)."""
    return [subfigure.subplots() for subfigure in fig.subfigures(1, count)]


def _legend_under_each(axes):
    """Under each panel of _side_by_side, the legend of that panel's labelled artists alone."""
    for ax in axes:
        _legend_below(ax.figure, [ax])


def _draw_ecdf(ax, values, **style):
    """Empirical CDF as a step line; returns the line (None for no values)."""
    if len(values) == 0:
        return None
    # Start at height 0 so the first jump is drawn too (it is all of it for constant values).
    ordered = np.sort(values)
    positions = np.concatenate([ordered[:1], ordered])
    heights = np.arange(len(ordered) + 1) / len(ordered)
    (line,) = ax.step(positions, heights, where="post", **style)
    return line


def _use_log_scale(ax, axis, values):
    """Log scale, or symlog when zeros (or negatives) are present so they stay visible.

    The linear part of symlog reaches up to the smallest positive value, so every
    positive value is still on the logarithmic part.
    """
    values = np.asarray(values, dtype=float)
    positive = values[values > 0]
    set_scale = ax.set_xscale if axis == "x" else ax.set_yscale
    if len(positive) == len(values) and len(values):
        set_scale("log")
    else:
        set_scale("symlog", linthresh=float(positive.min()) if len(positive) else 1.0)


def _log_bins(values, count):
    """`count` bins evenly spaced on a log axis over the positive values, and one from 0 where there are zeros."""
    positive = values[values > 0]
    low, high = (positive.min(), positive.max()) if len(positive) else (1.0, 1.0)
    if high <= low:
        low, high = low / 1.5, high * 1.5
    edges = np.geomspace(low, high, count + 1)
    return np.concatenate([[0.0], edges]) if np.any(values <= 0) else edges


def plot_per_step_histogram(eps: ArrayLike, baseline_eps: float, path: str, *, delta: float,
                            title: str = "Per-instance per-step privacy",
                            xlabel: str = "per-instance per-step ε") -> dict:
    """Histogram of one per-step guarantee per point on a log ε axis, with the median, the baseline, and the points
    at the worst case (at_worst_case) stacked in their own colour and their share written next to them. `delta`: the
    δ of the guarantees, on the axis label."""
    eps = _as_1d("eps", eps)
    baseline_eps = float(baseline_eps)
    median = _median(eps)
    median_interval = _median_interval(eps)
    share_2x_below = float(np.mean(eps <= baseline_eps / 2)) if len(eps) else float("nan")
    worst = at_worst_case(eps, baseline_eps)
    share_at_worst = float(np.mean(worst)) if len(eps) else float("nan")

    fig, ax = plt.subplots(figsize=SINGLE_PANEL_LEGEND_BELOW, layout="constrained")
    bins = _log_bins(np.concatenate([eps, [baseline_eps]]), HISTOGRAM_BINS)
    counts, _, _ = ax.hist([eps[~worst], eps[worst]], bins=bins, stacked=True, color=["tab:blue", "tab:red"],
                           alpha=0.8, label=[f"{int((~worst).sum())} points below the worst case",
                                             f"{int(worst.sum())} points at the worst case"])
    _use_log_scale(ax, "x", bins)
    median_label = f"median = {_fmt(median)}" if median_interval is None else \
        f"median = {interval_text(median_interval)} (95%)"
    if len(eps):
        ax.axvline(median, color="tab:orange", linewidth=2, label=median_label)
        _draw_interval_band(ax, median_interval, "tab:orange")
    ax.axvline(baseline_eps, **{**BASELINE_STYLE, "label": f"{BASELINE_LABEL}: {_fmt(baseline_eps)}"})
    tallest = float(np.max(counts[-1])) if len(eps) else 1.0
    ax.set_ylim(0, max(tallest, 1.0) * 1.3)  # room for the note on the worst case above the bars
    if worst.any():
        at_height = float(counts[-1][np.searchsorted(bins, baseline_eps * (1 - WORST_CASE_RTOL), side="right") - 1])
        ax.annotate(f"{share_at_worst:.1%} of points\nat the worst case", xy=(baseline_eps, at_height),
                    xytext=(-12, 18), textcoords="offset points", ha="right", va="bottom", color="tab:red",
                    arrowprops={"arrowstyle": "->", "color": "tab:red"})
    ax.set_xlabel(eps_label(xlabel, delta) + " (log scale)")
    ax.set_ylabel("number of points")
    ax.set_title(f"{title}\n{share_2x_below:.0%} of points at ≤ half the baseline, {share_at_worst:.1%} at it")
    _legend_below(fig, [ax])
    _save(fig, path)
    return {"median": median, "median_interval": median_interval, "baseline": baseline_eps,
            "share_2x_below": share_2x_below, "share_at_worst": share_at_worst}


def plot_correct_vs_misclassified(values: ArrayLike, correct: ArrayLike, baseline: float, path: str, value_label: str,
                                  *, delta: float) -> dict:
    """Empirical CDFs of a per-point guarantee for correctly and wrongly classified points, on a log axis. `delta`:
    the δ of the guarantees, on the axis label."""
    values = _as_1d("values", values)
    correct = np.asarray(correct)
    if correct.dtype != bool:
        raise ValueError(f"correct must be a boolean array, got dtype {correct.dtype}")
    _same_length(values=values, correct=correct)
    groups = {"correct": values[correct], "misclassified": values[~correct]}
    colors = {"correct": "tab:green", "misclassified": "tab:red"}
    medians = {name: _median(group) for name, group in groups.items()}
    median_intervals = {name: _median_interval(group) for name, group in groups.items()}
    ratio_interval = (intervals.median_ratio_interval(groups["misclassified"], groups["correct"])
                      if all(len(group) for group in groups.values()) else None)

    fig, ax = plt.subplots(figsize=SINGLE_PANEL_LEGEND_BELOW, layout="constrained")
    missing = [name for name, group in groups.items() if len(group) == 0]
    for name, group in groups.items():
        if len(group) == 0:
            # An invisible handle keeps the absence explicit in the legend.
            ax.plot([], [], color=colors[name], label=f"no {name} points")
            continue
        _draw_ecdf(ax, group, color=colors[name], linewidth=2, label=f"{name} (n = {len(group)})")
        ax.axvline(medians[name], color=colors[name], linestyle=":", linewidth=1.5,
                   label=f"median {name} = {interval_text(median_intervals[name])} (95%)")
        _draw_interval_band(ax, median_intervals[name], colors[name])
    ax.axvline(float(baseline), **BASELINE_STYLE)
    _use_log_scale(ax, "x", np.concatenate([values, [float(baseline)]]))
    ax.set_xlabel(eps_label(value_label, delta) + " (log scale)")
    ax.set_ylabel("fraction of points ≤ value")
    ax.set_ylim(0, 1.02)
    title = f"{value_label}:\ncorrect vs misclassified points"
    if ratio_interval is not None:
        title += f"\nmedian ratio misclassified / correct = {interval_text(ratio_interval)} (95%)"
    if missing:
        title += "\n(" + ", ".join(f"no {name} points" for name in missing) + ")"
    ax.set_title(title)
    _legend_below(fig, [ax])
    _save(fig, path)
    return {
        "median_correct": medians["correct"],
        "median_misclassified": medians["misclassified"],
        "count_correct": len(groups["correct"]),
        "count_misclassified": len(groups["misclassified"]),
        "ratio": _ratio(medians["misclassified"], medians["correct"]),
        "ratio_interval": ratio_interval,
    }


def plot_composed_over_training(curves: dict, baseline_curve: ArrayLike, path: str, delta: float,
                                checkpoint_steps: tuple = (), estimates: dict | None = None) -> dict:
    """Yu et al.: composed per-instance ε of a few points as training proceeds, from step 0, with the
    checkpoints marked on the step axis. `estimates`: the same points' composition that holds Δ* between those
    checkpoints (accounting.md §4), drawn dashed next to `curves`, then their bound from Δ* at every step."""
    baseline_steps, baseline_eps = (_as_1d(f"baseline_curve[{index}]", array)
                                    for index, array in enumerate(baseline_curve))
    _same_length(baseline_steps=baseline_steps, baseline_eps=baseline_eps)
    final = {}

    estimated = {}
    # The legend goes right of the axes, where it covers no curve.
    fig, ax = plt.subplots(figsize=WIDE_PANEL, layout="constrained")
    for label, (steps, eps) in curves.items():
        steps, eps = _as_1d(f"steps of {label!r}", steps), _as_1d(f"ε of {label!r}", eps)
        _same_length(steps=steps, eps=eps)
        final[label] = float(eps[-1]) if len(eps) else float("nan")
        kind = "" if estimates is None else ", bound (Δ* at every step)"
        (line,) = ax.plot(steps, eps, linewidth=2, label=f"{label}{kind}: final ε = {_fmt(final[label])}")
        if estimates is not None and label in estimates:
            held_steps, held = (_as_1d(f"estimate of {label!r}", array) for array in estimates[label])
            estimated[label] = float(held[-1]) if len(held) else float("nan")
            ax.plot(held_steps, held, linewidth=1.5, linestyle="--", color=line.get_color(),
                    label=f"{label}, held-Δ* estimate: final ε = {_fmt(estimated[label])}")
    baseline_final = float(baseline_eps[-1]) if len(baseline_eps) else float("nan")
    style = {**BASELINE_STYLE, "label": f"{BASELINE_LABEL}: final ε = {_fmt(baseline_final)}"}
    ax.plot(baseline_steps, baseline_eps, **style)
    checkpoint_steps = _as_1d("checkpoint_steps", checkpoint_steps)
    if len(checkpoint_steps):
        ax.plot(checkpoint_steps, np.zeros(len(checkpoint_steps)), "|", color="0.3", markersize=10,
                clip_on=False, label="checkpoints")
        # A figure-level label: the constrained layout makes room for it below the axis label.
        fig.supxlabel("Step t is charged at Δ* of the latest checkpoint ≤ t − 1\n(piecewise constant between "
                      "checkpoints; accounting.md §4)." if estimates is None else
                      "Solid: Δ* at every step, a bound along the observed run. Dashed: step t charged at Δ* of the "
                      "latest\ncheckpoint ≤ t − 1, held between the checkpoints marked: a held-Δ* estimate "
                      "(accounting.md §4).", fontsize="small", color="0.3")
    ax.set_xlabel("training step")
    ax.set_ylabel(eps_label("composed ε", delta))
    ax.set_title("Per-instance privacy over training")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)
    return {"final": final, "estimate_final": estimated, "baseline_final": baseline_final}


def plot_estimate_accuracy(eps_from_checkpoints: ArrayLike, eps_from_every_step: ArrayLike, path: str,
                           baseline_eps: float, *, delta: float) -> dict:
    """Yu et al., Fig. 4: ε from Δ* held between checkpoints (a held-Δ* estimate) against ε from Δ* at every step (the
    bound, accounting.md §4), with how far the estimate is from the bound: the relative error (estimate − bound) /
    bound (over the points with a positive bound), its median and its largest size, and the share of points whose
    estimate is below their bound, each with its 95% interval (§10); points below the bound drawn in red. `delta`:
    the δ of both compositions, on the axis labels."""
    estimate = _as_1d("eps_from_checkpoints", eps_from_checkpoints)
    truth = _as_1d("eps_from_every_step", eps_from_every_step)
    _same_length(eps_from_checkpoints=estimate, eps_from_every_step=truth)
    baseline_eps = float(baseline_eps)
    pearson = _pearson(truth, estimate)
    pearson_interval = _pearson_interval(truth, estimate)
    errors = np.abs(estimate - truth)
    below = estimate < truth
    positive = truth > 0
    relative = (estimate[positive] - truth[positive]) / truth[positive]
    largest = int(np.argmax(np.abs(relative))) if len(relative) else None
    found = {"pearson": pearson, "pearson_interval": pearson_interval,
             "mean_abs_error": float(errors.mean()) if len(errors) else float("nan"),
             "max_abs_error": float(errors.max()) if len(errors) else float("nan"),
             "relative_median": _median_interval(relative),
             "relative_largest": intervals.maximum_interval(np.abs(relative)) if len(relative) else None,
             "relative_largest_signed": float(relative[largest]) if largest is not None else float("nan"),
             "shortfall_largest": intervals.maximum_interval(-relative[relative < 0]) if np.any(relative < 0) else None,
             "share_below": intervals.share_interval(below) if len(below) else None,
             "count_below": int(below.sum())}

    fig, ax = plt.subplots(figsize=(SINGLE_PANEL_LEGEND_BELOW[0], SINGLE_PANEL_LEGEND_BELOW[1] + 0.4),
                           layout="constrained")
    ax.scatter(truth[~below], estimate[~below], s=8, alpha=0.5, color="tab:blue",
               label=f"{int((~below).sum())} points: held-Δ* estimate at or above the bound")
    ax.scatter(truth[below], estimate[below], s=8, alpha=0.7, color="tab:red",
               label=f"{int(below.sum())} points: held-Δ* estimate BELOW the bound")
    plotted = np.concatenate([[0.0, baseline_eps], truth, estimate])
    span = np.array([plotted.min(), plotted.max()])
    ax.plot(span, span, color="tab:gray", linewidth=1, label="y = x")
    ax.axhline(baseline_eps, **BASELINE_STYLE)
    ax.axvline(baseline_eps, color=BASELINE_STYLE["color"], linestyle="--", linewidth=1.5)
    ax.set_xlabel(eps_label("composed ε from Δ* at every step\n(the bound along the run)", delta))
    ax.set_ylabel(eps_label("composed ε from Δ* at checkpoints,\nheld between them (held-Δ* estimate)", delta))
    median, share = found["relative_median"], found["share_below"]
    lines = [f"Held-Δ* estimate vs the bound: Pearson r = {_fmt_r(pearson, pearson_interval)}"]
    if median is not None:
        lines.append(f"relative error: median {median.estimate:+.2%}, largest {found['relative_largest_signed']:+.2%}")
    if share is not None:
        lines.append(f"below the bound: {share.estimate:.1%} of points"
                     + ("" if found["shortfall_largest"] is None else
                        f", by up to {found['shortfall_largest'].estimate:.2%}"))
    ax.set_title("\n".join(lines), fontsize="medium")
    _legend_below(fig, [ax], ncols=2)
    _save(fig, path)
    return found

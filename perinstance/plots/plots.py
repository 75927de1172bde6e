"""Figures for the per-instance accounting results of GLA (Thudi et al., "Gradients Look Alike:
Sensitivity is Often Overestimated in DP-SGD", USENIX Security 2024) and Yu et al. ("Individual
Privacy Accounting for Differentially Private Stochastic Gradient Descent", TMLR 2023).

Pure plotting: every function takes arrays the caller already computed, draws one
figure, writes it atomically as a PNG and returns the numbers it displayed, so a
report can quote exactly what the figure shows. Nothing here reads files or computes
privacy guarantees. Every privacy plot carries the data-independent DP-SGD baseline.
"""

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
from numpy.typing import ArrayLike

from perinstance.accounting import intervals
from perinstance.files.fileio import atomic_path

DPI = 120
SINGLE_PANEL = (6.4, 4.4)
WIDE_PANEL = (11.5, 4.8)
TWO_PANELS = (12.0, 4.6)
BASELINE_LABEL = "worst-case baseline (DP-SGD)"
BASELINE_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.5, "label": BASELINE_LABEL}
# No "Software" entry: matplotlib would write its version there, so bytes would
# differ between installations; the PNG writer adds no timestamp of its own.
PNG_METADATA = {"Software": None}
LOSS_FLOOR = 1e-8


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


def plot_per_step_histogram(eps: ArrayLike, baseline_eps: float, path: str, title: str = "Per-instance per-step privacy",
                            xlabel: str = "per-instance per-step ε") -> dict:
    """Histogram of one per-step guarantee per point, with the median and the baseline."""
    eps = _as_1d("eps", eps)
    baseline_eps = float(baseline_eps)
    median = _median(eps)
    median_interval = _median_interval(eps)
    share_2x_below = float(np.mean(eps <= baseline_eps / 2)) if len(eps) else float("nan")

    fig, ax = plt.subplots(figsize=SINGLE_PANEL, layout="constrained")
    ax.hist(eps, bins=40, color="tab:blue", alpha=0.75, label=f"{len(eps)} points")
    median_label = f"median = {_fmt(median)}" if median_interval is None else \
        f"median = {interval_text(median_interval)} (95%)"
    ax.axvline(median, color="tab:orange", linewidth=2, label=median_label)
    _draw_interval_band(ax, median_interval, "tab:orange")
    ax.axvline(baseline_eps, **BASELINE_STYLE)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("number of points")
    ax.set_title(f"{title}\n{share_2x_below:.0%} of points at ≤ half the baseline")
    ax.legend()
    _save(fig, path)
    return {"median": median, "median_interval": median_interval, "baseline": baseline_eps,
            "share_2x_below": share_2x_below}


def plot_correct_vs_misclassified(values: ArrayLike, correct: ArrayLike, baseline: float, path: str, value_label: str) -> dict:
    """Empirical CDFs of a per-point guarantee for correctly and wrongly classified points."""
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

    fig, ax = plt.subplots(figsize=SINGLE_PANEL, layout="constrained")
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
    ax.set_xlabel(value_label)
    ax.set_ylabel("fraction of points ≤ value")
    ax.set_ylim(0, 1.02)
    title = f"{value_label}: correct vs misclassified points"
    if ratio_interval is not None:
        title += f"\nmedian ratio misclassified / correct = {interval_text(ratio_interval)} (95%)"
    if missing:
        title += "\n(" + ", ".join(f"no {name} points" for name in missing) + ")"
    ax.set_title(title)
    ax.legend(loc="lower right")
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
    # Beside the estimates, two lines per point: the legend goes right of the axes.
    fig, ax = plt.subplots(figsize=SINGLE_PANEL if estimates is None else WIDE_PANEL, layout="constrained")
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
                      "latest\ncheckpoint ≤ t − 1, held between the checkpoints marked: a held-Δ* estimate (accounting.md "
                      "§4).", fontsize="small", color="0.3")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"composed ε at δ = {delta:g}")
    ax.set_title("Per-instance privacy over training")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if estimates is None:
        ax.legend()
    else:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)
    return {"final": final, "estimate_final": estimated, "baseline_final": baseline_final}


def _class_accuracies(class_names, class_test_accuracy):
    """Accuracy per class name, from a mapping by name or a sequence aligned with class_names."""
    if isinstance(class_test_accuracy, Mapping):
        return {name: float(class_test_accuracy[name]) for name in class_names}
    accuracies = _as_1d("class_test_accuracy", class_test_accuracy)
    if len(accuracies) != len(class_names):
        raise ValueError(f"class_test_accuracy has {len(accuracies)} values for {len(class_names)} classes")
    return dict(zip(class_names, accuracies.tolist(), strict=True))


def _draw_loss_panel(ax, eps, log_loss, baseline_eps, eps_label):
    """Left panel of plot_individual_accounting: ε vs final loss with the fit ε ≈ a + b·log(loss)."""
    pearson = _pearson(eps, log_loss)
    pearson_interval = _pearson_interval(eps, log_loss)
    can_fit = len(np.unique(log_loss)) >= 2  # a line through one x value is undefined
    ax.set_xscale("log")
    if not can_fit and len(log_loss):
        # Autoscaling a log axis around a single value warns; fix a decade each side first.
        ax.set_xlim(np.exp(log_loss[0]) / 10, np.exp(log_loss[0]) * 10)
    ax.scatter(np.exp(log_loss), eps, s=10, alpha=0.5, color="tab:blue", label=f"{len(eps)} training points")
    intercept = slope = float("nan")
    if can_fit:
        slope, intercept = (float(c) for c in np.polyfit(log_loss, eps, 1))
        grid = np.linspace(log_loss.min(), log_loss.max(), 200)
        ax.plot(np.exp(grid), intercept + slope * grid, color="tab:red", linewidth=2,
                label=f"ε ≈ {intercept:.3g} {'−' if slope < 0 else '+'} {abs(slope):.3g}·ln(loss), "
                      f"Pearson r = {_fmt_r(pearson, pearson_interval)}")
    else:
        ax.plot([], [], color="tab:red", label="no fit: fewer than two distinct loss values")
    ax.axhline(baseline_eps, **BASELINE_STYLE)
    ax.set_xlabel(f"final training loss (log scale, clipped at {LOSS_FLOOR:g})")
    ax.set_ylabel(eps_label)
    ax.set_title("Privacy vs final training loss")
    ax.legend(loc="lower right", fontsize="small")
    return pearson, pearson_interval, intercept, slope


def _draw_class_panel(ax, class_mean_eps, class_accuracy, baseline_eps):
    """Right panel of plot_individual_accounting: per-class mean ε against test accuracy."""
    names = [name for name, mean in class_mean_eps.items() if np.isfinite(mean)]
    accuracies = [class_accuracy[name] for name in names]
    means = [class_mean_eps[name] for name in names]
    pearson = _pearson(accuracies, means) if len(names) >= 3 else float("nan")
    pearson_interval = _pearson_interval(accuracies, means) if len(names) >= 3 else None
    ax.scatter(accuracies, means, s=40, color="tab:purple", zorder=3,
               label=f"class mean ε, {len(names)} classes (Pearson r = {_fmt_r(pearson, pearson_interval)})")
    for name, accuracy, mean in zip(names, accuracies, means, strict=True):
        ax.annotate(str(name), (accuracy, mean), textcoords="offset points", xytext=(5, 4), fontsize="small")
    ax.axhline(baseline_eps, **BASELINE_STYLE)
    ax.margins(x=0.15)  # room for the class names written right of the points
    ax.set_xlabel("class test accuracy")
    ax.set_ylabel("mean per-instance ε of the class")
    ax.set_title("Class privacy vs class accuracy")
    ax.legend(loc="lower left", fontsize="small")
    return pearson, pearson_interval


def plot_individual_accounting(eps: ArrayLike, final_loss: ArrayLike, labels: ArrayLike, class_names: list, class_test_accuracy: ArrayLike,
                               baseline_eps: float, path: str, by_accountant: dict | None = None,
                               eps_label: str = "per-instance composed ε") -> dict:
    """Yu et al., Fig. 2/5: composed ε against final loss, and per class against accuracy.

    labels are class indices into class_names; class_test_accuracy is either aligned
    with class_names or a mapping from class name to accuracy. by_accountant: {name: (every point's composed ε,
    the worst case by that accountant)}, e.g. RDP and PLD, drawn as a third panel (the share of points at or
    below each ε) and summarised per accountant (median, 10% and 90% quantiles, share below half the worst case);
    an entry whose name says "estimate" is drawn dashed. eps_label: the ε axis, saying what the values are.
    """
    eps = _as_1d("eps", eps)
    final_loss = _as_1d("final_loss", final_loss)
    labels = np.asarray(labels)
    _same_length(eps=eps, final_loss=final_loss, labels=labels)
    baseline_eps = float(baseline_eps)
    log_loss = np.log(np.maximum(final_loss, LOSS_FLOOR))  # a zero loss must not break the log
    class_accuracy = _class_accuracies(class_names, class_test_accuracy)
    class_mean_eps = {name: float(np.mean(eps[labels == index])) if np.any(labels == index) else float("nan")
                      for index, name in enumerate(class_names)}

    panels = 2 if by_accountant is None else 3
    fig, axes = plt.subplots(1, panels, figsize=(TWO_PANELS[0] * panels / 2, TWO_PANELS[1]), layout="constrained")
    pearson_log_loss, pearson_log_loss_interval, intercept, slope = _draw_loss_panel(axes[0], eps, log_loss,
                                                                                    baseline_eps, eps_label)
    pearson_class, pearson_class_interval = _draw_class_panel(axes[1], class_mean_eps, class_accuracy, baseline_eps)
    accountants = None if by_accountant is None else _draw_accountant_panel(axes[2], by_accountant)
    _save(fig, path)
    return {
        "pearson_log_loss": pearson_log_loss,
        "pearson_log_loss_interval": pearson_log_loss_interval,
        "fit_intercept": intercept,
        "fit_slope": slope,
        "class_mean_eps": class_mean_eps,
        "class_accuracy": class_accuracy,
        "pearson_class": pearson_class,
        "pearson_class_interval": pearson_class_interval,
        "accountants": accountants,
    }


def _draw_accountant_panel(ax, by_accountant):
    """Third panel of plot_individual_accounting: the share of points whose composed ε is at most x, per
    accountant, with each accountant's worst case; returns each one's summary."""
    summaries, drawn_worst = {}, set()
    for (name, (values, worst)), color in zip(by_accountant.items(), ("tab:blue", "tab:orange", "tab:green")):
        values = np.sort(_as_1d(f"ε by {name}", values))
        worst = float(worst)
        summaries[name] = {"median": float(np.median(values)), "median_interval": _median_interval(values),
                           "q10": float(np.quantile(values, 0.1)),
                           "q90": float(np.quantile(values, 0.9)), "worst": worst,
                           "share_below_half": float(np.mean(values <= worst / 2)), "points": len(values)}
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=color, linewidth=2,
                linestyle="--" if "estimate" in name else "-",
                label=f"{name}: median {interval_text(summaries[name]['median_interval'])} (95%)")
        if worst not in drawn_worst:  # an estimate of the same accountant shares its worst case
            drawn_worst.add(worst)
            ax.axvline(worst, color=color, linestyle=":", linewidth=1.5, label=f"{name} worst case {_fmt(worst)}")
    ax.set_xlabel("composed per-instance ε")
    ax.set_ylabel("share of points with at most this ε")
    ax.set_title("Per-instance ε by accountant")
    ax.legend(loc="upper left", fontsize="small")
    return summaries


def plot_estimate_accuracy(eps_from_checkpoints: ArrayLike, eps_from_every_step: ArrayLike, path: str, baseline_eps: float) -> dict:
    """Yu et al., Fig. 4: ε from Δ* held between checkpoints (a held-Δ* estimate) against ε from Δ* at every step (the
    bound, accounting.md §4), with how far the estimate is from the bound: the relative error (estimate − bound) /
    bound (over the points with a positive bound), its median and its largest size, and the share of points whose
    estimate is below their bound, each with its 95% interval (§10); points below the bound drawn in red."""
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

    fig, ax = plt.subplots(figsize=SINGLE_PANEL, layout="constrained")
    ax.scatter(truth[~below], estimate[~below], s=8, alpha=0.5, color="tab:blue",
               label=f"{int((~below).sum())} points: held-Δ* estimate at or above the bound")
    ax.scatter(truth[below], estimate[below], s=8, alpha=0.7, color="tab:red",
               label=f"{int(below.sum())} points: held-Δ* estimate BELOW the bound")
    plotted = np.concatenate([[0.0, baseline_eps], truth, estimate])
    span = np.array([plotted.min(), plotted.max()])
    ax.plot(span, span, color="tab:gray", linewidth=1, label="y = x")
    ax.axhline(baseline_eps, **BASELINE_STYLE)
    ax.axvline(baseline_eps, color=BASELINE_STYLE["color"], linestyle="--", linewidth=1.5)
    ax.set_xlabel("ε from Δ* at every step (the bound along the run)")
    ax.set_ylabel("ε from Δ* at checkpoints, held between them (held-Δ* estimate)")
    median, share = found["relative_median"], found["share_below"]
    ax.set_title(f"Held-Δ* estimate vs the bound: Pearson r = {_fmt_r(pearson, pearson_interval)}\n"
                 + ("" if median is None else f"relative error median {median.estimate:+.2%}, largest "
                    f"{found['relative_largest_signed']:+.2%}; ")
                 + ("" if share is None else f"below the bound: {share.estimate:.1%} of points")
                 + ("" if found["shortfall_largest"] is None else
                    f", by up to {found['shortfall_largest'].estimate:.2%}"), fontsize="medium")
    ax.legend(loc="lower right", fontsize="small")
    _save(fig, path)
    return found

"""Figure 5 of a reproduction (Yu et al., Fig. 2/5): every point's composed ε against its final loss, per class
against the class's test accuracy, and by accountant.

As perinstance/plots/plots.py: the function takes arrays already computed, draws one figure, writes it atomically
as a PNG and returns the numbers it shows.
"""

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
from numpy.typing import ArrayLike

from perinstance.plots.plots import (
    BASELINE_LABEL,
    BASELINE_STYLE,
    TWO_PANELS,
    _as_1d,
    _fmt,
    _fmt_r,
    _legend_under_each,
    _median_interval,
    _pearson,
    _pearson_interval,
    _same_length,
    _save,
    _side_by_side,
    eps_label,
    interval_text,
)

LOSS_FLOOR = 1e-8
# The points are cut into this many groups of (nearly) equal size by final loss; each group's median ε is drawn with
# its 95% interval, a summary that stays inside the data (a fitted line would leave it).
LOSS_GROUPS = 12
PANEL_HEIGHT = 6.4


def _class_accuracies(class_names, class_test_accuracy):
    """Accuracy per class name, from a mapping by name or a sequence aligned with class_names."""
    if isinstance(class_test_accuracy, Mapping):
        return {name: float(class_test_accuracy[name]) for name in class_names}
    accuracies = _as_1d("class_test_accuracy", class_test_accuracy)
    if len(accuracies) != len(class_names):
        raise ValueError(f"class_test_accuracy has {len(accuracies)} values for {len(class_names)} classes")
    return dict(zip(class_names, accuracies.tolist(), strict=True))


def loss_group_medians(log_loss: ArrayLike, eps: ArrayLike, groups: int = LOSS_GROUPS) -> list[dict]:
    """The points cut into `groups` groups of (nearly) equal size by their log loss: per group its loss range, its
    median loss, and its median ε with the 95% bootstrap interval (accounting.md §10). Fewer groups when there are
    fewer points; none without points."""
    log_loss, eps = np.asarray(log_loss, dtype=float), np.asarray(eps, dtype=float)
    order = np.argsort(log_loss, kind="stable")
    found = []
    for members in np.array_split(order, min(groups, len(order))):
        losses = np.exp(log_loss[members])
        found.append({"points": len(members), "loss_low": float(losses.min()), "loss_high": float(losses.max()),
                      "loss_median": float(np.median(losses)), "eps_median": _median_interval(eps[members])})
    return found


def _draw_loss_panel(ax, eps, log_loss, baseline_eps, label):
    """Left panel of plot_individual_accounting: ε against final loss, every point and the median ε of each group of
    points by loss (loss_group_medians) with its 95% interval."""
    pearson = _pearson(eps, log_loss)
    pearson_interval = _pearson_interval(eps, log_loss)
    ax.set_xscale("log")
    if len(log_loss) and np.ptp(log_loss) == 0:
        # Autoscaling a log axis around a single value warns; fix a decade each side first.
        ax.set_xlim(np.exp(log_loss[0]) / 10, np.exp(log_loss[0]) * 10)
    ax.scatter(np.exp(log_loss), eps, s=6, alpha=0.3, color="tab:blue", linewidths=0,
               label=f"{len(eps)} training points")
    medians = loss_group_medians(log_loss, eps)
    if medians:
        centre = np.array([group["loss_median"] for group in medians])
        middle = np.array([group["eps_median"].estimate for group in medians])
        low = middle - np.array([group["eps_median"].low for group in medians])
        high = np.array([group["eps_median"].high for group in medians]) - middle
        ax.errorbar(centre, middle, yerr=[low, high], fmt="o-", color="black", markersize=5, capsize=4, linewidth=1.5,
                    label=f"median ε of each of {len(medians)} groups of ~{medians[0]['points']} points by loss "
                          "(95% interval)")
    ax.axhline(baseline_eps, **{**BASELINE_STYLE, "label": f"{BASELINE_LABEL}: {_fmt(baseline_eps)}"})
    ax.set_xlabel(f"final training loss (log scale, clipped at {LOSS_FLOOR:g})")
    ax.set_ylabel(label)
    ax.set_title(f"Privacy vs final training loss\nPearson r(ε, ln loss) = {_fmt_r(pearson, pearson_interval)}")
    return pearson, pearson_interval, medians


def _draw_class_panel(ax, class_mean_eps, class_accuracy, baseline_eps, label):
    """Middle panel of plot_individual_accounting: per-class mean ε against test accuracy."""
    names = [name for name, mean in class_mean_eps.items() if np.isfinite(mean)]
    accuracies = [class_accuracy[name] for name in names]
    means = [class_mean_eps[name] for name in names]
    pearson = _pearson(accuracies, means) if len(names) >= 3 else float("nan")
    pearson_interval = _pearson_interval(accuracies, means) if len(names) >= 3 else None
    ax.scatter(accuracies, means, s=40, color="tab:purple", zorder=3, label=f"class mean ε, {len(names)} classes")
    for name, accuracy, mean in zip(names, accuracies, means, strict=True):
        ax.annotate(str(name), (accuracy, mean), textcoords="offset points", xytext=(5, 4), fontsize="small")
    ax.axhline(baseline_eps, **{**BASELINE_STYLE, "label": f"{BASELINE_LABEL}: {_fmt(baseline_eps)}"})
    ax.margins(x=0.15)  # room for the class names written right of the points
    ax.set_xlabel("class test accuracy")
    ax.set_ylabel(f"mean of the class's {label}")
    ax.set_title(f"Class privacy vs class accuracy\nPearson r = {_fmt_r(pearson, pearson_interval)}")
    return pearson, pearson_interval


def _draw_accountant_panel(ax, by_accountant, delta):
    """Right panel of plot_individual_accounting: the share of points whose composed ε is at most x, per
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
    ax.set_xlabel(eps_label("composed per-instance ε", delta))
    ax.set_ylabel("cumulative share of points")
    ax.set_title("Per-instance ε by accountant")
    return summaries


def plot_individual_accounting(eps: ArrayLike, final_loss: ArrayLike, labels: ArrayLike, class_names: list,
                               class_test_accuracy: ArrayLike, baseline_eps: float, path: str, *, delta: float,
                               by_accountant: dict | None = None, what: str = "per-instance composed ε") -> dict:
    """Yu et al., Fig. 2/5: composed ε against final loss (every point, and the median ε of each group of points by
    loss with its 95% interval: loss_group_medians), and per class against accuracy.

    labels are class indices into class_names; class_test_accuracy is either aligned
    with class_names or a mapping from class name to accuracy. by_accountant: {name: (every point's composed ε,
    the worst case by that accountant)}, e.g. RDP and PLD, drawn as a third panel (the share of points at or
    below each ε) and summarised per accountant (median, 10% and 90% quantiles, share below half the worst case);
    an entry whose name says "estimate" is drawn dashed. what: what the ε values are; delta: their δ (the axis labels
    say both). Each panel has its legend below it.
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
    label = eps_label(what, delta)

    panels = 2 if by_accountant is None else 3
    fig = plt.figure(figsize=(TWO_PANELS[0] * panels / 2, PANEL_HEIGHT), layout="constrained")
    axes = _side_by_side(fig, panels)
    pearson_log_loss, pearson_log_loss_interval, medians = _draw_loss_panel(axes[0], eps, log_loss, baseline_eps,
                                                                           label)
    pearson_class, pearson_class_interval = _draw_class_panel(axes[1], class_mean_eps, class_accuracy, baseline_eps,
                                                              label)
    accountants = None if by_accountant is None else _draw_accountant_panel(axes[2], by_accountant, delta)
    _legend_under_each(axes)
    _save(fig, path)
    return {
        "pearson_log_loss": pearson_log_loss,
        "pearson_log_loss_interval": pearson_log_loss_interval,
        "loss_groups": medians,
        "class_mean_eps": class_mean_eps,
        "class_accuracy": class_accuracy,
        "pearson_class": pearson_class,
        "pearson_class_interval": pearson_class_interval,
        "accountants": accountants,
    }

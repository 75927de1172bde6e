"""Figures of the audit and of the membership attack (docs/audit.md).

As perinstance/plots/plots.py: each function takes arrays already computed, draws one figure,
writes it atomically as a PNG and returns the numbers it shows.
"""

import textwrap

import matplotlib.pyplot as plt
import numpy as np
from numpy.typing import ArrayLike

from perinstance.accounting import audit_bounds
from perinstance.plots.plots import (
    SINGLE_PANEL_LEGEND_BELOW,
    TWO_PANELS,
    _as_1d,
    _fmt,
    _fmt_r,
    _legend_below,
    _legend_under_each,
    _median,
    _pearson,
    _same_length,
    _save,
    _side_by_side,
    eps_label,
)

GROUP_COLORS = {"easy": "tab:green", "hard": "tab:olive", "misclassified": "tab:red"}
GROUP_MEANINGS = {"easy": "easy (correct, eps_upper below the correct points' median)",
                  "hard": "hard (correct, eps_upper at or above that median)", "misclassified": "misclassified"}
# A note under a figure (`note`) is wrapped at about this many characters a line, each line given this height (inches).
NOTE_WIDTH = 95
NOTE_LINE_HEIGHT = 0.2


def _audit_arrays(eps_lower, eps_upper, correct):
    """The audit's per-point arrays, checked: finite bounds, boolean correctness, one length."""
    eps_lower, eps_upper = _as_1d("eps_lower", eps_lower), _as_1d("eps_upper", eps_upper)
    correct = np.asarray(correct)
    if correct.dtype != bool:
        raise ValueError(f"correct must be a boolean array, got dtype {correct.dtype}")
    _same_length(eps_lower=eps_lower, eps_upper=eps_upper, correct=correct)
    return eps_lower, eps_upper, correct


def _ring(ax, x, y, mask, name):
    """Ring the points of `mask`: bounds the audit proves wrong."""
    if mask.any():
        ax.scatter(x[mask], y[mask], s=120, facecolors="none", edgecolors="black", linewidths=1.5,
                   label=f"{name}: {mask.sum()}")


def _figure_with_note(size, note):
    """A figure of `size` (inches) with `note` under it, wrapped to NOTE_WIDTH characters a line, in a band of its own
    below everything else (legend included): (the figure, the subfigure that holds the panel; the figure itself
    without a note)."""
    lines = textwrap.wrap(note, NOTE_WIDTH)
    if not lines:
        fig = plt.figure(figsize=size, layout="constrained")
        return fig, fig
    band = NOTE_LINE_HEIGHT * (len(lines) + 1)
    fig = plt.figure(figsize=(size[0], size[1] + band), layout="constrained")
    panel, below = fig.subfigures(2, 1, height_ratios=[size[1], band])
    below.text(0.5, 0.5, "\n".join(lines), ha="center", va="center", fontsize="small", color="0.25")
    return fig, panel


def plot_audit_bounds(eps_lower: ArrayLike, eps_upper: ArrayLike, correct: ArrayLike, path: str, *, delta: float,
                      title: str = "Per-instance audit of one step", upper_kind: str = "accountant",
                      note: str = "") -> dict:
    """Lower bound (audit, 95%) against upper bound (`upper_kind`: what the accountant's value is) per point, with
    y = x, the points coloured by their group (audit_bounds.point_groups: easy, hard, misclassified), as the report
    names them. `delta`: the δ of both, on the axis labels; `note`: a sentence under the figure.

    Every point must lie on or below the diagonal; one above it is an upper bound the audit
    proves wrong, and is ringed.
    """
    eps_lower, eps_upper, correct = _audit_arrays(eps_lower, eps_upper, correct)
    violated = eps_lower > eps_upper
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(eps_upper > 0, eps_lower / eps_upper, 0.0)
    groups = audit_bounds.point_groups(eps_upper, correct)

    fig, panel = _figure_with_note(SINGLE_PANEL_LEGEND_BELOW, note)
    ax = panel.subplots()
    for name, mask in groups.items():
        ax.scatter(eps_upper[mask], eps_lower[mask], s=18, alpha=0.7, color=GROUP_COLORS[name],
                   label=f"{GROUP_MEANINGS[name]}: n = {mask.sum()}, median lower/upper = "
                         f"{_fmt(_median(ratio[mask]))}")
    _ring(ax, eps_upper, eps_lower, violated, "violated")
    positive = np.concatenate([eps_upper[eps_upper > 0], eps_lower[eps_lower > 0]])
    low = positive.min() if len(positive) else 1e-3
    high = max(positive.max(), low * 10) if len(positive) else 1.0
    span = np.geomspace(low, high, 100)
    ax.plot(span, span, color="tab:gray", linewidth=1, label="eps_lower = eps_upper")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=low)
    ax.set_ylim(0, high * 1.5)  # ε ≥ 0: the lower half of a symlog axis would be empty
    ax.set_xlabel(eps_label(f"eps_upper: per-step ε by the accountant ({upper_kind})", delta) + ", log scale")
    ax.set_ylabel(eps_label("eps_lower: audit, 95% confidence,\nper-step ε", delta) + ", symlog scale")
    ax.set_title(title)
    _legend_below(panel, [ax])
    _save(fig, path)
    return {"count": len(eps_lower), "violated": int(violated.sum()), "median_ratio": _median(ratio),
            "median_lower": _median(eps_lower), "median_upper": _median(eps_upper),
            "groups": {name: int(mask.sum()) for name, mask in groups.items()}}


def plot_audit_gap(eps_lower: ArrayLike, eps_upper: ArrayLike, correct: ArrayLike, sum_rule_eps: float,
                   mean_baseline_eps: float, path: str, *, delta: float,
                   title: str = "The realised-size mean rule against the sum rule's accounting", note: str = "") -> dict:
    """The audit of the realised-size mean rule per point, ranked by eps_lower (docs/audit.md §1):
    its lower bound (95%), the mean rule's per-point estimate eps_upper, and two lines: the per-step
    ε that the sum rule's accounting gives at the same σ and q, and the mean rule's own baseline. `delta`: the δ of
    every value, on the axis label; `note`: a sentence under the figure (why its points are what they are).

    A lower bound above the first line is leakage that the sum rule's accounting does not cover;
    one above the second would prove the mean rule's baseline wrong, and is ringed.
    """
    eps_lower, eps_upper, correct = _audit_arrays(eps_lower, eps_upper, correct)
    order = np.argsort(eps_lower, kind="stable")
    eps_lower, eps_upper, correct = eps_lower[order], eps_upper[order], correct[order]
    rank = np.arange(1, len(eps_lower) + 1)
    above_sum = eps_lower > sum_rule_eps
    above_baseline = eps_lower > mean_baseline_eps

    fig, panel = _figure_with_note((SINGLE_PANEL_LEGEND_BELOW[0] + 0.6, SINGLE_PANEL_LEGEND_BELOW[1] + 1.2), note)
    ax = panel.subplots()
    ax.scatter(rank, eps_upper, s=14, marker="_", color="tab:gray",
               label="eps_upper: mean rule's estimate per point (Monte Carlo, not a bound)")
    for mask, color, name in ((correct, "tab:green", "correct"), (~correct, "tab:red", "misclassified")):
        ax.scatter(rank[mask], eps_lower[mask], s=18, alpha=0.8, color=color,
                   label=f"eps_lower (audit, 95%), {name} by the run's final model (n = {mask.sum()})")
    _ring(ax, rank, eps_lower, above_baseline, "above the mean rule's baseline")
    ax.axhline(mean_baseline_eps, color="black", linewidth=1.5,
               label=f"mean rule's own baseline, one step: {_fmt(mean_baseline_eps)}")
    ax.axhline(sum_rule_eps, color="tab:blue", linestyle="--", linewidth=1.5,
               label=f"sum rule's accounting, one step: {_fmt(sum_rule_eps)} ({above_sum.sum()} of "
                     f"{len(eps_lower)} lower bounds above, each at 95%)")
    ax.set_ylim(0, max(mean_baseline_eps, eps_upper.max(initial=0), eps_lower.max(initial=0)) * 1.1)
    ax.set_xlabel("audited points, ranked by their lower bound")
    ax.set_ylabel(eps_label("per-step ε", delta))
    ax.set_title(title)
    _legend_below(panel, [ax])
    _save(fig, path)
    return {"count": len(eps_lower), "above_sum_rule": int(above_sum.sum()),
            "above_baseline": int(above_baseline.sum()), "median_lower": _median(eps_lower),
            "max_lower": float(eps_lower.max()) if len(eps_lower) else float("nan")}


def plot_class_attack(class_names: list, class_eps: ArrayLike, attack_accuracy: dict, attack_std: dict,
                      test_accuracy: dict, path: str, *, delta: float | None, descriptions: dict[str, str]) -> dict:
    """Per class: the loss-threshold attack's accuracy (left) and the test accuracy (right)
    against the class's mean composed ε at `delta` (None: not recorded), one colour per model ("DP", "non-private",
    ...).

    attack_accuracy, attack_std, test_accuracy: {model: values aligned with class_names}. descriptions: {model: what
    the legends say of it besides its name}, e.g. its learning rate and its test accuracy over all classes.
    Returns {model: Pearson r of attack accuracy and of test accuracy with the class ε}.
    """
    class_eps = _as_1d("class_eps", class_eps)
    colors = dict(zip(attack_accuracy, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    pearsons = {}
    fig = plt.figure(figsize=(TWO_PANELS[0] + 1.0, TWO_PANELS[1] + 1.4), layout="constrained")
    left, right = _side_by_side(fig, 2)
    for model, accuracies in attack_accuracy.items():
        accuracies = _as_1d(f"attack_accuracy[{model}]", accuracies)
        tests = _as_1d(f"test_accuracy[{model}]", test_accuracy[model])
        _same_length(class_eps=class_eps, attack=accuracies, test=tests)
        pearsons[model] = {"attack": _pearson(class_eps, accuracies), "test": _pearson(class_eps, tests)}
        left.errorbar(class_eps, accuracies, yerr=_as_1d(f"attack_std[{model}]", attack_std[model]), fmt="o",
                      color=colors[model], capsize=3,
                      label=f"{model}, {descriptions[model]}: Pearson r = {_fmt_r(pearsons[model]['attack'])}")
        right.scatter(class_eps, tests, color=colors[model],
                      label=f"{model}, {descriptions[model]}: Pearson r = {_fmt_r(pearsons[model]['test'])}")
    # Each class named once, right of its highest point.
    highest = np.max([_as_1d(f"attack_accuracy[{model}]", values) for model, values in attack_accuracy.items()], axis=0)
    for name, x, y in zip(class_names, class_eps, highest, strict=True):
        left.annotate(str(name), (x, y), textcoords="offset points", xytext=(5, 3), fontsize="small")
    left.axhline(0.5, color="black", linestyle=":", linewidth=1, label="chance")
    class_eps_label = eps_label("mean per-instance composed ε of the class (DP run)", delta)
    left.set_xlabel(class_eps_label)
    left.set_ylabel("loss-threshold attack accuracy (held-out half)")
    left.set_title("Membership inference per class")
    right.set_xlabel(class_eps_label)
    right.set_ylabel("class test accuracy")
    right.set_title("Class accuracy")
    _legend_under_each([left, right])
    _save(fig, path)
    return pearsons

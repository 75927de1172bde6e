"""The median composed ε of groups of points (the classes, or the groups of --groups), each with its 95% interval,
against the worst case: the per-point report's breakdown (perinstance/experiments/run_report.py). Pure drawing.
"""

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from perinstance.accounting.intervals import Interval
from perinstance.plots.plots import BASELINE_STYLE, _legend_below, _save

ROW_HEIGHT = 0.32
WIDTH = 8.0


def plot_group_medians(names: Sequence[str], medians: Sequence[Interval], worst: float, path: str, *, title: str,
                       eps_label: str, worst_label: str = "worst case ε") -> None:
    """One row per group: its median ε (a dot) with its 95% interval (a bar), labelled by its name and number of
    points (Interval.count), from the top in the order given; the worst case as a dashed vertical line, named
    `worst_label` (a filtered run's: its guarantee). The ε axis starts at 0, so that lengths compare; `eps_label`
    says what the values are and at which δ."""
    if len(names) != len(medians) or not len(names):
        raise ValueError(f"{len(names)} names for {len(medians)} medians (at least one of each)")
    estimates = np.array([median.estimate for median in medians])
    lows = np.array([median.low for median in medians])
    highs = np.array([median.high for median in medians])
    rows = np.arange(len(names))[::-1]
    fig, ax = plt.subplots(figsize=(WIDTH, max(2.6, ROW_HEIGHT * len(names) + 1.5)), layout="constrained")
    ax.errorbar(estimates, rows, xerr=np.vstack([estimates - lows, highs - estimates]), fmt="o", color="tab:blue",
                ecolor="tab:blue", elinewidth=2, capsize=3, label="median, 95% interval over the group's points")
    ax.axvline(worst, **{**BASELINE_STYLE, "label": f"{worst_label} = {worst:.3g}"})
    ax.set_yticks(rows, [f"{name} ({median.count:,} points)" for name, median in zip(names, medians, strict=True)])
    ax.set_xlim(0, max(worst, float(np.nanmax(highs))) * 1.05)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.set_xlabel(eps_label)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    _legend_below(fig, [ax], ncols=2, frameon=False)
    _save(fig, path)

"""Figures of a filtered run (docs/accounting.md §12): the points still in the training set at each step, per class
or per group, against the step where uniform DP-SGD at the same σ, q and worst-case ε stops; and each point's composed
ε along the run against its guarantee. Pure drawing: the caller computes every number (experiments/filter_findings.py).
"""

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from numpy.typing import ArrayLike

from perinstance.plots.plots import (
    BASELINE_STYLE,
    SINGLE_PANEL_LEGEND_BELOW,
    _as_1d,
    _draw_ecdf,
    _legend_below,
    _save,
    eps_label,
)

# Beyond this many lines a legend stops being readable: the rest share one grey style, named in the legend once.
NAMED_LINES = 12
UNIFORM_STYLE = {"color": "black", "linestyle": ":", "linewidth": 1.5}


def plot_points_training(names: Sequence[str], counts: Sequence[ArrayLike], uniform_steps: int, path: str, *,
                         title: str) -> None:
    """One line per group: the number of its points still in the training set at each step 0..T (`counts`, each
    of length T + 1), labelled by its name and size; the step T_u where uniform DP-SGD stops as a dashed line."""
    if len(names) != len(counts) or not len(names):
        raise ValueError(f"{len(names)} names for {len(counts)} series (at least one of each)")
    series = [_as_1d(f"counts[{index}]", values) for index, values in enumerate(counts)]
    if len({len(values) for values in series}) != 1:
        raise ValueError("every series needs one count per step 0..T")
    steps = np.arange(len(series[0]))
    fig, ax = plt.subplots(figsize=SINGLE_PANEL_LEGEND_BELOW, layout="constrained")
    colours = plt.get_cmap("tab20" if len(series) > 10 else "tab10")
    for index, (name, values) in enumerate(zip(names, series, strict=True)):
        named = index < NAMED_LINES
        label = f"{name} ({int(values[0]):,} points)" if named else \
            (f"{len(series) - NAMED_LINES} more" if index == NAMED_LINES else None)
        ax.step(steps, values, where="post", color=colours(index % colours.N) if named else "0.6", linewidth=1.4,
                label=label)
    ax.axvline(uniform_steps, **{**BASELINE_STYLE, "label": f"uniform DP-SGD stops (T_u = {uniform_steps})"})
    ax.set_xlim(0, steps[-1])
    ax.set_ylim(0, max(float(values.max()) for values in series) * 1.05)
    ax.set_xlabel("training step")
    ax.set_ylabel("points still in the training set")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    _legend_below(fig, [ax], ncols=3)
    _save(fig, path)


def plot_eps_against_guarantee(eps_rdp: ArrayLike, eps_pld: ArrayLike | None, guarantee: float, uniform_eps: float,
                               uniform_steps: int, path: str, *, delta: float) -> None:
    """The share of points at or below each composed ε along the run (certified), by RDP and by PLD (None: not
    drawn), against the guarantee (dashed) and uniform DP-SGD's ε after T_u steps (dotted); δ on the ε axis."""
    eps_rdp = _as_1d("eps_rdp", eps_rdp)
    eps_pld = eps_rdp[:0] if eps_pld is None else _as_1d("eps_pld", eps_pld)
    fig, ax = plt.subplots(figsize=SINGLE_PANEL_LEGEND_BELOW, layout="constrained")
    _draw_ecdf(ax, eps_rdp, color="tab:blue", linewidth=1.6, label="composed ε, RDP (b = ∞)")
    _draw_ecdf(ax, eps_pld, color="tab:orange", linewidth=1.6, label="composed ε, PLD")
    ax.axvline(guarantee, **{**BASELINE_STYLE, "label": f"guarantee ε = {guarantee:.4g} (every trajectory)"})
    ax.axvline(uniform_eps, **UNIFORM_STYLE, label=f"uniform DP-SGD after T_u = {uniform_steps} steps, "
                                                   f"ε = {uniform_eps:.4g}")
    ax.set_xlim(0, max(guarantee, uniform_eps, float(eps_rdp.max()), float(eps_pld.max(initial=0))) * 1.05)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(eps_label("composed ε along the run (certified)", delta))
    ax.set_ylabel("share of the points at or below")
    ax.grid(alpha=0.3)
    ax.set_title("Composed ε against the guarantee")
    _legend_below(fig, [ax], ncols=2)
    _save(fig, path)

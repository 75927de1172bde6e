"""The figure of the one-run audit (docs/audit.md §1b): per canary norm group, the lower bounds its canaries prove
(both statistics), the same test's bound on the idealised mechanism, and the accountant's upper bounds for a point
of that sensitivity.

As perinstance/plots/plots.py: the function takes arrays already computed, draws one figure, writes it
atomically as a PNG and returns the numbers it shows.
"""

import matplotlib.pyplot as plt
import numpy as np

from perinstance.plots.plots import (
    SINGLE_PANEL_LEGEND_BELOW,
    _as_1d,
    _fmt,
    _legend_below,
    _same_length,
    _save,
    _use_log_scale,
    eps_label,
)

BAR_WIDTH = 0.13


def plot_one_run_audit(norms: np.ndarray, lower: np.ndarray, lower_summed: np.ndarray, ideal: np.ndarray,
                       upper_rdp: np.ndarray, upper_pld: np.ndarray, fdp_cap: np.ndarray, path: str, *,
                       assumption_free: np.ndarray, delta: float,
                       title: str = "One-run audit per canary group") -> dict[str, list[float]]:
    """Grouped bars per canary norm c (×Γ): the f-DP family bound of the likelihood-ratio statistic and of the summed
    projection (last-iterate), which hold if the run's trade-off curve has the subsampled-Gaussian shape
    (accounting.md §11.9), the assumption-free bound of the likelihood-ratio statistic (`assumption_free`, Steinke et
    al.'s test), the family bound on the idealised mechanism, and the RDP and PLD upper bounds, with the f-DP test's
    cap for these canaries as a black dashed tick. A lower bar above the upper bound is
    a violation, drawn hatched; `delta`: the δ of every bound, on the axis label. Returns {"lower", "ideal",
    "upper", "ratio", "ideal_ratio", "violated"} per group (upper: the smaller of the two; ratio: lower/upper;
    ideal_ratio: lower/ideal)."""
    arrays = {name: _as_1d(name, value) for name, value in (
        ("norms", norms), ("lower", lower), ("lower_summed", lower_summed), ("assumption_free", assumption_free),
        ("ideal", ideal),
        ("upper_rdp", upper_rdp), ("upper_pld", upper_pld), ("fdp_cap", fdp_cap))}
    _same_length(**arrays)
    norms, lower, lower_summed, ideal = (arrays[name] for name in ("norms", "lower", "lower_summed", "ideal"))
    upper_rdp, upper_pld, fdp_cap = arrays["upper_rdp"], arrays["upper_pld"], arrays["fdp_cap"]
    upper = np.minimum(upper_rdp, upper_pld)
    violated = lower > upper
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(upper > 0, lower / upper, np.nan)
        ideal_ratio = np.where(ideal > 0, lower / ideal, np.nan)

    fig, ax = plt.subplots(figsize=SINGLE_PANEL_LEGEND_BELOW, layout="constrained")
    positions = np.arange(norms.size)
    bars = [(lower, "tab:red", "f-DP family bound, likelihood ratio of every step (§11.9)"),
            (lower_summed, "salmon", "f-DP family bound, summed projection (last-iterate)"),
            (arrays["assumption_free"], "tab:purple", "assumption-free bound, likelihood ratio (Steinke et al.)"),
            (ideal, "tab:orange", "the family bound on the idealised mechanism (§11.11)"),
            (upper_rdp, "tab:blue", "upper bound, RDP (§4)"), (upper_pld, "tab:green", "upper bound, PLD (§8.2)")]
    for offset, (values, color, label) in zip(np.arange(len(bars)) - (len(bars) - 1) / 2, bars, strict=True):
        ax.bar(positions + offset * BAR_WIDTH, values, BAR_WIDTH, color=color, label=label)
    first = positions - (len(bars) - 1) / 2 * BAR_WIDTH
    if violated.any():
        ax.bar(first[violated], lower[violated], BAR_WIDTH, color="none", edgecolor="black", hatch="//",
               label=f"VIOLATION: lower > upper ({violated.sum()})")
    ax.hlines(fdp_cap, positions - len(bars) / 2 * BAR_WIDTH, positions + len(bars) / 2 * BAR_WIDTH, colors="black",
              linestyles="--",
              label="cap of the f-DP test with these canaries")
    for position, value, share in zip(first, lower, ratio, strict=True):
        ax.annotate(f"{_fmt(value)}\n({_fmt(share)} of upper)", (position, max(value, 0)), ha="center",
                    va="bottom", fontsize=7)
    _use_log_scale(ax, "y", np.concatenate([lower, lower_summed, arrays["assumption_free"], ideal, upper_rdp,
                                            upper_pld, fdp_cap]))
    ax.set_xticks(positions, [f"c = {norm:g}" for norm in norms])
    ax.set_xlabel("gradient canary group (sensitivity c·Γ)")
    ax.set_ylabel(eps_label("ε over the whole run", delta))
    ax.set_title(f"{title}\nfamily bounds: if the run's trade-off curve has the subsampled-Gaussian shape",
                 fontsize=9)
    _legend_below(fig, [ax], ncols=2, fontsize=7)
    _save(fig, path)
    return {"lower": lower.tolist(), "ideal": ideal.tolist(), "upper": upper.tolist(), "ratio": ratio.tolist(),
            "ideal_ratio": ideal_ratio.tolist(), "violated": violated.tolist()}

"""The figure of the one-run audit (docs/audit.md §1b): per canary norm group, the lower bound its canaries prove
against the accountant's upper bounds for a point of that sensitivity.

As perinstance/plots/plots.py: the function takes arrays already computed, draws one figure, writes it
atomically as a PNG and returns the numbers it shows.
"""

import matplotlib.pyplot as plt
import numpy as np

from perinstance.plots.plots import SINGLE_PANEL, _as_1d, _fmt, _same_length, _save, _use_log_scale

BAR_WIDTH = 0.25


def plot_one_run_audit(norms: np.ndarray, eps_lower: np.ndarray, eps_upper_rdp: np.ndarray,
                       eps_upper_pld: np.ndarray, eps_cap: np.ndarray, path: str,
                       title: str = "One-run audit per canary group") -> dict[str, list[float]]:
    """Grouped bars per canary norm c (×Γ): the one-run lower bound and the RDP and PLD upper bounds, with the cap
    the group's canaries put on any lower bound as a black tick. A lower bar above either upper bar is a violation,
    drawn hatched. Returns {"lower", "upper", "ratio", "violated"} per group (upper: the smaller of the two)."""
    norms, eps_lower = _as_1d("norms", norms), _as_1d("eps_lower", eps_lower)
    eps_upper_rdp, eps_upper_pld = _as_1d("eps_upper_rdp", eps_upper_rdp), _as_1d("eps_upper_pld", eps_upper_pld)
    eps_cap = _as_1d("eps_cap", eps_cap)
    _same_length(norms=norms, eps_lower=eps_lower, eps_upper_rdp=eps_upper_rdp, eps_upper_pld=eps_upper_pld,
                 eps_cap=eps_cap)
    upper = np.minimum(eps_upper_rdp, eps_upper_pld)
    violated = eps_lower > upper
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(upper > 0, eps_lower / upper, np.nan)

    fig, ax = plt.subplots(figsize=SINGLE_PANEL, layout="constrained")
    positions = np.arange(norms.size)
    ax.bar(positions - BAR_WIDTH, eps_lower, BAR_WIDTH, color="tab:red", label="lower bound (canaries, §11.2)")
    if violated.any():
        ax.bar((positions - BAR_WIDTH)[violated], eps_lower[violated], BAR_WIDTH, color="none", edgecolor="black",
               hatch="//", label=f"VIOLATION: lower > upper ({violated.sum()})")
    ax.bar(positions, eps_upper_rdp, BAR_WIDTH, color="tab:blue", label="upper bound, RDP (§4)")
    ax.bar(positions + BAR_WIDTH, eps_upper_pld, BAR_WIDTH, color="tab:green", label="upper bound, PLD (§8.2)")
    ax.hlines(eps_cap, positions - 1.5 * BAR_WIDTH, positions + 1.5 * BAR_WIDTH, colors="black", linestyles="--",
              label="cap of any lower bound from these canaries")
    for position, lower, share in zip(positions, eps_lower, ratio, strict=True):
        ax.annotate(f"{_fmt(lower)}\n({_fmt(share)} of upper)", (position - BAR_WIDTH, max(lower, 0)),
                    ha="center", va="bottom", fontsize=7)
    _use_log_scale(ax, "y", np.concatenate([eps_lower, eps_upper_rdp, eps_upper_pld, eps_cap]))
    ax.set_xticks(positions, [f"c = {norm:g}" for norm in norms])
    ax.set_xlabel("canary norm group (sensitivity c·Γ)")
    ax.set_ylabel("ε over the whole run")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    _save(fig, path)
    return {"lower": eps_lower.tolist(), "upper": upper.tolist(), "ratio": ratio.tolist(),
            "violated": violated.tolist()}

"""GLA's sampling-rate claim for the mean rule (its Fig. 3c) as three figures, one per quantity: the per-step value,
the whole-run ε, and the per-step value's ratio to the mean rule's baseline, over the sampling rates, one panel per
controlled design and one legend below the panels."""

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np

from perinstance.plots.plots import _legend_below, _median, _median_interval, _save, _use_log_scale, eps_label

QUANTITIES = ("per_step", "composed", "ratios")
PANEL_SIZE = (5.6, 6.0)
# Wide enough for the heading and the legend above and below a single panel.
MIN_WIDTH = 11.0

MEAN_RULE_SERIES = {
    # key: (label, style); estimates say so in the legend (accounting.md §3.5).
    "certified": ("mean rule, certified bound (median, 95% interval; band 10-90%)", {"color": "tab:blue",
                                                                                     "marker": "o"}),
    "estimate": ("mean rule, estimate (Monte Carlo, median, 95% interval)", {"color": "tab:orange", "marker": "s",
                                                                             "linestyle": ":"}),
    "baseline": ("mean rule, data-independent baseline", {"color": "black", "marker": "D", "linestyle": "--"}),
    "sum_rule": ("sum rule, per instance at the same θ (median, 95% interval)", {"color": "tab:green", "marker": "^",
                                                                                 "linestyle": "-."}),
    "sum_baseline": ("sum rule, worst case at the same sigma", {"color": "grey", "marker": "v", "linestyle": "--"}),
}


# Over a whole run the per-step values are held between checkpoints (one checkpoint for all T steps in the fixed
# designs): every composed series is an estimate (accounting.md §4): a held estimate of certified per-step values, a
# Monte Carlo estimate of Monte Carlo ones.
HELD_LABELS = {
    "certified": "mean rule, certified per step, held between checkpoints: a held estimate (median, 95% interval; "
                 "band 10-90%)",
    "estimate": "mean rule, Monte Carlo per step, held between checkpoints: an estimate (median, 95% interval)",
}


RATIO_SERIES = {
    "certified": ("certified / mean-rule baseline (median, 95% interval)", {"color": "tab:blue", "marker": "o"}),
    "estimate": ("estimate / mean-rule baseline (median, 95% interval; Monte Carlo)",
                 {"color": "tab:orange", "marker": "s", "linestyle": ":"}),
}


def _finite(values):
    return values[np.isfinite(values)]


def _draw_medians(ax, rates, arrays, label, style):
    """Medians over the rates with their 95% bootstrap intervals as error bars (accounting.md §10); a single
    value (a baseline) has no interval. Returns ({q: median}, {q: Interval or None})."""
    medians = [_median(values) for values in arrays]
    found = [_median_interval(values) if len(values) > 1 else None for values in arrays]
    low = [median - interval.low if interval else 0.0 for median, interval in zip(medians, found, strict=True)]
    high = [interval.high - median if interval else 0.0 for median, interval in zip(medians, found, strict=True)]
    ax.errorbar(rates, medians, yerr=[low, high], label=label, linewidth=2, capsize=4, **style)
    return dict(zip(rates, medians, strict=True)), dict(zip(rates, found, strict=True))


def _draw_ratio_panel(ax, values_by_rate, title):
    """The data-dependent per-step values relative to the mean rule's own baseline, per rate: the quantity
    GLA's sampling-rate claim is about. Returns ({series: {q: median ratio}}, {series: {q: its interval}})."""
    rates = sorted(values_by_rate)
    drawn, found = {}, {}
    for key, (label, style) in RATIO_SERIES.items():
        present = [q for q in rates if key in values_by_rate[q]]
        ratios = [_finite(np.atleast_1d(np.asarray(values_by_rate[q][key], dtype=float)))
                  / float(values_by_rate[q]["baseline"]) for q in present]
        drawn[key], found[key] = _draw_medians(ax, present, ratios, label, style)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="the baseline itself (ratio 1)")
    ax.set_xscale("log")
    ax.set_xticks(rates, [f"{q:g}" for q in rates])
    _use_log_scale(ax, "y", np.array([value for series in drawn.values() for value in series.values()] + [1.0]))
    ax.set_xlabel("sampling rate q")
    ax.set_ylabel("per-step value ÷ mean-rule baseline")
    ax.set_title(title)
    return drawn, found


def _draw_rate_panel(ax, values_by_rate, ylabel, title, labels=None):
    """One line per series over the sampling rates: medians of per-point arrays with their 95% intervals (and a
    10-90% band for the certified bound) or single values; returns the medians drawn per series and rate, and
    their intervals. `labels`: {series: legend} where a series means more than MEAN_RULE_SERIES says."""
    rates = sorted(values_by_rate)
    drawn, found = {}, {}
    everything = [np.zeros(0)]
    for key, (label, style) in MEAN_RULE_SERIES.items():
        present = [q for q in rates if key in values_by_rate[q]]
        if not present:
            continue
        # A point without an estimate (NaN: some size unsampled) or without a finite guarantee (inf: δ_fail
        # left nothing to spend) has no place on a log axis; the medians are over the finite values.
        arrays = [_finite(np.atleast_1d(np.asarray(values_by_rate[q][key], dtype=float))) for q in present]
        drawn[key], found[key] = _draw_medians(ax, present, arrays, (labels or {}).get(key, label), style)
        everything.extend(arrays)
        if key == "certified":
            low = [np.quantile(values, 0.1) if len(values) else np.nan for values in arrays]
            high = [np.quantile(values, 0.9) if len(values) else np.nan for values in arrays]
            ax.fill_between(present, low, high, color=style["color"], alpha=0.15, linewidth=0)
    ax.set_xscale("log")
    ax.set_xticks(rates, [f"{q:g}" for q in rates])
    _use_log_scale(ax, "y", np.concatenate(everything))
    ax.set_xlabel("sampling rate q")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return drawn, found


def plot_sampling_rate_designs(designs: dict, alpha: float, delta: float, paths: Mapping[str, str]) -> dict:
    """GLA's sampling-rate claim for the mean rule (its Fig. 3c) in controlled designs (accounting.md §3.2, §4):
    {design title: (per_step, whole_run)}, each {q: {series: per-point array or one value}} with series among
    MEAN_RULE_SERIES (ratios need "baseline" per step). Three figures, one panel per design each, written to
    paths["per_step"] (the per-step Rényi DP at order α), paths["composed"] (ε over the whole run at δ) and
    paths["ratios"] (the per-step data-dependent values relative to the mean rule's baseline), every median with
    its 95% interval (§10). Returns {design: {"per_step", "composed", "ratios"} (medians) and the same three with
    "_intervals" (their Interval, None for a single value)}."""
    if set(paths) != set(QUANTITIES):
        raise ValueError(f"paths must name the figures {', '.join(QUANTITIES)}, got {', '.join(sorted(paths))}")
    for title, (per_step, whole_run) in designs.items():
        if set(per_step) != set(whole_run):
            raise ValueError(f"{title}: per_step and whole_run cover different rates: {sorted(per_step)} vs "
                             f"{sorted(whole_run)}")
    headings = {"per_step": f"The mean rule per sampling rate: one step (Rényi DP at α = {alpha:g})",
                "composed": f"The mean rule per sampling rate: ε over the whole run (δ = {delta:g})",
                "ratios": "The mean rule per sampling rate: the per-step value relative to the mean rule's baseline "
                          "(GLA's claim: it falls as q grows)"}
    drawers = {
        "per_step": lambda ax, per_step, _, title: _draw_rate_panel(
            ax, per_step, f"per-step Rényi DP ε at α = {alpha:g}\n(a Rényi bound: no δ)", title),
        "composed": lambda ax, _, whole_run, title: _draw_rate_panel(
            ax, whole_run, eps_label("ε over the whole run", delta), title, labels=HELD_LABELS),
        "ratios": lambda ax, per_step, _, title: _draw_ratio_panel(ax, per_step, title),
    }
    drawn = {title: {} for title in designs}
    for quantity in QUANTITIES:
        fig, axes = plt.subplots(1, len(designs), figsize=(max(PANEL_SIZE[0] * len(designs), MIN_WIDTH), PANEL_SIZE[1]),
                                 layout="constrained", squeeze=False)
        for ax, (title, (per_step, whole_run)) in zip(axes[0], designs.items(), strict=True):
            medians, found = drawers[quantity](ax, per_step, whole_run, title)
            drawn[title][quantity] = medians
            drawn[title][f"{quantity}_intervals"] = found
        fig.suptitle(headings[quantity])
        _legend_below(fig, axes[0], ncols=min(2, len(designs)))
        _save(fig, paths[quantity])
    return drawn

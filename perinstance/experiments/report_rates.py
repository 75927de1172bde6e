"""The report's findings on the mean rule per sampling rate (figure 3): one per design of the experiment (the main
run's early and final checkpoint analysed at every q; one run per q trained for the same T steps), each with a
row per rate and the verdicts between adjacent rates (docs/accounting.md §10), and GLA's sampling-rate claim judged
on them.
"""

import math

from perinstance.accounting.intervals import FALLS, RISES
from perinstance.experiments.config import ReproduceConfig
from perinstance.experiments.report_cells import (
    EMPTY,
    Headline,
    count,
    figure_files,
    interval,
    more_link,
    number,
    of,
    share,
)
from perinstance.experiments.sampling_rates import DESIGN_MATCHED, FIXED_WHOLE_RUN, MATCHED_WHOLE_RUN
from perinstance.plots.document import Finding, Table

FIGURE = figure_files(r"3[a-z]?_")
# The quantities whose change with q is judged, by verdicts' part and series, as the verdict table names them.
JUDGED = (("ratio", "certified", "certified ÷ baseline, one step"),
          ("ratio", "estimate", "Monte Carlo ÷ baseline, one step"),
          ("per_step", "certified", "certified, one step"), ("per_step", "estimate", "Monte Carlo, one step"),
          ("whole_run", "certified", "certified, whole run (held)"),
          ("whole_run", "estimate", "Monte Carlo, whole run (held)"))
# The data-dependent series as the report names them: the certified bound and the Monte Carlo estimate.
SERIES_NAMES = {"certified": "certified", "estimate": "Monte Carlo"}
CLAIM_HOLDS = "both fall: the claim holds"
CLAIM_COLUMN = "steps up in q"


def design_key(design: str) -> str:
    """The anchor of a design's finding: 'mean-rule-early', 'mean-rule-final', 'mean-rule-matched'."""
    for word in ("early", "final", "matched"):
        if word in design:
            return f"mean-rule-{word}"
    return "mean-rule-" + "-".join(design.split())


def rates_findings(config: ReproduceConfig, rates: dict) -> tuple[list[Finding], list[Headline]]:
    """Findings 3 to 6: a finding per design and the claim judged on all of them; the summary row of the claim."""
    designs = [design_finding(config, design, drawn) for design, drawn in rates.items()]
    claim = claim_finding(rates)
    return [*designs, claim], [Headline("steps up in q where GLA's sampling-rate claim for the mean rule holds",
                                        claim.key, CLAIM_HOLDS, CLAIM_COLUMN, None, "verdicts from 95% intervals")]


def median_cell(medians: dict, found: dict, series: str, rate: float) -> str:
    """A median of figure 3 with its 95% interval where it has one; empty where the series has no value there."""
    if series not in medians or rate not in medians[series]:
        return EMPTY
    return interval(found.get(series, {}).get(rate), medians[series][rate])


def change_cell(pair: dict) -> str:
    """'falls ×0.57 [0.52, 0.61]': the verdict on a pair of adjacent rates and the factor by which the median
    changes, with its 95% interval."""
    factor, low, high = (math.exp(value) for value in (pair["change"].estimate, pair["change"].low,
                                                        pair["change"].high))
    return f"{pair['verdict']} ×{factor:.3g} [{low:.3g}, {high:.3g}]"


def pair_text(first: float, second: float) -> str:
    return f"{first:.4g}→{second:.4g}"


def design_finding(config: ReproduceConfig, design: str, drawn: dict) -> Finding:
    """Finding 3, 4 or 5: one design's mechanism per rate, its per-step and whole-run medians per rate, and the
    verdicts between adjacent rates."""
    facts, step, whole = drawn["facts"], drawn["per_step"], drawn["composed"]
    step_found, whole_found = drawn["per_step_intervals"], drawn["composed_intervals"]
    ratios, ratio_found = drawn["ratios"], drawn["ratios_intervals"]
    ordered = sorted(facts)
    matched = design == DESIGN_MATCHED
    mechanism = Table(
        ("q", "B", "σ", "T", "k_min", "points with k* = k_min", "points: certified", "Monte Carlo: points × batches"),
        tuple((f"{rate:.4g}", str(facts[rate]["batch_size"]), number(facts[rate]["sigma"]), str(facts[rate]["steps"]),
               str(facts[rate]["k_min"]), share(facts[rate]["dominated_by_k_min"]), count(facts[rate]["points"]),
               f"{count(facts[rate].get('estimate_points', facts[rate]['points']))} × "
               f"{count(facts[rate]['estimate_samples'])}") for rate in ordered),
        title="Each rate's mechanism: batch size, noise multiplier and steps of a run at q; the smallest batch size "
              "admitted, and the points whose bound it decides")
    one_step = Table(
        ("q", "certified", "Monte Carlo estimate", "mean-rule baseline", "certified ÷ baseline", "Monte Carlo ÷ baseline",
         "sum rule, same θ and σ", "sum-rule worst case"),
        tuple((f"{rate:.4g}", median_cell(step, step_found, "certified", rate),
               median_cell(step, step_found, "estimate", rate), median_cell(step, step_found, "baseline", rate),
               median_cell(ratios, ratio_found, "certified", rate), median_cell(ratios, ratio_found, "estimate", rate),
               median_cell(step, step_found, "sum_rule", rate), median_cell(step, step_found, "sum_baseline", rate))
              for rate in ordered),
        title=f"One step: Rényi DP at α = {config.renyi_order:g}, the median point with its 95% interval")
    whole_columns = [("certified", "certified per step, held"), ("estimate", "Monte Carlo per step, held"),
                     ("sum_rule", "sum rule, same θ and σ, held"), ("baseline", "mean-rule baseline"),
                     ("sum_baseline", "sum-rule worst case")]
    whole_columns = [(series, heading) for series, heading in whole_columns if series in whole]
    whole_run = Table(
        ("q", *(heading for _, heading in whole_columns)),
        tuple((f"{rate:.4g}", *(median_cell(whole, whole_found, series, rate) for series, _ in whole_columns))
              for rate in ordered),
        title=f"The whole run: ε at δ = {config.delta:g}, b = ∞; {MATCHED_WHOLE_RUN if matched else FIXED_WHOLE_RUN}. "
              "Each data-dependent value is a held-Δ* estimate, each baseline a bound")
    verdicts = drawn["verdicts"]
    pairs = [(first, second) for first, second in zip(ordered, ordered[1:])]
    by_pair = {(part, series): {(pair["from"], pair["to"]): pair for pair in verdicts[part].get(series, [])}
               for part, series, _ in JUDGED}
    judged = [(label, by_pair[(part, series)]) for part, series, label in JUDGED if by_pair[(part, series)]]
    pairing = ("the same points at every rate, resampled together" if not matched else
               "one independent run per rate, each resampled on its own")
    changes = Table(
        ("as q grows", *(pair_text(*pair) for pair in pairs)),
        tuple((label, *(change_cell(found[pair]) if pair in found else EMPTY for pair in pairs))
              for label, found in judged),
        title=f"Between adjacent rates: the verdict and the factor by which the median changes, with its 95% "
              f"interval ({pairing})")
    return Finding(
        design_key(design), f"Mean rule per sampling rate: {design}", design_takeaway(verdicts["ratio"]),
        mechanism, figures=FIGURE, more=more_link(design_key(design)), extra_tables=(one_step, whole_run, changes),
        note=("One mean-rule run per q, trained for the same T steps." if matched else
              "One model: this checkpoint analysed as one mean-rule step at each q, σ per q for the same whole-run "
              "ε."))


def verdict_counts(judged: list[dict], first: bool) -> str:
    """'falls at 2 of 3 steps up in q and rises at 1' (`first`; else 'falls at 2 and rises at 1'): the verdicts of
    one series, counted."""
    tally = {FALLS: 0, RISES: 0}
    for pair in judged:
        if pair["verdict"] in tally:
            tally[pair["verdict"]] += 1
    unclear = len(judged) - tally[FALLS] - tally[RISES]
    return (f"falls at {of(tally[FALLS], len(judged)) + ' steps up in q' if first else tally[FALLS]} and rises at "
            f"{tally[RISES]}" + (f", {unclear} unclear at this precision" if unclear else ""))


def design_takeaway(ratio_verdicts: dict[str, list[dict]]) -> str:
    """What the per-step ratios to the mean rule's baseline do as q grows, per series."""
    names = {"certified": "the certified bound", "estimate": "the Monte Carlo estimate"}
    judged = [(series, pairs) for series, pairs in ratio_verdicts.items() if pairs]
    if not judged:
        return "No pair of adjacent rates has values to compare."
    return "Per step ÷ the mean rule's baseline, " + "; ".join(
        f"{names[series]} {verdict_counts(pairs, index == 0)}" for index, (series, pairs) in enumerate(judged)) + "."


def claim_steps(ratio_verdicts: dict[str, list[dict]]) -> list[tuple[float, float, str]]:
    """Per adjacent pair of rates, the certified and estimated ratios' verdicts together: one verdict where they
    agree, "mixed (…)" naming both where they do not."""
    by_pair = {}
    for series, judged in ratio_verdicts.items():
        for pair in judged:
            by_pair.setdefault((pair["from"], pair["to"]), {})[series] = pair["verdict"]
    steps = []
    for (first, second), verdicts in sorted(by_pair.items()):
        agreed = set(verdicts.values())
        steps.append((first, second, agreed.pop() if len(agreed) == 1 else
                      "mixed (" + ", ".join(f"{SERIES_NAMES.get(series, series)} {verdict}"
                                            for series, verdict in verdicts.items()) + ")"))
    return steps


def claim_finding(rates: dict) -> Finding:
    """Finding 6: GLA's claim that a higher sampling rate gives the mean rule better data-dependent privacy (per
    step, relative to its own baseline), judged per step up in q of every design from the 95% intervals of both
    ratios' change: it holds where both fall."""
    tally, rows = {FALLS: 0, RISES: 0, "other": 0}, []
    for design, drawn in rates.items():
        ratio = drawn["verdicts"]["ratio"]
        found = {series: {(pair["from"], pair["to"]): pair["verdict"] for pair in judged}
                 for series, judged in ratio.items()}
        for first, second, verdict in claim_steps(ratio):
            tally[verdict if verdict in (FALLS, RISES) else "other"] += 1
            rows.append((design, pair_text(first, second), found.get("certified", {}).get((first, second), EMPTY),
                         found.get("estimate", {}).get((first, second), EMPTY), verdict))
    steps = sum(tally.values())
    tallies = Table(("both ratios", CLAIM_COLUMN),
                    ((CLAIM_HOLDS, of(tally[FALLS], steps)), ("both rise", of(tally[RISES], steps)),
                     ("mixed, or no difference at this precision", of(tally["other"], steps))),
                    title="Every step up in q of the three designs, counted")
    return Finding(
        "gla-claim", "GLA's sampling-rate claim for the mean rule",
        f"GLA's claim that a higher q lowers the mean rule's per-step loss relative to its own baseline holds "
        f"at {of(tally[FALLS], steps)} steps up in q; both ratios rise at {tally[RISES]}, and at {tally['other']} "
        "they are mixed or show no difference at this precision.",
        Table(("design", "step up in q", "certified ÷ baseline", "Monte Carlo ÷ baseline", "both"), tuple(rows),
              title="The verdicts of the per-step ratios to the mean rule's baseline, design by design (the three "
                    "findings above)"),
        figures=FIGURE, more=more_link("gla-claim"), extra_tables=(tallies,),
        note="Whole-run values also change with T and σ, so they do not judge the claim.")

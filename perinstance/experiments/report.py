"""report.md: the findings' sentences, the configuration, every command, the timing table and the figures.
"""

import math
import os
import shlex

from perinstance.accounting.intervals import FALLS, RISES, Interval
from perinstance.experiments.commands import FIGURES, ONE_RUN_FIGURE, Commands
from perinstance.experiments.config import ReproduceConfig, field_text, field_types, overridden
from perinstance.experiments.main_run import COMPOSITION_HOLDER_B, holder_text
from perinstance.experiments.sampling_rates import DESIGN_MATCHED, FIXED_WHOLE_RUN, MATCHED_WHOLE_RUN
from perinstance.files import fileio
from perinstance.plots.plots import interval_text
from perinstance.train.runs import RunConfig


def finding_lines(config: ReproduceConfig, findings: dict) -> list[str]:
    """The numbered findings of the report, every setting quoted from `config` and the constants, every median,
    ratio and correlation a finding rests on with its 95% interval and the points behind it (§10)."""
    hist, corr, rates = findings["histogram"], findings["correctness"], findings["rates"]
    individual, estimate = findings["individual"], findings["estimate"]
    class_eps = list(individual["class_mean_eps"].values())
    return [
        f"median per-instance per-step ε is {interval_text(hist['median_interval'], 4)} (95% interval, "
        f"{hist['median_interval'].count} points), baseline {hist['baseline']:.4g}; "
        f"{100 * hist['share_2x_below']:.1f}% of points are at least 2× below the baseline",
        correctness_line(corr),
        *mean_rule_lines(config, rates),
        (f"composed ε over {findings['total_steps']} steps (b={holder_text(COMPOSITION_HOLDER_B)}, "
         f"δ={config.delta:g}), {HEADLINE[findings['composed_bound']]}: median "
         f"{interval_text(findings['composed_median'], 4)} ({findings['composed_median'].count} points), baseline "
         f"{findings['composed_baseline']:.4g}; bound (estimate) of "
         + ", ".join(f"{label}: {value:.4g} ({findings['curves']['estimate_final'][label]:.4g})"
                     for label, value in findings["curves"]["final"].items())),
        "composed ε by accountant (every point, b=∞): " + "; ".join(
            f"{name}: median {interval_text(values['median_interval'], 4)} ({values['points']} points; 10-90%: "
            f"{values['q10']:.4g}-{values['q90']:.4g}), worst case {values['worst']:.4g}, "
            f"{100 * values['share_below_half']:.1f}% of points below half the worst case"
            for name, values in individual["accountants"].items()),
        ("Pearson r between composed ε and log final loss = "
         f"{r_text(individual['pearson_log_loss'], individual['pearson_log_loss_interval'])}"
         f"; across classes, r between class mean ε and class test accuracy = "
         f"{r_text(individual['pearson_class'], individual['pearson_class_interval'])}: the class with the lowest "
         f"test accuracy ({individual['lowest_class']}) has mean ε {class_eps[individual['lowest_class']]:.4g}, the "
         f"highest ({individual['highest_class']}) {class_eps[individual['highest_class']]:.4g}"),
        estimate_line(estimate),
        *attack_lines(findings),
        *one_run_lines(config, findings),
    ]


# What the headline composition (finding 7) is: a bound when every point's Δ* was measured at every step (§4).
HEADLINE = {True: "a bound along the observed run (Δ* of every point at every step)",
            False: "an estimate (Δ* held between checkpoints; the bound covers the tracked points only, finding 10)"}


def percent_text(interval: Interval, sign: str = "+") -> str:
    """'+0.12% [−0.05%, +0.3%]': a relative value with its 95% interval (sign "": without the plus signs)."""
    return (f"{100 * interval.estimate:{sign}.3g}% [{100 * interval.low:{sign}.3g}%, "
            f"{100 * interval.high:{sign}.3g}%]")


def estimate_line(estimate: dict) -> str:
    """Finding 10: how far the composition that holds Δ* between checkpoints is from the bound from Δ* at every
    step, and in which direction, each statistic with its 95% interval over the points (§10)."""
    if estimate["relative_median"] is None:
        return f"the checkpoint estimate against the bound: no point with a positive bound ({estimate['points']} points)"
    largest, share = estimate["relative_largest"], estimate["share_below"]
    side = "below" if estimate["relative_largest_signed"] < 0 else "above"
    return (f"the checkpoint estimate (Δ* held between the {estimate['checkpoints']} checkpoints) against the bound "
            f"(Δ* at every step), {estimate['points']} points: relative error (estimate − bound)/bound median "
            f"{percent_text(estimate['relative_median'])} (95% interval), largest |relative error| "
            f"{percent_text(largest, sign='')} ({side} its bound); "
            f"the estimate is below the bound for {estimate['count_below']} points, {percent_text(share, sign='')}"
            + ("" if estimate["shortfall_largest"] is None else
               f", by up to {percent_text(estimate['shortfall_largest'], sign='')}")
            + " (a composition over checkpoints is an estimate, not a bound); "
            f"Pearson r = {r_text(estimate['pearson'], estimate['pearson_interval'])}, mean |error| "
            f"{estimate['mean_abs_error']:.3g}, max |error| {estimate['max_abs_error']:.3g}")


def r_text(pearson: float, interval: Interval | None) -> str:
    """Pearson r with its 95% interval and the number of pairs behind it, or why it is undefined."""
    if interval is None:
        return "undefined (fewer than two distinct values)" if math.isnan(pearson) else f"{pearson:.3f}"
    return f"{pearson:.3f} [{interval.low:.3f}, {interval.high:.3f}] (95% interval, {interval.count} pairs)"


def correctness_line(corr: dict) -> str:
    """Finding 2: whether misclassified points pay more, from the interval of the ratio of the two medians."""
    ratio = corr["ratio_interval"]
    counts = f"{corr['count_misclassified']} misclassified, {corr['count_correct']} correct points"
    if ratio is None:
        return f"misclassified median / correct median undefined ({counts}) — NOT borne out by this run"
    if ratio.low > 1:
        meaning = "misclassified points pay more"
    elif ratio.high < 1:
        meaning = "NOT borne out by this run: misclassified points pay less"
    else:
        meaning = "NOT borne out by this run: no difference at this precision"
    return f"misclassified median / correct median = {interval_text(ratio)} (95% interval; {counts}) — {meaning}"


def median_text(medians: dict, found: dict, series: str, rate: float, digits: int = 4) -> str:
    """A median of figure 3 (3a-3c) with its 95% interval where it has one."""
    interval = found[series][rate]
    return interval_text(interval, digits) if interval is not None else f"{medians[series][rate]:.{digits}g}"


def verdict_text(judged: list[dict]) -> str:
    """'0.008→0.032 falls (×0.57 [0.52, 0.61]), …': the verdict per adjacent pair of rates and the factor by which
    the median changes, with its 95% interval."""
    parts = []
    for pair in judged:
        factor, low, high = (math.exp(value) for value in (pair["change"].estimate, pair["change"].low,
                                                            pair["change"].high))
        parts.append(f"{pair['from']:.4g}→{pair['to']:.4g} {pair['verdict']} "
                     f"(×{factor:.3g} [{low:.3g}, {high:.3g}])")
    return ", ".join(parts)


VERDICT_PARTS = {"ratio": "per step ÷ mean-rule baseline", "per_step": "per-step value", "whole_run": "whole-run ε"}


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
                      "mixed (" + ", ".join(f"{series} {verdict}" for series, verdict in verdicts.items()) + ")"))
    return steps


def mean_rule_lines(config: ReproduceConfig, rates: dict) -> list[str]:
    """Findings 3 to 6: the mean rule per sampling rate in both designs, per step and over the whole run, each
    median with its 95% interval, the verdicts between adjacent rates (§10), and GLA's sampling-rate claim judged
    on the per-step data-dependent values relative to the mean rule's baseline."""
    lines, phrases, tally = [], [], {FALLS: 0, RISES: 0, "other": 0}
    for design, drawn in rates.items():
        facts, step, whole = drawn["facts"], drawn["per_step"], drawn["composed"]
        step_found, whole_found = drawn["per_step_intervals"], drawn["composed_intervals"]
        ratios, ratio_found = drawn["ratios"], drawn["ratios_intervals"]
        ordered = sorted(facts)
        per_rate = "; ".join(
            f"q={rate:.4g} (B={facts[rate]['batch_size']}, σ={facts[rate]['sigma']:.3g}, T={facts[rate]['steps']}, "
            f"k_min={facts[rate]['k_min']}): certified {median_text(step, step_found, 'certified', rate)} "
            f"({facts[rate]['points']} points; k*=k_min for {100 * facts[rate]['dominated_by_k_min']:.0f}%), "
            f"estimate {median_text(step, step_found, 'estimate', rate)} (Monte Carlo, "
            f"{facts[rate].get('estimate_points', facts[rate]['points'])} points, {facts[rate]['estimate_samples']} "
            f"batches per point), mean-rule baseline {step['baseline'][rate]:.4g}, sum rule at the same θ and σ "
            f"{median_text(step, step_found, 'sum_rule', rate)} (worst case {step['sum_baseline'][rate]:.4g}); "
            f"whole run, per-step values held between checkpoints (an estimate, §4): certified per step "
            f"{median_text(whole, whole_found, 'certified', rate)}, "
            + (f"Monte Carlo per step {median_text(whole, whole_found, 'estimate', rate)}, " if "estimate" in whole
               else "")
            + f"mean-rule baseline {whole['baseline'][rate]:.4g}, sum rule worst case {whole['sum_baseline'][rate]:.4g}"
            for rate in ordered)
        ratio_text = ", ".join(f"q={rate:.4g}: certified/baseline "
                               f"{median_text(ratios, ratio_found, 'certified', rate, 3)}"
                               + (f", estimate/baseline {median_text(ratios, ratio_found, 'estimate', rate, 3)}"
                                  if rate in ratios["estimate"] else "") for rate in ordered)
        verdicts = drawn["verdicts"]
        judged_text = "; ".join(f"{VERDICT_PARTS[part]}, {series}: {verdict_text(judged)}"
                                for part, by_series in verdicts.items() for series, judged in by_series.items())
        whole_run_meaning = MATCHED_WHOLE_RUN if design == DESIGN_MATCHED else FIXED_WHOLE_RUN
        pairing = ("the same points at one checkpoint, resampled together" if design != DESIGN_MATCHED else
                   "one independent run per rate, each resampled on its own")
        lines.append(f"mean rule, {design}: per-step Rényi DP at α={config.renyi_order:g} (medians, 95% intervals) "
                     f"and ε over the whole run (δ={config.delta:g}, b=∞; {whole_run_meaning}): {per_rate}. "
                     f"Relative to the mean rule's baseline: {ratio_text}. Between adjacent rates, as q grows "
                     f"(factor of the median, 95% interval; {pairing}): {judged_text}")
        steps = claim_steps(verdicts["ratio"])
        for _, _, verdict in steps:
            tally[verdict if verdict in (FALLS, RISES) else "other"] += 1
        phrases.append(f"{design}: " + ", ".join(f"{first:.4g}→{second:.4g} {verdict}"
                                                 for first, second, verdict in steps))
    verdict = ("GLA's claim that a higher sampling rate gives the mean rule better data-dependent privacy (per "
               "step, relative to its own baseline) holds, by the 95% intervals of the certified and estimated "
               f"ratios (figure 3c: a step up in q supports it where both ratios' error bars fall "
               f"apart downwards), at {tally[FALLS]} of {sum(tally.values())} steps up in q; both ratios rise at "
               f"{tally[RISES]}, and {tally['other']} are mixed or show no difference at this precision — "
               + "; ".join(phrases)
               + "; the whole-run values also change with T and σ, so they do not judge it")
    return [*lines, verdict]


def configuration_lines(preset: str, config: ReproduceConfig) -> list[str]:
    """A table of every field of the configuration; the ones overridden on the command line are marked."""
    changed = overridden(config, preset)
    lines = ["| field | value |", "| --- | --- |"]
    lines += [f"| `{name}` | `{field_text(getattr(config, name))}`{' (overridden)' if name in changed else ''} |"
              for name in field_types()]
    return lines


def write_report(out_dir: str, preset: str, config: ReproduceConfig, argv: list[str], commands: Commands,
                 main_run: RunConfig, findings: dict, seconds: float) -> str:
    text = [f"# Per-instance privacy of DP-SGD: preset `{preset}`", "",
            f"`{shlex.join(['python', 'reproduce.py', *argv])}` took {seconds:.0f} s. Main run `{main_run.run}` "
            f"on `{main_run.dataset}`: sigma = {main_run.noise_multiplier:.4g}, q = {main_run.sample_rate:.4g}, "
            f"T = {main_run.total_steps}, Γ = {main_run.clip_bound:g}, N = {main_run.dataset_size}; "
            f"test accuracy at the end {findings['test_accuracy']:.4f}.", "", "## Findings", ""]
    text += [f"{index}. {line}" for index, line in enumerate(findings["headlines"], 1)]
    text += ["", "## Configuration", "", *configuration_lines(preset, config)]
    text += ["", "## Commands", "", "Every number above comes from these commands, in this order "
             "(\"cached\": the output of the same command on the same input was reused).", "", "```"]
    text += [f"{line}{'  # cached' if cached else ''}" for line, cached in commands.lines]
    text += ["```", "", "## Time and memory", "", *commands.timing_lines(seconds)]
    text += ["", "## Figures", ""] + [f"![{figure}]({figure})" for figure in sorted(figures_drawn(config))]
    path = os.path.join(out_dir, "report.md")
    fileio.write_text(path, "\n".join(text) + "\n")
    return path


def figures_drawn(config: ReproduceConfig) -> list[str]:
    """The figures a run of `config` writes: all of FIGURES, less the one-run audit's when `canaries` is 0."""
    return [figure for figure in FIGURES if config.canaries or figure != ONE_RUN_FIGURE]


def attack_lines(findings: dict) -> list[str]:
    """The audits, the mean rule's gap audit and the membership attack as report lines."""
    lines = []
    for rule, summary in findings["audit"].items():
        for step, result in summary.items():
            groups = ", ".join(f"{group} {values['median_lower']:.3g}/{values['median_upper']:.3g} (ratio "
                               + (interval_text(values["ratio_interval"]) if values["ratio_interval"] else
                                  f"{values['median_ratio']:.3g}")
                               + f", {values['points']} points)"
                               for group, values in result["groups"].items() if group != "all")
            lines.append(f"audit, {rule} rule, step {step}, {result['trials']:,} simulated steps per law, "
                         f"δ={result['delta']:g}: eps_lower/eps_upper medians ({result['upper_kind']} upper bound) "
                         f"{groups}; violated: {result['violated']} of {result['points']}")
    gap = findings["gap"]
    lines.append(
        f"the realised-size mean rule against the sum rule's accounting (run {gap['run']}: N={gap['dataset_size']}, "
        f"B={gap['batch_size']}, σ={gap['noise_multiplier']:g}, audited at step {gap['step']}, {gap['trials']:,} "
        f"simulated steps per law, δ={gap['delta']:g}): eps_lower (95%) median "
        f"{interval_text(gap['median_lower_interval'])} (95% interval over the points), max "
        f"{gap['max_lower']:.3g}; above the sum rule's per-step ε {gap['sum_rule_eps']:.4g} for {gap['above_sum_rule']} "
        f"of {gap['points']} points ({gap['above_sum_rule_jointly']} with all bounds holding together), above the mean "
        f"rule's own baseline {gap['mean_baseline_eps']:.4g} (k_min={gap['k_min']}) for {gap['above_baseline']}"
        + (" — the sum rule's accounting does NOT cover the realised-size mean rule" if gap["above_sum_rule_jointly"]
           else " — no gap shown at this size"))
    attack = findings["membership"]
    lines.append("membership inference (loss threshold, per class): " + "; ".join(
        f"{model}: mean attack accuracy {attack_accuracy_text(values)}, Pearson r(attack, class ε) = "
        f"{r_text(values['pearson_attack'], values['pearson_attack_interval'])}, r(test accuracy, class ε) = "
        f"{values['pearson_test']:.2f}" for model, values in attack.items()))
    return lines


def one_run_lines(config: ReproduceConfig, findings: dict) -> list[str]:
    """The one-run audit (docs/audit.md §1b): a line per canary group of the main run, what such an audit can and
    cannot show, and the realised-size mean rule's canaries against the sum rule's accounting (§1c)."""
    audited = findings["one_run"]
    if audited is None:
        return ["one-run audit of the trained main run: not run (canaries=0)", *gap_canary_lines(config, findings)]
    lines = []
    for row in audited["rows"]:
        ideal = row["ideal_lower_bound"]
        lines.append(
            f"one-run audit of the trained main run, gradient canaries of norm {row['norm']:g}·Γ ({row['canaries']} "
            f"canaries, {row['included']} in; significance {row['significance']:g} split over the groups, "
            f"{row['group_significance']:.3g} here; δ={row['delta']:g}): lower bound {row['lower_bound']:.3g} (f-DP "
            f"test against the accountant's curves, likelihood ratio of every step), {row['lower_bound_summed']:.3g} "
            f"from the summed projection (last-iterate), {row['steinke_lower']:.3g} by Steinke et al.'s (ε, δ) test; "
            f"upper bound of a point of that sensitivity {row['upper_bound']:.4g} (RDP {row['upper_rdp']:.4g}, PLD "
            f"{row['upper_pld']:.4g}), lower/upper {row['tightness']:.3g}; the same test on the idealised mechanism "
            f"(same m, q, T, σ/c; median of its simulations) {ideal:.3g}"
            + (f", lower/ideal {row['lower_bound'] / ideal:.3g}" if ideal > 0 else "")
            + f"; caps of these canaries: {row['fdp_cap']:.3g} (f-DP test), {row['steinke_cap']:.3g} ((ε, δ) test)"
            + (" — VIOLATION: the canaries reject the accountant's trade-off curve; the accounting or the training "
               "code is wrong" if row["violated"] else " — no violation"))
    caps = ", ".join(f"{row['fdp_cap']:.3g} for c={row['norm']:g}" for row in audited["rows"])
    lines.append(
        "what the one-run audit shows: the gradient canaries are insertions of c·Γ·u into the noisy gradient sum, "
        "sampled by the run's own Poisson sampler (not examples the model is trained on), and each is seen at every "
        "step; the f-DP test holds them against the whole trade-off curve the accountant claims for their "
        "sensitivity, and a rejected curve would prove the accounting or the noise and sampling code wrong. They "
        "skip the per-sample gradients and the clipping (input canaries test those: train_dpsgd.py "
        "--input-canaries, and audit.py --self-test plants such faults). A lower bound below the upper bound proves "
        f"nothing about how loose the bound is: these canaries cannot show more than {caps} (the f-DP test's caps, "
        "every guess right, docs/accounting.md §11.9), and the idealised mechanism's bound says how much of the gap "
        "is the test's own")
    return lines + gap_canary_lines(config, findings)


def gap_canary_lines(config: ReproduceConfig, findings: dict) -> list[str]:
    """The realised-size mean rule's canaries against the sum rule's accounting (docs/audit.md §1c), one line."""
    gap = findings["one_run_gap"]
    if gap is None:
        return ["the realised-size mean rule against the sum rule's accounting in a trained run: not run "
                "(gap_canaries=0); docs/audit.md §1c has measured numbers"]
    level = f"significance {config.audit_significance:g}, δ={config.delta:g}"
    needed = ("with any number of canaries" if gap["canaries_needed"] is None
              else f"with fewer than {gap['canaries_needed']:,} canaries")
    return [
        f"the realised-size mean rule against the sum rule's accounting in a trained run (run {gap['run']}: "
        f"{gap['canaries']} canaries of norm Γ, {gap['included']} in, B_exp={gap['batch_size']}, "
        f"σ={gap['noise_multiplier']:g}, T={gap['steps']}; {level}): lower bound {gap['lower_bound']:.3g} (f-DP "
        f"test) against the sum rule's upper bound {gap['eps_upper']:.4g} (RDP {gap['upper_rdp']:.4g}, PLD "
        f"{gap['upper_pld']:.4g}) — "
        + ("the sum rule's accounting does NOT cover the realised-size mean rule: the trained run leaks more"
           if gap["violated"] else
           f"not seen: these canaries cannot show more than {gap['fdp_cap']:.3g} (the f-DP test's cap), and no "
           f"(ε, δ) test of docs/accounting.md §11.2 passes {gap['eps_upper']:.4g} {needed} (its cap with the "
           f"frontier's thresholds, §11.6; necessary, not sufficient). More canaries of this kind "
           f"do not help (measured up to 1,024 in docs/audit.md §1c): the "
           f"{gap['included']} in already add {gap['canaries_per_step']:.2g} per step to a batch of "
           f"{gap['batch_size']} expected points, and a canary drawn into a batch moves the update on average by "
           f"{gap['signal_ratio']:.3g}× what it moves it by under the sum rule (docs/audit.md §1c), less as canaries "
           "are added; the "
           "gap lives in the rare steps whose realised batch is tiny, which the per-step audit (above) tests")]


def attack_accuracy_text(values: dict) -> str:
    """The membership attack's mean accuracy over classes, its 95% interval (classes resampled), and its verdict
    against chance (0.5)."""
    accuracy = values["attack_accuracy_interval"]
    counts = f"{values['classes']} classes, {values['points']} points"
    if accuracy is None:
        return f"undefined ({counts})"
    against = ("above chance" if accuracy.low > 0.5 else "below chance" if accuracy.high < 0.5
               else "no difference from chance (0.5) at this precision")
    return (f"{accuracy.estimate:.3f} [{accuracy.low:.3f}, {accuracy.high:.3f}] (95% interval over {counts}): "
            f"{against}")

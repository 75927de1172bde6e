"""The report's findings on the bounds held against attacks (docs/audit.md; figures 7 to 10): the simulated
per-instance audits, the realised-size mean rule against the sum rule's accounting, the membership attack, and the
one-run audit of the trained main run and of a realised-size mean-rule run.
"""

from perinstance.accounting.intervals import Interval
from perinstance.experiments.config import ReproduceConfig
from perinstance.experiments.report_cells import (
    BOUND,
    EMPTY,
    LOWER_BOUND,
    MONTE_CARLO,
    Headline,
    confidence,
    count,
    figure_files,
    interval,
    more_link,
    number,
    of,
    pearson,
)
from perinstance.plots.document import Finding, Table

AUDIT_GROUPS = ("easy", "hard", "misclassified", "all")
UPPER_KINDS = {"exact": "exact", "estimate": MONTE_CARLO}
VIOLATED = "lower bound above the upper bound"
ALL = "all"
# Findings 13 and 19's rows that the summary quotes.
ABOVE_SUM_RULE_JOINTLY = "points above the sum rule's ε, all lower bounds holding together"
SUM_RULE_EPS = "the sum rule's per-step ε at the same σ and q"
FAMILY = "f-DP family bound, likelihood ratio"
ASSUMPTION_FREE = "Steinke et al.'s (ε, δ) test, likelihood ratio (assumption-free)"
UPPER_PLD = "upper bound, PLD"


def audit_findings(config: ReproduceConfig, findings: dict) -> tuple[list[Finding], list[Headline]]:
    """Findings 11 to 19 and their summary rows: the audits, the gap audit, the membership attack, then the one-run
    audit (a finding per canary group, what it can show, the realised-size mean rule's canaries)."""
    built, headlines = [], []
    for rule, summary in findings["audit"].items():
        for step, result in summary.items():
            finding = simulated_audit_finding(rule, step, result)
            built.append(finding)
            kind = LOWER_BOUND if result["upper_kind"] == "exact" else f"{LOWER_BOUND} against a {MONTE_CARLO}"
            headlines.append(Headline(f"audited points whose lower bound beats the upper bound ({rule} rule)",
                                      finding.key, ALL, VIOLATED, None, kind))
    built.append(gap_finding(findings["gap"]))
    headlines.append(Headline("realised-size mean rule: points whose lower bound exceeds the sum rule's per-step ε",
                              "mean-rule-gap", ABOVE_SUM_RULE_JOINTLY, "value", (SUM_RULE_EPS, "value"),
                              "lower bounds (95% together)"))
    built.append(membership_finding(findings["membership"]))
    headlines.append(Headline("membership attack accuracy per class under DP", "membership", "DP",
                              "mean attack accuracy", ("DP", "chance"), "measured (95% interval over the classes)"))
    audited = findings["one_run"]
    if audited is None:
        built.append(Finding("one-run-audit", "One-run audit of the main run",
                             "Not run: the main run carries no canaries (canaries = 0).",
                             more=more_link("one-run-audit")))
    else:
        groups = [one_run_group_finding(row) for row in audited["rows"]]
        built += [*groups, one_run_scope_finding(audited["rows"])]
        level = confidence(audited["rows"][-1]["group_significance"])
        headlines += [
            Headline(f"one-run audit, canaries of norm {audited['rows'][-1]['norm']:g}·Γ: f-DP family bound (if the "
                     "run's trade-off curve has the subsampled-Gaussian shape)", groups[-1].key, FAMILY, "ε",
                     (UPPER_PLD, "ε"), level),
            Headline("the same canaries' assumption-free bound (Steinke et al.)", groups[-1].key, ASSUMPTION_FREE,
                     "ε", (UPPER_PLD, "ε"), level)]
    built.append(gap_canary_finding(config, findings["one_run_gap"]))
    return built, headlines


def simulated_audit_finding(rule: str, step: int, result: dict) -> Finding:
    """Finding 11 or 12: the per-instance audit of one rule, its groups' medians of the empirical lower bound, the
    upper bound and their ratio (with its 95% interval), and whether any upper bound is violated."""
    upper = UPPER_KINDS.get(result["upper_kind"], result["upper_kind"])
    rows = []
    for group in AUDIT_GROUPS:
        values = result["groups"].get(group)
        if values is None:
            continue
        rows.append((group, count(values["points"]), number(values["median_lower"]), number(values["median_upper"]),
                     interval(values["ratio_interval"], values["median_ratio"]),
                     of(result["violated"], result["points"]) if group == ALL else EMPTY))
    if result["violated"]:
        takeaway = (f"VIOLATED: {of(result['violated'], result['points'])} audited points have a lower bound above "
                    f"their upper bound; " + ("these upper bounds are wrong." if upper == "exact" else
                                              "this Monte Carlo estimate is wrong or too noisy."))
    elif upper == "exact":
        takeaway = f"No upper bound is violated: none of the {count(result['points'])} audited points has a lower " \
                   "bound (95%) above its exact upper bound."
    else:
        takeaway = f"None of the {count(result['points'])} audited points has a lower bound (95%) above its upper " \
                   f"bound, here a {MONTE_CARLO} (not a bound)."
    return Finding(
        f"audit-{rule}", f"Simulated audit of the {rule} rule", takeaway,
        Table(("group", "points", "median lower bound (95%)", f"median upper bound ({upper})",
               "median lower ÷ upper", VIOLATED), tuple(rows),
              title=f"Step {step}, {count(result['trials'])} simulated steps per law, δ = {result['delta']:g}; easy "
                    "and hard: correctly classified points below and at or above their median upper bound"),
        figures=figure_files(r"7_audit\.png") if rule == "sum" else figure_files(r"7_audit_mean"),
        more=more_link(f"audit-{rule}"))


def gap_finding(gap: dict) -> Finding:
    """Finding 13 (docs/audit.md §1): every point's empirical lower bound of the realised-size mean-rule run against
    the sum rule's per-step ε at the same σ and q, each bound at 95% and all of them holding together (Bonferroni
    over the points), and against the mean rule's own baseline."""
    points = gap["points"]
    rows = (("lower bound (95%), median point", interval(gap["median_lower_interval"], gap["median_lower"])),
            ("largest lower bound (95%)", number(gap["max_lower"])),
            (SUM_RULE_EPS, number(gap["sum_rule_eps"])),
            ("points above the sum rule's ε, each lower bound at 95%", of(gap["above_sum_rule"], points)),
            (ABOVE_SUM_RULE_JOINTLY, of(gap["above_sum_rule_jointly"], points)),
            (f"the mean rule's own per-step baseline (k_min = {gap['k_min']})", number(gap["mean_baseline_eps"])),
            ("points above the mean rule's baseline, each lower bound at 95%", of(gap["above_baseline"], points)))
    if gap["above_sum_rule_jointly"]:
        takeaway = (f"The sum rule's accounting does NOT cover the realised-size mean rule: with all {count(points)} "
                    f"lower bounds holding together, {of(gap['above_sum_rule_jointly'], points)} points exceed the "
                    "per-step ε it prints.")
    else:
        takeaway = ("No gap shown at this size: with all lower bounds holding together, no point exceeds the sum "
                    "rule's per-step ε.")
    return Finding(
        "mean-rule-gap", "The realised-size mean rule against the sum rule's accounting", takeaway,
        Table(("", "value"), rows,
              title=f"Run {gap['run']}: N = {gap['dataset_size']}, B = {gap['batch_size']}, σ = "
                    f"{gap['noise_multiplier']:g}, audited at step {gap['step']}, {count(gap['trials'])} simulated "
                    f"steps per law, δ = {gap['delta']:g}; holding together: each point's bound at confidence "
                    f"1 − 5%/{points}, so that all {count(points)} hold at once with probability at least 95% "
                    "(Bonferroni)"),
        figures=figure_files(r"9_"), more=more_link("mean-rule-gap"),
        note=(f"{of(gap['above_baseline'], points)} points exceed the mean rule's own baseline: that baseline is WRONG."
              if gap["above_baseline"] else ""))


def against_chance(found: Interval | None) -> str:
    """The membership attack's mean accuracy against chance (0.5), from its 95% interval."""
    if found is None:
        return "undefined"
    return ("above chance" if found.low > 0.5 else "below chance" if found.high < 0.5
            else "no difference at this precision")


def membership_finding(attack: dict) -> Finding:
    """Finding 14: the loss-threshold attack per class on the DP and the non-private model: its mean accuracy over
    the classes against chance, and its correlation with the class's composed ε."""
    rows = tuple((model, interval(values["attack_accuracy_interval"], values["mean_attack_accuracy"]), "0.5",
                  against_chance(values["attack_accuracy_interval"]), count(values["classes"]),
                  count(values["points"]), pearson(values["pearson_attack"], values["pearson_attack_interval"]),
                  number(values["pearson_test"]))
                 for model, values in attack.items())
    verdicts = {against_chance(values["attack_accuracy_interval"]) for values in attack.values()}
    if verdicts == {"no difference at this precision"}:
        takeaway = "The loss-threshold attack does not beat chance at this precision, with or without DP."
    else:
        phrases = {"no difference at this precision": "not different from chance at this precision"}
        takeaway = "By the 95% interval of its mean accuracy, the loss-threshold attack is " + "; ".join(
            f"{phrases.get(verdict, verdict)} on the {model} model"
            for model, verdict in ((model, against_chance(values["attack_accuracy_interval"]))
                                   for model, values in attack.items())) + "."
    return Finding(
        "membership", "Membership inference per class", takeaway,
        Table(("model", "mean attack accuracy", "chance", "against chance", "classes", "points",
               "r(attack accuracy, class ε)", "r(test accuracy, class ε)"), rows,
              title="Loss-threshold attack, a threshold per class; the mean over the classes with its 95% interval "
                    "(the classes resampled); class ε: the DP run's composed ε"),
        figures=figure_files(r"8_"), more=more_link("membership"))


def group_key(norm: float) -> str:
    return "one-run-c" + f"{norm:g}".replace(".", "-")


def one_run_group_finding(row: dict) -> Finding:
    """Findings 15 to 17: one canary group of the main run: its f-DP family bound (which assumes the run's
    trade-off curve has the subsampled-Gaussian shape, docs/accounting.md §11.9) beside the assumption-free bound
    of Steinke et al.'s test (§11.2), each at the group's level α/G, against the upper bound of a point of that
    sensitivity and the same test on the idealised mechanism."""
    level = confidence(row["group_significance"])
    family_kind = f"{level}, if the curve has the subsampled-Gaussian shape"
    ideal = row["ideal_lower_bound"]
    upper = row["upper_bound"]
    rows = [(FAMILY, number(row["lower_bound"]), family_kind),
            ("f-DP family bound, summed projection (last-iterate)", number(row["lower_bound_summed"]), family_kind),
            (ASSUMPTION_FREE, number(row["steinke_lower"]), level),
            (UPPER_PLD, number(row["upper_pld"]), BOUND), ("upper bound, RDP", number(row["upper_rdp"]), BOUND),
            ("f-DP family bound of the idealised mechanism (median of its simulations)", number(ideal),
             "the same test on simulated runs that leak exactly the claim"),
            ("family bound ÷ upper bound", number(row["tightness"]), EMPTY),
            ("assumption-free bound ÷ upper bound", number(row["steinke_lower"] / upper) if upper > 0 else EMPTY,
             EMPTY)]
    if ideal > 0:
        rows.append(("family bound ÷ idealised", number(row["lower_bound"] / ideal), EMPTY))
    if row["violated"]:
        takeaway = ("VIOLATION: these canaries reject the accountant's trade-off curve: the accounting or the training "
                    "code is wrong.")
    elif row["lower_bound"] == 0 and row["steinke_lower"] == 0:
        takeaway = f"No violation; these canaries show no lower bound above 0 against the upper bound {number(upper)}."
    else:
        takeaway = (f"No violation; the assumption-free lower bound is {number(row['steinke_lower'])} against the "
                    f"upper bound {number(upper)}, and the f-DP family bound, {number(row['lower_bound'])}, holds only "
                    "if the run's trade-off curve has the subsampled-Gaussian shape.")
    return Finding(
        group_key(row["norm"]), f"One-run audit, gradient canaries of norm {row['norm']:g}·Γ", takeaway,
        Table(("", "ε", "kind"), tuple(rows),
              title=f"{count(row['canaries'])} canaries, {count(row['included'])} in; ε over the whole run at "
                    f"δ = {row['delta']:g}; each bound at level {row['significance']:g}/{groups_of(row)} = "
                    f"{row['group_significance']:.3g}"),
        figures=figure_files(r"10_"), more=more_link("one-run-audit"))


def groups_of(row: dict) -> int:
    """G, the number of canary groups the significance is split over (§11.7)."""
    return round(row["significance"] / row["group_significance"])


def one_run_scope_finding(rows: list[dict]) -> Finding:
    """Finding 18: what the one-run audit shows: its verdict over all groups together, and per group the caps of
    its tests (the bound of perfectly separated scores), beyond which these canaries cannot show anything."""
    first = rows[0]
    violated = sum(bool(row["violated"]) for row in rows)
    table = Table(("canary norm", "canaries (in)", "level", "f-DP test's cap", "(ε, δ) test's cap",
                   "upper bound (PLD)", "curve rejected"),
                  tuple((f"{row['norm']:g}·Γ", f"{count(row['canaries'])} ({count(row['included'])})",
                         f"{row['group_significance']:.3g}", number(row["fdp_cap"]), number(row["steinke_cap"]),
                         number(row["upper_pld"]), "yes" if row["violated"] else "no") for row in rows),
                  title=f"Each group tested at {first['significance']:g}/{len(rows)}; a cap is the bound of "
                        "perfectly separated scores (docs/accounting.md §11.9)")
    verdict = ("no group's canaries reject the accountant's trade-off curve" if not violated else
               f"{violated} group(s) reject the accountant's trade-off curve")
    return Finding(
        "one-run-scope", "What the one-run audit can show",
        f"The verdict, {verdict}, holds for the {len(rows)} groups together at {first['significance']:g}; a lower "
        "bound below the upper bound says nothing of how loose the bound is, since these canaries cannot show more "
        "than their caps.",
        table, figures=figure_files(r"10_"), more=more_link("one-run-scope"),
        note="Gradient canaries skip per-sample gradients and clipping; input canaries test those.")


def gap_canary_finding(config: ReproduceConfig, gap: dict | None) -> Finding:
    """Finding 19 (docs/audit.md §1c): a realised-size mean-rule run's canaries against the sum rule's accounting:
    the f-DP test's lower bound, its cap with these canaries and the perfectly separated canaries it needs to show
    the upper bound."""
    key, title = "mean-rule-gap-canaries", "The realised-size mean rule's canaries against the sum rule's accounting"
    if gap is None:
        return Finding(key, title, "Not run (gap_canaries = 0).", more=more_link(key))
    upper = number(gap["eps_upper"])
    needed = ("none suffice" if gap["canaries_needed"] is None else f"at least {count(gap['canaries_needed'])}")
    rows = (("lower bound, f-DP test", number(gap["lower_bound"]), confidence(gap["group_significance"])),
            ("lower bound, Steinke et al.'s (ε, δ) test (assumption-free)", number(gap["steinke_lower"]),
             confidence(gap["group_significance"])),
            ("the sum rule's upper bound, PLD", upper, BOUND),
            ("the sum rule's upper bound, RDP", number(gap["upper_rdp"]), BOUND),
            ("the f-DP test's cap with these canaries", number(gap["fdp_cap"]), EMPTY),
            (f"perfectly separated canaries the f-DP test needs to show {upper}", needed, "necessary, not sufficient"),
            ("canaries in a batch, expected per step", f"{gap['canaries_per_step']:.2g}", EMPTY),
            ("a drawn canary's move of the update ÷ the sum rule's", f"{gap['signal_ratio']:.3g}×", EMPTY))
    if gap["violated"]:
        takeaway = "The canaries show it: the sum rule's accounting does NOT cover the realised-size mean rule."
    else:
        takeaway = (f"These canaries do not see the gap of [the per-step audit](#mean-rule-gap): their lower bound is "
                    f"{number(gap['lower_bound'])} against {upper}, and "
                    + (f"no number of perfectly separated canaries lets the f-DP test show {upper}."
                       if gap["canaries_needed"] is None else
                       f"the f-DP test needs {needed} perfectly separated canaries to show {upper}."))
    return Finding(
        key, title, takeaway,
        Table(("", "value", "kind"), rows,
              title=f"Run {gap['run']}: {count(gap['canaries'])} canaries of norm Γ, {count(gap['included'])} in, "
                    f"B_exp = {gap['batch_size']}, σ = {gap['noise_multiplier']:g}, T = {gap['steps']}; level "
                    f"{config.audit_significance:g}, δ = {config.delta:g}"),
        more=more_link(key),
        note="More canaries of this kind do not help: they join the small batches they probe.")

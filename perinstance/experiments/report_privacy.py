"""The report's findings on the main run's own privacy (figures 1, 2, 4, 5 and 6): per step, by correctness, over
the whole run, by accountant, against loss and class, and the held-Δ* estimate against the bound. Each is a
one-sentence takeaway, a table of its numbers with their 95% intervals (docs/accounting.md §10), and the rows it
gives the summary table.
"""

from perinstance.accounting.intervals import Interval
from perinstance.experiments.config import ReproduceConfig
from perinstance.experiments.report_cells import (
    BOUND,
    BOUND_ALONG_RUN,
    EMPTY,
    HELD_ESTIMATE,
    Headline,
    count,
    figure_files,
    interval,
    more_link,
    number,
    pearson,
    percent,
    share,
)
from perinstance.plots.document import Finding, Table

MEDIAN = "median point"
WORST = "worst case (DP-SGD)"


def privacy_findings(config: ReproduceConfig, findings: dict) -> tuple[list[Finding], list[Headline]]:
    """Findings 1 and 2 (one step), 7 to 10 (the whole run), in the report's order, and their summary rows; the
    mean rule's findings go between the two groups (report.py)."""
    per_step = [per_step_finding(config, findings), correctness_finding(findings["correctness"], findings)]
    whole_run = [composed_finding(config, findings), accountants_finding(findings),
                 loss_and_class_finding(findings["individual"]), held_estimate_finding(findings["estimate"])]
    kind = BOUND_ALONG_RUN if findings["composed_bound"] else HELD_ESTIMATE
    headlines = [
        Headline("per-step ε of the median point (sum rule, final checkpoint)", "per-step-eps", MEDIAN, "per-step ε",
                 (WORST, "per-step ε"), BOUND),
        Headline("misclassified ÷ correctly classified points, median per-step ε", "misclassified",
                 "misclassified ÷ correct", "median per-step ε", None, "ratio of bounds"),
        Headline("ε over the whole run, median point (Rényi DP, b = ∞)", "composed-eps", MEDIAN, composed_column(findings),
                 (WORST, BOUND_COLUMN), kind),
        Headline("the same by privacy loss distributions", "accountants", "PLD", "median point", ("PLD", "worst case"),
                 kind),
        Headline("Pearson r of whole-run ε with log final training loss", "loss-and-class", LOSS_ROW, "value", None,
                 "correlation of bounds"),
    ]
    if findings["estimate"]["relative_median"] is not None:  # else the finding has no table of the comparison
        headlines.insert(4, Headline("points whose held-Δ* estimate falls below their bound", "held-estimate",
                                     SHARE_BELOW, "value", None, "held-Δ* estimate against the bound"))
    return per_step + whole_run, headlines


def per_step_finding(config: ReproduceConfig, findings: dict) -> Finding:
    """Finding 1: the per-step ε of every point at the final checkpoint against the worst case."""
    hist = findings["histogram"]
    median, worst, below = interval(hist["median_interval"], hist["median"]), number(hist["baseline"]), share(
        hist["share_2x_below"])
    return Finding(
        "per-step-eps", "Per-step ε of each point",
        f"At the final checkpoint {below} of the points lose at least 2× less privacy per step than DP-SGD's worst "
        f"case ({worst}); the median point's per-step ε is {number(hist['median'])}.",
        Table(("", "per-step ε", "kind"), ((MEDIAN, median, BOUND), (WORST, worst, BOUND),
                                           ("points at least 2× below the worst case", below, "share of the points")),
              title=f"Sum rule, one step at step {findings['total_steps']} (the final checkpoint), (ε, δ) at "
                    f"δ = {config.delta:g}; the median over {count(hist['median_interval'].count)} points"),
        figures=figure_files(r"1_"), more=more_link("per-step-eps"))


def correctness_finding(corr: dict, findings: dict) -> Finding:
    """Finding 2: whether misclassified points pay more, from the interval of the ratio of the two medians."""
    ratio = corr["ratio_interval"]
    if ratio is None:
        takeaway = "NOT borne out by this run: the ratio of the medians is undefined (a group has no points)."
    elif ratio.low > 1:
        takeaway = "Misclassified points pay more per step: the ratio of the medians is above 1 with its whole 95% " \
                   "interval."
    elif ratio.high < 1:
        takeaway = "NOT borne out by this run: misclassified points pay less per step (the whole 95% interval of " \
                   "the ratio is below 1)."
    else:
        takeaway = "NOT borne out by this run: no difference at this precision (the ratio's 95% interval holds 1)."
    intervals = corr["median_intervals"]
    return Finding(
        "misclassified", "Misclassified against correctly classified points", takeaway,
        Table(("", "points", "median per-step ε"),
              (("correctly classified", count(corr["count_correct"]),
                interval(intervals["correct"], corr["median_correct"])),
               ("misclassified", count(corr["count_misclassified"]),
                interval(intervals["misclassified"], corr["median_misclassified"])),
               ("misclassified ÷ correct", EMPTY, interval(ratio, corr["ratio"]))),
              title=f"Sum rule, one step at step {findings['total_steps']}; each group's median and the ratio of the "
                    "two, its groups resampled on their own"),
        figures=figure_files(r"2_"), more=more_link("misclassified"))


BOUND_COLUMN = "bound (Δ* at every step)"


def held_column(findings: dict) -> str:
    return f"held-Δ* estimate (Δ* at the {findings['estimate']['checkpoints']} checkpoints)"


def composed_column(findings: dict) -> str:
    """The column of finding 7 that holds the headline median: the bound when every point was tracked."""
    return BOUND_COLUMN if findings["composed_bound"] else held_column(findings)


def composed_finding(config: ReproduceConfig, findings: dict) -> Finding:
    """Finding 7: the headline composition over the whole run (a bound along the observed run when every point's
    Δ* was measured at every step, a held-Δ* estimate otherwise), and figure 4's points, by both."""
    accountants = findings["individual"]["accountants"]
    median = interval(findings["composed_median"])
    other = next(values for name, values in accountants.items() if name not in ("RDP", "PLD"))
    if findings["composed_bound"]:
        median_row = (MEDIAN, median, interval(other["median_interval"]))
        takeaway = (f"Over the {findings['total_steps']} steps the median point's composed ε is {number(findings['composed_median'].estimate)} "
                    f"against the worst case {number(findings['composed_baseline'])}: a bound along the observed run, "
                    "from Δ* of every point at every step.")
    else:
        median_row = (MEDIAN, EMPTY, median)
        takeaway = (f"Over the {findings['total_steps']} steps the median point's composed ε is {number(findings['composed_median'].estimate)} "
                    f"against the worst case {number(findings['composed_baseline'])}: a held-Δ* estimate, since only "
                    f"{count(other['points'])} points were tracked at every step.")
    curves = findings["curves"]
    rows = [median_row, *((label, number(value), number(curves["estimate_final"].get(label, float("nan"))))
                          for label, value in curves["final"].items()),
            (WORST, number(findings["composed_baseline"]), EMPTY)]
    return Finding(
        "composed-eps", "Whole-run ε of each point", takeaway,
        Table(("", BOUND_COLUMN, held_column(findings)), tuple(rows),
              title=f"Composed over {findings['total_steps']} steps, Rényi DP, b = ∞, δ = {config.delta:g}; the "
                    f"median over {count(findings['composed_median'].count)} points, then figure 4's points"),
        figures=figure_files(r"4_", r"5_"), more=more_link("composed-eps"))


def accountant_rows(findings: dict) -> list[tuple[str, str, dict]]:
    """(row label, kind, summary) per accountant of figure 5's third panel."""
    kind = BOUND_ALONG_RUN if findings["composed_bound"] else HELD_ESTIMATE
    rows = []
    for name, values in findings["individual"]["accountants"].items():
        if name in ("RDP", "PLD"):
            rows.append((name, kind, values))
        elif findings["composed_bound"]:
            rows.append(("RDP, Δ* held between the checkpoints", HELD_ESTIMATE, values))
        else:
            rows.append((f"RDP, Δ* at every step of the {count(values['points'])} tracked points", BOUND_ALONG_RUN,
                         values))
    return rows


def accountants_finding(findings: dict) -> Finding:
    """Finding 8: the composition of every point by each accountant: median, spread, worst case, the share of
    points below half the worst case."""
    accountants = findings["individual"]["accountants"]
    rdp, pld = accountants["RDP"], accountants["PLD"]
    tighter = "more" if pld["median"] < rdp["median"] else "no more"
    takeaway = (f"Privacy loss distributions compose the same sensitivities {tighter} tightly than Rényi DP: median "
                f"{number(pld['median'])} against {number(rdp['median'])}, worst case {number(pld['worst'])} against "
                f"{number(rdp['worst'])}.")
    rows = tuple((label, kind, interval(values["median_interval"], values["median"]),
                  f"{number(values['q10'])}–{number(values['q90'])}", number(values["worst"]), count(values["points"]),
                  share(values["share_below_half"]))
                 for label, kind, values in accountant_rows(findings))
    return Finding(
        "accountants", "Whole-run ε by accountant", takeaway,
        Table(("accountant", "kind", "median point", "10–90% of the points", "worst case", "points",
               "points below half the worst case"), rows,
              title=f"Composed over {findings['total_steps']} steps, b = ∞"),
        figures=figure_files(r"5_"), more=more_link("accountants"))


LOSS_ROW = "Pearson r: composed ε, log final training loss"
CLASS_ROW = "Pearson r: class mean ε, class test accuracy"


def correlation(found: Interval | None) -> str:
    """How one value goes with another, from the 95% interval of their Pearson r (§10)."""
    if found is None:
        return "has no defined correlation with"
    return ("correlates positively with" if found.low > 0 else "correlates negatively with" if found.high < 0
            else "shows no correlation at this precision with")


def loss_and_class_finding(individual: dict) -> Finding:
    """Finding 9: composed ε against the final training loss (points) and against the class test accuracy
    (classes), each Pearson r with its interval; the classes of lowest and highest accuracy."""
    loss, classes = individual["pearson_log_loss_interval"], individual["pearson_class_interval"]
    names = list(individual["class_mean_eps"])
    lowest, highest = names[individual["lowest_class"]], names[individual["highest_class"]]
    means = individual["class_mean_eps"]
    return Finding(
        "loss-and-class", "Composed ε against training loss and class",
        f"Composed ε {correlation(loss)} the final training loss over the points, and class mean ε "
        f"{correlation(classes)} class test accuracy over the classes.",
        Table(("", "value", "over"),
              ((LOSS_ROW, pearson(individual["pearson_log_loss"], loss),
                f"{count(loss.count)} points" if loss is not None else EMPTY),
               (CLASS_ROW, pearson(individual["pearson_class"], classes),
                f"{count(classes.count)} classes" if classes is not None else EMPTY),
               (f"mean ε of the class with the lowest test accuracy ({lowest})", number(means[lowest]), EMPTY),
               (f"mean ε of the class with the highest test accuracy ({highest})", number(means[highest]), EMPTY)),
              title="Composed ε as in [the whole-run ε](#composed-eps); Pearson r of paired values, the pairs "
                    "resampled together"),
        figures=figure_files(r"5_"), more=more_link("loss-and-class"))


SHARE_BELOW = "share of the points whose held-Δ* estimate is below their bound"


def held_estimate_finding(estimate: dict) -> Finding:
    """Finding 10: how far the composition that holds Δ* between checkpoints is from the bound from Δ* at every
    step, and in which direction, each statistic with its 95% interval over the points (§10)."""
    title = "The held-Δ* estimate against the bound"
    table_title = (f"{count(estimate['points'])} points; the held-Δ* estimate holds Δ* between the {estimate['checkpoints']} "
                   "checkpoints, the bound takes Δ* at every step")
    if estimate["relative_median"] is None:
        return Finding("held-estimate", title, "No point has a positive bound: there is nothing to compare.",
                       Table(("", "value"), (("points", count(estimate["points"])),), title=table_title),
                       figures=figure_files(r"6_"), more=more_link("held-estimate"))
    side = "below" if estimate["relative_largest_signed"] < 0 else "above"
    rows = [("relative error (held − bound) ÷ bound, median", percent(estimate["relative_median"])),
            (f"largest |relative error| ({side} its bound)", percent(estimate["relative_largest"], sign="")),
            ("points whose held-Δ* estimate is below their bound", count(estimate["count_below"])),
            (SHARE_BELOW, percent(estimate["share_below"], sign=""))]
    if estimate["shortfall_largest"] is not None:
        rows.append(("largest shortfall below the bound", percent(estimate["shortfall_largest"], sign="")))
    rows += [("Pearson r of held-Δ* estimate and bound", pearson(estimate["pearson"], estimate["pearson_interval"])),
             ("mean |held − bound|", number(estimate["mean_abs_error"])),
             ("largest |held − bound|", number(estimate["max_abs_error"]))]
    if estimate["count_below"]:
        takeaway = (f"Holding Δ* between checkpoints is not a bound: the held-Δ* estimate falls below the bound for "
                    f"{share(estimate['share_below'].estimate)} of the points.")
    else:
        takeaway = ("The held-Δ* estimate is at or above the bound for every point here, but holding Δ* between "
                    "checkpoints is not a bound.")
    return Finding("held-estimate", title, takeaway, Table(("", "value"), tuple(rows), title=table_title),
                   figures=figure_files(r"6_", r"4_"), more=more_link("held-estimate"))

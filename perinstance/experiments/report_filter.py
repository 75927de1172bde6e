"""The report's finding on the individual Rényi filter (docs/accounting.md §12-§13; filtered_run.py; figure 11): the
filtered run at the main run's σ, q and ε against uniform DP-SGD at the same worst-case ε, in test accuracy at the
main run's T and at the cap (differences with their 95% intervals over the test points), the points that left and
trained past uniform DP-SGD's last step, per class, and each point's composed ε against its guarantee.
"""

import numpy as np

from perinstance.accounting import intervals
from perinstance.accounting.mechanism import Mechanism
from perinstance.experiments.config import ReproduceConfig
from perinstance.experiments.filter_findings import guarantee_text, share_text
from perinstance.experiments.report_cells import (
    BOUND,
    EMPTY,
    Headline,
    count,
    figure_files,
    interval,
    more_link,
    number,
    of,
    percent,
)
from perinstance.plots.document import Finding, Table

FILTER = "individual filter"
UNIFORM = "uniform DP-SGD"
CHANGE_AT_CAP = "filter − uniform, test accuracy at the cap [95% interval]"
PAST_UNIFORM = "points trained past uniform DP-SGD's last step [95% interval]"
ABOVE_GUARANTEE = "points whose composed ε passes their guarantee"
MEASURED = "measured on the test points (one seed)"


def filter_findings(config: ReproduceConfig, comparison: dict | None) -> tuple[list[Finding], list[Headline]]:
    """The finding on the filtered run and its summary rows; where `filter_cap` is 0, a finding that says it did not
    run."""
    if comparison is None:
        return [Finding("filter-run", "The individual filter against uniform DP-SGD",
                        "Not run: filter_cap = 0 (a filtered run measures every point, which this preset does not "
                        "afford).", more=more_link("filter-run"))], []
    headlines = [Headline("individual filter: points trained past uniform DP-SGD's last step", "filter-run",
                          PAST_UNIFORM, FILTER, None, "share of the points"),
                 Headline("individual filter: points whose composed ε passes their guarantee", "filter-run",
                          ABOVE_GUARANTEE, FILTER, None, BOUND)]
    if comparison["accuracy"] is not None:
        headlines.insert(0, Headline("individual filter at the main run's ε: test accuracy at the cap − uniform "
                                     "DP-SGD's at T", "filter-run", CHANGE_AT_CAP, FILTER, None, MEASURED))
    return [filter_run_finding(config, comparison)], headlines


def accuracy_verdict(change: intervals.Interval) -> str:
    """Whether the filter's test accuracy is above or below uniform DP-SGD's, from the change's interval (§10)."""
    if change.low > 0:
        return "is higher than"
    if change.high < 0:
        return "is lower than"
    return "shows no difference at this precision from"


def filter_run_finding(config: ReproduceConfig, comparison: dict) -> Finding:
    """The filtered run against uniform DP-SGD: steps, ε, test accuracy at T and at the cap, the points that left
    and that trained past uniform DP-SGD's last step, each point's composed ε against its guarantee; per class."""
    filtered, steps = comparison["filtered"], comparison["main_steps"]
    cap = filtered.total_steps
    uniform_eps, _ = Mechanism.of_run(filtered.run).baseline_eps(filtered.delta, steps=steps)
    left = ~filtered.stayed
    above = int(np.sum(filtered.eps_rdp > filtered.guarantee))
    past = filtered.steps_trained > steps
    rows = [("steps", count(steps), f"{count(cap)} (the cap: {config.filter_cap:g} × T)"),
            (f"ε of every point at δ = {filtered.delta:g} (data-independent)", number(uniform_eps, 4),
             f"{guarantee_text(filtered)} (its guarantee)")]
    accuracy = comparison["accuracy"]
    if accuracy is not None:
        rows += [(f"test accuracy at step T = {steps}", f"{accuracy['uniform']:.4f}", f"{accuracy['at_steps']:.4f}"),
                 (f"test accuracy at the cap ({cap})", EMPTY, f"{accuracy['at_cap']:.4f}"),
                 ("filter − uniform, test accuracy at step T [95% interval]", EMPTY,
                  percent(accuracy["change_at_steps"])),
                 (CHANGE_AT_CAP, EMPTY, percent(accuracy["change_at_cap"]))]
    rows += [(PAST_UNIFORM, "0%", share_text(past)),
             ("points that left before the cap", EMPTY, of(int(left.sum()), len(left))),
             ("composed ε along the run (certified, RDP), median [95% interval]", EMPTY,
              interval(intervals.median_interval(filtered.eps_rdp))),
             (ABOVE_GUARANTEE, EMPTY, of(above, len(left)))]
    uniform = "the main run" if comparison["uniform_is_main"] else "the main run trained without its canaries"
    title = (f"Same σ = {filtered.run.noise_multiplier:.4g}, q = {filtered.run.sample_rate:.4g} and seed; {UNIFORM}: "
             f"{uniform} (`{comparison['uniform_run']}`), {steps} steps; {FILTER}: `{comparison['run']}`, budget "
             f"ε = {config.eps:g} at λ_f = {filtered.order:g} (a point charged at Γ at every step trains "
             f"{filtered.uniform_steps} steps), Δ* every {filtered.run.measure_every} steps, each point clipped at "
             f"(1 + {filtered.run.clip_margin:g})·Δ* in between")
    if accuracy is None:
        takeaway = (f"At the same σ, q and ε the filter trained {share_text(past)} of the points past step {steps}, "
                    "each within its guarantee.")
    else:
        takeaway = (f"At the same σ, q and ε the filter trained {share_text(past)} of the points past step {steps}, "
                    f"and its test accuracy at the cap {accuracy_verdict(accuracy['change_at_cap'])} uniform "
                    f"DP-SGD's at step {steps}: {percent(accuracy['change_at_cap'])}.")
    if above:
        takeaway = (f"FAULT: {of(above, len(left))} points have a composed ε above their guarantee, which the "
                    "filter's charges make impossible.")
    return Finding(
        "filter-run", "The individual filter against uniform DP-SGD at the same ε", takeaway,
        Table(("", UNIFORM, FILTER), tuple(rows), title=title),
        extra_tables=(class_table(comparison),),
        figures=figure_files(r"11_"),
        note="One seed: an accuracy's interval is over the test points, not training's randomness.",
        more=more_link("filter-run"))


def class_table(comparison: dict) -> Table:
    """Per class: its points, the shares that left before the cap and that trained past uniform DP-SGD's last step,
    and each run's test accuracy on the class."""
    filtered, steps = comparison["filtered"], comparison["main_steps"]
    accuracy = comparison["accuracy"]
    rows = []
    for label, name, members in comparison["classes"]:
        cells = [name, count(int(members.sum())), share_text(~filtered.stayed[members]),
                 share_text(filtered.steps_trained[members] > steps)]
        if accuracy is not None:
            cells += [number(accuracy["per_class"]["uniform"][label], 3),
                      number(accuracy["per_class"]["at_cap"][label], 3)]
        rows.append(tuple(cells))
    columns = ["class", "training points", "left before the cap [95% interval]",
               f"trained past step {steps} [95% interval]"]
    if accuracy is not None:
        columns += [f"test accuracy, {UNIFORM} at T", f"test accuracy, {FILTER} at the cap"]
    return Table(tuple(columns), tuple(rows), title="Per class; each interval is over the class's own training points")

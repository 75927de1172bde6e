"""Figures 1-6 of a reproduction and the numbers the findings quote from them (the drawing itself is in
perinstance/plots/).
"""

import os

import numpy as np
import pandas as pd

from perinstance.accounting import intervals, rdp_composition
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis import composition
from perinstance.experiments.commands import (
    CORRECTNESS_FIGURE,
    CURVES_FIGURE,
    ESTIMATE_FIGURE,
    HISTOGRAM_FIGURE,
    INDIVIDUAL_FIGURE,
    RATE_FIGURES,
)
from perinstance.experiments.config import DATA_ROOT, ReproduceConfig
from perinstance.experiments.main_run import COMPOSITION_HOLDER_B, Accounted, MainRun
from perinstance.experiments.sampling_rates import DESIGN_EARLY, DESIGN_FINAL, DESIGN_MATCHED, design_verdicts
from perinstance.files import checkpoints
from perinstance.plots import individual_plots, plots, sampling_rate_plots
from perinstance.train import evaluation, training
from perinstance.train.data import load_dataset
from perinstance.train.runs import RunConfig

# What the headline composition is (findings 7 and 8, figure 5), by whether every point was tracked (§4).
HEADLINE_LABEL = {True: "bound: Δ* at every step", False: "held-Δ* estimate: Δ* held between checkpoints"}
ESTIMATE_LABEL = "RDP, held-Δ* estimate (Δ* held between checkpoints)"


def final_rows(frame: pd.DataFrame, step: int) -> pd.DataFrame:
    return frame[frame["step"] == step]


def draw_figures(out_dir: str, config: ReproduceConfig, main: MainRun, accounted: Accounted, mean_results: dict,
                 device: str) -> dict:
    run = main.run
    final_step = max(checkpoints.saved_steps(main.run_dir))
    at_end = final_rows(main.sensitivities, final_step).set_index("point")
    findings = {}

    def path(name):
        return os.path.join(out_dir, name)

    # Figure 1: per-step ε of every point at the final checkpoint.
    step_eps = final_rows(accounted.per_step, final_step).set_index("point")
    baseline_step = float(step_eps["baseline_eps"].iloc[0])
    findings["histogram"] = plots.plot_per_step_histogram(
        step_eps["eps"].to_numpy(), baseline_step, path(HISTOGRAM_FIGURE), delta=float(step_eps["delta"].iloc[0]),
        title=f"Per-instance per-step ε at step {final_step} (sum rule)")

    # Figure 2: correct vs misclassified.
    correct = at_end.loc[step_eps.index, "correct"].astype(bool).to_numpy()
    findings["correctness"] = plots.plot_correct_vs_misclassified(
        step_eps["eps"].to_numpy(), correct, baseline_step, path(CORRECTNESS_FIGURE), "per-instance per-step ε",
        delta=float(step_eps["delta"].iloc[0]))
    findings["correctness"]["median_intervals"] = {
        group: intervals.median_interval(values) if len(values) else None
        for group, values in (("correct", step_eps["eps"].to_numpy()[correct]),
                              ("misclassified", step_eps["eps"].to_numpy()[~correct]))}

    # Figure 3: mean rule at several sampling rates.
    findings["rates"] = draw_mean_rule(mean_results, config, {quantity: path(name)
                                                              for quantity, name in RATE_FIGURES.items()})

    # Figure 4: composed ε over training of an easy, a hard and a misclassified tracked point: the bound from Δ* at
    # every step, and the estimate that holds Δ* between checkpoints.
    bound = accounted.bound.set_index("point")
    chosen = pick_points(bound["eps"], accounted.estimate.set_index("point")["eps"],
                         at_end.loc[bound.index, "correct"].astype(bool))
    findings["curves"] = plots.plot_composed_over_training(
        composition_curves(run, main.tracked(), chosen, config.delta), baseline_curve(run, config.delta),
        path(CURVES_FIGURE), config.delta, main.checkpoint_steps,
        estimates=composition_curves(run, main.sensitivities, chosen, config.delta))

    # Figure 5: individual accounting of every point vs its final loss; classes; the accountants.
    model, payload = training.load_model(run, main.run_dir, final_step, device)
    findings["test_accuracy"] = payload["test_accuracy"]
    dataset = load_dataset(run.dataset, DATA_ROOT, run.less_point)
    class_accuracy = evaluation.per_class_accuracy(model, dataset.test_x, dataset.test_y, dataset.num_classes, device)
    findings["test_accuracy_per_class"] = class_accuracy  # the per-point report's classes quote it too
    composed = accounted.composed.set_index("point")
    composed_pld = accounted.composed_pld.set_index("point").loc[composed.index]
    worst = float(composed["baseline_eps"].iloc[0])
    other, other_label = (accounted.estimate, ESTIMATE_LABEL) if main.every_point else \
        (accounted.bound, f"RDP, Δ* at every step (bound, {len(bound)} tracked points)")
    by_accountant = {"RDP": (composed["eps"].to_numpy(), worst),
                     "PLD": (composed_pld["eps"].to_numpy(), float(composed_pld["baseline_eps"].iloc[0])),
                     other_label: (other["eps"].to_numpy(), worst)}
    findings["individual"] = individual_plots.plot_individual_accounting(
        composed["eps"].to_numpy(), at_end.loc[composed.index, "loss"].to_numpy(),
        at_end.loc[composed.index, "label"].to_numpy(), dataset.class_names, class_accuracy, worst,
        path(INDIVIDUAL_FIGURE), delta=config.delta, by_accountant=by_accountant,
        what=f"per-instance composed ε\n({HEADLINE_LABEL[main.every_point]})")
    findings["individual"]["lowest_class"] = int(np.argmin(class_accuracy))
    findings["individual"]["highest_class"] = int(np.argmax(class_accuracy))

    # Figure 6: the held-Δ* estimate against the bound, on the points both cover.
    estimate = accounted.estimate.set_index("point")["eps"]
    points = bound.index.intersection(estimate.index)
    findings["estimate"] = plots.plot_estimate_accuracy(estimate.loc[points].to_numpy(),
                                                        bound.loc[points, "eps"].to_numpy(), path(ESTIMATE_FIGURE), worst,
                                                        delta=config.delta)
    findings["estimate"].update(points=len(points), checkpoints=len(main.checkpoint_steps))
    findings["composed_median"] = findings["individual"]["accountants"]["RDP"]["median_interval"]  # one bootstrap
    findings["composed_baseline"] = worst
    findings["composed_bound"] = main.every_point
    findings["total_steps"] = run.total_steps
    return findings


def draw_mean_rule(mean_results: dict, config: ReproduceConfig, paths: dict[str, str]) -> dict:
    """Figure 3 (its three files, `paths` by quantity: sampling_rate_plots.plot_sampling_rate_designs) and its
    numbers: both designs' per-step and whole-run guarantees of the mean rule by sampling rate, with the verdicts on
    their change between adjacent rates (§10; paired over the points in the fixed-checkpoint designs, independent
    runs in the matched-steps one)."""
    designs, facts, paired = {}, {}, {}
    for label, step in ((DESIGN_EARLY, "early"), (DESIGN_FINAL, "final")):
        by_rate = mean_results["fixed"][step]
        checkpoint = next(iter(by_rate.values()))[2]["checkpoint"]
        label_at = f"{label} (step {checkpoint})"
        designs[label_at] = ({rate: series[0] for rate, series in by_rate.items()},
                             {rate: series[1] for rate, series in by_rate.items()})
        facts[label_at] = {rate: series[2] for rate, series in by_rate.items()}
        paired[label_at] = True
    matched = mean_results["matched"]
    designs[DESIGN_MATCHED] = ({rate: series[0] for rate, series in matched.items()},
                               {rate: series[1] for rate, series in matched.items()})
    facts[DESIGN_MATCHED] = {rate: series[2] for rate, series in matched.items()}
    paired[DESIGN_MATCHED] = False
    drawn = sampling_rate_plots.plot_sampling_rate_designs(designs, config.renyi_order, config.delta, paths)
    return {design: {**values, "facts": facts[design],
                     "verdicts": design_verdicts(*designs[design], paired=paired[design])}
            for design, values in drawn.items()}


def pick_points(bound: pd.Series, estimate: pd.Series, correct: pd.Series) -> dict[str, int]:
    """Points of figure 4 by their composed ε (`bound`, indexed by point; `estimate`, the same points' checkpoint
    estimate where they have one): the correctly classified point of lowest ε and one at their median, the point
    whose estimate falls furthest below its bound (where one does), and a misclassified point at their median."""
    chosen = {}
    right = bound[correct.to_numpy()]
    if len(right):
        chosen[f"easy (point {right.idxmin()})"] = int(right.idxmin())
        point = int((right - right.median()).abs().idxmin())
        chosen[f"median (point {point})"] = point
    shortfall = ((bound - estimate.reindex(bound.index)) / bound).dropna()
    if len(shortfall) and shortfall.max() > 0:
        point = int(shortfall.idxmax())
        chosen[f"held-Δ* estimate furthest below its bound (point {point})"] = point
    wrong = bound[~correct.to_numpy()]
    if len(wrong):
        point = int((wrong - wrong.median()).abs().idxmin())
        chosen[f"misclassified (point {point})"] = point
    return chosen


def composition_curves(run: RunConfig, rows: pd.DataFrame, chosen: dict[str, int], delta: float) -> dict:
    """Composed ε after every step t = 0..T (accounting.md §4, b = COMPOSITION_HOLDER_B = ∞) of the chosen points, by
    the accountant's own composition (composition.compose_sum_rule, its default rounding) of their Δ* in `rows`: at
    every step (a bound) or at the checkpoints, held between them (a held-Δ* estimate)."""
    rows = rows[rows["point"].isin(list(chosen.values()))]
    table_of = rows.pivot_table(index="step", columns="point", values="value", aggfunc="first")
    ratio = (table_of[list(chosen.values())].to_numpy() / run.clip_bound)[None]
    # Every horizon from step 0 (no privacy spent) to T: the early steps, where every point is often still
    # clipped at Γ, are where the curves rise fastest.
    horizon = np.arange(run.total_steps + 1)
    eps, _ = composition.compose_sum_rule(ratio, table_of.index.to_numpy(), Mechanism.of_run(run, "sum"),
                                          orders=rdp_composition.COMPOSITION_ORDERS, delta=delta,
                                          holder_b=COMPOSITION_HOLDER_B, rounding=composition.SUM_RULE_ROUNDING,
                                          horizons=horizon[1:])
    return {label: (horizon, np.concatenate([[0.0], eps[:, index]])) for index, label in enumerate(chosen)}


def baseline_curve(run: RunConfig, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The worst case's composed ε after every step t = 0..T."""
    mechanism = Mechanism.of_run(run, "sum")
    horizon = np.arange(run.total_steps + 1)
    return horizon, np.asarray([0.0] + [mechanism.baseline_eps(delta, end, rdp_composition.COMPOSITION_ORDERS)[0]
                                        for end in horizon[1:]])

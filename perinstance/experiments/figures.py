"""Figures 1-6 of a reproduction and the numbers the findings quote from them (the drawing itself is in
perinstance/plots/).
"""

import os

import numpy as np
import pandas as pd

from perinstance.accounting import rdp_composition
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis import composition
from perinstance.experiments.commands import FIGURES
from perinstance.experiments.config import DATA_ROOT, ReproduceConfig
from perinstance.experiments.main_run import COMPOSITION_HOLDER_B
from perinstance.experiments.sampling_rates import DESIGN_EARLY, DESIGN_FINAL, DESIGN_MATCHED, design_verdicts
from perinstance.files import checkpoints
from perinstance.plots import plots, sampling_rate_plots
from perinstance.train import training
from perinstance.train.data import load_dataset
from perinstance.train.runs import RunConfig


def final_rows(frame: pd.DataFrame, step: int) -> pd.DataFrame:
    return frame[frame["step"] == step]


def draw_figures(out_dir: str, config: ReproduceConfig, main_run: RunConfig, run_dir: str, sensitivities: pd.DataFrame,
                 per_step: pd.DataFrame, composed: pd.DataFrame, composed_pld: pd.DataFrame, tracked: pd.DataFrame,
                 mean_results: dict, device: str) -> dict:
    final_step = max(checkpoints.saved_steps(run_dir))
    at_end = final_rows(sensitivities, final_step).set_index("point")
    findings = {}

    def path(name):
        return os.path.join(out_dir, name)

    # Figure 1: per-step ε of every point at the final checkpoint.
    step_eps = final_rows(per_step, final_step).set_index("point")
    baseline_step = float(step_eps["baseline_eps"].iloc[0])
    findings["histogram"] = plots.plot_per_step_histogram(
        step_eps["eps"].to_numpy(), baseline_step, path(FIGURES[0]),
        title=f"Per-instance per-step ε at step {final_step} (sum rule, δ={step_eps['delta'].iloc[0]:g})")

    # Figure 2: correct vs misclassified.
    correct = at_end.loc[step_eps.index, "correct"].astype(bool).to_numpy()
    findings["correctness"] = plots.plot_correct_vs_misclassified(
        step_eps["eps"].to_numpy(), correct, baseline_step, path(FIGURES[1]), "per-instance per-step ε")

    # Figure 3: mean rule at several sampling rates.
    findings["rates"] = draw_mean_rule(mean_results, config, path(FIGURES[2]))

    # Figure 4: composed ε over training for an easy, a hard and a misclassified point.
    composed = composed.set_index("point")
    chosen = pick_points(composed["eps"], at_end.loc[composed.index, "correct"].astype(bool))
    curves, baseline_curve, checkpoint_steps = composition_curves(main_run, sensitivities, chosen, config.delta)
    findings["curves"] = plots.plot_composed_over_training(curves, baseline_curve, path(FIGURES[3]), config.delta,
                                                           checkpoint_steps)

    # Figure 5: individual accounting of every point vs its final loss; classes.
    model, payload = training.load_model(main_run, run_dir, final_step, device)
    findings["test_accuracy"] = payload["test_accuracy"]
    dataset = load_dataset(main_run.dataset, DATA_ROOT, main_run.less_point)
    class_accuracy = training.per_class_accuracy(model, dataset.test_x, dataset.test_y, dataset.num_classes, device)
    composed_pld = composed_pld.set_index("point").loc[composed.index]
    by_accountant = {"RDP": (composed["eps"].to_numpy(), float(composed["baseline_eps"].iloc[0])),
                     "PLD": (composed_pld["eps"].to_numpy(), float(composed_pld["baseline_eps"].iloc[0]))}
    findings["individual"] = plots.plot_individual_accounting(
        composed["eps"].to_numpy(), at_end.loc[composed.index, "loss"].to_numpy(),
        at_end.loc[composed.index, "label"].to_numpy(), dataset.class_names, class_accuracy,
        float(composed["baseline_eps"].iloc[0]), path(FIGURES[4]), by_accountant)
    findings["individual"]["lowest_class"] = int(np.argmin(class_accuracy))
    findings["individual"]["highest_class"] = int(np.argmax(class_accuracy))

    # Figure 6: ε from norms at checkpoints only vs from norms at every step.
    exact = tracked.set_index("point")["eps"]
    findings["estimate"] = plots.plot_estimate_accuracy(
        composed.loc[exact.index, "eps"].to_numpy(), exact.to_numpy(), path(FIGURES[5]),
        float(composed["baseline_eps"].iloc[0]))
    findings["estimate"]["points"] = len(exact)
    findings["composed_median"] = findings["individual"]["accountants"]["RDP"]["median_interval"]  # one bootstrap
    findings["composed_baseline"] = float(composed["baseline_eps"].iloc[0])
    findings["total_steps"] = main_run.total_steps
    return findings


def draw_mean_rule(mean_results: dict, config: ReproduceConfig, path: str) -> dict:
    """Figure 3 and its numbers: both designs' per-step and whole-run guarantees of the mean rule by sampling rate,
    with the verdicts on their change between adjacent rates (§10; paired over the points in the fixed-checkpoint
    designs, independent runs in the matched-steps one)."""
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
    drawn = sampling_rate_plots.plot_sampling_rate_designs(designs, config.renyi_order, config.delta, path)
    return {design: {**values, "facts": facts[design],
                     "verdicts": design_verdicts(*designs[design], paired=paired[design])}
            for design, values in drawn.items()}


def pick_points(eps: pd.Series, correct: pd.Series) -> dict[str, int]:
    """An easy (lowest ε), a hard (highest ε) correctly classified point, and a misclassified one."""
    chosen = {}
    right = eps[correct.to_numpy()]
    if len(right):
        chosen[f"easy (point {right.idxmin()})"] = int(right.idxmin())
        chosen[f"hard (point {right.idxmax()})"] = int(right.idxmax())
    wrong = eps[~correct.to_numpy()]
    if len(wrong):
        point = int((wrong - wrong.median()).abs().idxmin())
        chosen[f"misclassified (point {point})"] = point
    return chosen


def composition_curves(run: RunConfig, sensitivities: pd.DataFrame, chosen: dict[str, int],
                       delta: float) -> tuple[dict, tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Composed ε after every step t = 0..T (accounting.md §4, b = COMPOSITION_HOLDER_B = ∞) for the chosen
    points, by the accountant's own composition (composition.compose_sum_rule, its default rounding), and
    the worst case; also the checkpoint steps whose Δ* charge the steps after them."""
    rows = sensitivities[sensitivities["point"].isin(list(chosen.values()))]
    table_of = rows.pivot_table(index="step", columns="point", values="value", aggfunc="first")
    steps = table_of.index.to_numpy()
    ratio = (table_of[list(chosen.values())].to_numpy() / run.clip_bound)[None]
    mechanism = Mechanism.of_run(run, "sum")
    # Every horizon from step 0 (no privacy spent) to T: the early steps, where every point is often still
    # clipped at Γ, are where the curves rise fastest.
    horizon = np.arange(run.total_steps + 1)
    eps, _ = composition.compose_sum_rule(ratio, steps, mechanism, orders=rdp_composition.COMPOSITION_ORDERS, delta=delta,
                                          holder_b=COMPOSITION_HOLDER_B, rounding=composition.SUM_RULE_ROUNDING,
                                          horizons=horizon[1:])
    curves = {label: (horizon, np.concatenate([[0.0], eps[:, index]])) for index, label in enumerate(chosen)}
    baseline = [0.0] + [mechanism.baseline_eps(delta, end, rdp_composition.COMPOSITION_ORDERS)[0] for end in horizon[1:]]
    return curves, (horizon, np.asarray(baseline)), steps

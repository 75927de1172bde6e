"""The bounds held against attacks (docs/audit.md): the per-instance audit of the sum rule on the main run and
of the mean rule on the matched-steps run at the main batch size, and the gap audit of the realised-size mean
rule against the sum rule's accounting on a small run.

Findings 11 to 13 (the audits, the gap audit); figures 7 and 7_audit_mean (drawn by audit.py), 9 and
9_gap_audit_bounds (drawn here).
"""

import os

import numpy as np

from perinstance.accounting import audit_bounds
from perinstance.accounting.mechanism import Mechanism
from perinstance.audit import audit_simulation
from perinstance.experiments.commands import AUDIT_FIGURES, GAP_BOUNDS_FIGURE, GAP_FIGURE, RES_DIR, Commands
from perinstance.experiments.config import ReproduceConfig, gap_run_flags
from perinstance.plots import audit_plots
from perinstance.train import runs, training


def audit_rules(commands: Commands, config: ReproduceConfig, main_name: str, mean_name: str, out_dir: str,
                device: str) -> dict[str, dict]:
    """Findings 11 and 12: {rule: audit summary}, the sum rule audited on the main run and the mean rule on the
    matched-steps run at the batch size nearest the main run's."""
    audits = {}
    mean_batch = min(config.mean_batch_sizes, key=lambda size: abs(size - config.batch_size))
    for rule, run_name, points in (("sum", main_name, config.audit_points),
                                   ("mean", f"{mean_name}-bs{mean_batch}", max(2, config.audit_points // 2))):
        out = os.path.join(RES_DIR, f"{run_name}_audit_{rule}.csv")
        figure = os.path.join(out_dir, AUDIT_FIGURES[rule])
        audited = commands.account("audit.py", ["--run", run_name, "--spread", str(points), "--rule", rule,
                                                "--trials", str(config.audit_trials), "--delta", str(config.delta),
                                                "--figure", figure, "--device", device], out,
                                   runs.run_file(os.path.join("models", run_name)))
        audits[rule] = audit_simulation.audit_summary(audited)
    return audits


def gap_audit(commands: Commands, config: ReproduceConfig, gap_name: str, out_dir: str, device: str) -> dict:
    """Finding 13 and figure 9 (docs/audit.md §1): a realised-size mean-rule run on the first gap_points training
    points, audited at its last checkpoint; every point's empirical lower bound against the sum rule's per-step
    ε at the same σ and q and the mean rule's own baseline (audit_simulation.gap_summary). Both figures 9 are drawn
    here from the audit's rows, with the note of why its points are mostly misclassified (gap_run_training); audit.py's
    own figure of the bounds stays next to its rows in res/."""
    commands.run("train_dpsgd.py", gap_run_flags(config, gap_name, device))
    run_dir = os.path.join("models", gap_name)
    out = os.path.join(RES_DIR, f"{gap_name}_audit_mean.csv")
    rows = commands.account("audit.py", ["--run", gap_name, "--points", "all", "--stage", "final", "--rule", "mean",
                                         "--trials", str(config.gap_trials), "--delta", str(config.delta),
                                         "--figure", os.path.splitext(out)[0] + ".png", "--device", device],
                            out, runs.run_file(run_dir))
    run = runs.load_run(run_dir)
    summary = audit_simulation.gap_summary(rows, Mechanism.of_run(run))
    step = max(summary)
    last = rows[rows["step"] == step]
    eps_lower, eps_upper = last["eps_lower"].to_numpy(), last["eps_upper"].to_numpy()
    correct = last["correct"].to_numpy().astype(bool)
    learned = gap_run_training(run, run_dir, step, correct)
    note = misclassified_note(learned)
    audit_plots.plot_audit_gap(eps_lower, eps_upper, correct, summary[step]["sum_rule_eps"],
                               summary[step]["mean_baseline_eps"], os.path.join(out_dir, GAP_FIGURE), delta=config.delta,
                               title=f"Audit of {gap_name}, step {step}:\nthe realised-size mean rule against the sum "
                                     "rule's accounting", note=note)
    audit_plots.plot_audit_bounds(eps_lower, eps_upper, correct, os.path.join(out_dir, GAP_BOUNDS_FIGURE),
                                  delta=config.delta, title=f"Audit of {gap_name}\nstep {step}, mean rule",
                                  upper_kind=last["upper_kind"].iloc[0], note=note)
    return {**summary[step], "step": step, "run": gap_name, "training": learned}


def gap_run_training(run: runs.RunConfig, run_dir: str, step: int, correct: np.ndarray) -> dict:
    """What the gap run learned by checkpoint `step`, which decides what "misclassified" means in figure 9: how many
    of its audited training points its model gets right (`correct`) with the 95% Clopper–Pearson interval, chance
    (1 / classes), its test accuracy, how far its weights moved from step 0 (L2), and, for plain SGD, the most the
    clipped gradients can move them: Σ_t lr_t·Γ, a step's mean of clipped gradients being at most Γ long (None for
    another optimizer)."""
    low, high = audit_bounds.clopper_pearson(int(correct.sum()), len(correct))
    _, payload = training.load_model(run, run_dir, step)
    plain_sgd = run.optimizer == "sgd" and run.momentum == 0
    return {"points": len(correct), "correct": int(correct.sum()), "accuracy_low": float(low),
            "accuracy_high": float(high), "chance": 1 / run.num_classes, "test_accuracy": payload["test_accuracy"],
            "steps": step, "weight_change": training.weight_change(run, run_dir, 0, step),
            "gradient_reach": (sum(training.learning_rate(run, t) for t in range(1, step + 1)) * run.clip_bound
                               if plain_sgd else None),
            "noise_multiplier": run.noise_multiplier, "batch_size": run.batch_size}


def misclassified_note(learned: dict) -> str:
    """Figure 9's note: why its points are mostly misclassified (or that they are not), from gap_run_training."""
    points, right = learned["points"], learned["correct"]
    text = (f"The run's final model gets {right} of these {points} training points right, {right / points:.0%} "
            f"[{learned['accuracy_low']:.0%}, {learned['accuracy_high']:.0%}] (95% Clopper–Pearson), against a chance "
            f"level of {learned['chance']:.0%}; its test accuracy is {learned['test_accuracy']:.1%}.")
    at_chance = learned["accuracy_low"] <= learned["chance"]
    reach = learned["gradient_reach"]
    if reach is not None and learned["weight_change"] > reach:
        text += (f" Over its {learned['steps']} steps its weights moved {learned['weight_change']:.3g} (L2), while the "
                 f"clipped gradients can move them by at most Σ lr·Γ = {reach:.3g}: the noise (σ = "
                 f"{learned['noise_multiplier']:g} on batches of about {learned['batch_size']} points) dominates the "
                 "updates.")
    if at_chance:
        text += (" The model is not distinguishable from chance, so 'misclassified' says that it has not learned, "
                 "not that these points are hard.")
    return text

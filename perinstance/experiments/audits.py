"""The bounds held against attacks (docs/audit.md): the per-instance audit of the sum rule on the main run and
of the mean rule on the matched-steps run at the main batch size, and the gap audit of the realised-size mean
rule against the sum rule's accounting on a small run.

Findings 11 to 13 (the audits, the gap audit); figures 7 and 7_audit_mean (drawn by audit.py), 9 and
9_gap_audit_bounds.
"""

import os

from perinstance.accounting.mechanism import Mechanism
from perinstance.audit import audit_simulation
from perinstance.experiments.commands import FIGURES, RES_DIR, Commands
from perinstance.experiments.config import ReproduceConfig, gap_run_flags
from perinstance.plots import audit_plots
from perinstance.train import runs


def audit_rules(commands: Commands, config: ReproduceConfig, main_name: str, mean_name: str, out_dir: str,
                device: str) -> dict[str, dict]:
    """Findings 11 and 12: {rule: audit summary}, the sum rule audited on the main run and the mean rule on the
    matched-steps run at the batch size nearest the main run's."""
    audits = {}
    mean_batch = min(config.mean_batch_sizes, key=lambda size: abs(size - config.batch_size))
    for rule, run_name, points in (("sum", main_name, config.audit_points),
                                   ("mean", f"{mean_name}-bs{mean_batch}", max(2, config.audit_points // 2))):
        out = os.path.join(RES_DIR, f"{run_name}_audit_{rule}.csv")
        figure = os.path.join(out_dir, FIGURES[6] if rule == "sum" else FIGURES[9])
        audited = commands.account("audit.py", ["--run", run_name, "--spread", str(points), "--rule", rule,
                                                "--trials", str(config.audit_trials), "--delta", str(config.delta),
                                                "--figure", figure, "--device", device], out,
                                   runs.run_file(os.path.join("models", run_name)))
        audits[rule] = audit_simulation.audit_summary(audited)
    return audits


def gap_audit(commands: Commands, config: ReproduceConfig, gap_name: str, out_dir: str, device: str) -> dict:
    """Finding 13 and figure 9 (docs/audit.md §1): a realised-size mean-rule run on the first gap_points training
    points, audited at its last checkpoint; every point's empirical lower bound against the sum rule's per-step
    ε at the same σ and q and the mean rule's own baseline (audit_simulation.gap_summary)."""
    commands.run("train_dpsgd.py", gap_run_flags(config, gap_name, device))
    run_dir = os.path.join("models", gap_name)
    out = os.path.join(RES_DIR, f"{gap_name}_audit_mean.csv")
    rows = commands.account("audit.py", ["--run", gap_name, "--points", "all", "--stage", "final", "--rule", "mean",
                                         "--trials", str(config.gap_trials), "--delta", str(config.delta),
                                         "--figure", os.path.join(out_dir, FIGURES[10]), "--device", device],
                            out, runs.run_file(run_dir))
    mechanism = Mechanism.of_run(runs.load_run(run_dir))
    summary = audit_simulation.gap_summary(rows, mechanism)
    step = max(summary)
    last = rows[rows["step"] == step]
    audit_plots.plot_audit_gap(last["eps_lower"].to_numpy(), last["eps_upper"].to_numpy(),
                               last["correct"].to_numpy().astype(bool), summary[step]["sum_rule_eps"],
                               summary[step]["mean_baseline_eps"], os.path.join(out_dir, FIGURES[8]),
                               title=f"Audit of {gap_name}, step {step}:\nthe realised-size mean rule against the sum "
                                     "rule's accounting")
    return {**summary[step], "step": step, "run": gap_name}

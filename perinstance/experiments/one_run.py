"""The one-run audit in a reproduction (docs/audit.md §1b, §1c): the canaries of the main run, group by group,
against the suite's accounting of a point of their sensitivity; and, when `gap_canaries` > 0, the canaries of a
realised-size mean-rule run against the sum rule's accounting.

Finding "one-run audit" (a line per canary group, the cap m puts on any lower bound) and "the mean rule's gap in
a trained run"; figure 10.
"""

import math
import os

import pandas as pd

from perinstance.accounting import one_run_audit
from perinstance.experiments.commands import ONE_RUN_FIGURE, RES_DIR, Commands
from perinstance.experiments.config import ReproduceConfig, canary_flags, gap_run_flags
from perinstance.plots import one_run_plots
from perinstance.train import canaries


def audit_canaries(commands: Commands, config: ReproduceConfig, run_name: str) -> pd.DataFrame:
    """audit.py --run RUN --one-run (cached by its command and the run's canaries.csv), each group's row with the
    cap its canaries put on any lower bound (`eps_cap`, §11.6) added."""
    run_dir = os.path.join("models", run_name)
    rows = commands.account("audit.py", ["--run", run_name, "--one-run", "--significance",
                                         str(config.audit_significance), "--delta", str(config.delta)],
                            os.path.join(RES_DIR, f"{run_name}_one_run_audit.csv"),
                            os.path.join(run_dir, canaries.CANARY_FILE))
    rows["eps_cap"] = [one_run_audit.one_run_cap(members=row.included, non_members=row.canaries - row.included,
                                                 significance=config.audit_significance, delta=config.delta)
                       for row in rows.itertuples()]
    return rows


def main_run_audit(commands: Commands, config: ReproduceConfig, main_name: str, out_dir: str) -> dict:
    """The main run's canaries audited per group, figure 10 drawn: {"run", "rows": one dict per group}."""
    rows = audit_canaries(commands, config, main_name)
    with commands.timed("figure 10: the one-run audit"):
        one_run_plots.plot_one_run_audit(
            rows["norm"].to_numpy(), rows["eps_lower"].to_numpy(), rows["eps_upper_rdp"].to_numpy(),
            rows["eps_upper_pld"].to_numpy(), rows["eps_cap"].to_numpy(), os.path.join(out_dir, ONE_RUN_FIGURE),
            title=f"One-run audit of {main_name}: {config.canaries} canaries, significance "
                  f"{config.audit_significance:g}, δ={config.delta:g}")
    return {"run": main_name, "rows": rows.to_dict("records")}


def gap_run_audit(commands: Commands, config: ReproduceConfig, gap_name: str, device: str) -> dict | None:
    """§1c of docs/audit.md: the gap run's realised-size mean rule trained with `gap_canaries` canaries of norm Γ,
    audited against the sum rule's accounting; with the canaries whose cap would pass that upper bound (§11.6).
    None when gap_canaries is 0."""
    if not config.gap_canaries:
        return None
    commands.run("train_dpsgd.py", gap_run_flags(config, gap_name, device,
                                                 tuple(canary_flags(config.gap_canaries, (1.0,)))))
    (row,) = audit_canaries(commands, config, gap_name).to_dict("records")
    upper = min(row["eps_upper_rdp"], row["eps_upper_pld"])
    needed = one_run_audit.canaries_needed(epsilon=upper, significance=config.audit_significance, delta=config.delta)
    others = config.gap_points + row["included"] - 1
    return {**row, "run": gap_name, "eps_upper": upper, "canaries_needed": needed,
            "canaries_per_step": row["included"] * row["sample_rate"], "batch_size": config.gap_batch_size,
            "signal_ratio": mean_rule_signal_ratio(others=others, sample_rate=row["sample_rate"],
                                                   expected_batch=config.gap_points * row["sample_rate"])}


def mean_rule_signal_ratio(*, others: int, sample_rate: float, expected_batch: float) -> float:
    """docs/audit.md §1c: a canary's expected contribution to its summed score under the realised-size mean rule,
    as a multiple of the sum rule's, E[B_exp/(1 + K)] with K ~ Binomial(others, q) the rest of its batch:
    B_exp·(1 − (1 − q)^(n+1))/((n + 1)·q) for n = others."""
    trials = others + 1
    return expected_batch * -math.expm1(trials * math.log1p(-sample_rate)) / (trials * sample_rate)

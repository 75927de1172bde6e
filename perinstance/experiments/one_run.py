"""The one-run audit in a reproduction (docs/audit.md §1b, §1c): the canaries of the main run, group by group,
against the suite's accounting of a point of their sensitivity; and, when `gap_canaries` > 0, the canaries of a
realised-size mean-rule run against the sum rule's accounting.

Finding "one-run audit" (a line per canary group: both statistics, the idealised mechanism's bound, the caps),
one_run_audit.csv in the output folder (a row per group and statistic) and "the mean rule's gap in a trained run";
figure 10.
"""

import math
import os

import pandas as pd

from perinstance.accounting import one_run_fdp
from perinstance.experiments.commands import ONE_RUN_FIGURE, RES_DIR, Commands
from perinstance.experiments.config import ReproduceConfig, canary_flags, gap_run_flags
from perinstance.files import fileio
from perinstance.plots import one_run_plots
from perinstance.train import canaries

# The table of the output folder: one row per canary group and statistic (docs/audit.md §1b).
TABLE = "one_run_audit.csv"
STATISTICS = {"likelihood_ratio": "", "summed": "_summed"}


def audit_canaries(commands: Commands, config: ReproduceConfig, run_name: str) -> pd.DataFrame:
    """audit.py --run RUN --one-run (cached by its command and the run's canaries.csv): one row per canary group."""
    run_dir = os.path.join("models", run_name)
    return commands.account("audit.py", ["--run", run_name, "--one-run", "--significance",
                                         str(config.audit_significance), "--delta", str(config.delta)],
                            os.path.join(RES_DIR, f"{run_name}_one_run_audit.csv"),
                            os.path.join(run_dir, canaries.CANARY_FILE))


def audit_table(rows: pd.DataFrame) -> pd.DataFrame:
    """one_run_audit.csv: per group and statistic, the f-DP lower bound, the upper bound (the smaller of RDP and
    PLD) and the same test's bound on the idealised mechanism."""
    return pd.DataFrame([{"canary_norm": row["norm"], "canaries": row["canaries"],
                          "lower_bound": row[f"lower_bound{suffix}"], "upper_bound": row["upper_bound"],
                          "ideal_lower_bound": row[f"ideal_lower_bound{suffix}"], "statistic": statistic}
                         for _, row in rows.iterrows() for statistic, suffix in STATISTICS.items()])


def main_run_audit(commands: Commands, config: ReproduceConfig, main_name: str, out_dir: str) -> dict:
    """The main run's canaries audited per group, one_run_audit.csv written and figure 10 drawn: {"run", "rows":
    one dict per group}."""
    rows = audit_canaries(commands, config, main_name)
    fileio.write_csv(os.path.join(out_dir, TABLE), audit_table(rows))
    with commands.timed("figure 10: the one-run audit"):
        one_run_plots.plot_one_run_audit(
            rows["norm"].to_numpy(), rows["lower_bound"].to_numpy(), rows["lower_bound_summed"].to_numpy(),
            rows["ideal_lower_bound"].to_numpy(), rows["upper_rdp"].to_numpy(), rows["upper_pld"].to_numpy(),
            rows["fdp_cap"].to_numpy(), os.path.join(out_dir, ONE_RUN_FIGURE),
            assumption_free=rows["steinke_lower"].to_numpy(), delta=config.delta,
            title=f"One-run audit of {main_name}\n{config.canaries} gradient canaries, significance "
                  f"{config.audit_significance:g} over {len(rows)} groups, δ={config.delta:g}")
    return {"run": main_name, "rows": rows.to_dict("records")}


def gap_run_audit(commands: Commands, config: ReproduceConfig, gap_name: str, device: str) -> dict | None:
    """§1c of docs/audit.md: the gap run's realised-size mean rule trained with `gap_canaries` canaries of norm Γ,
    audited against the sum rule's accounting. None when gap_canaries is 0.

    `canaries_needed`: the fewest canaries, half of them in, whose perfectly separated scores make the verdict that
    runs (the f-DP test of accounting.md §11.8, at the group's level) reject the sum rule's claimed curve, whose ε
    at δ is `eps_upper` (one_run_fdp.canaries_to_reject); None if no number does. Necessary, not sufficient: fewer
    canaries cannot refute the claim whatever their scores."""
    if not config.gap_canaries:
        return None
    commands.run("train_dpsgd.py", gap_run_flags(config, gap_name, device,
                                                 tuple(canary_flags(config.gap_canaries, (1.0,)))))
    (row,) = audit_canaries(commands, config, gap_name).to_dict("records")
    upper = row["upper_bound"]
    claim = one_run_fdp.subsampled_gaussian_curve(row["noise_multiplier"] / row["norm"], row["sample_rate"],
                                                  row["steps"])
    needed = one_run_fdp.canaries_to_reject(claim.curve, significance=row["group_significance"])
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

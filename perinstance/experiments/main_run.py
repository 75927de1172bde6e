"""The main run (sum rule): training with tracked points and the one-run audit's canaries (one_run.py), Δ* of
every point at every checkpoint, and the accountants on it (per-step (ε, δ) at the final checkpoint, composition
along the run by RDP and by PLD, composition from the tracked points' every-step norms).

Findings 1, 2 and 5-7 (per-step ε, correct vs misclassified, composed ε, the accountants compared, ε against
the loss and the classes, checkpoints-only against every-step norms); figures 1, 2, 4, 5 and 6, drawn by
figures.py.
"""

import math
import os

import pandas as pd

from perinstance.experiments.commands import RES_DIR, Commands, result_file
from perinstance.experiments.config import (
    MAIN_RUN_FIELDS,
    ReproduceConfig,
    canary_flags,
    training_flags,
    variant_tag,
)
from perinstance.files import storage
from perinstance.train import runs
from perinstance.train.runs import RunConfig

# Composition along the run uses Hölder b = ∞: plain composition along the one observed trajectory
# (accounting.md §4), in the accountant and in the curves of figure 4 alike.
COMPOSITION_HOLDER_B = math.inf


def train_and_measure(commands: Commands, config: ReproduceConfig, preset: str, name: str,
                      device: str) -> tuple[str, str, RunConfig, pd.DataFrame]:
    """The main run (sum rule) with per-step norms of the tracked points (figure 6), then Δ* of every training point
    at every checkpoint: (run name, run folder, RunConfig, sensitivity rows)."""
    main_name, main_flags = main_run_flags(config, preset, name, device)
    commands.run("train_dpsgd.py", main_flags)
    run_dir = os.path.join("models", main_name)
    main_run = runs.load_run(run_dir)
    commands.run("compute_sensitivity.py", [*main_flags, "--exp", "eps_delta", "--reduction", "sum", "--points", "all",
                                            "--stage", "all", "--res-name", main_name, "--no-train"])
    return main_name, run_dir, main_run, storage.read_frame(result_file(main_name))


def main_run_flags(config: ReproduceConfig, preset: str, name: str, device: str) -> tuple[str, list[str]]:
    """(run name, flags of train_dpsgd.py) of the main run; without canaries when `canaries` is 0, so that it is
    trained as a run without the one-run audit would be."""
    main_name = f"{name}{variant_tag(config, preset, MAIN_RUN_FIELDS)}-sum"
    canaries = canary_flags(config.canaries, config.canary_norms) if config.canaries else []
    return main_name, [*training_flags(config, device), "--save-name", main_name, "--track-points",
                       config.track_points, *canaries]


def account_main_run(commands: Commands, config: ReproduceConfig, main_name: str, run_dir: str,
                     total_steps: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(per-step (ε, δ) at the final checkpoint, composed ε from checkpoints by RDP and by PLD, composed ε from the
    tracked points' every-step norms)."""
    source = result_file(main_name)
    delta = ["--delta", str(config.delta)]
    per_step = commands.account("eps_delta.py", ["--res-name", main_name, *delta, "--method", config.per_step_method,
                                                 "--filter", f"step={total_steps}"],
                                os.path.join(RES_DIR, f"{main_name}_eps_delta.csv"), source)
    compose = ["--holder-b", holder_text(COMPOSITION_HOLDER_B).replace("∞", "inf"), *delta]
    composed = commands.account("renyi_per_instance_sum_compo.py", ["--res-name", main_name, *compose],
                                os.path.join(RES_DIR, f"{main_name}_compo.csv"), source)
    composed_pld = commands.account("renyi_per_instance_sum_compo.py", ["--res-name", main_name, *compose,
                                                                        "--accountant", "pld"],
                                    os.path.join(RES_DIR, f"{main_name}_compo_pld.csv"), source)
    tracked_source = os.path.join(run_dir, "tracked_norms.csv")
    tracked = commands.account("renyi_per_instance_sum_compo.py", ["--res-file", tracked_source, *compose],
                               os.path.join(RES_DIR, f"{main_name}-tracked_compo.csv"), tracked_source)
    return (guarantees(per_step, ["step", "point"]), guarantees(composed, ["point"]),
            guarantees(composed_pld, ["point"]), guarantees(tracked, ["point"]))


def guarantees(rows: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    """An accountant's long output (one row per `kind`) as one row per `index`: `eps` the certified
    guarantee (the max over directions where rows have one), `baseline_eps` the baseline, and `delta`."""
    if "direction" in rows:
        rows = rows[rows["direction"] == "max"]
    table = rows.pivot_table(index=index, columns="kind", values="eps", aggfunc="first")
    table = table.rename(columns={"certified": "eps", "baseline": "baseline_eps"})[["eps", "baseline_eps"]]
    return table.join(rows.groupby(index)["delta"].first()).reset_index()


def holder_text(exponent: float) -> str:
    return "∞" if exponent == math.inf else f"{exponent:g}"

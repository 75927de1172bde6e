"""The main run (sum rule): training with Δ* of the tracked points at every step and the one-run audit's canaries
(one_run.py), Δ* of every point at every checkpoint, and the accountants on it (per-step (ε, δ) at the final
checkpoint, composition along the run by RDP and by PLD).

When every training point is tracked (the quick preset), the composition from the every-step norms is the headline:
a bound along the observed run (accounting.md §4). Δ* at the checkpoints is then read from the same table, and the
composition that holds it between checkpoints (a held-Δ* estimate) is computed from it for comparison. Otherwise Δ* of every
point is measured at the checkpoints (compute_sensitivity.py): the all-points composition is that held-Δ* estimate, and the
bound covers the tracked points.

Findings 1, 2 and 7-10 (per-step ε, correct vs misclassified, composed ε, the accountants compared, ε against
the loss and the classes, the held-Δ* estimate against the bound); figures 1, 2, 4, 5 and 6, drawn by figures.py.
"""

import math
import os
from dataclasses import dataclass

import pandas as pd

from perinstance.accounting.guarantees import Kind
from perinstance.experiments.commands import RES_DIR, Commands, result_file
from perinstance.experiments.config import (
    MAIN_RUN_FIELDS,
    ReproduceConfig,
    canary_flags,
    training_flags,
    variant_tag,
)
from perinstance.files import storage, tracked_rows
from perinstance.train import runs
from perinstance.train.runs import RunConfig

# Composition along the run uses Hölder b = ∞: plain composition along the one observed trajectory
# (accounting.md §4), in the accountant and in the curves of figure 4 alike.
COMPOSITION_HOLDER_B = math.inf
# The columns of the tracked table the figures and the sampling-rate design read.
TRACKED_COLUMNS = ["step", "point", "label", "correct", "loss", "value"]


@dataclass(frozen=True)
class MainRun:
    """The trained main run and its Δ*: `sensitivities`, every point at every checkpoint; the tracked points at every
    step (θ_0 .. θ_T) in the table at `tracked_path` (None: none tracked; `tracked()` reads them); `every_point`, whether that is every training
    point (then the headline composition is a bound)."""

    name: str
    run_dir: str
    run: RunConfig
    sensitivities: pd.DataFrame
    tracked_path: str | None
    every_point: bool

    @property
    def checkpoint_steps(self) -> list[int]:
        return sorted(int(step) for step in self.sensitivities["step"].unique())

    def tracked(self) -> pd.DataFrame:
        """The TRACKED_COLUMNS of the tracked table, read when a figure needs them: a million rows at every-step
        tracking, not held through the steps in between, where the accountants' own copies of the table peak."""
        return read_tracked(self.run, self.tracked_path)


@dataclass(frozen=True)
class Accounted:
    """The accountants' outputs on the main run, one row per point (guarantees()): the per-step (ε, δ) at the final
    checkpoint; the headline composition of every point by RDP and by PLD; the composition from every-step Δ*
    (`bound`, the tracked points; None for a run without them) and the one holding Δ* between checkpoints
    (`estimate`, every point: a held-Δ* estimate; None for a run with per-point clipping that tracked every point,
    whose headline is a bound from its held clip bounds)."""

    per_step: pd.DataFrame
    composed: pd.DataFrame
    composed_pld: pd.DataFrame
    bound: pd.DataFrame | None
    estimate: pd.DataFrame | None


def train_and_measure(commands: Commands, config: ReproduceConfig, preset: str, name: str, device: str) -> MainRun:
    """The main run (sum rule) with Δ* of its tracked points at every step; Δ* of every training point at every
    checkpoint, from the tracked table when it holds every point, else measured by compute_sensitivity.py."""
    main_name, main_flags = main_run_flags(config, preset, name, device)
    commands.run("train_dpsgd.py", main_flags)
    return measured_run(commands, os.path.join("models", main_name), main_flags)


def measured_run(commands: Commands, run_dir: str, run_flags: list[str]) -> MainRun:
    """The trained run of `run_dir` with Δ* of every training point at every checkpoint: from its tracked table when
    that holds every point, else measured by compute_sensitivity.py (`run_flags` name the run to it; a rerun skips
    what an earlier measurement wrote). A run trained without --track-points has no tracked table (tracked_path
    None, no point tracked)."""
    run = runs.load_run(run_dir)
    tracked_path = tracked_rows.table_path(run_dir) if tracked_rows.has_table(run_dir) else None
    tracked = read_tracked(run, tracked_path)
    every_point = tracked["point"].nunique() == run.dataset_size
    if every_point:
        sensitivities = tracked[tracked["step"].isin(run.checkpoint_steps)].reset_index(drop=True)
    else:
        commands.run("compute_sensitivity.py", [*run_flags, "--exp", "eps_delta", "--reduction", "sum", "--points",
                                                "all", "--stage", "all", "--res-name", run.run, "--no-train"])
        sensitivities = storage.read_frame(result_file(run.run))
    return MainRun(run.run, run_dir, run, sensitivities, tracked_path, every_point)


def read_tracked(run: RunConfig, tracked_path: str | None) -> pd.DataFrame:
    """The TRACKED_COLUMNS of the Δ* rows of the tracked table at `tracked_path` (none: no rows)."""
    if tracked_path is None:
        return pd.DataFrame({column: [] for column in TRACKED_COLUMNS})
    if not run.per_point_clipping:
        return storage.read_frame(tracked_path, TRACKED_COLUMNS)
    # Its table also holds each point's clip bounds and filter budget (held_bound, filter_budget rows,
    # accounting.md §13.6): Δ* is the grad_norm rows.
    tracked = storage.read_frame(tracked_path, [*TRACKED_COLUMNS, "quantity"])
    return tracked[tracked["quantity"] == "grad_norm"].drop(columns="quantity").reset_index(drop=True)


def main_run_flags(config: ReproduceConfig, preset: str, name: str, device: str) -> tuple[str, list[str]]:
    """(run name, flags of train_dpsgd.py) of the main run; without canaries when `canaries` is 0, so that it is
    trained as a run without the one-run audit would be."""
    main_name = f"{name}{variant_tag(config, preset, MAIN_RUN_FIELDS)}-sum"
    canaries = canary_flags(config.canaries, config.canary_norms) if config.canaries else []
    return main_name, [*training_flags(config, device), "--save-name", main_name, "--track-points",
                       config.track_points, *canaries]


def account_main_run(commands: Commands, config: ReproduceConfig, main: MainRun) -> Accounted:
    """The accountants on the main run at the preset's δ and per-step method (account_run)."""
    return account_run(commands, main, config.delta, config.per_step_method)


def account_run(commands: Commands, main: MainRun, delta: float, per_step_method: str = "exact") -> Accounted:
    """The accountants on a measured run (measured_run). Every-step source: the tracked table; checkpoint source: the
    same table at the checkpoint steps (--steps) when it holds every point, else compute_sensitivity.py's result
    file. Without a tracked table there is no bound (Accounted.bound None)."""
    total_steps = main.run.total_steps
    tracked = ["--res-file", main.tracked_path]
    # The other composition beside the headline one, from the tracked table: at the checkpoints only (the held-Δ*
    # estimate) where the headline is every step's, or every step of the tracked points (their bound) otherwise.
    if main.every_point:
        source, flags = main.tracked_path, tracked
        other_flags, other_suffix = [*tracked, "--steps", ",".join(map(str, main.checkpoint_steps))], "-checkpoints_compo"
    else:
        source, flags = result_file(main.name), ["--res-name", main.name]
        other_flags, other_suffix = tracked, "-tracked_compo"
    delta_flags = ["--delta", str(delta)]
    compose = ["--holder-b", holder_text(COMPOSITION_HOLDER_B).replace("∞", "inf"), *delta_flags]

    def account(script, argv, suffix, input_path):
        return commands.account(script, argv, os.path.join(RES_DIR, f"{main.name}{suffix}.csv"), input_path)

    per_step = account("eps_delta.py", [*flags, *delta_flags, "--method", per_step_method, "--filter",
                                        f"step={total_steps}"], "_eps_delta", source)
    composed = account("renyi_per_instance_sum_compo.py", [*flags, *compose], "_compo", source)
    composed_pld = account("renyi_per_instance_sum_compo.py", [*flags, *compose, "--accountant", "pld"], "_compo_pld",
                           source)
    # A run with per-point clipping composes the bounds training clipped at, a bound however rarely it measured
    # (§12.4): no composition over its checkpoints stands beside it.
    held_bounds = main.every_point and main.run.per_point_clipping
    other = None if main.tracked_path is None or held_bounds else \
        account("renyi_per_instance_sum_compo.py", [*other_flags, *compose], other_suffix, main.tracked_path)
    bound, estimate = (composed, other) if main.every_point else (other, composed)
    return Accounted(guarantees(per_step, ["step", "point"]), guarantees(composed, ["point"]),
                     guarantees(composed_pld, ["point"]), None if bound is None else guarantees(bound, ["point"]),
                     None if estimate is None else guarantees(estimate, ["point"]))


def guarantees(rows: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    """An accountant's long output (one row per `kind`) as one row per `index`: `eps` the point's own value (the
    max over directions where rows have one), `kind` what it is (certified, or held_estimate where the composition
    holds Δ* between checkpoints), `baseline_eps` the baseline, `delta`, and for a filtered run's composition
    `guarantee_eps`, the point's guarantee at δ (accounting.md §12.3)."""
    if "direction" in rows:
        rows = rows[rows["direction"] == "max"]
    table = rows.pivot_table(index=index, columns="kind", values="eps", aggfunc="first")
    kind = next(kind for kind in (Kind.CERTIFIED, Kind.HELD_ESTIMATE, Kind.ESTIMATE) if kind in table.columns)
    kept = ["eps", "baseline_eps"] + (["guarantee_eps"] if Kind.GUARANTEE in table.columns else [])
    table = table.rename(columns={kind: "eps", "baseline": "baseline_eps", Kind.GUARANTEE: "guarantee_eps"})[kept]
    return table.join(rows.groupby(index)["delta"].first()).reset_index().assign(kind=kind)


def holder_text(exponent: float) -> str:
    return "∞" if exponent == math.inf else f"{exponent:g}"

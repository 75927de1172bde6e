"""One row per training point of a sum-rule run (`points.csv`, Parquet past storage.AUTO_PARQUET_ROWS rows): what
the point is (label), what the final model makes of it (prediction, correctness, loss), its Δ* at the final
parameters, and its privacy: the composed ε by RDP and by PLD with their kind (accounting.md §4, §8), the composition
that holds Δ* between checkpoints, and the per-step ε at the final checkpoint (§3.3). `--groups PATH.csv` (columns
point and group) adds each point's group. docs/commands.md lists the columns.
"""

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from perinstance.accounting.guarantees import Kind
from perinstance.errors import UsageError
from perinstance.experiments.main_run import Accounted, MainRun
from perinstance.files import results, storage

POINTS_NAME = "points"
# The table's columns, in order; a filtered run's (FILTER_COLUMNS) follow them, then `group` with --groups.
COLUMNS = ["point", "label", "prediction", "correct", "loss", "grad_norm", "sensitivity_ratio", "eps_rdp",
           "eps_rdp_kind", "eps_pld", "eps_pld_kind", "eps_held", "eps_step", "delta"]
# A filtered run's: each point's guarantee at δ (accounting.md §12.3) and the step it left the training set at.
FILTER_COLUMNS = ["eps_guarantee", "eps_guarantee_kind", "left_step"]
GROUP_COLUMNS = ("point", "group")


@dataclass(frozen=True)
class Groups:
    """--groups: the file (`path`) and the group of each point it lists (`of_point`, text indexed by point)."""

    path: str
    of_point: pd.Series

    def check(self, points: np.ndarray, run: str) -> None:
        """Every listed point is a training point of the run (`points`, those with a composed ε)."""
        listed = self.of_point.index.to_numpy()
        outside = ~np.isin(listed, points)
        if outside.any():
            line = int(np.flatnonzero(outside)[0])
            raise UsageError("--groups", f"{self.path} line {line + 2}: point {listed[line]} is not a training point "
                                         f"of {run} (its {len(points):,} points are {points.min()}..{points.max()})")


def read_groups(path: str) -> Groups:
    """--groups PATH.csv, read and checked: refused in one line naming --groups for a missing or unreadable file, a
    missing point or group column, no rows, a point that is not an integer, a point listed twice, an empty group.
    Points left out belong to no group; other columns are ignored. Groups.check holds the points against a run."""
    if not os.path.isfile(path):
        raise UsageError("--groups", f"no file {path} (a CSV with columns point and group)")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except storage.read_errors() as error:
        raise UsageError("--groups", f"cannot read {path}: {str(error).splitlines()[0]}") from None
    missing = [column for column in GROUP_COLUMNS if column not in frame.columns]
    if missing:
        raise UsageError("--groups", f"{path} has no column {' or '.join(missing)} (its columns: "
                                     f"{', '.join(map(str, frame.columns)) or 'none'}; needed: point, group)")
    if frame.empty:
        raise UsageError("--groups", f"{path} lists no points")
    text = frame["point"].str.strip()
    points = pd.to_numeric(text, errors="coerce")
    bad = ~(np.isfinite(points) & (points == np.round(points)) & (points >= 0))
    if bad.any():
        line = int(np.flatnonzero(bad)[0])
        raise UsageError("--groups", f"{path} line {line + 2}: point {text.iloc[line]!r} is not a point index "
                                     "(an integer >= 0)")
    points = points.astype(np.int64)
    repeated = points.duplicated()
    if repeated.any():
        line = int(np.flatnonzero(repeated)[0])
        first = int(np.flatnonzero(points == points.iloc[line])[0])
        raise UsageError("--groups", f"{path} line {line + 2}: point {points.iloc[line]} is listed twice (first on "
                                     f"line {first + 2})")
    groups = frame["group"].str.strip()
    empty = groups == ""
    if empty.any():
        line = int(np.flatnonzero(empty)[0])
        raise UsageError("--groups", f"{path} line {line + 2}: point {points.iloc[line]} has an empty group")
    return Groups(path, pd.Series(groups.to_numpy(), index=pd.Index(points.to_numpy(), name="point"), name="group"))


def composed_kind(kind: str) -> str:
    """The kind of a composition of Δ* (§4): certified along the observed run, or held between measurements."""
    return Kind.CERTIFIED.value if kind == Kind.CERTIFIED.value else Kind.HELD_ESTIMATE.value


def final_grad_norms(main: MainRun) -> pd.Series:
    """Δ* of every point at the final parameters θ_T, by point, from the run's checkpoint rows."""
    rows = main.sensitivities
    if "quantity" in rows:
        rows = rows[rows["quantity"] == "grad_norm"]
    final = rows[rows["step"] == main.run.total_steps]
    return final.drop_duplicates("point").set_index("point")["value"].astype(float)


def point_table(main: MainRun, accounted: Accounted, labels: np.ndarray, predicted: np.ndarray, losses: np.ndarray,
                correct: np.ndarray, groups: Groups | None = None,
                left_step: pd.Series | None = None) -> pd.DataFrame:
    """The per-point table, one row per point of accounted.composed (ascending): `labels`, `predicted`, `losses`
    and `correct` are aligned with those points (the final model's, evaluation.example_outputs). eps_rdp is the
    point's bound from Δ* at every step where the run tracked the point, else the composition holding Δ* between
    checkpoints; eps_pld is the headline composition's by PLD; eps_held the held composition by RDP of every point
    (empty for a run with per-point clipping, whose headline is a bound from the bounds it clipped at). A filtered
    run (`left_step`: the filter record's, by point, NaN for a point that stayed) adds FILTER_COLUMNS."""
    composed = accounted.composed.sort_values("point").set_index("point")
    points = composed.index.to_numpy()
    rdp = composed["eps"].astype(float)
    rdp_kind = pd.Series(composed_kind(composed["kind"].iloc[0]), index=composed.index)
    if accounted.bound is not None and not main.every_point:
        bound = accounted.bound.set_index("point")["eps"].astype(float)
        rdp.loc[bound.index] = bound
        rdp_kind.loc[bound.index] = composed_kind(accounted.bound["kind"].iloc[0])
    pld = accounted.composed_pld.set_index("point")
    per_step = accounted.per_step.set_index("point")
    grad_norm = final_grad_norms(main).reindex(points).to_numpy()
    table = pd.DataFrame({
        "point": points, "label": labels, "prediction": predicted, "correct": correct, "loss": losses,
        "grad_norm": grad_norm, "sensitivity_ratio": grad_norm / main.run.clip_bound, "eps_rdp": rdp.to_numpy(),
        "eps_rdp_kind": rdp_kind.to_numpy(), "eps_pld": pld["eps"].reindex(points).to_numpy(dtype=float),
        "eps_pld_kind": composed_kind(pld["kind"].iloc[0]),
        "eps_held": np.nan if accounted.estimate is None else
        accounted.estimate.set_index("point")["eps"].reindex(points).to_numpy(dtype=float),
        "eps_step": per_step["eps"].reindex(points).to_numpy(dtype=float), "delta": float(composed["delta"].iloc[0])})
    if left_step is not None:
        table["eps_guarantee"] = composed["guarantee_eps"].to_numpy(dtype=float)
        table["eps_guarantee_kind"] = Kind.GUARANTEE.value
        table["left_step"] = left_step.reindex(points).astype("Int64").to_numpy()
    if groups is not None:
        table["group"] = groups.of_point.reindex(points).to_numpy()
    return table


def write_points(out_dir: str, table: pd.DataFrame) -> str:
    """points.csv (points.parquet past storage.AUTO_PARQUET_ROWS rows) in `out_dir`, written atomically: its path."""
    return results.write_sized(POINTS_NAME, out_dir, table, "--out-dir")

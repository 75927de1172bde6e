"""The sensitivity CSV written by compute_sensitivity.py and read by the accountants.

Long format, one row per measured value (accounting.md §2). `quantity` is one of
QUANTITIES; values are raw, in the units of accounting.md.
"""

import csv
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

import perinstance
from perinstance.accounting.mechanism import Mechanism
from perinstance.errors import UsageError
from perinstance.files import storage

COLUMNS = [
    "run", "seed", "step", "stage", "total_steps", "point", "label", "correct", "loss",
    "exp", "reduction", "direction", "target_batch", "sample", "quantity", "value",
    "alpha", "sigma", "clip_bound", "sample_rate", "batch_size", "dataset_size",
    "noise_std", "dataset", "model", "clipping", "update_rule", "target_eps", "delta",
    "accuracy", "mc_seed", "block", "k", "k_min", "count",
]
# Columns added after the first format: a file without them reads them as empty (NaN).
# `count`: the samples a Δ_B histogram row stands for (storage.histogram_rows); empty = 1.
LATER_COLUMNS = ["mc_seed", "block", "k", "k_min", "count"]



@dataclass(frozen=True)
class Quantity:
    """What a row's `value` is: measured for which update rule, by which command."""

    rule: str
    made_by: str


# Every quantity a result row may hold (accounting.md §2): Δ* (sum rule); Δ_B with its k, and
# the dataset statistics d*, v_X, b_X of §3.2 (mean rule, coupling); GLA's statistic S; in the tracked table of a run
# with per-point clipping, each point's clip bound from its row's step on (§12.4) and its filter's Rényi budget at
# the order `alpha` (§12.1).
QUANTITIES = {
    "grad_norm": Quantity("sum", "compute_sensitivity.py --reduction sum"),
    "held_bound": Quantity("sum", "train_dpsgd.py --budget-eps, --budgets or --track-every"),
    "filter_budget": Quantity("sum", "train_dpsgd.py --budget-eps or --budgets"),
    "batch_sensitivity": Quantity("mean", "compute_sensitivity.py --reduction mean"),
    "center_distance": Quantity("mean", "compute_sensitivity.py --reduction mean"),
    "spread": Quantity("mean", "compute_sensitivity.py --reduction mean"),
    "max_deviation": Quantity("mean", "compute_sensitivity.py --reduction mean"),
    "renyi_statistic": Quantity("mean", "compute_sensitivity.py --exp renyi --reduction mean --estimator jensen"),
}
STATISTICS = ("center_distance", "spread", "max_deviation")
COUPLING_QUANTITIES = ("batch_sensitivity", *STATISTICS)
# The rows of per-point clipping in a tracked table (§12.4, §13.6): each point's clip bound and filter budget.
HELD_QUANTITIES = ("held_bound", "filter_budget")

# Columns that describe the run configuration: rows that differ in these cannot be mixed
# in one accounting (the expectation over runs is over `run`/`seed` only).
CONFIG_COLUMNS = [
    "sigma", "clip_bound", "sample_rate", "batch_size", "dataset_size", "noise_std",
    "dataset", "model", "clipping", "update_rule", "total_steps", "reduction",
]


def results_path(res_name: str, res_dir: str = "res", flag: str = "--res-name") -> str:
    """res/<res-name> as named when the name ends in .csv or .parquet (the format); without an
    extension the one of res/<res-name>.csv and res/<res-name>.parquet that exists (CSV when
    neither does), since such a file turns Parquet when it grows (storage.AUTO_PARQUET_ROWS).
    Both existing is ambiguous: a UsageError naming `flag`."""
    if storage.extension(res_name):
        return os.path.join(res_dir, res_name)
    csv_path, parquet_path = format_paths(res_name, res_dir)
    if os.path.exists(csv_path) and os.path.exists(parquet_path):
        raise UsageError(flag, f"both {csv_path} and {parquet_path} exist; name the one to use with its extension "
                               f"({res_name}.csv or {res_name}.parquet)")
    return parquet_path if os.path.exists(parquet_path) else csv_path


def format_paths(res_name: str, res_dir: str = "res") -> tuple[str, str]:
    """(res/<name>.csv, res/<name>.parquet) for a result named without an extension."""
    return tuple(os.path.join(res_dir, res_name + ending) for ending in (storage.CSV, storage.PARQUET))


def write_sized(name: str, folder: str, frame: pd.DataFrame, flag: str | None = None) -> str:
    """Write `frame` as <folder>/<name>.csv, or .parquet past storage.AUTO_PARQUET_ROWS rows, atomically; remove the
    other format's file (an earlier, smaller or larger, write of the same table) and return the path written."""
    csv_path, parquet_path = format_paths(name, folder)
    path, other = (parquet_path, csv_path) if len(frame) > storage.AUTO_PARQUET_ROWS else (csv_path, parquet_path)
    storage.write_frame(path, frame, flag)
    if os.path.exists(other):
        os.remove(other)
    return path


# Columns every row needs as a finite number: the accounting reads them (accounting.md §1, §2).
REQUIRED_NUMBERS = ["seed", "step", "point", "value", "total_steps", "sigma", "clip_bound", "sample_rate",
                    "batch_size", "dataset_size", "noise_std"]


def read_results(path: str, flag: str = "--res-file") -> pd.DataFrame:
    """Read a sensitivity CSV (or Parquet); a missing, unreadable, foreign or damaged file is a
    UsageError naming the file, and the line and column where it is damaged: a line cut off
    (no newline at the end of the file) or with another number of fields than the header, or a
    row without a finite number in a column of REQUIRED_NUMBERS."""
    if not os.path.isfile(path):
        raise UsageError(flag, f"no result file at {path} (compute_sensitivity.py writes it)")
    csv_file = storage.extension(path) != storage.PARQUET
    try:
        if csv_file:
            _check_lines(path, flag)
        frame = storage.read_frame(path)  # CSV, or Parquet by extension (storage.py)
    except storage.read_errors() as error:
        raise UsageError(flag, f"cannot read {path}: {str(error).splitlines()[0]}") from None
    for column in LATER_COLUMNS:
        if column not in frame.columns:
            frame[column] = float("nan")
    missing = [column for column in COLUMNS if column not in frame.columns]
    if missing:
        raise UsageError(flag, f"{path} is not a sensitivity result file (missing columns: {', '.join(missing)})")
    _check_numbers(frame, path, flag, "line" if csv_file else "row")
    return frame


def _check_lines(path, flag):
    """Every line ends with a newline and has as many fields as the header (a cut-off write or a
    damaged line would otherwise be read with its missing fields empty)."""
    with open(path, "rb") as handle:
        raw = handle.read()
    if not raw:
        return  # empty: the reader says so
    if not raw.endswith(b"\n"):
        line = raw.count(b"\n") + 1
        raise UsageError(flag, f"{path} line {line} is cut off (the file ends in the middle of a line: a write "
                               "was interrupted or the file was truncated)")
    if b'"' in raw:  # quoted fields may hold commas: count fields the slow, exact way
        lines = raw.decode("utf-8", errors="replace").split("\n")[:-1]
        fields = np.array([len(next(csv.reader([line]), [])) for line in lines])
    else:
        data = np.frombuffer(raw, dtype=np.uint8)
        ends = np.flatnonzero(data == ord("\n"))
        fields = np.diff(np.searchsorted(np.flatnonzero(data == ord(",")), ends), prepend=0) + 1
    wrong = np.flatnonzero(fields != fields[0])
    if wrong.size:
        line = int(wrong[0]) + 1
        raise UsageError(flag, f"{path} line {line} has {fields[wrong[0]]} fields, the header {fields[0]} "
                               "(a damaged or cut-off line)")


def _check_numbers(frame, path, flag, unit):
    """The first row (by line; CSV line = row + 2) with a missing or non-finite required number."""
    first = None
    for column in REQUIRED_NUMBERS:
        numbers = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=float)
        bad = np.flatnonzero(~np.isfinite(numbers))
        if bad.size and (first is None or bad[0] < first[0]):
            first = (int(bad[0]), column)
    if first is None:
        return
    row, column = first
    value = frame[column].iloc[row]
    shown = "an empty or NaN cell" if pd.isna(value) else repr(value) if isinstance(value, str) else str(value)
    position = row + 2 if unit == "line" else row + 1
    raise UsageError(flag, f"{path} {unit} {position} (column {column}): {shown} is not a finite number")


def run_columns(run: "perinstance.train.runs.RunConfig", rule: str) -> dict:
    """The columns of a result row that come from the training run (a runs.RunConfig), analysed
    under the update rule `rule` (its `reduction` column)."""
    return {
        "run": run.run,
        "seed": run.seed,
        "total_steps": run.total_steps,
        "reduction": rule,
        "sigma": run.noise_multiplier,
        "clip_bound": run.clip_bound,
        "sample_rate": run.sample_rate,
        "batch_size": run.batch_size,
        "dataset_size": run.dataset_size,
        "noise_std": Mechanism.of_run(run, rule).noise_std,
        "dataset": run.dataset,
        "model": run.model,
        "clipping": run.clipping,
        "update_rule": run.update_rule,
        "target_eps": run.target_eps,
        "delta": run.delta,
    }


def class_labels(targets: np.ndarray) -> np.ndarray:
    """The `label` column of points whose targets are `targets` (one per point, in order): the class index where
    targets are one integer per point, else NaN (regression values, token sequences: no class to name)."""
    targets = np.asarray(targets)
    if targets.ndim == 1 and np.issubdtype(targets.dtype, np.integer):
        return targets
    return np.full(len(targets), np.nan)


def correct_column(correct: np.ndarray) -> np.ndarray:
    """The `correct` column from 1/0 values, NaN where correctness is not defined (targets that are not class
    labels): integers where every value is defined, as the files have always held them, else floats."""
    correct = np.asarray(correct, dtype=np.float64)
    return correct if np.isnan(correct).any() else correct.astype(int)


def result_rows(run: "perinstance.train.runs.RunConfig", rule: str, step: int, columns: dict) -> pd.DataFrame:
    """Long-format rows of one checkpoint: `columns` (per-row arrays, or one value for every row),
    the run's columns, the stage, and NaN in every column that does not apply (a float column
    whatever the run)."""
    frame = pd.DataFrame({"step": step, "stage": step / run.total_steps, **columns})
    for column, value in run_columns(run, rule).items():
        frame[column] = np.nan if value is None else value
    for column in COLUMNS:
        if column not in frame:
            frame[column] = np.nan
    return frame[COLUMNS]

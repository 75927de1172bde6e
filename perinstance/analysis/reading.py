"""The input side of the four accountants (docs/accountants.md): the sensitivity CSV
(perinstance/files/results.py) read, filtered and checked.

A command turns its flags (perinstance/cli/options.py) into a frozen request at the top (`Source` for the
input and the output it names); the result rows come back as `Loaded`, with the mechanism they describe.
The output side is perinstance/analysis/report.py; the mathematics perinstance/accounting/.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from perinstance.accounting import rdp_composition
from perinstance.accounting.mechanism import Mechanism, rule_noise_std
from perinstance.console import warn
from perinstance.errors import UsageError
from perinstance.files.results import COLUMNS, CONFIG_COLUMNS, QUANTITIES, STATISTICS, read_results, results_path
from perinstance.train.points import parse_points

NUMERIC_COLUMNS = ["step", "point", "value", "total_steps", "sigma", "clip_bound", "sample_rate",
                   "batch_size", "dataset_size", "noise_std"]


@dataclass(frozen=True)
class Source:
    """Where an accountant reads its rows (--res-name in --res-dir, or --res-file), which rows it
    keeps (--filter, --points, --steps), and the output it was asked for (--out, --overwrite)."""

    res_name: str | None
    res_file: str | None
    res_dir: str = "res"
    out: str | None = None
    filters: tuple = ()
    points: tuple | None = None
    overwrite: bool = False
    steps: tuple | None = None

    @property
    def path(self) -> tuple[str, str]:
        """The result file read, and the flag that names it."""
        if self.res_name is not None:
            return results_path(self.res_name, self.res_dir), "--res-name"
        return self.res_file, "--res-file"


@dataclass(frozen=True)
class Loaded:
    rows: pd.DataFrame
    mechanism: Mechanism  # from the rows' configuration columns
    path: str
    flag: str


# --- Hölder exponents -------------------------------------------------------------------------

def parse_holder(text: str | float, total_steps: int, flag: str = "--holder-p") -> float:
    """--holder-p (p, per step) or --holder-b (b, composition): a number, `inf`, or a multiple of the
    number of steps T such as `3T`."""
    value = str(text).strip()
    try:
        holder = float(value[:-1] or 1) * total_steps if value.upper().endswith("T") else float(value)
    except ValueError:
        raise UsageError(flag, f"{text!r} is not a number, inf or a multiple of T like 3T") from None
    if not holder > 1:
        raise UsageError(flag, f"the Hölder exponent must be > 1, not {text} (= {holder:g})")
    return holder


# --- reading and checking -------------------------------------------------------------------

def load(source: Source, quantities: list[str], one_run: bool, integer_columns: dict[str, int] | None = None) -> Loaded:
    """Read the CSV of `source` (a Source), apply --filter, keep `quantities`, check that the
    rows form one configuration (and one run if `one_run`), their values, and --points.

    integer_columns: {column: smallest allowed value} for the columns that index samples.
    """
    path, flag = source.path
    rows = read_results(path, flag)
    rows = _apply_filters(rows, source.filters)
    kept = rows["quantity"].isin(quantities)
    rows = rows if kept.all() else rows[kept]  # a million rows: no copy of all of them
    if rows.empty:
        makers = "; ".join(f"{quantity} rows come from {QUANTITIES[quantity].made_by}" for quantity in quantities)
        raise UsageError(flag, f"{path} has no {' or '.join(quantities)} rows left to account ({makers})")
    _check_single_configuration(rows, one_run)
    rows = _numeric(rows, NUMERIC_COLUMNS, path, flag)
    mechanism = _mechanism(rows, path, flag)
    _check_rows(rows, mechanism, path, flag)
    rows = _check_integers(rows, integer_columns or {}, path, flag)
    rows = rows.astype({"step": int, "point": int})
    rows = _select(rows, source.points, "point", mechanism.dataset_size, "--points")
    rows = _select(rows, source.steps, "step", mechanism.total_steps + 1, "--steps")
    return Loaded(rows=rows, mechanism=mechanism, path=path, flag=flag)


def _apply_filters(rows, filters):
    for spec in filters:
        column, separator, wanted = spec.partition("=")
        column = column.strip()
        if not separator or column not in COLUMNS:
            raise UsageError("--filter", f"{spec!r}: expected COLUMN=VALUE with a column of the result file "
                             "(e.g. sigma=1.0)")
        values = rows[column]
        if pd.api.types.is_numeric_dtype(values):
            try:
                keep = np.isclose(values.astype(float), float(wanted), rtol=1e-9, atol=0)
            except ValueError:
                raise UsageError("--filter", f"{spec!r}: column {column} holds numbers") from None
        else:
            keep = values.astype(str).str.strip() == wanted.strip()
        if not keep.any():
            raise UsageError("--filter", f"no rows with {column}={wanted} (values: {_distinct(values)})")
        rows = rows[keep]
    return rows


def _distinct(values, limit=8):
    distinct = sorted({str(value) for value in values.dropna()})
    return ", ".join(distinct[:limit]) + (f", ... ({len(distinct)} in all)" if len(distinct) > limit else "")


def _check_single_configuration(rows, one_run):
    columns = CONFIG_COLUMNS + (["run", "seed"] if one_run else [])
    mixed = [column for column in columns if rows[column].nunique(dropna=True) > 1]
    if not mixed:
        return
    described = "; ".join(f"{column} has {_distinct(rows[column])}" for column in mixed)
    example = " ".join(f"--filter {column}={rows[column].dropna().iloc[0]}" for column in mixed)
    what = "runs or configurations" if set(mixed) & {"run", "seed"} else "configurations"
    raise UsageError("--filter", f"rows from several {what} ({described}); keep one with e.g. {example}")


def _numeric(rows, columns, path, flag):
    rows = rows.copy(deep=False)  # each converted column replaces the caller's in the copy, never in its frame
    for column in columns:
        converted = pd.to_numeric(rows[column], errors="coerce")
        bad = ~np.isfinite(converted.astype(float))
        if bad.any():
            index = bad.idxmax()
            raise UsageError(flag, f"{_where(rows, index, path)}: {column} is {rows.at[index, column]!r}, "
                             "not a finite number")
        rows[column] = converted
    return rows


def _where(rows, index, path):
    """Names a row: its line in the CSV (header is line 1) and what it is about."""
    row = rows.loc[index]
    return f"{path} line {index + 2} (run={row['run']}, seed={row['seed']}, step={row['step']}, point={row['point']})"


def _first_bad(rows, bad, path, flag, message):
    bad = np.asarray(bad, dtype=bool)
    if bad.any():
        index = rows.index[bad][0]
        raise UsageError(flag, f"{_where(rows, index, path)}: {message(rows.loc[index])}")


def _mechanism(rows, path, flag):
    for column in ["sigma", "clip_bound", "batch_size", "dataset_size", "noise_std", "total_steps"]:
        _first_bad(rows, rows[column] <= 0, path, flag, lambda row, c=column: f"{c} must be > 0, not {row[c]}")
    _first_bad(rows, (rows["sample_rate"] <= 0) | (rows["sample_rate"] > 1), path, flag,
               lambda row: f"sample_rate must be in (0, 1], not {row['sample_rate']}")
    expected_reduction = rows["quantity"].map({name: quantity.rule for name, quantity in QUANTITIES.items()})
    _first_bad(rows, rows["reduction"] != expected_reduction, path, flag,
               lambda row: f"{row['quantity']} rows have reduction {QUANTITIES[row['quantity']].rule}, "
               f"not {row['reduction']!r}")
    # noise_std is σΓ in sum units and σΓ/B_exp in mean units (accounting.md §1).
    expected = rule_noise_std(rows["sigma"], rows["clip_bound"], rows["batch_size"], rows["reduction"])
    _first_bad(rows, ~np.isclose(rows["noise_std"], expected, rtol=1e-6, atol=0), path, flag,
               lambda row: f"noise_std {row['noise_std']} is not sigma*clip_bound"
               f"{'/batch_size' if row['reduction'] == 'mean' else ''} (reduction {row['reduction']})")
    first = rows.iloc[0]
    return Mechanism(noise_multiplier=float(first["sigma"]), clip_bound=float(first["clip_bound"]),
                     sample_rate=float(first["sample_rate"]), batch_size=int(first["batch_size"]),
                     dataset_size=int(first["dataset_size"]), total_steps=int(first["total_steps"]),
                     rule=str(first["reduction"]))


def _check_rows(rows, mechanism, path, flag):
    step, point, value = rows["step"], rows["point"], rows["value"]
    _first_bad(rows, (step != np.round(step)) | (step < 0) | (step > mechanism.total_steps), path, flag,
               lambda row: f"step {row['step']} is not a step in 0..total_steps={mechanism.total_steps}")
    _first_bad(rows, (point != np.round(point)) | (point < 0) | (point >= mechanism.dataset_size), path, flag,
               lambda row: f"point {row['point']} is not an index in 0..{mechanism.dataset_size - 1}")
    is_norm = rows["quantity"].isin(["grad_norm", "batch_sensitivity", "held_bound"])
    is_statistic = rows["quantity"].isin(list(STATISTICS))
    _first_bad(rows, (is_norm | is_statistic) & (value < 0), path, flag,
               lambda row: f"{row['quantity']} {row['value']} is negative")
    _first_bad(rows, is_norm & (value > mechanism.clip_bound), path, flag,
               lambda row: f"{row['quantity']} {row['value']} exceeds clip_bound {mechanism.clip_bound} (the bound Γ)")
    is_budget = (rows["quantity"] == "filter_budget").to_numpy()
    if is_budget.any():  # only a filtered run's table has them; its other rows (a million) need no alpha converted
        _first_bad(rows, is_budget & ~((value > 0) & (pd.to_numeric(rows["alpha"], errors="coerce") > 1)), path,
                   flag, lambda row: f"filter_budget {row['value']} at alpha {row['alpha']} is not a Rényi budget > 0 "
                                     "at an order > 1")


def _check_integers(rows, columns, path, flag):
    """Columns that index things (`sample`, `target_batch`, `alpha`): integers ≥ their minimum."""
    rows = _numeric(rows, list(columns), path, flag)
    for column, smallest in columns.items():
        values = rows[column]
        _first_bad(rows, (values != np.round(values)) | (values < smallest), path, flag,
                   lambda row, c=column, m=smallest: f"{c} {row[c]} is not an integer >= {m}")
    return rows.astype(dict.fromkeys(columns, int))


def check_unique(loaded: Loaded, keys: list[str]) -> None:
    """One row per `keys`: a repeated measurement would be counted twice."""
    rows = loaded.rows
    repeated = rows.duplicated(subset=keys, keep="first")
    if repeated.any():
        index = repeated.idxmax()
        earlier = rows.index[(rows[keys] == rows.loc[index, keys]).all(axis=1)][0]
        several = rows["exp"].nunique() > 1
        hint = "; the file holds several experiments, keep one with --filter exp=..." if several else ""
        raise UsageError(loaded.flag, f"{_where(rows, index, loaded.path)}: repeats line {earlier + 2} "
                         f"(same {', '.join(keys)}){hint}")


def check_values(loaded: Loaded, bad: ArrayLike, message: str, rows: pd.DataFrame | None = None) -> None:
    """Refuse the first row where `bad` holds (booleans over loaded.rows, or over `rows`, a
    selection of them), naming the row by `message(row)`."""
    rows = loaded.rows if rows is None else rows
    _first_bad(rows, np.asarray(bad, dtype=bool), loaded.path, loaded.flag, message)


def _select(rows, specs, column, universe, flag):
    """--points or --steps: the rows whose `column` is among `specs` (as --points, over 0..universe−1); requested
    values without rows are left out with a warning, none with rows is refused."""
    if not specs:
        return rows
    wanted = parse_points(specs, universe, flag=flag)
    present = np.isin(wanted, rows[column].unique())
    if not present.any():
        raise UsageError(flag, f"none of the {len(wanted)} {column}s has rows "
                         f"(the file has {column}s {_distinct(rows[column])})")
    if not present.all():
        warn(f"{(~present).sum()} of the {len(wanted)} requested {column}s have no rows and are left out")
    return rows[rows[column].isin(wanted)]


def checkpoint_sensitivity_ratio(loaded: Loaded) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Δ*/Γ of the grad_norm rows as an (R, C, P) array over runs, the union of their checkpoint
    steps and points, for rdp_composition.compose_rdp (§4): each run keeps its latest checkpoint,
    the worst case Γ before its first. Returns (sensitivity_ratio, steps, points)."""
    rows = loaded.rows.assign(run_key=run_key(loaded.rows))
    norms = rows.pivot(index=["run_key", "step"], columns="point", values="value")
    missing = norms.isna().stack()
    if missing.any():
        run, step, point = missing[missing].index[0]
        raise UsageError(loaded.flag, f"{loaded.path}: run {run} has no grad_norm of point {point} at its checkpoint "
                         f"step {step} (every point needs a value at every checkpoint of its run)")
    runs = sorted(rows["run_key"].unique())
    steps = np.sort(rows["step"].unique())
    for run in runs:
        first = norms.loc[run].index.min()
        if first > 0:
            warn(f"run {run} has no checkpoint at step 0: steps 1..{first} use the worst case Γ (accounting.md §4)")
    dense = norms.reindex(pd.MultiIndex.from_product([runs, steps])).to_numpy()
    sensitivity_ratio = dense.reshape(len(runs), len(steps), -1) / loaded.mechanism.clip_bound
    return rdp_composition.carry_forward(sensitivity_ratio), steps, norms.columns.to_numpy()


def every_step(loaded: Loaded) -> bool:
    """§4: whether every run's rows give every point a value at every step 0..T−1 (at θ_0 .. θ_{T−1}, the
    parameters the T steps start from; a row at step T is allowed and charges no step). Then a composition of
    the rows is a bound along the observed run; otherwise it holds values between measurements: a held estimate
    (`held_estimate`; an `estimate` where the values are Monte Carlo)."""
    # The four columns alone: a run's every-step rows are a million, and selecting rows of all columns copies them.
    rows, total = loaded.rows[["run", "seed", "point", "step"]], loaded.mechanism.total_steps
    pairs = rows.groupby(["run", "seed", "point"], sort=False).ngroups
    # Steps are integers in 0..T (load checks them): T distinct ones below T are all of 0..T−1.
    steps = rows.loc[rows["step"] < total].groupby(["run", "seed", "point"], sort=False)["step"].nunique()
    return len(steps) == pairs and bool((steps == total).all())


def run_key(rows: pd.DataFrame) -> pd.Series:
    """Runs are told apart by `run` and `seed` (accounting.md §4)."""
    return rows["run"].astype(str) + " seed " + rows["seed"].astype(str)

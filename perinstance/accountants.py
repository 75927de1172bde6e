"""Plumbing shared by the four accountant scripts (docs/accountants.md).

Flags, reading and checking the sensitivity CSV (perinstance/results.py), the printed table and
summary, and the atomic write of the output. The mathematics is in perinstance/accounting.py.
"""

import hashlib
import json
import os
import sys
from dataclasses import dataclass

import numpy as np
import pandas as pd

from perinstance import accounting, fileio, storage
from perinstance.errors import UsageError
from perinstance.mechanism import Mechanism, rule_noise_std
from perinstance.options import add_overwrite_argument, parse_points, probability
from perinstance.results import (
    COLUMNS,
    CONFIG_COLUMNS,
    QUANTITIES,
    STATISTICS,
    read_results,
    results_path,
)

TABLE_ROWS = 20
# Which update rule each quantity is measured for (results.QUANTITIES).
NUMERIC_COLUMNS = ["step", "point", "value", "total_steps", "sigma", "clip_bound", "sample_rate",
                   "batch_size", "dataset_size", "noise_std"]


@dataclass(frozen=True)
class Loaded:
    rows: pd.DataFrame
    mechanism: Mechanism  # from the rows' configuration columns
    path: str
    flag: str


# --- flags ----------------------------------------------------------------------------------

def add_input_arguments(parser):
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--res-name", help="read <res-dir>/<res-name>.csv, or .parquet, whichever exists (written "
                                           "by compute_sensitivity.py); an extension names one")
    source.add_argument("--res-file", help="read this sensitivity CSV (or Parquet file, by its extension)")
    parser.add_argument("--res-dir", default="res", help="folder of the result files (default res)")
    parser.add_argument("--out", help="output CSV (default: <res-dir>/<res-name>_<script>.csv, next to --res-file)")
    parser.add_argument("--filter", action="append", default=[], metavar="COLUMN=VALUE",
                        help="keep only rows with this value (repeatable), e.g. --filter sigma=1.0")
    parser.add_argument("--points", nargs="+", help="points to keep: indices, ranges 0-99, all, random:N")
    add_overwrite_argument(parser, "an existing --out even if it is not this script's earlier output for this input")


def add_delta_argument(parser):
    parser.add_argument("--delta", type=probability, default=1e-5, help="δ of the reported guarantee (default 1e-5)")


def add_failure_argument(parser):
    parser.add_argument("--failure", type=probability, default=None,
                        help="mean rule: β of the certified event (default δ_size, or the training δ/(10·T) when "
                             "k_min = 0)")


def check_delta(delta):
    """--delta: a probability strictly between 0 and 1 (NaN is not)."""
    if not 0 < delta < 1:
        raise UsageError("--delta", f"must be in (0, 1), not {delta:g}")


def check_orders(orders):
    """--alpha: finite orders > 1; returned sorted and without repeats."""
    orders = np.asarray(orders, dtype=float)
    bad = orders[~(orders > 1) | ~np.isfinite(orders)]
    if bad.size:
        raise UsageError("--alpha", f"Rényi orders must be finite and > 1, not {bad[0]:g}")
    return np.unique(orders)


def parse_holder(text, total_steps, flag="--holder-p"):
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

def load(args, quantities, one_run, integer_columns=None):
    """Read the CSV of --res-name/--res-file, apply --filter, keep `quantities`, check that the
    rows form one configuration (and one run if `one_run`), their values, and --points.

    integer_columns: {column: smallest allowed value} for the columns that index samples.
    """
    path, flag = _input_path(args)
    rows = read_results(path, flag)
    rows = _apply_filters(rows, args.filter)
    rows = rows[rows["quantity"].isin(quantities)]
    if rows.empty:
        makers = "; ".join(f"{quantity} rows come from {QUANTITIES[quantity].made_by}" for quantity in quantities)
        raise UsageError(flag, f"{path} has no {' or '.join(quantities)} rows left to account ({makers})")
    _check_single_configuration(rows, one_run)
    rows = _numeric(rows, NUMERIC_COLUMNS, path, flag)
    mechanism = _mechanism(rows, path, flag)
    _check_rows(rows, mechanism, path, flag)
    rows = _check_integers(rows, integer_columns or {}, path, flag)
    rows = _select_points(rows, args.points, mechanism.dataset_size)
    return Loaded(rows=rows, mechanism=mechanism, path=path, flag=flag)


def _input_path(args):
    if args.res_name is not None:
        return results_path(args.res_name, args.res_dir), "--res-name"
    return args.res_file, "--res-file"


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
    rows = rows.copy()
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
    is_norm = rows["quantity"].isin(["grad_norm", "batch_sensitivity"])
    is_statistic = rows["quantity"].isin(list(STATISTICS))
    _first_bad(rows, (is_norm | is_statistic) & (value < 0), path, flag,
               lambda row: f"{row['quantity']} {row['value']} is negative")
    _first_bad(rows, is_norm & (value > mechanism.clip_bound), path, flag,
               lambda row: f"{row['quantity']} {row['value']} exceeds clip_bound {mechanism.clip_bound} (the bound Γ)")


def _check_integers(rows, columns, path, flag):
    """Columns that index things (`sample`, `target_batch`, `alpha`): integers ≥ their minimum."""
    rows = _numeric(rows, list(columns), path, flag)
    for column, smallest in columns.items():
        values = rows[column]
        _first_bad(rows, (values != np.round(values)) | (values < smallest), path, flag,
                   lambda row, c=column, m=smallest: f"{c} {row[c]} is not an integer >= {m}")
    return rows.astype(dict.fromkeys(columns, int))


def check_unique(loaded, keys):
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


def check_values(loaded, bad, message):
    """Refuse the first row where `bad` holds (a boolean Series over loaded.rows)."""
    _first_bad(loaded.rows, bad.to_numpy(), loaded.path, loaded.flag, message)


def _select_points(rows, specs, dataset_size):
    rows = rows.astype({"step": int, "point": int})
    if not specs:
        return rows
    wanted = parse_points(specs, dataset_size, flag="--points")
    present = np.isin(wanted, rows["point"].unique())
    if not present.any():
        raise UsageError("--points", f"none of the {len(wanted)} points has rows "
                         f"(the file has points {_distinct(rows['point'])})")
    if not present.all():
        warn(f"{(~present).sum()} of the {len(wanted)} requested points have no rows and are left out")
    return rows[rows["point"].isin(wanted)]


def checkpoint_ratios(loaded):
    """Δ*/Γ of the grad_norm rows as an (R, C, P) array over runs, the union of their checkpoint
    steps and points, for accounting.compose_rdp (§4): each run keeps its latest checkpoint,
    the worst case Γ before its first. Returns (ratios, steps, points)."""
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
    ratios = dense.reshape(len(runs), len(steps), -1) / loaded.mechanism.clip_bound
    return accounting.carry_forward(ratios), steps, norms.columns.to_numpy()


def run_key(rows):
    """Runs are told apart by `run` and `seed` (accounting.md §4)."""
    return rows["run"].astype(str) + " seed " + rows["seed"].astype(str)


def correct_at_end(rows):
    """`correct` per point at each run's last checkpoint (majority over runs; a tie is misclassified),
    as a frame (point, correct); None when the rows do not all record it."""
    correct = pd.to_numeric(rows["correct"], errors="coerce")
    if correct.isna().any():
        return None
    last = rows["step"] == rows.groupby(run_key(rows))["step"].transform("max")
    share = correct[last].groupby(rows.loc[last, "point"]).mean()
    return pd.DataFrame({"point": share.index, "correct": (share > 0.5).astype(int).to_numpy()})


# --- output ---------------------------------------------------------------------------------

# An output's provenance (the script and input it comes from, its checksum) lives beside it.
PROVENANCE_FORMAT = 1
# output path (absolute) -> (script, input path), recorded by output_path for write_output.
_OUTPUT_SOURCES = {}


def output_path(args, script):
    """--out, or <res-dir>/<res-name>_<script>.csv, or <stem>_<script>.csv next to --res-file; checked
    before any work so that an output never clobbers a file.

    Refused (one line naming --out): the input file itself, a folder, a destination folder that
    is missing, read-only or a file, and an existing file that is not this script's own earlier
    output for this same input (its provenance file says so and its checksum still matches)
    unless --overwrite.
    """
    if args.out:
        path = args.out
    elif args.res_name is not None:
        stem = os.path.splitext(args.res_name)[0] if storage.extension(args.res_name) else args.res_name
        path = os.path.join(args.res_dir, f"{stem}_{script}.csv")
    else:
        stem = os.path.splitext(os.path.basename(args.res_file))[0]
        path = os.path.join(os.path.dirname(args.res_file), f"{stem}_{script}.csv")
    source = _input_path(args)[0]
    if _same_file(path, source):
        raise UsageError("--out", f"{path} is the input file; choose another output")
    if os.path.isdir(path):
        raise UsageError("--out", f"{path} is a folder; give the output a file name")
    fileio.check_folder(os.path.dirname(path) or ".", "--out", must_exist=True)
    if os.path.lexists(path) and not getattr(args, "overwrite", 0) and not _own_output(path, script, source):
        raise UsageError("--out", f"{path} exists and is not {script}.py's earlier output for {source}; refusing to "
                                  "replace it (use another --out, or --overwrite)")
    _OUTPUT_SOURCES[os.path.abspath(path)] = (script, source)
    return path


def _same_file(path, other):
    if os.path.exists(path) and os.path.exists(other):
        return os.path.samefile(path, other)
    return os.path.realpath(path) == os.path.realpath(other)


def provenance_path(path):
    """The hidden file beside an output that records where it comes from."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.provenance.json")


def _own_output(path, script, source):
    """`path` is what `script` wrote from `source` and nobody has changed it since."""
    try:
        with open(provenance_path(path), encoding="utf-8") as handle:
            provenance = json.load(handle)
        return (isinstance(provenance, dict) and provenance.get("script") == script
                and provenance.get("input") == _input_seen_from(path, source)
                and provenance.get("sha256") == fileio.sha256_of(path))
    except (OSError, ValueError):
        return False


def _input_seen_from(path, source):
    """The input's path relative to the output's folder: still right when both move together."""
    return os.path.relpath(os.path.realpath(source), os.path.realpath(os.path.dirname(path) or "."))


def write_output(path, frame):
    """Write the output CSV atomically, then its provenance beside it (what lets the same script
    on the same input replace it next time without --overwrite)."""
    text = fileio.csv_text(frame)
    fileio.write_text(path, text, flag="--out")
    script, source = _OUTPUT_SOURCES.get(os.path.abspath(path), (None, None))
    if script is not None:
        fileio.write_json(provenance_path(path), {
            "format": PROVENANCE_FORMAT, "script": script, "input": _input_seen_from(path, source),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}, flag="--out")


def warn(message):
    print(f"warning: {message}", file=sys.stderr)


# --- the mean rule by coupling (accounting.md §3.2, §3.4) -----------------------------------

# Sizes at which the certified bound and the baseline are evaluated (each size's probability is
# lumped onto the grid size below it, which keeps the bound valid: accounting.size_grid).
CERTIFIED_SIZES = 64
# Sensitivities are rounded up onto a geometric grid with this relative step before RDP_SGM is
# looked up (accounting.geometric_levels): at most 0.1% on Δ, an upper bound.
LEVEL_STEP = 1e-3


@dataclass(frozen=True)
class SizeModel:
    """The batch sizes of one mean-rule configuration (§3.4): n = |X|, q, k_min and what it costs."""

    n: int
    sample_rate: float
    k_min: int
    delta_size: float
    failure: float  # β of the certified event

    def grid(self):
        """Sizes and lumped log-probabilities at which certified bounds and baselines are evaluated."""
        sizes = accounting.size_grid(self.n, self.sample_rate, self.k_min, CERTIFIED_SIZES)
        return sizes, accounting.lumped_size_log_weights(sizes, self.n, self.sample_rate)

    def delta_fail(self, kind):
        """§3.4: δ_size for the estimate and the baseline, δ_size + β for the certified bound."""
        return self.delta_size + (self.failure if kind == "certified" else 0.0)


def size_model(loaded, failure=None):
    """§3.4 from the rows: k_min as measured (column k_min), n = N − 1 points besides x*.

    failure: β of the certified event; default δ_size, or δ/(10·T) with the run's training δ when
    k_min = 0 forces δ_size = 0."""
    k_mins = pd.to_numeric(loaded.rows["k_min"], errors="coerce").dropna().unique()
    if len(k_mins) != 1:
        raise UsageError(loaded.flag, f"{loaded.path}: mean-rule rows need one k_min (found "
                         f"{', '.join(f'{value:g}' for value in k_mins) or 'none'}); measure them with "
                         "compute_sensitivity.py --reduction mean")
    mechanism = loaded.mechanism
    n = mechanism.dataset_size - 1
    k_min = int(k_mins[0])
    delta_size = accounting.size_failure(n, mechanism.sample_rate, k_min)
    if failure is None:
        training_delta = pd.to_numeric(loaded.rows["delta"], errors="coerce").dropna()
        fallback = (float(training_delta.iloc[0]) if len(training_delta) else 1e-5) / (10 * mechanism.total_steps)
        failure = delta_size if delta_size > 0 else fallback
    return SizeModel(n=n, sample_rate=mechanism.sample_rate, k_min=k_min, delta_size=delta_size, failure=failure)


def mean_statistics(loaded):
    """d*, v_X, b_X per (point, step): a frame with one column per statistic."""
    rows = loaded.rows[loaded.rows["quantity"].isin(list(STATISTICS))]
    if rows.empty:
        return None
    # Every --mc-seed of one checkpoint records the same statistics: keep one copy.
    rows = rows.drop_duplicates(subset=["point", "step", "quantity", "value"])
    check_unique(Loaded(rows, loaded.mechanism, loaded.path, loaded.flag), ["point", "step", "quantity"])
    table = rows.pivot(index=["point", "step"], columns="quantity", values="value")
    missing = table.isna().any(axis=1) | (len(table.columns) < len(STATISTICS))
    if missing.any():
        point, step = table.index[np.argmax(missing.to_numpy())]
        raise UsageError(loaded.flag, f"{loaded.path}: point {point} at step {step} lacks one of "
                         f"{', '.join(STATISTICS)} (measure with compute_sensitivity.py --reduction mean)")
    return table


def mean_samples(loaded):
    """Δ_B samples per (point, step): index, and (P, S) arrays of value, size k and block (NaN = absent)."""
    rows = loaded.rows[loaded.rows["quantity"] == "batch_sensitivity"]
    if rows.empty:
        return None
    sizes = pd.to_numeric(rows["k"], errors="coerce")
    _first_bad(rows, sizes.isna().to_numpy() | (sizes < 0).to_numpy(), loaded.path, loaded.flag,
               lambda row: f"batch_sensitivity row without a batch size k ({row['k']!r}); re-measure with "
               "compute_sensitivity.py --reduction mean (Δ_B samples must carry k, accounting.md §2)")
    # Samples of several --mc-seed values pool; each (mc_seed, block) is a block of its own.
    seed = pd.to_numeric(rows["mc_seed"], errors="coerce").fillna(-1)
    block = pd.to_numeric(rows["block"], errors="coerce").fillna(0)
    rows = rows.assign(k=sizes.astype(int), mc_seed=seed,
                       block=pd.MultiIndex.from_arrays([seed, block]).factorize()[0])
    check_unique(Loaded(rows, loaded.mechanism, loaded.path, loaded.flag), ["point", "step", "mc_seed", "block", "sample"])
    rows = expand_histograms(rows, loaded)
    rows = rows.assign(column=rows.groupby(["point", "step"]).cumcount())
    index = pd.MultiIndex.from_frame(rows[["point", "step"]].drop_duplicates().sort_values(["point", "step"]))
    def dense(column):
        return rows.pivot(index=["point", "step"], columns="column", values=column).reindex(index).to_numpy(float)
    return index, dense("value"), dense("k"), dense("block")


def expand_histograms(rows, loaded):
    """Δ_B rows with their `count` (a histogram row of storage.histogram_rows stands for `count`
    samples of its value; empty: 1) as that many samples, ordered by (point, step, block, k, value):
    a histogram and the rounded-up samples it was made from give the same arrays, hence the same
    numbers from every estimator, to the last bit (docs/sensitivity.md)."""
    counts = pd.to_numeric(rows["count"], errors="coerce").fillna(1)
    _first_bad(rows, ((counts < 1) | (counts != np.round(counts))).to_numpy(), loaded.path, loaded.flag,
               lambda row: f"count {row['count']} is not an integer >= 1 (the samples a histogram row stands for)")
    rows = rows.loc[rows.index.repeat(counts.astype(int).to_numpy())]
    return rows.sort_values(["point", "step", "block", "k", "value"], kind="mergesort")


def sample_grid(batch_sizes, sizes, loaded):
    """The sizes the Δ_B samples were drawn at (§3.2), checked against k_min."""
    grid = np.unique(batch_sizes[~np.isnan(batch_sizes)]).astype(int)
    if len(grid) and grid[0] < sizes.k_min:
        raise UsageError(loaded.flag, f"{loaded.path}: Δ_B samples at size {grid[0]} below k_min={sizes.k_min}")
    return grid


def mean_rule_table(mechanism, orders, sensitivities, relative_step=LEVEL_STEP):
    """RDP_SGM(q, s_m/Δ, λ) for the mean rule (noise σΓ/B_exp) at the levels that the given
    sensitivities round up to (§5)."""
    ratios = np.concatenate([np.ravel(np.asarray(values, dtype=float)) / mechanism.clip_bound for values in sensitivities])
    levels = accounting.geometric_levels(ratios, relative_step)
    return accounting.RdpTable(mechanism.sample_rate, mechanism.noise_multiplier / mechanism.batch_size, orders, levels)


def mixture_rdp_by_point(table, sensitivities, log_weights, log_mass, mechanism, chunk=512):
    """§3.2 for every point and order of `table`: (1/(λ−1))·(log Σ_k w_k·exp(M_k(λ)) − log mass),
    with sensitivities (P, K) per point and size; computed in chunks of points (P × K × orders)."""
    orders = table.orders
    result = np.empty((len(sensitivities), len(orders)))
    for start in range(0, len(sensitivities), chunk):
        moments = table.log_moments(np.asarray(sensitivities[start:start + chunk]) / mechanism.clip_bound)
        combined = accounting.logsumexp(moments + np.asarray(log_weights)[None, :, None], axis=1)
        result[start:start + chunk] = (combined - log_mass) / (orders - 1.0)
    return result


# --- output: one row per value, each labelled with its kind (§3.5) ---------------------------

KINDS = ("estimate", "certified", "baseline", "gla_statistic")
KIND_LABEL = {"estimate": "estimate (Monte Carlo, not a bound)", "certified": "certified bound",
              "baseline": "data-independent baseline", "gla_statistic": "GLA statistic (loose)"}


def report(path, result, value, keys, groups, correct=None):
    """Print the guarantee (direction max) with its kinds side by side and a summary, then write
    `result` (long format: one row per key and kind) to `path`."""
    # The max over directions where there is one; a file that measured one direction shows that one.
    has_max = "direction" in result and (result["direction"] == "max").any()
    shown = result[result["direction"] == "max"] if has_max else result
    wide = shown.pivot_table(index=keys, columns="kind", values=value, aggfunc="first").reset_index()
    kinds = [kind for kind in KINDS if kind in wide.columns]
    main = next(kind for kind in ("certified", "estimate", "gla_statistic", "baseline") if kind in kinds)
    if "baseline" in kinds and main != "baseline":
        wide["ratio"] = wide[main] / wide["baseline"]
    print(wide.head(TABLE_ROWS).to_string(index=False, float_format=lambda number: f"{number:.4g}"))
    if len(wide) > TABLE_ROWS:
        print(f"... {len(wide) - TABLE_ROWS} more rows in {path}")
    print("kinds: " + "; ".join(f"{kind} = {KIND_LABEL[kind]}" for kind in kinds))
    if correct is not None:
        correct = wide[keys].merge(correct, on=[key for key in keys if key in correct.columns], how="left")["correct"]
    frame = wide.assign(subset="all")
    if correct is not None and set(correct.dropna().unique()) >= {0, 1}:
        labelled = wide.assign(subset=np.where(correct.to_numpy() == 1, "correct", "misclassified"))
        frame = pd.concat([frame, labelled], ignore_index=True)
    summary = frame.groupby(groups + ["subset"], sort=True).apply(_summarise_kinds, kinds, main,
                                                                  include_groups=False).reset_index()
    print(f"\nsummary of {value} ({main}; medians; '2x below': share of points with {main} <= baseline/2)")
    print(summary.to_string(index=False, float_format=lambda number: f"{number:.4g}"))
    write_output(path, result)
    print(f"wrote {path}")


def _summarise_kinds(group, kinds, main):
    summary = {"points": len(group)}
    for kind in kinds:
        summary[kind] = np.nanmedian(group[kind].to_numpy(dtype=float))
    summary[f"{main} q10"] = np.nanquantile(group[main].to_numpy(dtype=float), 0.1)
    summary[f"{main} q90"] = np.nanquantile(group[main].to_numpy(dtype=float), 0.9)
    if "baseline" in kinds and main != "baseline":
        summary["2x below"] = np.mean(group[main].to_numpy(dtype=float) <= group["baseline"].to_numpy(dtype=float) / 2)
    return pd.Series(summary)


def correct_table(rows, keys):
    """`correct` per `keys` from the measured rows (None when the rows do not all record it)."""
    correct = pd.to_numeric(rows["correct"], errors="coerce")
    if correct.isna().any():
        return None
    return rows[keys].assign(correct=correct).groupby(keys, as_index=False)["correct"].first()

"""Result tables on disk: CSV (the default, what users open in pandas) or Parquet (compact at scale).

The format follows the file's extension, `.csv` or `.parquet`. A long-format result file repeats
~20 configuration columns on every row: ~227 bytes per measured value as CSV. Parquet stores
each column once per page, so a column that repeats costs almost nothing and the file comes
down to the measured values themselves (benchmarks/bench_storage.py measures bytes per value):

- text, boolean and few-valued columns: dictionary encoding (a repeated value is an index,
  run-length encoded);
- many-valued floats (the measured Δ): BYTE_STREAM_SPLIT, which puts the sign/exponent bytes
  of all values side by side, where zstd compresses them;
- many-valued integers (sample, point): DELTA_BINARY_PACKED, which stores a counter in ~0 bits.

A Parquet file holds exactly the table that reading its CSV twin gives back (every column
goes through the CSV text first), so every accountant computes identical numbers from both.

A result named without an extension is CSV while it holds at most AUTO_PARQUET_ROWS rows and
Parquet from then on (result_file.ResultFile); `.csv` or `.parquet` fixes the format.

Δ_B histograms (`compute_sensitivity.py --histogram-precision R`): the mean rule's Δ_B samples
rounded UP onto the geometric grid Γ·(1+R)^−j, one row per distinct rounded value of a (point,
checkpoint, block, size k) with its `count`. Every accountant expands a row into `count` samples,
so it computes exactly what it computes on the rounded-up samples; and every estimator of the
mean rule is nondecreasing in each Δ_B sample (accounting.md §5), so that is at least what it
computes on the raw samples: the histogram is an upper bound, coarser by at most a factor 1 + R
on each Δ_B.
"""

import io
import math
import os
from collections.abc import Iterator

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from perinstance.errors import UsageError
from perinstance.files import fileio

CSV, PARQUET = ".csv", ".parquet"
EXTENSIONS = (CSV, PARQUET)
# An integer or float column with at most this many distinct values is dictionary-encoded.
DICTIONARY_MAX_DISTINCT = 4096
PARQUET_INSTALL_HINT = "Parquet result files need pyarrow: pip install pyarrow"
# A result named without an extension turns Parquet above this many rows: ~22 MB of CSV, which
# takes seconds to rewrite after every checkpoint (docs/paper-scale.md, storage table: 218-240 bytes per row).
AUTO_PARQUET_ROWS = 100_000


def extension(path: str) -> str | None:
    """`.csv` or `.parquet` if `path` ends in one (case-insensitive), else None."""
    ending = os.path.splitext(os.fspath(path))[1].lower()
    return ending if ending in EXTENSIONS else None


def read_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean "not a readable table" (pyarrow's only when it is installed)."""
    errors = (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError)
    try:
        import pyarrow
    except ImportError:
        return errors
    return errors + (pyarrow.ArrowException,)


def read_frame(path: str, columns: list[str] | None = None) -> pd.DataFrame:
    """The table at `path` (its `columns` only, where given), in the format of its extension (CSV when it has
    none)."""
    if extension(path) == PARQUET:
        parquet = _parquet()
        # Each column's Arrow memory is let go as it is converted, and the columns are not gathered into one block
        # per dtype: a run's every-step norms (a million rows) are then held once while read, not twice.
        return parquet.read_table(path, columns=columns).to_pandas(self_destruct=True, split_blocks=True)
    return pd.read_csv(path, keep_default_na=False, na_values=[""], usecols=columns)


def write_frame(path: str, frame: pd.DataFrame, flag: str | None = None) -> None:
    """Write `frame` atomically to `path`, in the format of its extension (CSV when it has none);
    a failed write is a UsageError naming `flag`."""
    if extension(path) != PARQUET:
        fileio.write_csv(path, frame, flag)
        return
    parquet = _parquet()
    table, dictionary, encodings = arrow_table(frame)
    with fileio.atomic_path(path, flag) as temp_path:
        parquet.write_table(table, temp_path, compression="zstd", use_dictionary=dictionary,
                            column_encoding=encodings)


def arrow_table(frame: pd.DataFrame) -> tuple[object, list[str], dict[str, str]]:
    """(`frame` as_read_from_csv, as a pyarrow Table; the columns to dictionary-encode; {column: encoding} of the
    others). Converted a column at a time, each as pyarrow.Table.from_pandas converts it: a column the CSV text
    gives back unchanged (integers, text, a constant) is not copied, its Arrow array shares the frame's memory,
    so that a million rows (a run's every-step norms) are held once beside the frame, not twice."""
    import pyarrow

    columns = dict(columns_as_read(frame))
    dictionary, encodings = column_encodings(columns)
    # The schema, and pandas' description of each column in its metadata, follow from the dtypes, except for an
    # object column, whose description pandas infers from its values: such a table is converted whole.
    if any(values.dtype == object for values in columns.values()):
        return pyarrow.Table.from_pandas(pd.DataFrame(columns), preserve_index=False), dictionary, encodings
    schema = pyarrow.Table.from_pandas(pd.DataFrame({column: values.iloc[:1] for column, values in columns.items()}),
                                       preserve_index=False).schema
    arrays = [pyarrow.Table.from_pandas(values.to_frame(), preserve_index=False).column(0)
              for values in columns.values()]
    return pyarrow.Table.from_arrays(arrays, schema=schema), dictionary, encodings


def as_read_from_csv(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` as fileio.write_csv + read_frame would give it back: same values (floats at ten
    significant digits, parsed by pandas' own parser), same dtypes (columns_as_read)."""
    return pd.DataFrame(dict(columns_as_read(frame)), index=pd.RangeIndex(len(frame)))


def columns_as_read(frame: pd.DataFrame) -> Iterator[tuple[str, pd.Series]]:
    """(name, values) of each column of `frame` as write_csv + read_frame would give it back. Only each column's
    distinct values go through the text (a configuration column has one), and the parser infers the same dtype
    from them as from the whole column; a column they come back from unchanged is the frame's own (no copy)."""
    for column in frame.columns:
        values = frame[column].reset_index(drop=True)
        codes, distinct = pd.factorize(values, use_na_sentinel=False)
        text = pd.DataFrame({column: distinct}).to_csv(index=False, float_format=fileio.CSV_FLOAT_FORMAT,
                                                       lineterminator="\n")
        parsed = pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=[""])[column]
        if parsed.dtype == values.dtype and parsed.equals(pd.Series(distinct, name=column)):
            yield column, values
        else:
            yield column, parsed.take(codes).reset_index(drop=True)


def column_encodings(columns: dict[str, pd.Series]) -> tuple[list[str], dict[str, str]]:
    """(columns to dictionary-encode, {column: encoding} for the rest), as explained at the top."""
    dictionary, encodings = [], {}
    for column, values in columns.items():
        kind = values.dtype.kind
        if kind not in "iuf" or values.nunique(dropna=False) <= DICTIONARY_MAX_DISTINCT:
            dictionary.append(column)
        else:
            encodings[column] = "BYTE_STREAM_SPLIT" if kind == "f" else "DELTA_BINARY_PACKED"
    return dictionary, encodings


# --- Δ_B histograms (accounting.md §5: rounding a sensitivity up keeps every bound valid) --------

def round_up(values: ArrayLike, bound: ArrayLike, precision: float) -> np.ndarray:
    """Each value rounded up onto the grid bound·(1+precision)^−j, j = 0, ±1, ±2, ...: the result
    is >= the value and < value·(1+precision) (up to one rounding of exp), a value <= bound stays
    <= bound, 0 stays 0 and NaN stays NaN. Equal grid points come out as equal floats."""
    values = np.asarray(values, dtype=float)
    log_step = math.log1p(precision)
    positive = values > 0
    safe = np.where(positive, values, bound)
    steps = np.floor(np.log(bound / safe) / log_step)
    rounded = bound * np.exp(-steps * log_step)
    # log/exp may land one ulp below the value: then the grid point above it is the answer.
    rounded = np.where(rounded < safe, bound * np.exp(-(steps - 1) * log_step), rounded)
    return np.where(positive, rounded, values)


def histogram_rows(rows: pd.DataFrame, precision: float, quantity: str = "batch_sensitivity") -> pd.DataFrame:
    """`rows` with the `quantity` rows replaced by their histogram: values rounded up onto the grid
    clip_bound·(1+precision)^−j (round_up), one row per distinct value among rows equal in every
    other column but `sample`, with its `count`; `sample` then numbers those rows within each
    (run, step, point, mc_seed, block). Other rows pass unchanged."""
    chosen = (rows["quantity"] == quantity).to_numpy()
    samples = rows[chosen]
    if samples.empty:
        return rows
    bound = pd.to_numeric(samples["clip_bound"]).to_numpy(dtype=float)
    samples = samples.assign(value=round_up(samples["value"].to_numpy(dtype=float), bound, precision))
    keys = [column for column in rows.columns if column not in ("sample", "value", "count")]
    ordered = ["run", "step", "point", "mc_seed", "block", "k", "value"]
    counted = (samples.groupby(keys + ["value"], dropna=False, sort=False).size().rename("count").reset_index()
               .sort_values(ordered, kind="mergesort", ignore_index=True))
    counted["sample"] = counted.groupby(["run", "step", "point", "mc_seed", "block"], dropna=False).cumcount()
    return pd.concat([rows[~chosen], counted[rows.columns]], ignore_index=True)


def _parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise UsageError(None, PARQUET_INSTALL_HINT) from None
    return pyarrow.parquet

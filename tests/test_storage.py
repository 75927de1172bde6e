"""Result files as CSV or Parquet (perinstance/storage.py): the same table from both, compact encodings,
and results.read_results / results_path choosing the format by extension."""

import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from perinstance import results, storage
from perinstance.errors import UsageError


def mixed_table(rows=3000, seed=0):
    """Every kind of column a result file has: floats over many magnitudes, NaN, integers,
    integral floats (which a CSV reads back as integers), text with gaps, booleans."""
    rng = np.random.default_rng(seed)
    magnitudes = 10.0 ** rng.integers(-8, 9, rows)
    return pd.DataFrame({
        "value": rng.random(rows) * magnitudes,
        "with_gaps": np.where(rng.random(rows) < 0.2, np.nan, rng.normal(size=rows)),
        "point": np.arange(rows),
        "sample": np.tile(np.arange(100), rows // 100),
        "target_eps": 10.0,
        "empty": np.nan,
        "dataset": "synthetic",
        "note": np.where(np.arange(rows) % 7 == 0, None, "x"),
        "flag": np.arange(rows) % 3 == 0,
    })


def write_both(folder, frame, name="table"):
    paths = {ending: os.path.join(folder, name + ending) for ending in storage.EXTENSIONS}
    for path in paths.values():
        storage.write_frame(path, frame)
    return paths


def test_parquet_holds_exactly_the_table_the_csv_reads_back(tmp_path):
    frame = mixed_table()
    paths = write_both(tmp_path, frame)
    from_csv = storage.read_frame(paths[storage.CSV])
    from_parquet = storage.read_frame(paths[storage.PARQUET])
    pd.testing.assert_frame_equal(from_parquet, from_csv, check_exact=True)
    # Independently of pandas: each float is the ten-significant-digit decimal the CSV holds.
    expected = np.array([float(f"{value:.10g}") for value in frame["value"]])
    np.testing.assert_array_equal(from_parquet["value"].to_numpy(), expected)
    assert not np.array_equal(from_parquet["value"].to_numpy(), frame["value"].to_numpy())
    # Integral floats come back as integers, as from the CSV; a column of gaps as floats.
    assert from_parquet["target_eps"].dtype.kind == "i" and from_parquet["empty"].isna().all()
    assert from_parquet["note"].isna().sum() == (np.arange(len(frame)) % 7 == 0).sum()


def test_parquet_encodes_repeats_as_dictionaries_and_measured_floats_byte_split(tmp_path):
    frame = mixed_table(rows=20000)
    paths = write_both(tmp_path, frame)
    metadata = pq.ParquetFile(paths[storage.PARQUET]).metadata.row_group(0)
    encodings = {metadata.column(i).path_in_schema: set(metadata.column(i).encodings)
                 for i in range(metadata.num_columns)}
    assert "BYTE_STREAM_SPLIT" in encodings["value"]
    assert "DELTA_BINARY_PACKED" in encodings["point"]
    for column in ("dataset", "target_eps", "sample", "note"):  # (booleans are bit-packed anyway)
        assert "RLE_DICTIONARY" in encodings[column], (column, encodings[column])
    # A column that repeats one value costs next to nothing: under 1% of the CSV's bytes for it.
    repeated = pd.DataFrame({"dataset": ["a-long-configuration-value"] * 20000})
    repeated_paths = write_both(tmp_path, repeated, "repeated")
    assert os.path.getsize(repeated_paths[storage.PARQUET]) < 0.01 * os.path.getsize(repeated_paths[storage.CSV])


def test_empty_table_round_trips(tmp_path):
    frame = pd.DataFrame(columns=results.COLUMNS)
    paths = write_both(tmp_path, frame)
    from_csv, from_parquet = (storage.read_frame(path) for path in paths.values())
    assert list(from_parquet.columns) == results.COLUMNS and len(from_parquet) == 0
    assert list(from_csv.columns) == list(from_parquet.columns)


def test_extension_decides_the_format():
    assert storage.extension("res/x.parquet") == storage.PARQUET
    assert storage.extension("res/x.PARQUET") == storage.PARQUET
    assert storage.extension("res/x.csv") == storage.CSV
    assert storage.extension("res/x") is None and storage.extension("res/x.tsv") is None


def test_results_path_resolves_the_format(tmp_path):
    folder = str(tmp_path)
    assert results.results_path("a.parquet", folder) == os.path.join(folder, "a.parquet")
    assert results.results_path("a.csv", folder) == os.path.join(folder, "a.csv")
    assert results.results_path("a", folder) == os.path.join(folder, "a.csv")
    storage.write_frame(os.path.join(folder, "a.parquet"), mixed_table(100))
    assert results.results_path("a", folder) == os.path.join(folder, "a.parquet")  # only the Parquet file exists
    storage.write_frame(os.path.join(folder, "a.csv"), mixed_table(100))
    assert results.results_path("a", folder) == os.path.join(folder, "a.csv")  # both: the default wins


def result_rows(count=500, seed=1):
    """Rows with every column of a result file."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({column: np.nan for column in results.COLUMNS}, index=range(count))
    frame["run"], frame["exp"], frame["direction"], frame["quantity"] = "r", "eps_delta", "none", "grad_norm"
    for column in results.REQUIRED_NUMBERS:
        frame[column] = 1
    frame["point"], frame["step"] = np.arange(count), 5
    frame["value"] = rng.random(count)
    return frame[results.COLUMNS]


def test_read_results_reads_both_formats_alike(tmp_path):
    paths = write_both(tmp_path, result_rows())
    pd.testing.assert_frame_equal(results.read_results(paths[storage.PARQUET]),
                                  results.read_results(paths[storage.CSV]), check_exact=True)


def test_a_corrupt_parquet_file_is_a_usage_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(UsageError) as error:
        results.read_results(str(path), flag="--res-file")
    assert error.value.flag == "--res-file" and "cannot read" in error.value.message


# --- every accountant, from both formats ------------------------------------------------------------

RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--save-freq", "8", "--clipping", "psac", "--sigma", "1.0"]
ACCOUNTANTS = {
    "sum": [("eps_delta.py", []), ("eps_delta.py", ["--method", "holder", "--holder-p", "inf"]),
            ("renyi_per_instance_sum.py", []), ("renyi_per_instance_sum_compo.py", []),
            ("renyi_per_instance_sum_compo.py", ["--holder-b", "3T"])],
    # (the composition reads the mean rule's rows as eps_delta does, and takes seconds per call here)
    "mean": [("eps_delta.py", []), ("renyi_per_instance_mean.py", [])],
}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_every_accountant_gives_identical_numbers_from_csv_and_parquet(reduction, tmp_path):
    from conftest import run_in_process

    measured = run_in_process("compute_sensitivity.py", *RUN, "--reduction", reduction, "--num-batches", "100",
                              "--points", "0-19", "--stage", "all", "--res-name", "rows.parquet", cwd=tmp_path)
    assert measured.returncode == 0, measured.stderr
    parquet_path = tmp_path / "res" / "rows.parquet"
    rows = storage.read_frame(parquet_path)
    assert len(rows) > 0 and set(rows["reduction"]) == {reduction}
    storage.write_frame(tmp_path / "res" / "rows.csv", rows)
    for script, flags in ACCOUNTANTS[reduction]:
        outputs = {}
        for ending in storage.EXTENSIONS:
            out = tmp_path / f"{script}{'-'.join(flags)}{ending}.out.csv"
            result = run_in_process(script, "--res-file", tmp_path / "res" / f"rows{ending}", "--out", out, *flags,
                                    cwd=tmp_path)
            assert result.returncode == 0, (script, flags, result.stderr)
            outputs[ending] = out.read_bytes()
        assert outputs[storage.CSV] == outputs[storage.PARQUET], (script, flags)
        assert len(outputs[storage.CSV].splitlines()) > 20

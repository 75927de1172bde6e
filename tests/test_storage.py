"""Result files as CSV or Parquet (perinstance/files/storage.py): the same table from both, compact encodings,
and results.read_results / results_path choosing the format by extension."""

import io
import math
import os

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from perinstance.errors import UsageError
from perinstance.files import results, storage


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
    assert results.results_path("a.csv", folder) == os.path.join(folder, "a.csv")  # named: no ambiguity
    with pytest.raises(UsageError) as error:  # both, unnamed: ambiguous
        results.results_path("a", folder, flag="--res-name")
    assert error.value.flag == "--res-name" and "a.csv or a.parquet" in error.value.message


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


# --- Δ_B histograms: values rounded up onto a geometric grid ---------------------------------------

def test_round_up_lands_on_the_grid_above_the_value_within_the_precision():
    rng = np.random.default_rng(2)
    bound, precision = 0.7, 0.01
    values = bound * np.concatenate([rng.random(5000), 10.0 ** rng.uniform(-9, 0, 5000), [1.0]])
    rounded = storage.round_up(values, bound, precision)
    # Independently: the smallest point of bound·(1+R)^-j, j = 0..3000, at or above each value.
    grid = np.sort(bound * (1 + precision) ** -np.arange(3000.0))
    expected = grid[np.searchsorted(grid, values * (1 - 1e-13))]
    np.testing.assert_allclose(rounded, expected, rtol=1e-12)
    assert np.all(rounded >= values) and np.all(rounded <= bound)
    assert np.all(rounded <= values * (1 + precision) * (1 + 1e-12))
    assert rounded[-1] == bound  # the bound itself is a grid point
    # One float per grid point: the dictionary of a histogram has one entry per level.
    assert len(np.unique(rounded)) == len(np.unique(np.round(np.log(bound / rounded) / math.log1p(precision))))
    special = storage.round_up(np.array([0.0, np.nan]), bound, precision)
    assert special[0] == 0 and np.isnan(special[1])


def coupling_table(points=3, samples=400, seed=3):
    """Mean-rule rows as compute_sensitivity.py writes them: the three statistics per point, then
    Δ_B samples with their size k and block, at one checkpoint (values within each size spread ±20%)."""
    rng = np.random.default_rng(seed)
    base = pd.DataFrame({column: np.nan for column in results.COLUMNS}, index=range(points * samples))
    point = np.repeat(np.arange(points), samples)
    k = rng.choice([20, 24, 30], points * samples)
    samples_frame = base.assign(
        run="r", seed=0, step=8, stage=1.0, total_steps=8, point=point, label=point % 2, correct=1, loss=0.5,
        exp="coupling", reduction="mean", direction="none", target_batch=0,
        sample=np.tile(np.arange(samples), points), quantity="batch_sensitivity",
        value=2.0 / (k + 1) * (0.3 + 0.1 * point) * rng.uniform(0.8, 1.2, points * samples),
        sigma=1.0, clip_bound=1.0, sample_rate=0.125, batch_size=32, dataset_size=256, noise_std=1.0 / 32,
        dataset="synthetic", model="mlp", clipping="flat", update_rule="mean", target_eps=math.nan, delta=1e-5,
        accuracy=0.5, mc_seed=0, block=np.tile(np.arange(samples) % 4, points), k=k, k_min=20)
    statistics = samples_frame.drop_duplicates("point").assign(sample=0, block=np.nan, k=np.nan)
    frames = [statistics.assign(quantity=quantity, value=value)
              for quantity, value in (("center_distance", 0.5), ("spread", 0.02), ("max_deviation", 0.9))]
    return pd.concat([*frames, samples_frame], ignore_index=True)[results.COLUMNS]


def test_histogram_rows_count_the_rounded_samples():
    table = coupling_table()
    histogram = storage.histogram_rows(table, 0.05)
    raw = table[table["quantity"] == "batch_sensitivity"]
    rows = histogram[histogram["quantity"] == "batch_sensitivity"]
    assert len(rows) < len(raw) / 3  # ±20% at 5%: about 9 levels for the ~33 samples of a (point, block, k)
    # Independently: each (point, block, k) cell's samples counted per grid level j = floor(log(Γ/value)/log 1.05).
    level = np.floor(np.log(1.0 / raw["value"].to_numpy()) / math.log(1.05))
    expected = raw.assign(level=level).groupby(["point", "block", "k", "level"]).size()
    found = rows.assign(level=np.round(np.log(1.0 / rows["value"].to_numpy()) / math.log(1.05))).set_index(
        ["point", "block", "k", "level"])["count"]
    pd.testing.assert_series_equal(found.sort_index().astype(int), expected.sort_index(), check_names=False)
    # The statistics pass unchanged; samples are numbered within (point, block) in (k, value) order.
    pd.testing.assert_frame_equal(histogram[histogram["quantity"] != "batch_sensitivity"].reset_index(drop=True),
                                  table[table["quantity"] != "batch_sensitivity"].reset_index(drop=True))
    for _, cell in rows.groupby(["point", "block"]):
        assert list(cell["sample"]) == list(range(len(cell)))
        assert list(cell[["k", "value"]].itertuples(index=False)) == sorted(cell[["k", "value"]].itertuples(index=False))


# --- every accountant, from both formats, and from histograms ------------------------------------------

RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--save-freq", "8", "--clipping", "psac", "--sigma", "1.0"]
ACCOUNTANTS = {
    "sum": [("eps_delta.py", []), ("eps_delta.py", ["--method", "holder", "--holder-p", "inf"]),
            ("renyi_per_instance_sum.py", []), ("renyi_per_instance_sum_compo.py", []),
            ("renyi_per_instance_sum_compo.py", ["--holder-b", "3T"])],
    "mean": [("eps_delta.py", []), ("renyi_per_instance_mean.py", ["--alpha", "2", "8"]),
             ("renyi_per_instance_sum_compo.py", ["--kind", "estimate", "--alpha", "2", "4", "8", "16"]),
             ("renyi_per_instance_sum_compo.py", ["--alpha", "2", "4", "8", "16"])],
}
PRECISION = 0.01


MEASUREMENTS = {"sum": ["--reduction", "sum"], "mean": ["--reduction", "mean"],
                "histogram": ["--reduction", "mean", "--histogram-precision", str(PRECISION)]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """measured(name): one synthetic run measured by compute_sensitivity.py (once per module) with
    the sum rule, the mean rule, or the mean rule with Δ_B histograms (same seeds, so the same
    draws), read back as a table."""
    from conftest import run_in_process

    folder = tmp_path_factory.mktemp("measured")
    tables = {}

    def table(name):
        if name not in tables:
            result = run_in_process("compute_sensitivity.py", *RUN, *MEASUREMENTS[name], "--num-batches", "200",
                                    "--points", "0-9", "--stage", "all", "--res-name", f"{name}.parquet", cwd=folder)
            assert result.returncode == 0, result.stderr
            tables[name] = storage.read_frame(folder / "res" / f"{name}.parquet")
        return tables[name]
    return table


def account(folder, table, name, script, flags, endings=storage.EXTENSIONS):
    """Write `table` in each format of `endings`, run `script` on each; returns {ending: output bytes}."""
    from conftest import run_in_process

    outputs = {}
    for ending in endings:
        source = folder / f"{name}{ending}"
        if not source.exists():
            storage.write_frame(source, table)
        out = folder / f"{name}-{script}{'-'.join(flags)}{ending}.out.csv"
        result = run_in_process(script, "--res-file", source, "--out", out, *flags, cwd=folder)
        assert result.returncode == 0, (script, flags, result.stderr)
        outputs[ending] = out.read_bytes()
    return outputs


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_every_accountant_gives_identical_numbers_from_csv_and_parquet(reduction, measured, tmp_path):
    """(Histograms: in the test after next.)"""
    rows = measured(reduction)
    assert len(rows) > 0 and set(rows["reduction"]) == {reduction}
    for script, flags in ACCOUNTANTS[reduction]:
        outputs = account(tmp_path, rows, reduction, script, flags)
        assert outputs[storage.CSV] == outputs[storage.PARQUET], (script, flags)
        assert len(outputs[storage.CSV].splitlines()) > 20


def test_the_histogram_flag_stores_the_histogram_of_the_samples(measured):
    """compute_sensitivity.py --histogram-precision writes what storage.histogram_rows makes of the
    raw samples of the same draws (few per (point, block, k) here: few rows saved)."""
    raw, histogram = measured("mean"), measured("histogram")
    expected = storage.as_read_from_csv(storage.histogram_rows(raw, PRECISION))
    sort = ["step", "point", "quantity", "block", "sample"]
    pd.testing.assert_frame_equal(histogram.sort_values(sort, ignore_index=True),
                                  expected.sort_values(sort, ignore_index=True), check_exact=True)
    samples = histogram[histogram["quantity"] == "batch_sensitivity"]
    assert samples["count"].sum() == (raw["quantity"] == "batch_sensitivity").sum()
    assert len(samples) < samples["count"].sum() and samples["count"].max() > 1


ESTIMATE_COLUMNS = {"eps_delta.py": ["eps", "eps_min", "eps_max"], "renyi_per_instance_mean.py": ["rdp", "rdp_min",
                                                                                                  "rdp_max"],
                    "renyi_per_instance_sum_compo.py": ["eps"]}


def test_accountants_on_a_histogram_equal_them_on_the_rounded_samples_and_bound_the_raw_ones(measured, tmp_path):
    """Exactly the numbers of the rounded-up samples (one row each), from CSV and from Parquet, and
    never below those of the raw samples: every estimator is nondecreasing in each Δ_B (accounting.md
    §5). (The composition's certified kind does not read Δ_B; it is compared in the test above.)"""
    raw = measured("mean")
    is_sample = (raw["quantity"] == "batch_sensitivity").to_numpy()
    rounded = raw.assign(value=np.where(is_sample, storage.round_up(raw["value"].to_numpy(),
                                                                    raw["clip_bound"].to_numpy(), PRECISION),
                                        raw["value"]))
    histogram = storage.histogram_rows(raw, PRECISION)
    strictly_above = 0
    for script, flags in ACCOUNTANTS["mean"][:3]:
        from_histograms = account(tmp_path, histogram, "histogram", script, flags)
        from_histogram = from_histograms[storage.CSV]
        from_rounded = account(tmp_path, rounded, "rounded", script, flags, [storage.CSV])[storage.CSV]
        from_raw = account(tmp_path, raw, "raw", script, flags, [storage.CSV])[storage.CSV]
        assert from_histograms[storage.PARQUET] == from_histogram == from_rounded, (script, flags)
        bounded, exact = (pd.read_csv(io.BytesIO(output)) for output in (from_histogram, from_raw))
        assert list(bounded.columns) == list(exact.columns) and len(bounded) == len(exact)
        estimate = (exact["kind"] == "estimate").to_numpy()
        columns = ESTIMATE_COLUMNS[script]
        above, below = bounded.loc[estimate, columns].to_numpy(), exact.loc[estimate, columns].to_numpy()
        # (a block without samples at some size has no estimate, NaN, from either)
        np.testing.assert_array_equal(np.isnan(above), np.isnan(below))
        assert np.all(above[~np.isnan(above)] >= below[~np.isnan(below)]), script
        strictly_above += int(np.sum(above[~np.isnan(above)] > below[~np.isnan(below)]))
        # The other kinds do not read Δ_B: unchanged.
        pd.testing.assert_frame_equal(bounded[~estimate], exact[~estimate])
    assert strictly_above > 0


# --- a result named without an extension: CSV, then Parquet when large ----------------------------------

def measure(folder, *flags):
    from conftest import run_in_process

    return run_in_process("compute_sensitivity.py", *RUN, "--reduction", "sum", "--points", "0-19", *flags,
                          cwd=folder)


def test_an_unnamed_format_turns_parquet_above_the_threshold_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "AUTO_PARQUET_ROWS", 30)
    first = measure(tmp_path, "--stage", "initial", "--res-name", "auto")  # 20 rows: CSV
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(tmp_path / "res")) == ["auto.csv", "auto.lock"]
    assert "Parquet" not in first.stdout
    second = measure(tmp_path, "--stage", "all", "--res-name", "auto")  # 20 more per checkpoint: Parquet
    assert second.returncode == 0, second.stderr
    assert not (tmp_path / "res" / "auto.csv").exists() and (tmp_path / "res" / "auto.parquet").exists()
    assert "auto.parquet (Parquet: more than 30 rows; --res-name auto.csv keeps CSV)" in second.stdout
    grown = storage.read_frame(tmp_path / "res" / "auto.parquet")
    # The same table as one command writing an explicitly named CSV, and a rerun finds it: nothing to do.
    explicit = measure(tmp_path, "--stage", "all", "--res-name", "named.csv")
    assert explicit.returncode == 0 and (tmp_path / "res" / "named.csv").exists(), explicit.stderr
    pd.testing.assert_frame_equal(grown, storage.read_frame(tmp_path / "res" / "named.csv"), check_exact=True)
    before = (tmp_path / "res" / "auto.parquet").read_bytes()
    again = measure(tmp_path, "--stage", "all", "--res-name", "auto")
    assert again.returncode == 0 and " 0 rows written" in again.stdout, again.stdout
    assert (tmp_path / "res" / "auto.parquet").read_bytes() == before
    # Every accountant finds it by its name, and names its output after it.
    from conftest import run_in_process

    for script, _ in ACCOUNTANTS["sum"][:3]:
        result = run_in_process(script, "--res-name", "auto", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "res" / f"auto_{os.path.splitext(script)[0]}.csv").exists()


def test_an_explicit_extension_keeps_its_format_and_two_files_are_ambiguous(tmp_path, monkeypatch):
    from conftest import assert_usage_error, run_in_process

    monkeypatch.setattr(storage, "AUTO_PARQUET_ROWS", 30)
    kept = measure(tmp_path, "--stage", "all", "--res-name", "kept.csv")
    assert kept.returncode == 0, kept.stderr
    assert len(storage.read_frame(tmp_path / "res" / "kept.csv")) > 30
    assert not (tmp_path / "res" / "kept.parquet").exists()
    storage.write_frame(tmp_path / "res" / "kept.parquet", storage.read_frame(tmp_path / "res" / "kept.csv"))
    assert_usage_error(run_in_process("eps_delta.py", "--res-name", "kept", cwd=tmp_path), "--res-name")
    assert_usage_error(measure(tmp_path, "--stage", "all", "--res-name", "kept"), "--res-name")
    named = run_in_process("eps_delta.py", "--res-name", "kept.parquet", cwd=tmp_path)
    assert named.returncode == 0 and (tmp_path / "res" / "kept_eps_delta.csv").exists(), named.stderr


@pytest.mark.parametrize("flags", [["--reduction", "mean", "--histogram-precision", "2"],
                                   ["--reduction", "sum", "--histogram-precision", "0.01"],
                                   ["--reduction", "mean", "--exp", "renyi", "--estimator", "jensen",
                                    "--histogram-precision", "0.01"]])
def test_bad_histogram_precision_is_a_usage_error(flags, tmp_path):
    from conftest import assert_usage_error

    result = measure(tmp_path, "--stage", "final", "--res-name", "x", *flags)
    assert_usage_error(result, "--histogram-precision")
    assert not (tmp_path / "res").exists()


def test_a_histogram_count_that_is_no_positive_integer_is_refused(tmp_path):
    from conftest import assert_usage_error, run_in_process

    table = storage.histogram_rows(coupling_table(), 0.05)
    samples = np.flatnonzero(table["quantity"] == "batch_sensitivity")
    for count in (0, 1.5):
        broken = table.copy()
        broken.loc[samples[3], "count"] = count
        storage.write_frame(tmp_path / "broken.csv", broken)
        result = run_in_process("eps_delta.py", "--res-file", tmp_path / "broken.csv", "--out", tmp_path / "o.csv",
                                "--overwrite", cwd=tmp_path)
        assert_usage_error(result, "--res-file")
        assert "count" in result.stderr

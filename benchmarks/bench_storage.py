"""Bytes per stored value of a result file, CSV against Parquet (perinstance/files/storage.py), at paper scale.

Long-format tables with every column of results.COLUMNS, as compute_sensitivity.py writes them:
- sum rule: Δ* of every CIFAR-10 training point (50,000) at 20 checkpoints = 1,000,000 values;
  Δ* = min(C, LogNormal) with about a third of the points clipped at C;
- mean rule: Δ_B of 100 points × 10,000 batches at one checkpoint = 1,000,000 values, each with
  its batch size k (cycling over the coupling grid of accounting.md §3.2) and Monte-Carlo block;
- the same Δ_B as histograms (compute_sensitivity.py --histogram-precision 0.01: each value
  rounded up by at most 1%, one row per distinct value of a (point, block, k) with its count).
The values are synthetic. Raw values cost what their number of distinct values costs, wherever
they come from; a histogram's size depends on how much Δ_B varies within a (point, block, k),
so Δ_B here follows the coupling's geometry: (k+1)·Δ_B = ||a + e||, a point's offset a from the
data mean (||a|| = d* log-uniform in [0.03, 1]) plus the batch mean's deviation e ~ N(0, v_X·(1/k
− 1/n)/D · I_D), v_X = 0.37, D = 32: the spreads measured on a LeNet-5 checkpoint of embedded
MNIST (docs/paper-scale.md, storage table). The benchmark measures the file format, not the engine. It also
checks that CSV and Parquet read back to the same table (read_results, as every accountant).

    python benchmarks/bench_storage.py            # 3 tables of 1,000,000 values
    python benchmarks/bench_storage.py --smoke    # seconds: 20,000 values each, same code paths
"""

import argparse
import os
import sys
import tempfile
import time
import types

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perinstance.accounting import batch_sizes
from perinstance.files import results, storage

# CIFAR-10 at batch 512, σ = 1, C = 1: the configuration columns every row repeats.
METADATA = {
    "run": "CIFAR10_resnet20_sum_flat_eps10_bs512_seed0_1a2b3c4d", "seed": 0, "total_steps": 3900,
    "noise_multiplier": 1.0, "clip_bound": 1.0, "sample_rate": 512 / 50000, "batch_size": 512,
    "dataset_size": 50000, "dataset": "CIFAR10", "model": "resnet20", "clipping": "flat",
    "update_rule": "sum", "target_eps": 10.0, "delta": 1e-5,
}
FULL = {"sum": (50000, 20, 1), "mean": (100, 1, 10000)}  # points, checkpoints, samples per point
# The numbers measured per row (everything else repeats across rows): the sum rule's loss is
# per point and checkpoint, like its Δ*; a Δ_B sample carries its batch size k, a histogram row
# also its count.
MEASURED = {"sum": ("value", "loss"), "mean": ("value", "k"), "histogram": ("value", "k", "count")}
SMOKE = {"sum": (1000, 20, 1), "mean": (10, 1, 2000)}
MC_BLOCKS = 4
HISTOGRAM_PRECISION = 0.01
# The synthetic coupling geometry (see the top): v_X, effective dimension D, range of d*.
SPREAD, DIMENSION, CENTER_DISTANCES = 0.37, 32, (0.03, 1.0)


def result_table(reduction, points, checkpoints, samples, rng):
    """A result table of points × checkpoints × samples rows, sorted as compute_sensitivity.py sorts."""
    steps = np.linspace(0, METADATA["total_steps"], checkpoints).round().astype(int)
    per_step = points * samples
    rows = {
        "step": np.repeat(steps, per_step),
        "stage": np.repeat(steps / METADATA["total_steps"], per_step),
        "point": np.tile(np.repeat(np.arange(points), samples), checkpoints),
        "label": np.tile(np.repeat(rng.integers(0, 10, points), samples), checkpoints),
        "correct": rng.integers(0, 2, per_step * checkpoints) if samples == 1 else
        np.tile(np.repeat(rng.integers(0, 2, points), samples), checkpoints),
        "loss": np.repeat(rng.exponential(1.0, points * checkpoints), samples),
        "exp": "eps_delta",
        "direction": "none",
        "target_batch": 0,
        "sample": np.tile(np.arange(samples), points * checkpoints),
        "alpha": np.nan,
        "accuracy": np.repeat(rng.uniform(0.1, 0.6, checkpoints), per_step),
        "mc_seed": np.nan if reduction == "sum" else 0,
        "count": np.nan,
        "block": np.nan if reduction == "sum" else np.tile(np.arange(samples) * MC_BLOCKS // samples,
                                                           points * checkpoints),
    }
    count = per_step * checkpoints
    if reduction == "sum":
        rows["quantity"] = "grad_norm"
        rows["value"] = np.minimum(METADATA["clip_bound"], rng.lognormal(-0.5, 1.0, count))
        rows["k"] = rows["k_min"] = np.nan
    else:
        rows["quantity"] = "batch_sensitivity"
        rows["k_min"], rows["k"], rows["value"] = coupling_samples(points, checkpoints, samples, rng)
    frame = pd.DataFrame(rows)
    for column, value in results.run_columns(types.SimpleNamespace(**dict(METADATA, update_rule=reduction)), reduction).items():
        frame[column] = value
    return frame[results.COLUMNS]


def coupling_samples(points, checkpoints, samples, rng):
    """k_min, and each draw's size k and Δ_B = ||a + e||/(k+1) (see the top), point-major."""
    n, rate = METADATA["dataset_size"] - 1, METADATA["sample_rate"]
    k_min = batch_sizes.size_threshold(n, rate, METADATA["delta"] / (10 * METADATA["total_steps"]))
    grid = batch_sizes.size_grid(n, rate, k_min, 32)
    k = np.tile(grid[np.arange(samples) % len(grid)], points * checkpoints)
    center = np.repeat(np.exp(rng.uniform(*np.log(CENTER_DISTANCES), points * checkpoints)), samples)
    scale = np.sqrt(SPREAD * (1 / k - 1 / n) / DIMENSION)
    along = center + scale * rng.standard_normal(len(k))
    across = scale**2 * rng.chisquare(DIMENSION - 1, len(k))
    value = np.sqrt(along**2 + across) / (k + 1)
    return k_min, k, np.minimum(value, 2 * METADATA["clip_bound"] / (k + 1))


def measure(frame, folder, name):
    """{format: (bytes per row, write seconds, read seconds)}, and whether both read back equal."""
    measured, tables = {}, {}
    for ending in storage.EXTENSIONS:
        path = os.path.join(folder, name + ending)
        started = time.perf_counter()
        storage.write_frame(path, frame)
        written = time.perf_counter()
        tables[ending] = results.read_results(path)
        measured[ending] = (os.path.getsize(path) / len(frame), written - started, time.perf_counter() - written)
    try:
        pd.testing.assert_frame_equal(tables[storage.CSV], tables[storage.PARQUET], check_exact=True)
        identical = True
    except AssertionError:
        identical = False
    return measured, identical


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="20,000 values per table (CI), same code paths")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    rng = np.random.default_rng(0)
    print(f"{'table (rows = Δ values)':<44} {'format':<9} {'bytes/row':>10} {'bytes/number':>13} "
          f"{'write s':>8} {'read s':>7}")
    all_identical = True
    tables = {reduction: result_table(reduction, *shape, rng) for reduction, shape in sizes.items()}
    tables["histogram"] = storage.histogram_rows(tables["mean"], HISTOGRAM_PRECISION)
    with tempfile.TemporaryDirectory() as folder:
        for name, frame in tables.items():
            points, checkpoints, samples = sizes["mean" if name == "histogram" else name]
            label = f"{name}: {points:,} pts × {checkpoints} ckpts × {samples:,} samples"
            measured, identical = measure(frame, folder, name)
            all_identical &= identical
            numbers = len(MEASURED[name])
            for ending, (per_row, write_s, read_s) in measured.items():
                print(f"{label:<44} {ending[1:]:<9} {per_row:>10.2f} {per_row / numbers:>13.2f} "
                      f"{write_s:>8.2f} {read_s:>7.2f}")
            ratio = measured[storage.CSV][0] / measured[storage.PARQUET][0]
            print(f"{'':<44} CSV/Parquet = {ratio:.1f}×; measured numbers per row: "
                  f"{', '.join(MEASURED[name])}; read back identical: {identical}")
            if name == "histogram":
                represented = points * checkpoints * samples
                per_sample = measured[storage.PARQUET][0] * len(frame) / represented
                print(f"{'':<44} {len(frame):,} rows for {represented:,} Δ_B samples (R = {HISTOGRAM_PRECISION:g}): "
                      f"{per_sample:.3f} bytes per Δ_B sample as Parquet, "
                      f"{measured[storage.CSV][0] * len(frame) / represented:.1f} as CSV")
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())

"""Bytes per stored value of a result file, CSV against Parquet (perinstance/storage.py), at paper scale.

Two long-format tables with every column of results.COLUMNS, as compute_sensitivity.py writes them:
- sum rule: Δ* of every CIFAR-10 training point (50,000) at 20 checkpoints = 1,000,000 values;
  Δ* = min(C, LogNormal) with about a third of the points clipped at C;
- mean rule: Δ_B of 100 points × 10,000 batches at one checkpoint = 1,000,000 values, each with
  its batch size k ~ Binomial(n, q) and Monte-Carlo block.
The values are synthetic (the sizes do not depend on where the values come from, only on how
many distinct values there are): the benchmark measures the file format, not the engine. It
also checks that both files read back to the same table (read_results, as every accountant).

    python benchmarks/bench_storage.py            # 2 × 1,000,000 values
    python benchmarks/bench_storage.py --smoke    # seconds: 2 × 20,000 values, same code paths
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perinstance import results, storage  # noqa: E402

# CIFAR-10 at batch 512, σ = 1, C = 1: the configuration columns every row repeats.
METADATA = {
    "run": "CIFAR10_resnet20_sum_flat_eps10_bs512_seed0_1a2b3c4d", "seed": 0, "total_steps": 3900,
    "noise_multiplier": 1.0, "clip_bound": 1.0, "sample_rate": 512 / 50000, "batch_size": 512,
    "dataset_size": 50000, "dataset": "CIFAR10", "model": "resnet20", "clipping": "flat",
    "update_rule": "sum", "target_eps": 10.0, "delta": 1e-5,
}
FULL = {"sum": (50000, 20, 1), "mean": (100, 1, 10000)}  # points, checkpoints, samples per point
# The numbers measured per row (everything else repeats across rows): the sum rule's loss is
# per point and checkpoint, like its Δ*; a Δ_B sample carries its batch size k.
MEASURED = {"sum": ("value", "loss"), "mean": ("value", "k")}
SMOKE = {"sum": (1000, 20, 1), "mean": (10, 1, 2000)}
MC_BLOCKS = 4


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
        "block": np.nan if reduction == "sum" else np.tile(np.arange(samples) * MC_BLOCKS // samples,
                                                           points * checkpoints),
    }
    count = per_step * checkpoints
    if reduction == "sum":
        rows["quantity"] = "grad_norm"
        rows["value"] = np.minimum(METADATA["clip_bound"], rng.lognormal(-0.5, 1.0, count))
        rows["k"] = rows["k_min"] = np.nan
    else:
        n = METADATA["dataset_size"] - 1
        rows["quantity"] = "batch_sensitivity"
        rows["k_min"] = 420
        rows["k"] = np.maximum(rows["k_min"], rng.binomial(n, METADATA["sample_rate"], count))
        rows["value"] = rng.lognormal(-8.0, 0.7, count)
    frame = pd.DataFrame(rows)
    for column, value in results.run_columns(dict(METADATA, update_rule=reduction), reduction).items():
        frame[column] = value
    return frame[results.COLUMNS]


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
    parser.add_argument("--smoke", action="store_true", help="2 × 20,000 values (CI), same code paths")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    rng = np.random.default_rng(0)
    print(f"{'table (rows = Δ values)':<44} {'format':<9} {'bytes/row':>10} {'bytes/number':>13} "
          f"{'write s':>8} {'read s':>7}")
    all_identical = True
    with tempfile.TemporaryDirectory() as folder:
        for reduction, (points, checkpoints, samples) in sizes.items():
            frame = result_table(reduction, points, checkpoints, samples, rng)
            label = f"{reduction}: {points:,} pts × {checkpoints} ckpts × {samples:,} samples"
            measured, identical = measure(frame, folder, reduction)
            all_identical &= identical
            numbers = len(MEASURED[reduction])
            for ending, (per_row, write_s, read_s) in measured.items():
                print(f"{label:<44} {ending[1:]:<9} {per_row:>10.2f} {per_row / numbers:>13.2f} "
                      f"{write_s:>8.2f} {read_s:>7.2f}")
            ratio = measured[storage.CSV][0] / measured[storage.PARQUET][0]
            print(f"{'':<44} CSV/Parquet = {ratio:.1f}×; measured numbers per row: "
                  f"{', '.join(MEASURED[reduction])}; read back identical: {identical}")
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())

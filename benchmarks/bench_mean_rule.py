"""Benchmark of the mean rule's all-point measurement by coupling (accounting.md §2, §3.2, §3.4; not a test).

    python benchmarks/bench_mean_rule.py [--num-batches 10000] [--slice-batches 100] [--device cpu|cuda|auto]
    python benchmarks/bench_mean_rule.py --smoke   # seconds: synthetic data at LeNet-5's input size (CI)

Side by side in one process, on every training point of the embedded MNIST subset (8,000) with
LeNet-5 (61,706 parameters), the dataset statistics of every point and --num-batches Δ_B draws per
point, on the grid of sizes of the default run (B_exp = 256, 8 epochs: T = 250, δ = 1e-5,
δ_size = δ/(10·T), 32 grid sizes, 4 blocks):

1. the coupling engine by the checkpoint's Gram (gram.py, coupling.gram_coupling_sensitivities): each layer
   of the engine's one pass in the centred Gram of the 8,000 rows or kept as rows, by the workload's costs;
2. the coupling engine over the per-sample gradient rows (coupling.coupling_sensitivities, the engine before
   the Gram): per-sample gradients held in memory, batch sums of every prefix, products of the centred
   points with the centred batch means;
3. the Monte Carlo the mean rule used before that (poisson_batches.batch_sensitivities: independent Poisson
   batches, s_D·h* gathered per batch, the products h_i·h* in float64), on every point but only
   --slice-batches batches, extrapolated to --num-batches: its per-point products are timed
   apart (they do not grow with the batches) and the rest is scaled by the number of batches.

Timings do not depend on the weights, so the checkpoint is LeNet-5 at its initialisation. The engines'
float32 values are checked against an explicit float64 evaluation of a few draws, and against each other.
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _smoke import synthetic_lenet_dataset  # noqa: E402
from _workloads import device_name, require_device, timer  # noqa: E402

from perinstance.cli.options import add_device_argument
from perinstance.measure import coupling, poisson_batches
from perinstance.measure.gradient_rows import checkpoint_gradients
from perinstance.measure.gram import checkpoint_gram
from perinstance.train import sampling
from perinstance.train.clipping import Transform
from perinstance.train.data import load_dataset
from perinstance.train.nets import build_model

TRANSFORM = Transform("flat", clip_norm=1.0)
BATCH_SIZE, EPOCHS, DELTA, MC_BLOCKS, MAX_SIZES = 256, 8, 1e-5, 4, 32
SMOKE_BATCH_SIZE, SMOKE_NUM_BATCHES, SMOKE_SLICE_BATCHES = 16, 200, 5
TARGET_SECONDS = 120
CHECKED_POINTS, CHECKED_DRAWS = 5, 20


class TimedRows:
    """The held rows, timing their products h_i·h* (the per-point part of the previous Monte Carlo)."""

    def __init__(self, rows, clock):
        self.rows, self.clock = rows, clock
        self.dots_seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.rows, name)

    def products(self, point_rows):
        started = self.clock()
        products = self.rows.products(point_rows)
        self.dots_seconds += self.clock() - started
        return products


def explicit_difference(rows, points, plan, samples):
    """The largest relative difference between an engine's Δ_B of the first draws of the first points and a
    float64 evaluation from explicit index lists: the check of the float32 products."""
    mine, theirs = [], []
    draws = [(block, index, size) for block in range(plan.blocks) for index in range(plan.permutations)
             for size in plan.sizes][:CHECKED_DRAWS]
    for position in range(min(CHECKED_POINTS, len(points.train_rows))):
        point = points.rows[position].double()
        for column, (block, index, size) in enumerate(draws):
            batch = plan.permutation(block, index, rows.num_rows)[:size]
            if points.train_rows[position] in batch:
                continue
            batch_mean = rows.take(batch).double().sum(dim=0) / max(size, 1)
            theirs.append(float(torch.linalg.norm(point - batch_mean)) / (size + 1))
            mine.append(samples.values[position, column])
    return float(np.max(np.abs(np.asarray(mine) - theirs) / np.asarray(theirs)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-batches", type=int, default=10_000, help="Δ_B draws per point")
    parser.add_argument("--slice-batches", type=int, default=100,
                        help="batches the previous Monte Carlo is timed on (then extrapolated)")
    add_device_argument(parser)
    parser.add_argument("--smoke", action="store_true", help="seconds: synthetic data, tiny sizes")
    args = parser.parse_args()
    require_device(parser, args.device)
    if args.smoke:
        dataset, batch_size = synthetic_lenet_dataset(), SMOKE_BATCH_SIZE
        args.num_batches, args.slice_batches = SMOKE_NUM_BATCHES, SMOKE_SLICE_BATCHES
    else:
        dataset, batch_size = load_dataset("mnist-embedded"), BATCH_SIZE
    device, clock = args.device, timer("wall", args.device)
    x, y = dataset.train_x, dataset.train_y
    size = len(y)
    sample_rate = batch_size / size
    total_steps = round(EPOCHS * size / batch_size)
    torch.manual_seed(0)
    model = build_model("lenet5", 1, 32, dataset.num_classes).to(device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"{device_name(device)}, load average before: {os.getloadavg()[0]:.2f}")

    plan = coupling.coupling_plan(0, 0, size - 1, sample_rate, DELTA / (10 * total_steps), args.num_batches,
                                  MC_BLOCKS, MAX_SIZES)
    everyone = np.arange(size)
    started = clock()
    gram, gram_points = checkpoint_gram(model, x, y, x, y, everyone, TRANSFORM,
                                        coupling.coupling_workload(size, [plan]), device)
    gram_statistics, gram_samples = coupling.measure_coupling(gram, gram_points, plan)
    gram_seconds = clock() - started
    layers_kept = f"{gram.row_width} columns" if gram.row_width else "none"
    del gram

    started = clock()
    rows, points = checkpoint_gradients(model, x, y, x, y, everyone, TRANSFORM, device, hold=True)
    gradient_seconds = clock() - started
    started = clock()
    statistics, samples = coupling.measure_coupling(rows, points, plan)
    coupling_seconds = clock() - started
    rows_seconds = gradient_seconds + coupling_seconds
    draws = size * plan.draws
    accepted = np.count_nonzero(~np.isnan(samples.values))
    rows_difference = explicit_difference(rows, points, plan, samples)
    gram_difference = explicit_difference(rows, points, plan, gram_samples)
    between = np.nanmax(np.abs(gram_samples.values - samples.values) / samples.values)
    statistics_between = max(np.max(np.abs(getattr(gram_statistics, name) - getattr(statistics, name))
                                    / getattr(statistics, name))
                             for name in ("center_distance", "spread", "max_deviation"))
    del samples, statistics, gram_samples, gram_statistics

    timed = TimedRows(rows, clock)
    started = clock()
    masks = sampling.poisson_masks(sampling.stream_rng(0, sampling.SENSITIVITY_STREAM, 0), args.slice_batches, size,
                                   sample_rate)
    poisson_batches.batch_sensitivities(timed, points, masks)
    slice_seconds = clock() - started
    per_batch = (slice_seconds - timed.dots_seconds) / args.slice_batches
    previous_seconds = gradient_seconds + timed.dots_seconds + args.num_batches * per_batch

    verdict = "smoke run, far below the target's sizes" if args.smoke else (
        f"target: all points × {args.num_batches:,} batches in ≤ {TARGET_SECONDS} s: "
        f"{'met' if gram_seconds <= TARGET_SECONDS else 'NOT met'}")
    print(f"\nEvery point of {len(y)}, LeNet-5 ({rows.dim} parameters), q = {batch_size}/{size}, T = {total_steps}: "
          f"k_min = {plan.k_min} (δ_size = {DELTA / (10 * total_steps):.1e}), {len(plan.sizes)} grid sizes "
          f"{plan.sizes[0]}..{plan.sizes[-1]}, {plan.blocks} blocks × {plan.permutations} permutations = "
          f"{plan.draws} draws per point, {draws:,} point × batch pairs, {accepted / draws:.1%} accepted")
    print(f"1. coupling engine by the Gram: {gram_seconds:.1f} s in all (the engine's pass, the Gram, the "
          f"statistics and every Δ_B; layers kept as rows: {layers_kept}): {1e9 * gram_seconds / draws:.2f} ns per "
          f"point and batch ({verdict})")
    print(f"   against float64 explicit index lists: max relative difference {gram_difference:.1e}; against the "
          f"rows engine: Δ_B {between:.1e}, statistics {statistics_between:.1e}")
    print(f"2. coupling engine over the gradient rows (the engine before): {rows_seconds:.1f} s = "
          f"{gradient_seconds:.1f} s per-sample gradients + {coupling_seconds:.1f} s dataset statistics and Δ_B; "
          f"against float64 explicit index lists: {rows_difference:.1e}")
    print(f"   the Gram is {rows_seconds / gram_seconds:.1f}× faster")
    print(f"3. previous Monte Carlo, timed on {size} points × {args.slice_batches} batches: "
          f"{timed.dots_seconds:.1f} s products h_i·h* (per point, once) + {per_batch * 1e3:.1f} ms per batch; "
          f"extrapolated to {args.num_batches:,} batches: {previous_seconds:.0f} s with the same per-sample "
          f"gradients as 2. ({1e9 * (previous_seconds - gradient_seconds) / (size * args.num_batches):.2f} ns per "
          "point and batch)")
    print(f"   the Gram is {previous_seconds / gram_seconds:.1f}× faster end to end, the rows engine "
          f"{previous_seconds / rows_seconds:.1f}×")
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (the machine is shared; other processes slow every "
          "method alike)")


if __name__ == "__main__":
    main()

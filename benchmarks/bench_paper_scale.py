"""The cifar10 preset's fixed-checkpoint design at one checkpoint (not a test): ResNet-20 (GroupNorm) on N
CIFAR-10-shaped points, 1,000 points × 4 sampling rates × 10,000 Δ_B draws, through the measurement's own
functions (docs/paper-scale-gpu.md).

    python benchmarks/bench_paper_scale.py --device cuda                  # the preset's sizes, on a GPU
    python benchmarks/bench_paper_scale.py --train-size 2000 --points 100 # reduced, then extrapolated to the preset
    python benchmarks/bench_paper_scale.py --smoke                        # seconds (CI)

Timed, in order: the engine's pass and the checkpoint's Gram (gram.checkpoint_gram, its layers split between the
Gram and kept rows by the workload of all four rates), the dataset statistics, each rate's Δ_B draws
(coupling.gram_coupling_sensitivities), and each rate's result rows (measurement.coupling_columns and
measurement_rows) written as Parquet, as reproduce.py's fixed-checkpoint design writes them. The rates, their
batch sizes, δ_size = δ/(10·T_q) with T_q = epochs/q, 4 Monte-Carlo blocks and 32 grid sizes are the preset's
(experiments/sampling_rates.py). Timings do not depend on the data or the weights: random inputs, ResNet-20 at
its initialisation.

When run smaller than the preset (--train-size, --points, --num-batches), each part is also extrapolated to the
preset's sizes by how it grows, printed with its arithmetic: the pass with N; the Gram's products with N²
(float32 or float64 products of fixed width per pair); each rate's draws with N² (a permutation's prefixes hold
q·N rows, each read as a Gram row of N values) and, for the layers kept as rows, with points × draws; the
result rows with points × draws. These are estimates for the same device; docs/paper-scale-gpu.md converts CPU
seconds to a GPU's.
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _workloads import device_name, random_cifar_dataset, require_device, timer  # noqa: E402

from perinstance.cli.options import parse_training_flags  # noqa: E402
from perinstance.experiments.config import PRESETS  # noqa: E402
from perinstance.experiments.sampling_rates import FIXED_MAX_SIZES, FIXED_MC_BLOCKS, rate_mechanisms  # noqa: E402
from perinstance.files import storage  # noqa: E402
from perinstance.measure import coupling, measurement  # noqa: E402
from perinstance.measure import gram as gram_module  # noqa: E402
from perinstance.measure.gram import checkpoint_gram, gram_route  # noqa: E402
from perinstance.train import run_plan  # noqa: E402
from perinstance.train.clipping import Transform  # noqa: E402
from perinstance.train.nets import build_model  # noqa: E402

# The cifar10 preset (experiments/config.py) and its fixed-checkpoint design (experiments/sampling_rates.py).
PRESET = PRESETS["cifar10"]
PRESET_SIZE = 50_000  # CIFAR-10's training set
PRESET_POINTS = int(PRESET.mean_points.removeprefix("random:"))
SMOKE = {"train_size": 64, "points": 4, "num_batches": 64}


def preset_run(dataset, device):
    """The preset's main run as its RunConfig (run.json), without training it."""
    args = run_plan.resolve_training_args(parse_training_flags([
        "--model", PRESET.model, "--batch-size", str(min(PRESET.batch_size, len(dataset.train_y))), "--epochs",
        str(PRESET.epochs), "--eps", str(PRESET.eps), "--models-dir", tempfile.gettempdir(), "--device", device]))
    return run_plan.plan_run(args, dataset)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-size", type=int, default=PRESET_SIZE, help="N, the training points")
    parser.add_argument("--points", type=int, default=PRESET_POINTS, help="points measured")
    parser.add_argument("--num-batches", type=int, default=PRESET.num_batches, help="Δ_B draws per point and rate")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--smoke", action="store_true", help=f"seconds: {SMOKE}")
    args = parser.parse_args()
    require_device(parser, args.device)
    if args.smoke:
        args.train_size, args.points, args.num_batches = SMOKE["train_size"], SMOKE["points"], SMOKE["num_batches"]
    device, clock = args.device, timer("wall", args.device)
    dataset = random_cifar_dataset(args.train_size)
    size = args.train_size
    torch.manual_seed(0)
    model = build_model(PRESET.model, 3, 32, 10).to(device)
    main_run = preset_run(dataset, device)
    _, analysed, size_deltas = rate_mechanisms(main_run, PRESET.fixed_sample_rates, PRESET.epochs, PRESET.eps)
    plans = [coupling.coupling_plan(0, main_run.total_steps, size - 1, mechanism.sample_rate, size_delta,
                                    args.num_batches, FIXED_MC_BLOCKS, FIXED_MAX_SIZES)
             for mechanism, size_delta in zip(analysed, size_deltas)]
    points = np.sort(np.random.default_rng(0).choice(size, args.points, replace=False))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"{device_name(device)}, load average before: {os.getloadavg()[0]:.2f}")
    print(f"ResNet-20 GN ({sum(param.numel() for param in model.parameters())} parameters), N = {size}, "
          f"{args.points} points × {len(plans)} rates × {args.num_batches} draws; Gram route: "
          f"{gram_route(model, size, device)}")

    x, y = dataset.train_x, dataset.train_y
    transform, workload = Transform.of_run(main_run), coupling.coupling_workload(args.points, plans)
    # One pass of the engine over the examples, alone: the build makes one per group of the Gram's layers.
    passes = max(1, len(gram_module._plan(model, x, y, transform, workload, device, size)[1]))
    started = clock()
    for _ in gram_module._factor_passes(model, x, y, transform, device, None):
        pass
    pass_seconds = clock() - started
    timings = []

    def timed(name, seconds, growth):
        """One row of the table, printed at once (a run cut short keeps the rows it finished)."""
        timings.append((name, seconds, growth))
        print(f"[{name}: {seconds:.2f} s]", flush=True)

    timed(f"the engine's passes over the examples ({passes} × {pass_seconds:.2f} s, measured alone)",
          passes * pass_seconds, "N")
    started = clock()
    gram, point_gradients = checkpoint_gram(model, x, y, x[points], y[points], points, transform, workload, device)
    timed("the Gram's products, the kept rows (the build less its passes)",
          max(0.0, clock() - started - passes * pass_seconds), "N²")
    kept = gram.row_width
    started = clock()
    statistics = coupling.gram_statistics(gram, point_gradients)
    timed("dataset statistics", clock() - started, "N")
    rows_seconds, draws_seconds = [], []
    print(f"the Gram: {gram.size} rows; layers kept as rows: {kept} columns of {gram_parameters(model)}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for mechanism, plan in zip(analysed, plans):
            started = clock()
            samples = coupling.gram_coupling_sensitivities(gram, point_gradients, plan)
            draws_seconds.append(clock() - started)
            started = clock()
            columns = measurement.coupling_columns(mechanism.clip_bound, statistics, samples)
            frame = measurement.measurement_rows("mean", measurement.COUPLING, 0, mechanism, main_run.total_steps, 0.1,
                                                 points, y[points].numpy(), point_gradients.predictions, columns)
            storage.write_frame(os.path.join(folder, f"q{mechanism.sample_rate:g}.parquet"), frame)
            rows_seconds.append(clock() - started)
            timed(f"q = {mechanism.sample_rate:.4g} (B = {mechanism.batch_size}, k_min = {plan.k_min}, sizes "
                  f"{plan.sizes[0]}..{plan.sizes[-1]}): Δ_B draws", draws_seconds[-1], "N²")
            timed(f"q = {mechanism.sample_rate:.4g}: {len(frame):,} result rows as Parquet", rows_seconds[-1],
                  "points × draws")
    total = sum(seconds for _, seconds, _ in timings)
    scale = {"N": PRESET_SIZE / size, "N²": (PRESET_SIZE / size) ** 2,
             "points × draws": PRESET_POINTS * PRESET.num_batches / (args.points * args.num_batches)}
    at_preset = all(value == 1 for value in scale.values())
    print("\n| part | seconds, measured | grows with | " + ("" if at_preset else "× factor | seconds at the preset |"))
    print("| --- | ---: | --- | " + ("" if at_preset else "---: | ---: |"))
    extrapolated = 0.0
    for name, seconds, growth in timings:
        extra = "" if at_preset else f"{scale[growth]:.4g} | {seconds * scale[growth]:.1f} |"
        extrapolated += seconds * scale[growth]
        print(f"| {name} | {seconds:.2f} | {growth} | {extra}")
    print(f"| **one checkpoint** | **{total:.1f}** | | " + ("" if at_preset else f"| **{extrapolated:.0f}** |"))
    if not at_preset:
        print(f"\nextrapolated to the preset (N = {PRESET_SIZE:,}, {PRESET_POINTS:,} points × {PRESET.num_batches:,} "
              f"draws) on this device: {extrapolated:.0f} s per checkpoint, {2 * extrapolated:.0f} s for the design's "
              "two checkpoints (an estimate from the growth of each part; the split of layers between the Gram and "
              "kept rows is the measured size's)")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


def gram_parameters(model):
    return sum(param.numel() for param in model.parameters() if param.requires_grad)


if __name__ == "__main__":
    main()

"""What tracking every point at every step costs (train_dpsgd.py --track-points all, perinstance/train/tracking.py), as
a ratio to the training steps themselves, side by side in one process.

The quick preset's main run: LeNet-5 on the embedded MNIST (8,000 points), expected batch 256, ε = 10, T = 125 steps.
For --steps steps of that run: the tracking pass over every point at θ_{t−1} (norms, losses, correctness; the norms
pass of compute_sensitivity.py), then training step t (its Poisson batch's clipped sum, the noise, the update), each
timed; printed: seconds per step of each, their same-step ratio (median and range over the steps), the tracking pass's
norms per second, and what the T steps of the run then take. A second table times the tracking pass at other chunk
sizes, interleaved on the same parameters, against the one tracking.py takes (gradients.examples_per_pass).

    python benchmarks/bench_tracking.py [--steps 12] [--repeats 3] [--threads 2] [--clock wall|cpu] [--device cpu]
    python benchmarks/bench_tracking.py --smoke     # seconds: 128 synthetic points, batch 32, two steps
"""

import argparse
import os
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _smoke import synthetic_lenet_dataset  # noqa: E402
from _workloads import device_name, parse_timed, timer  # noqa: E402

from perinstance.cli import options  # noqa: E402
from perinstance.experiments.config import PRESETS  # noqa: E402
from perinstance.train import run_plan, training  # noqa: E402
from perinstance.train.data import load_dataset  # noqa: E402

warnings.filterwarnings("ignore")
# The quick preset's main run (perinstance/experiments/config.py), its checkpoints aside.
QUICK_PRESET = PRESETS["quick"]
QUICK = ["--model", QUICK_PRESET.model, "--batch-size", str(QUICK_PRESET.batch_size), "--lr", str(QUICK_PRESET.lr),
         "--epochs", str(QUICK_PRESET.epochs), "--eps", str(QUICK_PRESET.eps)]
SMOKE_SIZES = {"steps": 2, "repeats": 1}
SMOKE_BATCH = 32
# The tracking pass's chunk sizes timed against tracking.py's, as multiples of it.
CHUNK_FACTORS = (0.5, 1, 2, 4)


def trainer_for(smoke, device):
    dataset = synthetic_lenet_dataset() if smoke else load_dataset("mnist-embedded")
    flags = [*QUICK, "--track-points", "all", "--device", device, "--models-dir", "unused"]
    if smoke:
        flags += ["--batch-size", str(SMOKE_BATCH)]
    args = run_plan.resolve_training_args(options.parse_training_flags(flags))
    run = run_plan.plan_run(args, dataset)
    return training.Trainer(run, dataset, args.device)


def time_steps(trainer, steps, clock):
    """(seconds of the tracking pass, seconds of the training step) of steps 2 .. steps + 1 (step 1: warm-up)."""
    tracker, timings = trainer.tracker, []
    for step in range(1, steps + 2):
        started = clock()
        tracker.measure(step - 1)
        tracked = clock()
        trainer.step(step)
        timings.append((tracked - started, clock() - tracked))
        tracker.held.clear()
    return timings[1:]


def time_chunks(trainer, repeats, clock):
    """Norms per second of the tracking pass at each chunk of CHUNK_FACTORS × tracking.py's, interleaved rounds."""
    tracker = trainer.tracker
    default = tracker.chunk
    chunks = sorted({max(1, int(default * factor)) for factor in CHUNK_FACTORS})
    rates = {chunk: [] for chunk in chunks}
    try:
        for _ in range(repeats + 1):  # the first round warms every chunk shape up
            for chunk in chunks:
                tracker.chunk = chunk
                started = clock()
                tracker.values(0)  # the values at the trainer's parameters (θ_0 for an error)
                rates[chunk].append(len(tracker.indices) / (clock() - started))
    finally:
        tracker.chunk = default
    return default, {chunk: values[1:] for chunk, values in rates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the chunk sizes")
    args = parse_timed(parser, SMOKE_SIZES)
    clock = timer(args.clock, args.device)
    trainer = trainer_for(args.smoke, args.device)
    run = trainer.run
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device_name(args.device)}, load average before: "
          f"{os.getloadavg()[0]:.2f}")
    timings = time_steps(trainer, args.steps, clock)
    tracking = [seconds for seconds, _ in timings]
    training_steps = [seconds for _, seconds in timings]
    ratios = [track / step for track, step in timings]
    points = len(run.tracked_points)
    per_track, per_step = statistics.median(tracking), statistics.median(training_steps)
    print(f"\n{run.model} on {run.dataset} ({points} points), expected batch {run.batch_size}, T = {run.total_steps}, "
          f"{args.steps} steps on {args.device} ({clock.__name__}), medians over the steps:")
    print(f"  training step           {per_step:8.3f} s")
    print(f"  tracking every point    {per_track:8.3f} s   {points / per_track:9.0f} norms/s")
    print(f"  tracking / training steps: {statistics.median(ratios):.2f}× (same-step ratios {min(ratios):.2f}–"
          f"{max(ratios):.2f}×)")
    print(f"  the run's {run.total_steps} steps: {run.total_steps * per_step:.1f} s of training steps, "
          f"{(run.total_steps + 1) * per_track:.1f} s of tracking at θ_0 .. θ_T")
    default, rates = time_chunks(trainer, args.repeats, clock)
    print(f"\nthe tracking pass by chunk size ({args.repeats} interleaved rounds; best round, and its ratio to "
          f"tracking.py's chunk of {default}):")
    for chunk, values in rates.items():
        print(f"  chunk {chunk:5d}   {max(values):9.0f} norms/s   {max(values) / max(rates[default]):.2f}×"
              f"{'   (tracking.py)' if chunk == default else ''}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (other processes on the machine slow every method alike)")


if __name__ == "__main__":
    main()

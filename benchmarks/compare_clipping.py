"""Flat clipping vs PSAC vs PSASC, with and without momentum, at the same (q, σ, T).

LeNet-5 on the embedded MNIST subset, 3 seeds each: test accuracy (mean ± std) and the
median per-instance per-step ε (sum rule, accounting.md §3.3 with p = ∞) of 500 training
points at the final checkpoint, next to the worst-case baseline (the same for every
transform: Γ cancels, §1).

    python benchmarks/compare_clipping.py [--seeds 3] [--epochs 4] [--models-dir /tmp/compare]
    python benchmarks/compare_clipping.py --smoke   # seconds: MLP on synthetic data, 2 seeds of 4 steps
"""

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perinstance.accounting import exact_eps_delta
from perinstance.accounting.mechanism import Mechanism
from perinstance.cli import options
from perinstance.measure import gradient_rows
from perinstance.train import clipping, training
from perinstance.train.data import load_dataset
from perinstance.train.points import parse_points

SIGMA = 0.6  # about ε = 10 at δ = 1e-5 for 4 epochs of q = 0.032 (Opacus calibration: 0.608)
DELTA = 1e-5


@dataclass(frozen=True)
class Setting:
    """What every variant trains on, and which points' per-step ε is measured."""

    dataset: str
    model: str
    batch_size: int
    points: str


FULL_SETTING = Setting(dataset="mnist-embedded", model="lenet5", batch_size=256, points="random:500")
SMOKE_SETTING = Setting(dataset="synthetic", model="mlp", batch_size=32, points="random:16")
SMOKE_SIZES = {"seeds": 2, "epochs": 0.25}
# Momentum multiplies the effective step by 1/(1−γ); the learning rate is scaled down to match.
VARIANTS = [
    ("flat", [], "flat"),
    ("psac", ["--clipping", "psac"], "psac (r=0.1)"),
    ("psasc", ["--clipping", "psasc"], "psasc (r=0.1, s=0.9)"),
    ("flat+m", ["--momentum", "0.9", "--lr", "0.2"], "flat + momentum 0.9"),
    ("psac+m", ["--clipping", "psac", "--momentum", "0.9", "--lr", "0.2"], "psac + momentum 0.9"),
    ("psasc+m", ["--clipping", "psasc", "--momentum", "0.9", "--lr", "0.2"], "psasc + momentum 0.9"),
]


def run_variant(flags, seed, epochs, models_dir, setting, points):
    args = options.parse_training_flags(["--dataset", setting.dataset, "--model", setting.model, "--batch-size",
                                         str(setting.batch_size), "--sigma", str(SIGMA), "--epochs", str(epochs),
                                     "--seed", str(seed), "--lr", "2.0", "--models-dir", models_dir, "--save-freq",
                                     "1000000", *flags])
    outcome = training.train(args, quiet=True)
    run = outcome.run
    model, payload = training.load_model(run, outcome.run_dir, run.total_steps)
    dataset = load_dataset(run.dataset)
    norms, _ = gradient_rows.transformed_norms(model, dataset.train_x[points], dataset.train_y[points],
                                               clipping.Transform.of_run(run))
    noise_std = Mechanism.of_run(run, "sum").noise_std
    eps = exact_eps_delta.eps_delta_holder(norms[:, None], noise_std, run.sample_rate, DELTA, np.inf)
    baseline = exact_eps_delta.baseline_eps_delta(run.noise_multiplier, run.sample_rate, DELTA)
    return payload["test_accuracy"], float(np.median(eps)), baseline, float(norms.max() / run.clip_bound)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=float, default=4)
    parser.add_argument("--models-dir", default="/tmp/compare_clipping")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_SETTING}, {SMOKE_SIZES}, for CI")
    args = parser.parse_args()
    if not args.smoke:
        compare(FULL_SETTING, args.seeds, args.epochs, args.models_dir)
        return
    with tempfile.TemporaryDirectory(prefix="compare_clipping_smoke_") as scratch:
        compare(SMOKE_SETTING, SMOKE_SIZES["seeds"], SMOKE_SIZES["epochs"], scratch)


def compare(setting, seeds, epochs, models_dir):
    """The table of all VARIANTS, and each one's median per-step ε relative to flat clipping's."""
    dataset_size = len(load_dataset(setting.dataset).train_y)
    points = parse_points(setting.points, dataset_size, seed=0)
    sample_rate = setting.batch_size / dataset_size
    print(f"{setting.model}, {setting.dataset}, batch {setting.batch_size} (q={sample_rate:.3g}), "
          f"σ={SIGMA}, {epochs:g} epochs, δ={DELTA:g}, {seeds} seeds; ε: median per-instance per-step ε of "
          f"{len(points)} points at the final checkpoint")
    print("| transform | test accuracy | median per-step ε | baseline ε | max Δ*/Γ |")
    print("| --- | --- | --- | --- | --- |")
    started = time.time()
    median_eps = {}
    for _, flags, label in VARIANTS:
        results = np.array([run_variant(flags, seed, epochs, models_dir, setting, points) for seed in range(seeds)])
        accuracy, eps, baseline, largest = results.T
        median_eps[label] = eps.mean()
        print(f"| {label} | {100 * accuracy.mean():.2f} ± {100 * accuracy.std(ddof=1):.2f}% | "
              f"{eps.mean():.4f} ± {eps.std(ddof=1):.4f} | {baseline[0]:.4f} | {largest.max():.4f} |", flush=True)
    flat = median_eps[VARIANTS[0][2]]
    print("median per-step ε relative to flat clipping: "
          + ", ".join(f"{label} {eps / flat:.2f}×" for label, eps in list(median_eps.items())[1:]))
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()

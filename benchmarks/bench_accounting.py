"""Speed of the composition accountant (docs/accounting.md §4, §5) at the scale of individual
accounting for every training point (Yu et al., "Individual Privacy Accounting for Differentially
Private Stochastic Gradient Descent", TMLR 2023): the precomputed RDP table vs calling Opacus's RDP
per point and step.

Synthetic Δ*/Γ (Beta(2, 5), one run) at checkpoints every --every steps and at every step; the
table path is timed in full (table, composition, conversion to ε), the direct path on a slice of
points and steps and extrapolated. Also prints how much the rounding (Δ up to --rounding·Γ, orders by
chords) raises ε against the unrounded computation on a few points.

    python benchmarks/bench_accounting.py [--points 10000] [--steps 5000] [--every 20]
    python benchmarks/bench_accounting.py --smoke     # seconds: 20 points x 30 steps, same code paths
"""

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perinstance.accounting import rdp_composition, renyi_step

ORDERS = np.array(rdp_composition.COMPOSITION_ORDERS)
# MNIST-like (batch 1024 of 60,000, σ = 1), the setting of Yu et al.'s MNIST experiments.
SAMPLE_RATE, NOISE_MULTIPLIER, DELTA = 1024 / 60000, 1.0, 1e-5
# --smoke: the same cases at a size that runs in seconds, so CI sees the benchmark break. A coarser
# rounding keeps the table to ~10 sensitivity levels.
SMOKE_SIZES = {"points": 20, "steps": 30, "every": 10, "rounding": 0.1}


def time_table_path(ratios, checkpoint_steps, total_steps, holder_b, rounding):
    """Seconds for (table, composition, conversion) and the resulting ε per point."""
    started = time.perf_counter()
    levels = rdp_composition.sensitivity_levels(rounding, ratios)
    table = rdp_composition.RdpTable(SAMPLE_RATE, NOISE_MULTIPLIER,
                                     rdp_composition.composition_orders(ORDERS, total_steps, holder_b), levels)
    built = time.perf_counter()
    rdp = rdp_composition.compose_rdp(table, ratios, checkpoint_steps, total_steps, ORDERS, holder_b)
    composed = time.perf_counter()
    eps, _ = rdp_composition.rdp_to_eps(ORDERS, rdp, DELTA)
    converted = time.perf_counter()
    return (built - started, composed - built, converted - composed, len(table.orders)), eps


def time_direct_per_step(ratios, checkpoint_steps, total_steps, holder_b, points, steps):
    """Seconds per (point, step) of Opacus's compute_rdp at that step's orders λ_{T−t} and the Δ* of
    the latest checkpoint ≤ t−1 (§4)."""
    growth = holder_b / (holder_b - 1) if np.isfinite(holder_b) else 1.0
    checkpoint_of_step = np.searchsorted(checkpoint_steps, np.arange(steps), side="right") - 1
    started = time.perf_counter()
    for point in range(points):
        for step in range(1, steps + 1):
            orders = 1 + (ORDERS - 1) * growth ** (total_steps - step)
            noise = NOISE_MULTIPLIER / max(float(ratios[0, checkpoint_of_step[step - 1], point]), 1e-12)
            renyi_step.opacus_rdp.compute_rdp(q=SAMPLE_RATE, noise_multiplier=noise, steps=1, orders=list(orders))
    return (time.perf_counter() - started) / (points * steps)


def unrounded_eps(ratios, checkpoint_steps, total_steps, point):
    """ε of one point with b = ∞ and no rounding: Σ over segments of (steps)·RDP_SGM at the exact Δ*."""
    rdp = np.zeros(len(ORDERS))
    for first, last, checkpoint in rdp_composition.step_segments(checkpoint_steps, total_steps):
        ratio = 1.0 if checkpoint is None else float(ratios[0, checkpoint, point])
        if ratio > 0:
            rdp += (last - first + 1) * renyi_step.rdp_sgm(SAMPLE_RATE, NOISE_MULTIPLIER / ratio, ORDERS)
    return float(rdp_composition.rdp_to_eps(ORDERS, rdp, DELTA)[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=5_000)
    parser.add_argument("--every", type=int, default=20, help="checkpoint spacing of the first case (steps)")
    parser.add_argument("--rounding", type=float, default=0.01, help="Δ/Γ rounded up to multiples of this")
    parser.add_argument("--smoke", action="store_true", help=f"tiny sizes {SMOKE_SIZES}, for CI")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE_SIZES)
    rng = np.random.default_rng(0)
    print(f"{args.points} points x {args.steps} steps x {len(ORDERS)} orders, one run, q={SAMPLE_RATE:.4g}, "
          f"sigma={NOISE_MULTIPLIER}, delta={DELTA:g}; times in seconds")
    for every in (args.every, 1):
        checkpoint_steps = np.arange(0, args.steps, every)
        ratios = rng.beta(2, 5, size=(1, len(checkpoint_steps), args.points)).astype(np.float32)
        for holder_b in (3.0 * args.steps, math.inf):
            (build, compose, convert, grid), eps = time_table_path(ratios, checkpoint_steps, args.steps, holder_b,
                                                                   args.rounding)
            total = build + compose + convert
            per_step = time_direct_per_step(ratios, checkpoint_steps, args.steps, holder_b, points=2, steps=15)
            direct = per_step * args.points * args.steps
            print(f"checkpoints every {every:>3} steps, b={holder_b:g}: table {build:.1f} ({grid} orders) + compose "
                  f"{compose:.1f} + eps {convert:.1f} = {total:.1f} s; Opacus per step: {per_step * 1e3:.2f} ms "
                  f"x {args.points * args.steps:.0e} = {direct / 3600:.3g} h; speed-up {direct / total:.0f}x; "
                  f"median eps {np.median(eps):.3f}")
        exact = [unrounded_eps(ratios, checkpoint_steps, args.steps, point) for point in range(3)]
        _, rounded = time_table_path(ratios[:, :, :3], checkpoint_steps, args.steps, math.inf, args.rounding)
        raised = 100 * np.max(rounded / np.array(exact) - 1)
        print(f"  rounding Δ up to {args.rounding:g}Γ raises eps by {raised:.2f}% at most "
              f"(3 points, b=inf)")


if __name__ == "__main__":
    main()

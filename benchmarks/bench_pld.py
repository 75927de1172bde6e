"""Speed and tightness of the sum rule's per-instance composition by privacy loss distributions
(docs/accounting.md §8) against the Rényi path of §4, side by side in one run, at the scale of the
quick run: 8,000 points × 14 checkpoints (steps 0, 10, ..., 120 and T = 125), q = 256/8000, σ
calibrated by Opacus for ε = 10 at δ = 1e-5 over T steps, Γ = 1.

RDP: rdp_composition.sensitivity_levels + RdpTable + compose_rdp (b = inf, one run) + rdp_to_eps, as
renyi_per_instance_sum_compo.py --accountant rdp computes it. PLD: pld.sum_rule_eps, both
directions, as --accountant pld. Both round Δ*/Γ up to multiples of --rounding.

Synthetic Δ*/Γ: every point at Γ at step 0 and decaying towards its own level (Beta(2, 5)) by the
last checkpoints, with noise; 8% of the points stay at Γ throughout (the clipped ones).

Then the mean rule's certified bound (§3.2, §8.4) for --mean-points points, both ways: RDP as the
script computes it (mean_rule.certified_rdp, composed with b = inf) and PLD (mean_rule.certified_sensitivities +
pld.step_law + pld.mean_rule_eps). Synthetic statistics: d* ~ U(0.05, 1.5)·Γ, v_X = 0.3·Γ²,
b_X = 1.5·Γ at every checkpoint; k_min from δ/(10·T), β = δ_size.

    python benchmarks/bench_pld.py [--points 8000] [--mean-points 500]
    python benchmarks/bench_pld.py --smoke     # seconds: 400 points x 12 steps, same code paths
"""

import argparse
import math
import os
import sys
import time
import warnings

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perinstance.accounting import batch_sizes, pld, pld_grid, rdp_composition
from perinstance.accounting.guarantees import Kind
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis import mean_rule

TARGET_EPS, DELTA = 10.0, 1e-5
ORDERS = np.array(rdp_composition.COMPOSITION_ORDERS)
CLIPPED_SHARE = 0.08
SMOKE_SIZES = {"points": 400, "batch_size": 32, "epochs": 1.0, "every": 4, "check_points": 2, "mean_points": 2}


def sensitivity_ratios(points, checkpoints, rng):
    """(P, C) Δ*/Γ: Γ at step 0, each point decaying to its own level; CLIPPED_SHARE at Γ throughout."""
    level = rng.beta(2, 5, size=points)
    decay = np.exp(-np.arange(checkpoints) / 3.0)
    ratios = level[:, None] * (1 - decay) + decay + rng.normal(0, 0.03, size=(points, checkpoints))
    ratios = np.clip(ratios, 0.0, 1.0)
    ratios[rng.random(points) < CLIPPED_SHARE] = 1.0
    return ratios


def calibrated_sigma(sample_rate, steps):
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_noise_multiplier(target_epsilon=TARGET_EPS, target_delta=DELTA, sample_rate=sample_rate,
                                    steps=steps, accountant="rdp")


def timed(function):
    wall, cpu = time.perf_counter(), time.process_time()
    result = function()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def rdp_eps(ratios, checkpoints, steps, sample_rate, sigma, rounding):
    levels = rdp_composition.sensitivity_levels(rounding, ratios)
    table = rdp_composition.RdpTable(sample_rate, sigma, ORDERS, levels)
    rdp = rdp_composition.compose_rdp(table, ratios.T[None], checkpoints, steps, ORDERS, math.inf)
    return rdp_composition.rdp_to_eps(ORDERS, rdp, DELTA)[0]


def mean_rule_case(mechanism, checkpoints, count, rng):
    """Seconds and ε of the mean rule's certified bound by RDP and by PLD for `count` points, each along the path
    renyi_per_instance_sum_compo.py takes (composition.mean_rule_composed and composition.mean_rule_pld)."""
    n, rate, steps = mechanism.dataset_size - 1, mechanism.sample_rate, mechanism.total_steps
    k_min = batch_sizes.size_threshold(n, rate, DELTA / (10 * steps))
    delta_size = batch_sizes.size_failure(n, rate, k_min)
    grid = batch_sizes.size_grid(n, rate, k_min, mean_rule.CERTIFIED_SIZES)
    sizes = mean_rule.SizeModel(n=n, sample_rate=rate, k_min=k_min, delta_size=delta_size, failure=delta_size,
                                grid=grid, log_weights=batch_sizes.lumped_size_log_weights(grid, n, rate))
    fail = sizes.delta_fail(Kind.CERTIFIED)
    rows = count * len(checkpoints)
    statistics = pd.DataFrame({"center_distance": rng.uniform(0.05, 1.5, size=rows), "spread": np.full(rows, 0.3),
                               "max_deviation": np.full(rows, 1.5)})
    charged, _ = pld.segment_counts(checkpoints, steps)

    def by_rdp():
        per_step = mean_rule.certified_rdp(statistics, mechanism, ORDERS, sizes)
        total = np.einsum("c,pco->po", charged, per_step.reshape(count, len(checkpoints), -1))
        return rdp_composition.rdp_to_eps(ORDERS, total, DELTA - steps * fail)[0]

    def by_pld():
        mixture = mean_rule.certified_sensitivities(statistics, mechanism.clip_bound, sizes)
        shaped = mixture.sensitivities.reshape(count, len(checkpoints), -1)
        law = pld.step_law(shaped, mixture.log_weights, sizes.log_mass(Kind.CERTIFIED), dominate=True)
        return pld.mean_rule_eps(shaped, law, checkpoints, steps, sample_rate=rate, noise_std=mechanism.noise_std,
                                 delta=DELTA, delta_fail=fail, relative_step=mean_rule.COMPOSITION_LEVEL_STEP).max

    return timed(by_rdp), timed(by_pld), k_min


def describe(name, eps, worst):
    low, median, high = np.quantile(eps, [0.1, 0.5, 0.9])
    return (f"{name}: median {median:.3f} (10-90%: {low:.3f}-{high:.3f}), worst case {worst:.3f}, "
            f"{np.mean(eps <= worst / 2):.1%} of points at or below half of it")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=8000, help="training points N")
    parser.add_argument("--batch-size", type=int, default=256, help="expected batch size (q = batch size / N)")
    parser.add_argument("--epochs", type=float, default=4.0, help="T = epochs·N/batch size steps (default 4: T = 125)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint spacing in steps (plus step T)")
    parser.add_argument("--rounding", type=float, default=0.01, help="Δ*/Γ rounded up to multiples of this")
    parser.add_argument("--interval", type=float, default=pld_grid.DEFAULT_INTERVAL, help="PLD discretisation")
    parser.add_argument("--check-points", type=int, default=10,
                        help="points recomputed at a 10x finer discretisation (its effect on ε)")
    parser.add_argument("--mean-points", type=int, default=500, help="points of the mean rule's certified case")
    parser.add_argument("--smoke", action="store_true", help=f"tiny sizes {SMOKE_SIZES}, for CI")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE_SIZES)
    sample_rate = args.batch_size / args.points
    steps = max(1, round(args.epochs * args.points / args.batch_size))
    checkpoints = np.union1d(np.arange(0, steps, args.every), [steps])
    sigma = calibrated_sigma(sample_rate, steps)
    ratios = sensitivity_ratios(args.points, len(checkpoints), np.random.default_rng(0))
    print(f"{args.points} points x {len(checkpoints)} checkpoints, T={steps}, q={sample_rate:.4g}, sigma={sigma:.4f} "
          f"(Opacus, eps={TARGET_EPS:g} at delta={DELTA:g}), delta={DELTA:g}, Δ*/Γ rounded up to {args.rounding:g}, "
          f"PLD discretisation {args.interval:g}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    common = dict(sample_rate=sample_rate, noise_multiplier=sigma, delta=DELTA, rounding=args.rounding)
    by_rdp, rdp_wall, rdp_cpu = timed(lambda: rdp_eps(ratios, checkpoints, steps, sample_rate, sigma, args.rounding))
    by_pld, pld_wall, pld_cpu = timed(lambda: pld.sum_rule_eps(ratios, checkpoints, steps, interval=args.interval,
                                                               **common).max)
    worst_rdp = float(rdp_eps(np.ones((1, len(checkpoints))), checkpoints, steps, sample_rate, sigma, args.rounding)[0])
    worst_pld = float(pld.sum_rule_eps(np.ones((1, len(checkpoints))), checkpoints, steps, interval=args.interval,
                                       **common).max[0])
    print(f"RDP (table, composition, conversion): {rdp_wall:.1f} s wall, {rdp_cpu:.1f} s CPU")
    print(f"PLD (levels, FFT composition, conversion, both directions): {pld_wall:.1f} s wall, {pld_cpu:.1f} s CPU")
    print(f"PLD/RDP time: {pld_wall / rdp_wall:.2f}x wall, {pld_cpu / rdp_cpu:.2f}x CPU")
    print(describe("RDP eps", by_rdp, worst_rdp))
    print(describe("PLD eps", by_pld, worst_pld))
    ratio = by_pld / np.where(by_rdp > 0, by_rdp, np.nan)
    print(f"PLD/RDP eps per point: median {np.nanmedian(ratio):.3f}x, largest {np.nanmax(ratio):.3f}x; "
          f"points with PLD above RDP: {int(np.sum(by_pld > by_rdp))}")
    finer = pld.sum_rule_eps(ratios[:args.check_points], checkpoints, steps, interval=args.interval / 10, **common).max
    raised = by_pld[:args.check_points] - finer
    print(f"discretisation {args.interval:g} against {args.interval / 10:g} on {args.check_points} points: eps higher "
          f"by {raised.max():.2g} at most ({100 * np.max(raised / finer):.2g}% relatively)")
    mechanism = Mechanism(noise_multiplier=sigma, clip_bound=1.0, sample_rate=sample_rate, batch_size=args.batch_size,
                          dataset_size=args.points, total_steps=steps, rule="mean")
    (by_rdp, rdp_wall, rdp_cpu), (by_pld, pld_wall, pld_cpu), k_min = mean_rule_case(
        mechanism, checkpoints, args.mean_points, np.random.default_rng(1))
    print(f"mean rule, certified, {args.mean_points} points (k_min={k_min}): RDP {rdp_wall:.1f} s wall "
          f"({rdp_cpu:.1f} s CPU), PLD {pld_wall:.1f} s wall ({pld_cpu:.1f} s CPU), PLD/RDP time {pld_wall / rdp_wall:.2f}x; "
          f"median eps {np.median(by_rdp):.3f} by RDP, {np.median(by_pld):.3f} by PLD; points with PLD above RDP: "
          f"{int(np.sum(by_pld > by_rdp))}")


if __name__ == "__main__":
    main()

"""Per-step per-instance (ε, δ) guarantees of DP-SGD, both update rules (docs/accounting.md §3.3).

    python eps_delta.py --res-name lenet_sum
    python eps_delta.py --res-name lenet_mean --delta 1e-5
    python eps_delta.py --res-name lenet_sum --method holder --holder-p 1e4     # GLA's formula

Sum rule (`grad_norm` rows, Δ* per point and checkpoint): the exact hockey-stick of the
subsampled Gaussian at Δ*, per direction (remove, add) and their max; `kind` certified, next to
the baseline at Δ = Γ. Mean rule (`center_distance`, `spread`, `max_deviation` and `batch_sensitivity`
rows of compute_sensitivity.py --reduction mean): the coupling bound averaged over batch sizes,
as an estimate from the Δ_B samples (with its min..max over Monte-Carlo blocks), a certified bound
from the dataset statistics, and the mean rule's own baseline, each with k_min and delta_fail:
the reported δ includes delta_fail (§3.4).
"""

import math

import numpy as np
import pandas as pd

from perinstance import accountants, accounting, results
from perinstance.errors import UsageError, run_main
from perinstance.options import HELP_FORMAT, Parser

COLUMNS = ["point", "step", "reduction", "direction", "kind", "eps", "eps_min", "eps_max", "delta", "delta_fail",
           "k_min", "samples", "method"]
KEYS = ["point", "step"]
DIRECTIONS = ("remove", "add")


def build_parser():
    parser = Parser(description=__doc__, formatter_class=HELP_FORMAT)
    accountants.add_input_arguments(parser)
    accountants.add_delta_argument(parser)
    parser.add_argument("--method", choices=["exact", "holder"], default="exact",
                        help="exact: the hockey-stick of §3.3 by convexity (default); holder: GLA's Hölder formula "
                             "(sum rule only, for reproducing the paper; never tighter)")
    parser.add_argument("--holder-p", default=None,
                        help="--method holder only: Hölder exponent p in (1, inf], a number or inf (default 1e4, GLA's)")
    parser.add_argument("--gaussian", choices=["analytic", "classic"], default=None,
                        help="--method holder only: the Gaussian mechanism's ε, exact (Balle & Wang 2018, default) "
                             "or the classic formula")
    accountants.add_failure_argument(parser)
    return parser


def parse_args(argv):
    args = build_parser().parse_args(argv)
    accountants.check_delta(args.delta)
    for flag, value in (("--holder-p", args.holder_p), ("--gaussian", args.gaussian)):
        if value is not None and args.method != "holder":
            raise UsageError(flag, "belongs to GLA's Hölder formula: add --method holder (the exact method has no "
                                   "such parameter)")
    args.holder_p = args.holder_p or "1e4"
    args.gaussian = args.gaussian or "analytic"
    return args


def rows_for(index, kind, eps_by_direction, delta, **columns):
    """Long rows for one kind: one per (point, step) and direction remove, add, max."""
    frames = []
    for direction in (*DIRECTIONS, "max"):
        eps = eps_by_direction[direction]
        frame = index.to_frame(index=False).assign(direction=direction, kind=kind, delta=delta,
                                                   **{name: (value[direction] if isinstance(value, dict) else value)
                                                      for name, value in columns.items()})
        frame["eps"] = eps
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def exact(mu, delta, sample_rate, weights=None, delta_fail=0.0):
    """ε per direction (remove, add) and their max for mixtures of one-dimensional pairs (§3.3)."""
    eps = {direction: accounting.per_step_eps(mu, delta, sample_rate, weights, delta_fail, direction)
           for direction in DIRECTIONS}
    eps["max"] = np.maximum(eps["remove"], eps["add"])
    return eps


def sum_rule(loaded, args):
    mechanism = loaded.mechanism
    accountants.check_unique(loaded, KEYS)
    rows = loaded.rows.sort_values(KEYS)
    index = pd.MultiIndex.from_frame(rows[KEYS])
    if args.method == "holder":
        holder_p = accountants.parse_holder(args.holder_p, mechanism.total_steps)
        eps = accounting.eps_delta_holder(rows["value"].to_numpy()[:, None], mechanism.noise_std, mechanism.sample_rate,
                                          args.delta, holder_p, args.gaussian)
        baseline = accounting.baseline_eps_delta(mechanism.noise_multiplier, mechanism.sample_rate, args.delta, args.gaussian)
        both = {direction: eps for direction in (*DIRECTIONS, "max")}
        worst = {direction: np.full(len(rows), baseline) for direction in (*DIRECTIONS, "max")}
        method = f"holder p={holder_p:g}"
    else:
        both = exact(rows["value"].to_numpy()[:, None] / mechanism.noise_std, args.delta, mechanism.sample_rate)
        worst_one = exact(np.array([[1.0 / mechanism.noise_multiplier]]), args.delta, mechanism.sample_rate)
        worst = {direction: np.full(len(rows), value[0]) for direction, value in worst_one.items()}
        method = "exact"
    common = dict(reduction="sum", delta_fail=0.0, k_min=math.nan, samples=1, method=method,
                  eps_min=math.nan, eps_max=math.nan)
    print(f"per-step (eps, delta) of {rows['point'].nunique()} points, sum rule, noise std {mechanism.noise_std:.4g}, "
          f"q={mechanism.sample_rate:.4g}, method {method}, delta={args.delta:g}")
    return pd.concat([rows_for(index, "certified", both, args.delta, **common),
                      rows_for(index, "baseline", worst, args.delta, **common)], ignore_index=True)


def mean_rule(loaded, args):
    if args.method == "holder":
        raise UsageError("--method", "GLA's Hölder formula is kept for the sum rule only; the mean rule uses the "
                         "exact coupling bound (allowed here: exact)")
    mechanism = loaded.mechanism
    sizes = accountants.size_model(loaded, args.failure)
    statistics = accountants.mean_statistics(loaded)
    samples = accountants.mean_samples(loaded)
    grid, log_weights = sizes.grid()
    weights = np.exp(log_weights)
    common = dict(reduction="mean", k_min=sizes.k_min, method="exact")
    frames = []
    if statistics is not None:
        index = statistics.index
        bound, certified_log_weights, _ = accounting.certified_mixture(
            statistics["center_distance"], statistics["spread"], statistics["max_deviation"], mechanism.clip_bound,
            grid, log_weights, sizes.failure)
        fail = sizes.delta_fail("certified")
        eps = exact(bound / mechanism.noise_std, args.delta, mechanism.sample_rate, np.exp(certified_log_weights), fail)
        frames.append(rows_for(index, "certified", eps, args.delta, delta_fail=fail, samples=0, eps_min=math.nan,
                               eps_max=math.nan, **common))
        baseline_index = index
    else:
        baseline_index = None
    if samples is not None:
        index, values, batch_sizes, blocks = samples
        sample_grid = accountants.sample_grid(batch_sizes, sizes, loaded)
        fail = sizes.delta_fail("estimate")
        mu = values / mechanism.noise_std

        def estimate(mask):
            weights, incomplete = sample_grid_weights(np.where(mask, batch_sizes, np.nan), sample_grid, sizes)
            eps = exact(np.where(mask, mu, np.nan), args.delta, mechanism.sample_rate, weights, fail)
            return {direction: np.where(incomplete, np.nan, value) for direction, value in eps.items()}

        eps = estimate(np.ones(mu.shape, dtype=bool))
        if np.isnan(eps["max"]).any():
            accountants.warn(f"{int(np.isnan(eps['max']).sum())} (point, step) estimates lack samples at some size and "
                             "are left empty (measure more --num-batches)")
        per_block = [estimate(blocks == block) for block in np.unique(blocks[~np.isnan(blocks)])]
        spread = {name: {direction: reducer([block[direction] for block in per_block], axis=0)
                         for direction in (*DIRECTIONS, "max")} for name, reducer in (("eps_min", np.min),
                                                                                     ("eps_max", np.max))}
        frames.append(rows_for(index, "estimate", eps, args.delta, delta_fail=fail,
                               samples=(~np.isnan(values)).sum(axis=1), **spread, **common))
        baseline_index = index if baseline_index is None else baseline_index.union(index)
    worst_bound = accounting.baseline_mean_sensitivity(mechanism.clip_bound, grid)[None, :]
    worst_fail = sizes.delta_fail("baseline")
    worst_one = exact(worst_bound / mechanism.noise_std, args.delta, mechanism.sample_rate, weights, worst_fail)
    worst = {direction: np.full(len(baseline_index), value[0]) for direction, value in worst_one.items()}
    frames.append(rows_for(baseline_index, "baseline", worst, args.delta, delta_fail=worst_fail, samples=0,
                           eps_min=math.nan, eps_max=math.nan, **common))
    print(f"per-step (eps, delta) of {baseline_index.get_level_values('point').nunique()} points, mean rule "
          f"(coupling, §3.2-§3.4), noise std {mechanism.noise_std:.4g}, q={mechanism.sample_rate:.4g}, n={sizes.n}, "
          f"k_min={sizes.k_min} (delta_size={sizes.delta_size:.3g}), beta={sizes.failure:.3g}, delta={args.delta:g} "
          "including delta_fail")
    if sizes.k_min == 0:
        accountants.warn("k_min = 0: batches without any other point are in the guarantee, and the realised-size "
                         "mean rule then has no useful bound (accounting.md §3.4)")
    return pd.concat(frames, ignore_index=True)


def sample_grid_weights(batch_sizes, sample_grid, sizes):
    """Weight of each Δ_B sample (NaN size = absent) in the stratified expectation of §3.2: its
    size's lumped probability split equally over that point's samples of that size; and per point
    whether some size has no sample (its probability would be lost: no estimate)."""
    log_weights = accounting.lumped_size_log_weights(sample_grid, sizes.n, sizes.sample_rate)
    present = ~np.isnan(batch_sizes)
    position = np.searchsorted(sample_grid, np.where(present, batch_sizes, sample_grid[0]))
    counts = np.stack([((position == column) & present).sum(axis=1) for column in range(len(sample_grid))], axis=1)
    share = np.exp(log_weights)[position] / np.maximum(np.take_along_axis(counts, position, axis=1), 1)
    return np.where(present, share, 0.0), (counts == 0).any(axis=1)


def main(argv=None):
    args = parse_args(argv)
    loaded = accountants.load(args, ["grad_norm", *results.COUPLING_QUANTITIES], one_run=True,
                              integer_columns={"sample": 0})
    out = accountants.output_path(args, "eps_delta")
    result = sum_rule(loaded, args) if loaded.mechanism.rule == "sum" else mean_rule(loaded, args)
    result = result.sort_values(["point", "step", "direction", "kind"], kind="mergesort")[COLUMNS]
    correct = accountants.correct_table(loaded.rows, KEYS)
    accountants.report(out, result, "eps", KEYS, ["step"], correct)


if __name__ == "__main__":
    run_main(main)

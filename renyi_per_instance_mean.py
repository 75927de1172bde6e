"""Per-step per-instance Rényi DP of DP-SGD's mean rule (docs/accounting.md §3.2, §3.4).

    python renyi_per_instance_mean.py --res-name lenet_mean --alpha 2 8
    python renyi_per_instance_mean.py --res-name lenet_jensen --estimator jensen   # GLA's statistic

Default (coupling): from the rows of compute_sensitivity.py --reduction mean, per point, checkpoint,
order α and direction (remove, add capped at log(1/(1−q)), and their max), three numbers side by side:
`estimate` (stratified Monte Carlo over the Δ_B samples, with its min..max over blocks: not a bound),
`certified` (from d*, v_X and b_X; valid with probability 1 − delta_fail) and `baseline` (the mean
rule's own data-independent bound). Every row carries k_min, delta_fail and the dominant size k*.
--estimator jensen: GLA's statistic S (rows of --estimator jensen), kind gla_statistic, for
reproducing the paper only: it is not a measure of the point's influence (§3.2).
"""

import math

import numpy as np
import pandas as pd

from perinstance import accountants, accounting, results
from perinstance.errors import UsageError, run_main
from perinstance.options import HELP_FORMAT, Parser, add_alpha_argument

COLUMNS = ["point", "step", "alpha", "direction", "kind", "rdp", "rdp_min", "rdp_max", "samples", "k_min", "k_star",
           "k_star_at_k_min", "delta_fail", "estimator"]
KEYS = ["point", "step", "alpha"]
AGGREGATE_LABEL = {"joint": "joint", "per-target": "per-target (not an upper bound)"}


def build_parser():
    parser = Parser(description=__doc__, formatter_class=HELP_FORMAT)
    accountants.add_input_arguments(parser)
    add_alpha_argument(parser, [8.0], "Rényi orders α > 1 (default 8; jensen: integer orders it measured)")
    parser.add_argument("--estimator", choices=["coupling", "jensen"], default="coupling",
                        help="coupling: estimate, certified and baseline of §3.2 (default); jensen: GLA's statistic")
    parser.add_argument("--aggregate", choices=["joint", "per-target"], default="joint",
                        help="jensen only: joint Monte-Carlo mean (default) or GLA's per-target average, NOT a bound")
    accountants.add_failure_argument(parser)
    return parser


def parse_args(argv):
    args = build_parser().parse_args(argv)
    args.alpha = accountants.check_orders(args.alpha)
    return args


def with_directions(frame, sample_rate):
    """§3.2: the coupling value bounds both directions; the add direction is also at most log(1/(1−q))."""
    cap = accounting.add_direction_cap(sample_rate)
    added = frame.assign(direction="add")
    for column in ("rdp", "rdp_min", "rdp_max"):
        added[column] = np.minimum(added[column], cap)
    return pd.concat([frame.assign(direction="remove"), added, frame.assign(direction="max")], ignore_index=True)


def coupling(loaded, args):
    mechanism = loaded.mechanism
    sizes = accountants.size_model(loaded, args.failure)
    statistics = accountants.mean_statistics(loaded)
    samples = accountants.mean_samples(loaded)
    grid, log_weights = sizes.grid()
    needed = [accounting.baseline_mean_sensitivity(mechanism.clip_bound, grid)]
    if statistics is not None:
        certified, certified_log_weights, certified_sizes = accounting.certified_mixture(
            statistics["center_distance"], statistics["spread"], statistics["max_deviation"], mechanism.clip_bound,
            grid, log_weights, sizes.failure)
        needed.append(certified)
    if samples is not None:
        index, values, batch_sizes, blocks = samples
        needed.append(values[~np.isnan(values)])
    table = accountants.mean_rule_table(mechanism, args.alpha, needed)
    frames = []
    common = dict(k_min=sizes.k_min, estimator="coupling")
    point_index = None
    # (α−1)·RDP_SGM at every order, looked up once per sensitivity: (..., orders).
    def moments(sensitivity):
        return table.log_moments(np.asarray(sensitivity) / mechanism.clip_bound)

    baseline_moments = moments(needed[0])
    certified_moments = moments(certified) if statistics is not None else None
    sample_moments = moments(np.nan_to_num(values)) if samples is not None else None
    for column, alpha in enumerate(table.orders):
        if statistics is not None:
            fail = sizes.delta_fail("certified")
            log_terms = certified_moments[..., column] + certified_log_weights
            rdp = accounting.mixture_rdp(certified_moments[..., column], certified_log_weights, math.log(1 - fail),
                                         alpha)
            frames.append(statistics.index.to_frame(index=False).assign(
                alpha=alpha, kind="certified", rdp=rdp, rdp_min=math.nan, rdp_max=math.nan, samples=0,
                k_star=accounting.dominant_size(log_terms, certified_sizes), delta_fail=fail, **common))
            point_index = statistics.index
        if samples is not None:
            frames.append(estimate(index, values, batch_sizes, blocks, sample_moments[..., column], sizes, alpha,
                                   loaded).assign(alpha=alpha, **common))
            point_index = index if point_index is None else point_index.union(index)
        baseline_terms = baseline_moments[..., column] + log_weights
        fail = sizes.delta_fail("baseline")
        frames.append(point_index.to_frame(index=False).assign(
            alpha=alpha, kind="baseline", rdp=accounting.mixture_rdp(baseline_moments[..., column], log_weights,
                                                                     math.log(1 - fail), alpha),
            rdp_min=math.nan, rdp_max=math.nan, samples=0, k_star=grid[np.argmax(baseline_terms)], delta_fail=fail,
            **common))
    result = pd.concat(frames, ignore_index=True)
    result["k_star_at_k_min"] = (result["k_star"] == sizes.k_min).astype(int)
    print(f"per-step Rényi DP of {point_index.get_level_values('point').nunique()} points, mean rule (coupling), "
          f"noise std {mechanism.noise_std:.4g}, q={mechanism.sample_rate:.4g}, n={sizes.n}, k_min={sizes.k_min} "
          f"(delta_size={sizes.delta_size:.3g}), beta={sizes.failure:.3g}")
    flagged = result.loc[result["kind"] != "baseline", "k_star_at_k_min"].sum()
    if flagged:
        accountants.warn(f"{flagged} values are dominated by the smallest size k_min: they mostly reflect the chosen "
                         "δ_size, not the data (column k_star_at_k_min)")
    if sizes.k_min == 0:
        accountants.warn("k_min = 0: the realised-size mean rule has no useful guarantee here (accounting.md §3.4)")
    return with_directions(result, mechanism.sample_rate)


def estimate(index, values, batch_sizes, blocks, sample_moments, sizes, alpha, loaded):
    """§3.2 estimate per point, pooled over blocks, with the min and max of the per-block estimates."""
    grid = accountants.sample_grid(batch_sizes, sizes, loaded)
    log_weights = accounting.lumped_size_log_weights(grid, sizes.n, sizes.sample_rate)
    log_moments = np.where(np.isnan(values), np.nan, sample_moments)
    log_mass = math.log(1 - sizes.delta_fail("estimate"))

    def rho(mask):
        means, counts = accounting.stratified_log_means(np.where(mask, log_moments, np.nan), batch_sizes, grid)
        return accounting.mixture_rdp(means, log_weights, log_mass, alpha), means, counts

    pooled, means, counts = rho(np.ones(values.shape, dtype=bool))
    per_block = np.array([rho(blocks == block)[0] for block in np.unique(blocks[~np.isnan(blocks)])])
    if (counts == 0).any():
        accountants.warn(f"{int((counts == 0).any(axis=1).sum())} points lack samples at some size: their estimate "
                         "is NaN (measure more --num-batches)")
    return index.to_frame(index=False).assign(
        kind="estimate", rdp=pooled, rdp_min=per_block.min(axis=0), rdp_max=per_block.max(axis=0),
        samples=(~np.isnan(values)).sum(axis=1), k_star=grid[np.argmax(np.nan_to_num(means, nan=-np.inf)
                                                                         + log_weights, axis=1)],
        delta_fail=sizes.delta_fail("estimate"))


def jensen(loaded, args):
    """GLA's statistic (§3.2, kept to reproduce the paper): ρ̂_J per point, step, order and direction."""
    accountants.check_values(loaded, ~loaded.rows["direction"].isin(["remove", "add"]),
                             lambda row: f"direction {row['direction']!r} is neither remove nor add")
    accountants.check_unique(loaded, KEYS + ["direction", "target_batch", "sample"])
    rows = loaded.rows
    missing = sorted(set(args.alpha) - set(rows["alpha"]))
    if missing:
        raise UsageError("--alpha", f"no renyi_statistic rows at order {missing[0]:g} (measured: "
                         f"{', '.join(str(order) for order in sorted(rows['alpha'].unique()))})")
    rows = rows[rows["alpha"].isin(args.alpha)]
    keys = KEYS + ["direction"]

    def one(group):
        alpha = dict(zip(keys, group.name, strict=True))["alpha"]
        return accounting.rdp_mean_rule(group["value"].to_numpy(), loaded.mechanism.noise_std, alpha, args.aggregate,
                                        group["target_batch"].to_numpy())

    per_direction = rows.groupby(keys).apply(one, include_groups=False).rename("rdp").reset_index()
    both = per_direction.groupby(KEYS).filter(lambda group: len(group) == 2)
    maximum = both.groupby(KEYS, as_index=False)["rdp"].max().assign(direction="max")
    result = pd.concat([per_direction, maximum], ignore_index=True).assign(
        kind="gla_statistic", rdp_min=math.nan, rdp_max=math.nan, samples=rows.groupby(keys).size().median(),
        k_min=math.nan, k_star=math.nan, k_star_at_k_min=0, delta_fail=math.nan,
        estimator=f"jensen {AGGREGATE_LABEL[args.aggregate]}")
    print(f"GLA's statistic for {rows['point'].nunique()} points (mean rule, noise std {loaded.mechanism.noise_std:.4g}, "
          f"aggregate {AGGREGATE_LABEL[args.aggregate]}): not a measure of the point's influence and not the mean "
          "rule's guarantee (accounting.md §3.2)")
    if args.aggregate == "per-target":
        accountants.warn("--aggregate per-target averages per-target-batch values (GLA's way): by Jensen it is "
                         "never above the joint estimate and is NOT an upper bound")
    if "max" not in set(result["direction"]):
        accountants.warn("only one direction was measured: no max over directions is reported")
    return result


def main(argv=None):
    args = parse_args(argv)
    if args.estimator == "jensen":
        loaded = accountants.load(args, ["renyi_statistic"], one_run=True,
                                  integer_columns={"alpha": 2, "target_batch": 0, "sample": 0})
        result = jensen(loaded, args)
    else:
        loaded = accountants.load(args, results.COUPLING_QUANTITIES, one_run=True, integer_columns={"sample": 0})
        result = coupling(loaded, args)
    out = accountants.output_path(args, "renyi_per_instance_mean")
    result = result.sort_values(KEYS + ["direction", "kind"], kind="mergesort")[COLUMNS]
    accountants.report(out, result, "rdp", KEYS, ["step", "alpha"],
                       accountants.correct_table(loaded.rows, ["point", "step"]))


if __name__ == "__main__":
    run_main(main)

"""Per-step per-instance Rényi DP of DP-SGD's mean rule (docs/accounting.md §3.2).

Reads `renyi_statistic` rows (the statistic S of §2, per target batch, sample, direction and
integer order α) from compute_sensitivity.py and writes, per point, checkpoint, order and
direction (remove, add and their max), the Monte-Carlo bound ρ̂(α) of one step next to the
data-independent baseline RDP_SGM(q, σ, α).
"""

import pandas as pd

from perinstance import accountants, accounting
from perinstance.errors import UsageError, run_main
from perinstance.options import Parser

COLUMNS = ["point", "step", "alpha", "direction", "rdp", "baseline_rdp", "aggregate"]
KEYS = ["point", "step", "alpha", "direction"]
AGGREGATE_LABEL = {"joint": "joint", "per-target": "per-target (not an upper bound)"}


def parse_args(argv):
    parser = Parser(description=__doc__)
    accountants.add_input_arguments(parser)
    accountants.add_alpha_argument(parser, [8.0],
                                   "integer Rényi orders α >= 2 measured by compute_sensitivity.py (default 8)")
    parser.add_argument("--aggregate", choices=["joint", "per-target"], default="joint",
                        help="joint: Monte-Carlo mean over all samples, the bound's estimator (default); "
                             "per-target: the paper's average over target batches, NOT an upper bound")
    args = parser.parse_args(argv)
    args.alpha = accountants.check_orders(args.alpha)
    return args


def estimate(rows, noise_std, aggregate):
    """ρ̂ per point, step, direction and order (§3.2), and direction `max` where both were measured."""
    def one(group):
        alpha = dict(zip(KEYS, group.name, strict=True))["alpha"]
        return accounting.rdp_mean_rule(group["value"].to_numpy(), noise_std, alpha, aggregate,
                                        group["target_batch"].to_numpy())

    per_direction = rows.groupby(KEYS).apply(one, include_groups=False).rename("rdp").reset_index()
    both = per_direction.groupby(["point", "step", "alpha"]).filter(lambda group: len(group) == 2)
    maximum = both.groupby(["point", "step", "alpha"], as_index=False)["rdp"].max().assign(direction="max")
    return pd.concat([per_direction, maximum], ignore_index=True).sort_values(KEYS)


def main(argv=None):
    args = parse_args(argv)
    loaded = accountants.load(args, ["renyi_statistic"], one_run=True,
                              integer_columns={"alpha": 2, "target_batch": 0, "sample": 0})
    accountants.check_values(loaded, ~loaded.rows["direction"].isin(["remove", "add"]),
                             lambda row: f"direction {row['direction']!r} is neither remove nor add")
    accountants.check_unique(loaded, KEYS + ["target_batch", "sample"])
    config, rows = loaded.config, loaded.rows
    missing = sorted(set(args.alpha) - set(rows["alpha"]))
    if missing:
        raise UsageError("--alpha", f"no renyi_statistic rows at order {missing[0]:g} (measured: "
                         f"{', '.join(str(order) for order in sorted(rows['alpha'].unique()))})")
    out = accountants.output_path(args, "renyi_per_instance_mean")

    rows = rows[rows["alpha"].isin(args.alpha)]
    result = estimate(rows, config.noise_std, args.aggregate)
    baseline = accounting.rdp_sgm(config.sample_rate, config.noise_multiplier, args.alpha)
    result = result.assign(baseline_rdp=result["alpha"].map(dict(zip(args.alpha, baseline, strict=True))),
                           aggregate=AGGREGATE_LABEL[args.aggregate])

    print(f"per-step Rényi DP of {rows['point'].nunique()} points, mean rule, noise std {config.noise_std:.4g}, "
          f"q={config.sample_rate:.4g}, {rows.groupby(KEYS).size().median():.0f} samples of S per estimate, "
          f"aggregate {AGGREGATE_LABEL[args.aggregate]}")
    if args.aggregate == "per-target":
        accountants.warn("--aggregate per-target averages per-target-batch values (the paper's way): "
                         "by Jensen it is never above the joint estimate and is NOT an upper bound")
    if "max" not in set(result["direction"]):
        accountants.warn("only one direction was measured: no max over directions is reported")
    correct = accountants.correct_at(rows, result, ["point", "step"])
    accountants.finish(out, result, COLUMNS, "rdp", "baseline_rdp", ["step", "alpha", "direction"], correct)


if __name__ == "__main__":
    run_main(main)

"""Per-instance privacy of DP-SGD over a whole training run, sum or mean rule (docs/accounting.md §4).

    python renyi_per_instance_sum_compo.py --res-name lenet_sum --holder-b inf
    python renyi_per_instance_sum_compo.py --res-name lenet_mean                  # mean rule, certified
    python renyi_per_instance_sum_compo.py --res-name lenet_mean --kind estimate

The name is the paper repository's; it composes both rules. Sum rule (`grad_norm` rows: Δ* per
point at several checkpoints, or at every step, of one or more runs told apart by `run` and `seed`):
the per-step Rényi DP composed over the T steps with the Hölder bound of §4 (b = inf: plain
composition along the observed trajectory), converted to (ε, δ), next to Opacus's accountant.
Mean rule (rows of compute_sensitivity.py --reduction mean at several checkpoints of one run):
the per-step coupling ρ of §3.2 (certified by default, or the Monte-Carlo estimate) composed with
b = inf, converted at δ − T·delta_fail (§3.4), next to the mean rule's own composed baseline.
"""

import math

import numpy as np
import pandas as pd

from perinstance import accountants, accounting, results
from perinstance.errors import UsageError, run_main
from perinstance.options import HELP_FORMAT, Parser, add_alpha_argument, non_negative_float

COLUMNS = ["point", "kind", "eps", "alpha", "delta", "delta_fail", "steps", "k_min", "reduction"]
# Orders above this (from a small Hölder exponent b) make the bound meaningless.
LARGEST_ORDER = 1e6
# The mean rule's per-step ρ at 47 orders for every point, size and checkpoint: a coarser rounding
# of Δ (1%, upward) keeps the RDP table to a few hundred levels.
COMPOSITION_LEVEL_STEP = 1e-2


def build_parser():
    parser = Parser(description=__doc__, formatter_class=HELP_FORMAT)
    accountants.add_input_arguments(parser)
    accountants.add_delta_argument(parser)
    add_alpha_argument(parser, accounting.COMPOSITION_ORDERS,
                       "Rényi orders α > 1 to convert from (default 1.25..256, 47 orders)")
    parser.add_argument("--holder-b", default=None,
                        help="Hölder exponent b in (1, inf] of the composition: a number, inf, or a multiple of the "
                             "number of steps T such as 3T (default 3T for the sum rule; the mean rule takes inf only)")
    parser.add_argument("--rounding", type=non_negative_float, default=0.01,
                        help="sum rule: round Δ* up to multiples of ROUNDING·Γ before the RDP lookup (default 0.01; "
                             "0: exact)")
    parser.add_argument("--kind", choices=["certified", "estimate"], default="certified",
                        help="mean rule: compose the certified per-step bound (default) or the Monte-Carlo estimate")
    accountants.add_failure_argument(parser)
    return parser


def parse_args(argv):
    args = build_parser().parse_args(argv)
    accountants.check_delta(args.delta)
    args.alpha = accountants.check_orders(args.alpha)
    if not 0 <= args.rounding <= 1:
        raise UsageError("--rounding", f"must be in [0, 1] (a fraction of the clip bound), not {args.rounding:g}")
    return args


def holder_exponent(args, total_steps, default):
    holder_b = accountants.parse_holder(args.holder_b or default, total_steps, flag="--holder-b")
    largest = accounting.holder_orders(args.alpha[-1], total_steps, holder_b)[-1]
    if not largest <= LARGEST_ORDER:
        raise UsageError("--holder-b", f"b={holder_b:g} inflates order {args.alpha[-1]:g} to {largest:.3g} over "
                         f"{total_steps} steps (λ_k = 1 + (λ-1)(b/(b-1))^k); use a larger b such as 3T")
    return holder_b


def sum_rule(loaded, args):
    accountants.check_unique(loaded, ["run", "seed", "step", "point"])
    mechanism = loaded.mechanism
    holder_b = holder_exponent(args, mechanism.total_steps, "3T")
    ratios, steps, points = accountants.checkpoint_ratios(loaded)
    levels = accounting.sensitivity_levels(args.rounding, ratios)
    orders = accounting.composition_orders(args.alpha, mechanism.total_steps, holder_b)
    table = accounting.RdpTable(mechanism.sample_rate, mechanism.noise_multiplier, orders, levels)
    rdp = accounting.compose_rdp(table, ratios, steps, mechanism.total_steps, args.alpha, holder_b)
    eps, best_order = accounting.rdp_to_eps(args.alpha, rdp, args.delta)
    baseline_eps, baseline_order = mechanism.baseline_eps(args.delta, orders=args.alpha)
    runs = ratios.shape[0]
    print(f"per-instance (eps, delta) of {len(points)} points over T={mechanism.total_steps} steps, sum rule, {runs} run(s), "
          f"{len(steps)} checkpoints, sigma={mechanism.noise_multiplier:g}, q={mechanism.sample_rate:.4g}, "
          f"Hölder b={holder_b:g}, Δ rounded up to {args.rounding:g}·Γ, delta={args.delta:g}")
    if runs == 1 and np.isfinite(holder_b):
        accountants.warn("with one run, --holder-b inf (plain composition along the observed trajectory) "
                         "is never larger than a finite b")
    warn_edge(best_order, args.alpha)
    common = dict(delta=args.delta, delta_fail=0.0, steps=mechanism.total_steps, k_min=math.nan, reduction="sum")
    return pd.concat([pd.DataFrame({"point": points, "kind": "certified", "eps": eps, "alpha": best_order, **common}),
                      pd.DataFrame({"point": points, "kind": "baseline", "eps": float(baseline_eps),
                                    "alpha": float(baseline_order), **common})], ignore_index=True)


def warn_edge(best_order, orders):
    at_edge = np.isin(best_order, [orders[0], orders[-1]]).sum()
    if at_edge:
        accountants.warn(f"{at_edge} points have their best order at an end of --alpha "
                         f"({orders[0]:g}..{orders[-1]:g}); a wider grid may lower their eps")


def mean_rule(loaded, args):
    mechanism = loaded.mechanism
    total_steps = mechanism.total_steps
    if holder_exponent(args, total_steps, "inf") != math.inf:
        raise UsageError("--holder-b", "the mean rule is composed with b = inf only (allowed here: inf)")
    runs = accountants.run_key(loaded.rows).unique()
    if len(runs) > 1:
        raise UsageError("--filter", f"the mean rule composes one run at a time (found {', '.join(runs)}); "
                         "keep one with --filter run=...")
    sizes = accountants.size_model(loaded, args.failure)
    kind = args.kind
    fail = sizes.delta_fail(kind)
    budget = args.delta - total_steps * fail
    if budget <= 0:
        raise UsageError("--delta", f"{args.delta:g} is used up by T·delta_fail = {total_steps}·{fail:.3g}; measure "
                         "with a smaller --size-delta or report a larger --delta")
    grid, log_weights = sizes.grid()
    per_step = per_checkpoint_rdp(loaded, args, sizes, grid, log_weights, kind)
    checkpoints = np.array(sorted(per_step))
    points = per_step[checkpoints[0]][0]
    for step in checkpoints:
        if not np.array_equal(per_step[step][0], points):
            raise UsageError(loaded.flag, f"{loaded.path}: step {step} has other points than step {checkpoints[0]} "
                             "(every point needs a value at every checkpoint)")
    baseline_table = accountants.mean_rule_table(mechanism, args.alpha, [accounting.baseline_mean_sensitivity(
        mechanism.clip_bound, grid)], COMPOSITION_LEVEL_STEP)
    baseline_step = accountants.mixture_rdp_by_point(
        baseline_table, accounting.baseline_mean_sensitivity(mechanism.clip_bound, grid)[None, :], log_weights,
        math.log(1 - sizes.delta_fail("baseline")), mechanism)[0]
    total = np.zeros((len(points), len(args.alpha)))
    for first, last, checkpoint in accounting.step_segments(checkpoints, total_steps):
        total += (last - first + 1) * (baseline_step if checkpoint is None else per_step[checkpoints[checkpoint]][1])
    if checkpoints[0] > 0:
        accountants.warn(f"no checkpoint at step 0: steps 1..{checkpoints[0]} use the mean rule's baseline (§4)")
    eps, best_order = accounting.rdp_to_eps(args.alpha, total, budget)
    baseline_budget = args.delta - total_steps * sizes.delta_fail("baseline")
    baseline_eps, baseline_order = accounting.rdp_to_eps(args.alpha, total_steps * baseline_step, baseline_budget)
    print(f"per-instance (eps, delta) of {len(points)} points over T={total_steps} steps, mean rule ({kind}), "
          f"{len(checkpoints)} checkpoints, sigma={mechanism.noise_multiplier:g}, q={mechanism.sample_rate:.4g}, "
          f"k_min={sizes.k_min}, delta_fail={fail:.3g} per step, converted at delta - T·delta_fail = {budget:.4g}")
    warn_edge(best_order, args.alpha)
    common = dict(delta=args.delta, steps=total_steps, k_min=sizes.k_min, reduction="mean")
    return pd.concat([
        pd.DataFrame({"point": points, "kind": kind, "eps": eps, "alpha": best_order, "delta_fail": fail, **common}),
        pd.DataFrame({"point": points, "kind": "baseline", "eps": float(baseline_eps), "alpha": float(baseline_order),
                      "delta_fail": sizes.delta_fail("baseline"), **common})], ignore_index=True)


def per_checkpoint_rdp(loaded, args, sizes, grid, log_weights, kind):
    """{step: (points, (P, O) per-step ρ)} of the mean rule at every checkpoint (§3.2)."""
    mechanism = loaded.mechanism
    if kind == "certified":
        statistics = accountants.mean_statistics(loaded)
        if statistics is None:
            raise UsageError(loaded.flag, f"{loaded.path} has no mean-rule statistics (center_distance, spread, "
                             "max_deviation) to certify; measure with compute_sensitivity.py --reduction mean")
        bound, certified_log_weights, _ = accounting.certified_mixture(
            statistics["center_distance"], statistics["spread"], statistics["max_deviation"], mechanism.clip_bound,
            grid, log_weights, sizes.failure)
        table = accountants.mean_rule_table(mechanism, args.alpha, [bound], COMPOSITION_LEVEL_STEP)
        rdp = accountants.mixture_rdp_by_point(table, bound, certified_log_weights,
                                               math.log(1 - sizes.delta_fail("certified")), mechanism)
        return by_checkpoint(statistics.index, rdp)
    samples = accountants.mean_samples(loaded)
    if samples is None:
        raise UsageError(loaded.flag, f"{loaded.path} has no Δ_B samples to estimate from (--kind estimate)")
    index, values, batch_sizes, _ = samples
    sample_grid = accountants.sample_grid(batch_sizes, sizes, loaded)
    sample_weights = accounting.lumped_size_log_weights(sample_grid, sizes.n, sizes.sample_rate)
    table = accountants.mean_rule_table(mechanism, args.alpha, [values[~np.isnan(values)]], COMPOSITION_LEVEL_STEP)
    log_moments = table.log_moments(np.nan_to_num(values) / mechanism.clip_bound)
    rdp = np.empty((len(values), len(table.orders)))
    for column, alpha in enumerate(table.orders):
        moments = np.where(np.isnan(values), np.nan, log_moments[..., column])
        means, _ = accounting.stratified_log_means(moments, batch_sizes, sample_grid)
        rdp[:, column] = accounting.mixture_rdp(means, sample_weights, math.log(1 - sizes.delta_fail("estimate")),
                                                alpha)
    return by_checkpoint(index, rdp)


def by_checkpoint(index, rdp):
    """{step: (points, their rows of rdp)} for an index of (point, step) pairs."""
    steps = index.get_level_values("step").to_numpy()
    points = index.get_level_values("point").to_numpy()
    return {int(step): (points[steps == step], rdp[steps == step]) for step in np.unique(steps)}


def main(argv=None):
    args = parse_args(argv)
    loaded = accountants.load(args, ["grad_norm", *results.COUPLING_QUANTITIES], one_run=False,
                              integer_columns={"sample": 0})
    trained = set(loaded.rows["update_rule"].astype(str))
    if trained != {loaded.mechanism.rule}:
        raise UsageError(loaded.flag, f"{loaded.path}: the rows analyse the {loaded.mechanism.rule} rule of a run "
                         f"trained with the {'/'.join(sorted(trained))} rule; composing over a run needs the rule it "
                         "was trained with (per-step analyses may differ)")
    out = accountants.output_path(args, "renyi_per_instance_sum_compo")
    result = sum_rule(loaded, args) if loaded.mechanism.rule == "sum" else mean_rule(loaded, args)
    result = result.sort_values(["point", "kind"], kind="mergesort")[COLUMNS]
    accountants.report(out, result, "eps", ["point"], [], accountants.correct_at_end(loaded.rows))


if __name__ == "__main__":
    run_main(main)

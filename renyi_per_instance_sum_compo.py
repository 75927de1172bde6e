"""Per-instance privacy of DP-SGD over a whole training run, sum or mean rule (docs/accounting.md §4).

    python renyi_per_instance_sum_compo.py --res-name lenet_sum --holder-b inf
    python renyi_per_instance_sum_compo.py --res-name lenet_mean                  # mean rule, certified
    python renyi_per_instance_sum_compo.py --res-name lenet_mean --kind estimate
    python renyi_per_instance_sum_compo.py --res-name lenet_sum --accountant pld   # either rule

The name is the paper repository's; it composes both rules. Sum rule (`grad_norm` rows: Δ* per
point at several checkpoints, or at every step, of one or more runs told apart by `run` and `seed`):
the per-step Rényi DP composed over the T steps with the Hölder bound of §4 (b = inf: plain
composition along the observed trajectory), converted to (ε, δ), next to Opacus's accountant.
Mean rule (rows of compute_sensitivity.py --reduction mean at several checkpoints of one run):
the per-step coupling ρ of §3.2 (certified by default, or the Monte-Carlo estimate) composed with
b = inf, converted at δ − T·delta_fail (§3.4), next to the mean rule's own composed baseline.
--accountant pld composes the same per-step pairs by privacy loss distributions instead (§8, b = inf,
both directions: eps is the larger of eps_remove and eps_add).
"""

import math

import numpy as np
import pandas as pd
from scipy.special import logsumexp

from perinstance import accountants, accounting, pld, results
from perinstance.errors import UsageError, run_main
from perinstance.options import HELP_FORMAT, Parser, add_alpha_argument, non_negative_float, positive_float

COLUMNS = ["point", "kind", "eps", "alpha", "delta", "delta_fail", "steps", "k_min", "reduction", "eps_remove",
           "eps_add", "accountant", "discretization"]
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
                        help="sum rule: round Δ* up to multiples of ROUNDING·Γ before the RDP or PLD lookup "
                             "(default 0.01; 0: exact)")
    parser.add_argument("--kind", choices=["certified", "estimate"], default="certified",
                        help="mean rule: compose the certified per-step bound (default) or the Monte-Carlo estimate")
    accountants.add_failure_argument(parser)
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp",
                        help="compose by Rényi DP (§4, default) or by privacy loss distributions (§8: dp_accounting, "
                             "pessimistic, both directions, b = inf)")
    parser.add_argument("--pld-interval", type=positive_float, default=pld.DEFAULT_INTERVAL,
                        help=f"--accountant pld: discretisation of the privacy loss (dp_accounting's "
                             f"value_discretization_interval; default {pld.DEFAULT_INTERVAL:g})")
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
    if args.accountant == "pld":
        return sum_rule_pld(loaded, args)
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
    common = dict(delta=args.delta, delta_fail=0.0, steps=mechanism.total_steps, k_min=math.nan, reduction="sum",
                  **RDP_COLUMNS)
    return pd.concat([pd.DataFrame({"point": points, "kind": "certified", "eps": eps, "alpha": best_order, **common}),
                      pd.DataFrame({"point": points, "kind": "baseline", "eps": float(baseline_eps),
                                    "alpha": float(baseline_order), **common})], ignore_index=True)


RDP_COLUMNS = dict(eps_remove=math.nan, eps_add=math.nan, accountant="rdp", discretization=math.nan)


def pld_columns(eps, args):
    """The output columns of a PLD result (§8): eps is the larger direction. A result of one row (the
    baseline) gives numbers, for every point."""
    values = dict(eps=eps.max, eps_remove=eps.remove, eps_add=eps.add)
    if len(eps.max) == 1:
        values = {name: float(value[0]) for name, value in values.items()}
    return dict(values, alpha=math.nan, accountant="pld", discretization=args.pld_interval)


def check_pld_holder(args):
    if args.holder_b is not None and accountants.parse_holder(args.holder_b, 1, flag="--holder-b") != math.inf:
        raise UsageError("--holder-b", "--accountant pld composes along the observed trajectory only (allowed: inf)")


def sum_rule_pld(loaded, args):
    """§8.2: every point's PLD composition; with several runs each step takes the largest Δ* (b = inf)."""
    check_pld_holder(args)
    mechanism = loaded.mechanism
    ratios, steps, points = accountants.checkpoint_ratios(loaded)
    common = dict(sample_rate=mechanism.sample_rate, noise_multiplier=mechanism.noise_multiplier, delta=args.delta,
                  rounding=args.rounding, interval=args.pld_interval)
    eps = pld.sum_rule_eps(ratios.max(axis=0).T, steps, mechanism.total_steps, **common)
    baseline = pld.sum_rule_eps(np.ones((1, len(steps))), steps, mechanism.total_steps, **common)
    print(f"per-instance (eps, delta) of {len(points)} points over T={mechanism.total_steps} steps, sum rule, "
          f"{ratios.shape[0]} run(s) (the largest Δ* per step), {len(steps)} checkpoints, "
          f"sigma={mechanism.noise_multiplier:g}, q={mechanism.sample_rate:.4g}, Δ rounded up to {args.rounding:g}·Γ, "
          f"delta={args.delta:g}; composed by PLD (dp_accounting, pessimistic, discretisation "
          f"{args.pld_interval:g}), eps = max(remove, add)")
    common = dict(delta=args.delta, delta_fail=0.0, steps=mechanism.total_steps, k_min=math.nan, reduction="sum")
    return pd.concat([pd.DataFrame({"point": points, "kind": "certified", **pld_columns(eps, args), **common}),
                      pd.DataFrame({"point": points, "kind": "baseline", **pld_columns(baseline, args), **common})],
                     ignore_index=True)


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
    if args.accountant == "pld":
        return mean_rule_pld(loaded, args, sizes, grid, log_weights)
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
    common = dict(delta=args.delta, steps=total_steps, k_min=sizes.k_min, reduction="mean", **RDP_COLUMNS)
    return pd.concat([
        pd.DataFrame({"point": points, "kind": kind, "eps": eps, "alpha": best_order, "delta_fail": fail, **common}),
        pd.DataFrame({"point": points, "kind": "baseline", "eps": float(baseline_eps), "alpha": float(baseline_order),
                      "delta_fail": sizes.delta_fail("baseline"), **common})], ignore_index=True)


def per_checkpoint_rdp(loaded, args, sizes, grid, log_weights, kind):
    """{step: (points, (P, O) per-step ρ)} of the mean rule at every checkpoint (§3.2)."""
    mechanism = loaded.mechanism
    if kind == "certified":
        index, bound = certified_bounds(loaded, sizes, grid)
        table = accountants.mean_rule_table(mechanism, args.alpha, [bound], COMPOSITION_LEVEL_STEP)
        rdp = accountants.mixture_rdp_by_point(table, bound, log_weights,
                                               math.log(1 - sizes.delta_fail("certified")), mechanism)
        return by_checkpoint(index, rdp)
    index, values, batch_sizes, sample_grid = estimate_samples(loaded, sizes)
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


def certified_bounds(loaded, sizes, grid):
    """(index of (point, step), (rows, sizes) Δ̄_k of §3.2)."""
    statistics = accountants.mean_statistics(loaded)
    if statistics is None:
        raise UsageError(loaded.flag, f"{loaded.path} has no mean-rule statistics (center_distance, spread, "
                         "max_deviation) to certify; measure with compute_sensitivity.py --reduction mean")
    bound = accounting.certified_sensitivity(statistics["center_distance"], statistics["spread"],
                                             statistics["max_deviation"], loaded.mechanism.clip_bound, grid,
                                             sizes.failure)
    return statistics.index, bound


def estimate_samples(loaded, sizes):
    """(index of (point, step), (rows, S) Δ_B samples and their sizes, the sizes they were drawn at)."""
    samples = accountants.mean_samples(loaded)
    if samples is None:
        raise UsageError(loaded.flag, f"{loaded.path} has no Δ_B samples to estimate from (--kind estimate)")
    index, values, batch_sizes, _ = samples
    return index, values, batch_sizes, accountants.sample_grid(batch_sizes, sizes, loaded)


def mean_rule_pld(loaded, args, sizes, grid, log_weights):
    """§8.4: every point's PLD composition of the mean rule's per-step mixture (certified or estimate),
    next to the baseline's, converted at δ − T·delta_fail."""
    mechanism, kind = loaded.mechanism, args.kind
    if kind == "certified":
        index, values = certified_bounds(loaded, sizes, grid)
        row_log_weights, log_mass = log_weights, math.log(1 - sizes.delta_fail(kind))
    else:
        index, values, batch_sizes, sample_grid = estimate_samples(loaded, sizes)
        sample_weights = accounting.lumped_size_log_weights(sample_grid, sizes.n, sizes.sample_rate)
        row_log_weights = pld.estimate_log_weights(batch_sizes, sample_grid, sample_weights)
        # P(k ≥ k_min) when the samples start at k_min (as measured); else the law of the sizes sampled.
        log_mass = float(logsumexp(sample_weights))
    points = index.get_level_values("point").unique().to_numpy()
    checkpoints = index.get_level_values("step").unique().sort_values().to_numpy()
    if len(index) != len(points) * len(checkpoints):
        raise UsageError(loaded.flag, f"{loaded.path}: every point needs a value at every checkpoint (steps "
                         f"{', '.join(map(str, checkpoints))})")
    shape = (len(points), len(checkpoints), -1)
    law = pld.step_law(values.reshape(shape), np.broadcast_to(row_log_weights, values.shape).reshape(shape), log_mass,
                       dominate=kind == "certified")
    worst = accounting.baseline_mean_sensitivity(mechanism.clip_bound, grid)
    worst_law = pld.step_law(worst, log_weights, math.log(1 - sizes.delta_fail("baseline")), dominate=False)
    common = dict(sample_rate=mechanism.sample_rate, noise_std=mechanism.noise_std, delta=args.delta,
                  relative_step=COMPOSITION_LEVEL_STEP, interval=args.pld_interval)
    fail = sizes.delta_fail(kind)
    eps = pld.mean_rule_eps(values.reshape(shape), law, checkpoints, mechanism.total_steps, delta_fail=fail,
                            before_first=(worst, worst_law), **common)
    baseline = pld.mean_rule_eps(worst[None, None], worst_law[None, None], [0], mechanism.total_steps,
                                 delta_fail=sizes.delta_fail("baseline"), **common)
    if checkpoints[0] > 0:
        accountants.warn(f"no checkpoint at step 0: steps 1..{checkpoints[0]} use the mean rule's baseline (§4)")
    print(f"per-instance (eps, delta) of {len(points)} points over T={mechanism.total_steps} steps, mean rule ({kind}), "
          f"{len(checkpoints)} checkpoints, sigma={mechanism.noise_multiplier:g}, q={mechanism.sample_rate:.4g}, "
          f"k_min={sizes.k_min}, delta_fail={fail:.3g} per step, converted at delta - T·delta_fail = "
          f"{args.delta - mechanism.total_steps * fail:.4g}; composed by PLD "
          f"(dp_accounting, pessimistic, discretisation {args.pld_interval:g}), eps = max(remove, add)")
    common = dict(delta=args.delta, steps=mechanism.total_steps, k_min=sizes.k_min, reduction="mean")
    return pd.concat([
        pd.DataFrame({"point": points, "kind": kind, **pld_columns(eps, args), "delta_fail": fail, **common}),
        pd.DataFrame({"point": points, "kind": "baseline", **pld_columns(baseline, args),
                      "delta_fail": sizes.delta_fail("baseline"), **common})], ignore_index=True)


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

"""Per-instance privacy of DP-SGD's sum rule over a whole training run (docs/accounting.md §4).

Reads `grad_norm` rows (Δ* per point at several checkpoints, or at every step, of one or more
runs told apart by `run` and `seed`) from compute_sensitivity.py, composes the per-step Rényi
DP over the T steps with the Hölder bound of §4 (b = inf: plain composition along the observed
trajectory), and converts it to (ε, δ) next to Opacus's data-independent accountant.
"""

import numpy as np
import pandas as pd

from perinstance import accountants, accounting
from perinstance.errors import UsageError, run_main
from perinstance.options import Parser

COLUMNS = ["point", "eps", "order", "baseline_eps", "delta", "steps"]
# Orders above this (from a small Hölder exponent b) make the bound meaningless.
LARGEST_ORDER = 1e6


def parse_args(argv):
    parser = Parser(description=__doc__)
    accountants.add_input_arguments(parser)
    accountants.add_delta_argument(parser)
    accountants.add_alpha_argument(parser, accounting.COMPOSITION_ORDERS,
                                   "Rényi orders λ > 1 to convert from (default 1.25..256, 47 orders)")
    accountants.add_holder_argument(parser, "3T", "Hölder exponent b in (1, inf]: a number, inf, or a multiple of "
                                    "the number of steps T such as 3T (default)")
    parser.add_argument("--rounding", type=float, default=0.01,
                        help="round Δ* up to multiples of ROUNDING·Γ before the RDP lookup (default 0.01; 0: exact)")
    args = parser.parse_args(argv)
    accountants.check_delta(args.delta)
    args.alpha = accountants.check_orders(args.alpha)
    if not 0 <= args.rounding <= 1:
        raise UsageError("--rounding", f"must be in [0, 1] (a fraction of the clip bound), not {args.rounding:g}")
    return args


def holder_exponent(args, total_steps):
    holder_b = accountants.parse_holder(args.holder_p, total_steps)
    largest = accounting.holder_orders(args.alpha[-1], total_steps, holder_b)[-1]
    if not largest <= LARGEST_ORDER:
        raise UsageError("--holder-p", f"b={holder_b:g} inflates order {args.alpha[-1]:g} to {largest:.3g} over "
                         f"{total_steps} steps (λ_k = 1 + (λ-1)(b/(b-1))^k); use a larger b such as 3T")
    return holder_b


def main(argv=None):
    args = parse_args(argv)
    loaded = accountants.load(args, ["grad_norm"], one_run=False)
    accountants.check_unique(loaded, ["run", "seed", "step", "point"])
    config = loaded.config
    holder_b = holder_exponent(args, config.total_steps)
    out = accountants.output_path(args, "renyi_per_instance_sum_compo")
    ratios, steps, points = accountants.checkpoint_ratios(loaded)

    levels = accounting.sensitivity_levels(args.rounding, ratios)
    orders = accounting.composition_orders(args.alpha, config.total_steps, holder_b)
    table = accounting.RdpTable(config.sample_rate, config.noise_multiplier, orders, levels)
    rdp = accounting.compose_rdp(table, ratios, steps, config.total_steps, args.alpha, holder_b)
    eps, best_order = accounting.rdp_to_eps(args.alpha, rdp, args.delta)
    baseline_rdp = accounting.baseline_rdp(config.noise_multiplier, config.sample_rate, args.alpha, config.total_steps)
    baseline_eps, _ = accounting.rdp_to_eps(args.alpha, baseline_rdp, args.delta)
    result = pd.DataFrame({"point": points, "eps": eps, "order": best_order, "baseline_eps": float(baseline_eps),
                           "delta": args.delta, "steps": config.total_steps})

    runs = ratios.shape[0]
    print(f"per-instance (eps, delta) of {len(points)} points over T={config.total_steps} steps, {runs} run(s), "
          f"{len(steps)} checkpoints, sigma={config.noise_multiplier:g}, q={config.sample_rate:.4g}, "
          f"Hölder b={holder_b:g}, Δ rounded up to {args.rounding:g}·Γ, delta={args.delta:g}")
    if runs == 1 and np.isfinite(holder_b):
        accountants.warn("with one run, --holder-p inf (plain composition along the observed trajectory) "
                         "is never larger than a finite b")
    at_edge = np.isin(best_order, [args.alpha[0], args.alpha[-1]]).sum()
    if at_edge:
        accountants.warn(f"{at_edge} points have their best order at an end of --alpha "
                         f"({args.alpha[0]:g}..{args.alpha[-1]:g}); a wider grid may lower their eps")
    accountants.finish(out, result, COLUMNS, "eps", "baseline_eps", [], accountants.correct_at_end(loaded.rows, result))


if __name__ == "__main__":
    run_main(main)

"""Per-step per-instance Rényi DP of DP-SGD's sum rule (docs/accounting.md §3.1).

    python renyi_per_instance_sum.py --res-name lenet_sum --alpha 2 8 32

Reads `grad_norm` rows (Δ*, one per point and checkpoint) from compute_sensitivity.py and writes,
per point, checkpoint and order λ, ρ(λ) = RDP_SGM(q, σΓ/Δ*, λ) of one step (kind certified: a bound
for both directions) next to the data-independent baseline RDP_SGM(q, σ, λ) (kind baseline).
"""

import numpy as np
import pandas as pd

from perinstance import accountants, accounting
from perinstance.errors import run_main
from perinstance.options import HELP_FORMAT, Parser, add_alpha_argument

COLUMNS = ["point", "step", "alpha", "direction", "kind", "rdp"]
KEYS = ["point", "step", "alpha"]


def build_parser():
    parser = Parser(description=__doc__, formatter_class=HELP_FORMAT)
    accountants.add_input_arguments(parser)
    add_alpha_argument(parser, [8.0], "Rényi orders α > 1, fractional allowed (default 8)")
    return parser


def parse_args(argv):
    args = build_parser().parse_args(argv)
    args.alpha = accountants.check_orders(args.alpha)
    return args


def main(argv=None):
    args = parse_args(argv)
    loaded = accountants.load(args, ["grad_norm"], one_run=True)
    accountants.check_unique(loaded, ["point", "step"])
    mechanism, rows = loaded.mechanism, loaded.rows.sort_values(["point", "step"])
    out = accountants.output_path(args, "renyi_per_instance_sum")

    rdp = accounting.rdp_sum_rule(rows["value"].to_numpy(), mechanism.clip_bound, mechanism.noise_multiplier,
                                  mechanism.sample_rate, args.alpha)
    baseline = mechanism.baseline_rdp(args.alpha, steps=1)
    keys = pd.DataFrame({"point": np.repeat(rows["point"].to_numpy(), len(args.alpha)),
                         "step": np.repeat(rows["step"].to_numpy(), len(args.alpha)),
                         "alpha": np.tile(args.alpha, len(rows)), "direction": "max"})
    result = pd.concat([keys.assign(kind="certified", rdp=rdp.ravel()),
                        keys.assign(kind="baseline", rdp=np.tile(baseline, len(rows)))], ignore_index=True)

    print(f"per-step Rényi DP of {rows['point'].nunique()} points, sum rule, sigma={mechanism.noise_multiplier:g}, "
          f"clip bound {mechanism.clip_bound:g}, q={mechanism.sample_rate:.4g}, "
          f"orders {', '.join(f'{alpha:g}' for alpha in args.alpha)}")
    result = result.sort_values(KEYS + ["kind"], kind="mergesort")[COLUMNS]
    accountants.report(out, result, "rdp", KEYS, ["step", "alpha"], accountants.correct_table(rows, ["point", "step"]))


if __name__ == "__main__":
    run_main(main)

"""Per-step per-instance (ε, δ) guarantees of DP-SGD (docs/accounting.md §3.3).

Reads `grad_norm` rows (sum rule: Δ*, one per point and checkpoint) or `batch_sensitivity` rows
(mean rule: Δ_B, one per drawn batch) from compute_sensitivity.py and writes, per point and
checkpoint, the (ε, δ) of one step next to the data-independent baseline (Δ = Γ).
"""

import numpy as np

from perinstance import accountants, accounting
from perinstance.errors import run_main
from perinstance.options import Parser

COLUMNS = ["point", "step", "reduction", "eps", "baseline_eps", "delta"]


def parse_args(argv):
    parser = Parser(description=__doc__)
    accountants.add_input_arguments(parser)
    accountants.add_delta_argument(parser)
    accountants.add_holder_argument(parser, "1e4",
                                    "Hölder exponent p in (1, inf]: a number or inf (default 1e4, the paper's)")
    accountants.add_gaussian_argument(parser)
    args = parser.parse_args(argv)
    accountants.check_delta(args.delta)
    return args


def main(argv=None):
    args = parse_args(argv)
    loaded = accountants.load(args, ["grad_norm", "batch_sensitivity"], one_run=True, integer_columns={"sample": 0})
    accountants.check_unique(loaded, ["point", "step", "sample"])
    config = loaded.config
    holder_p = accountants.parse_holder(args.holder_p, config.total_steps)
    out = accountants.output_path(args, "eps_delta")

    # One row per (point, step), one column per sensitivity sample (NaN where a point has fewer).
    samples = loaded.rows.pivot(index=["point", "step"], columns="sample", values="value")
    eps = accounting.eps_delta_holder(samples.to_numpy(), config.noise_std, config.sample_rate, args.delta,
                                      holder_p, args.gaussian)
    baseline = accounting.baseline_eps_delta(config.noise_multiplier, config.sample_rate, args.delta, args.gaussian)
    result = samples.index.to_frame(index=False).assign(
        reduction=config.reduction, eps=eps, baseline_eps=baseline, delta=args.delta)

    print(f"per-step (eps, delta) of {result['point'].nunique()} points, {config.reduction} rule, "
          f"noise std {config.noise_std:.4g}, q={config.sample_rate:.4g}, Hölder p={holder_p:g}, "
          f"{args.gaussian} Gaussian, delta={args.delta:g}")
    if args.gaussian == "classic" and np.any(result["eps"] >= 1):
        accountants.warn("the classic Gaussian formula is a valid bound only below eps 1; some values are above")
    correct = accountants.correct_at(loaded.rows, result, ["point", "step"])
    accountants.finish(out, result, COLUMNS, "eps", "baseline_eps", ["step"], correct)


if __name__ == "__main__":
    run_main(main)

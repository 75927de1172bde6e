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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perinstance.analysis import gla_statistic, mean_rule, reading, report
from perinstance.cli import options
from perinstance.cli.options import HELP_FORMAT, Parser, add_alpha_argument
from perinstance.files import results

COLUMNS = ["point", "step", "alpha", "direction", "kind", "rdp", "rdp_min", "rdp_max", "samples", "k_min", "k_star",
           "k_star_at_k_min", "delta_fail", "estimator"]
KEYS = ["point", "step", "alpha"]


@dataclass(frozen=True)
class RenyiMeanRequest:
    source: reading.Source
    orders: np.ndarray
    estimator: str
    aggregate: str
    failure: float | None


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    options.add_input_arguments(parser)
    add_alpha_argument(parser, [8.0], "Rényi orders α > 1 (default 8; jensen: integer orders it measured)")
    parser.add_argument("--estimator", choices=["coupling", "jensen"], default="coupling",
                        help="coupling: estimate, certified and baseline of §3.2 (default); jensen: GLA's statistic")
    parser.add_argument("--aggregate", choices=list(gla_statistic.AGGREGATE_LABEL), default="joint",
                        help="jensen only: joint Monte-Carlo mean (default) or GLA's per-target average, NOT a bound")
    options.add_failure_argument(parser)
    return parser


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> RenyiMeanRequest:
    args = build_parser(prog).parse_args(argv)
    return RenyiMeanRequest(source=options.source_of(vars(args)), orders=options.check_orders(args.alpha),
                   estimator=args.estimator, aggregate=args.aggregate, failure=args.failure)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    request = parse_args(argv, prog)
    if request.estimator == "jensen":
        loaded = reading.load(request.source, ["renyi_statistic"], one_run=True,
                                  integer_columns={"alpha": 2, "target_batch": 0, "sample": 0})
        result, description = gla_statistic.gla_statistic_rdp(loaded, request.orders, request.aggregate)
    else:
        loaded = reading.load(request.source, results.COUPLING_QUANTITIES, one_run=True,
                                  integer_columns={"sample": 0})
        result, description = mean_rule.per_step_rdp(loaded, request.orders, request.failure)
    output = report.output_path(request.source, "renyi_per_instance_mean")
    print(description)
    result = result.sort_values(KEYS + ["direction", "kind"], kind="mergesort")[COLUMNS]
    report.report(output, result, "rdp", KEYS, ["step", "alpha"], report.correct_table(loaded.rows, ["point", "step"]))


"""Per-step per-instance Rényi DP of DP-SGD's sum rule (docs/accounting.md §3.1).

    python renyi_per_instance_sum.py --res-name lenet_sum --alpha 2 8 32

Reads `grad_norm` rows (Δ*, one per point and checkpoint) from compute_sensitivity.py and writes,
per point, checkpoint and order λ, ρ(λ) = RDP_SGM(q, σΓ/Δ*, λ) of one step (kind certified: a bound
for both directions) next to the data-independent baseline RDP_SGM(q, σ, λ) (kind baseline).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perinstance.analysis import reading, report, sum_rule
from perinstance.cli import options
from perinstance.cli.options import HELP_FORMAT, Parser, add_alpha_argument

COLUMNS = ["point", "step", "alpha", "direction", "kind", "rdp"]
KEYS = ["point", "step", "alpha"]


@dataclass(frozen=True)
class RenyiSumRequest:
    source: reading.Source
    orders: np.ndarray


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    options.add_input_arguments(parser)
    add_alpha_argument(parser, [8.0], "Rényi orders α > 1, fractional allowed (default 8)")
    return parser


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> RenyiSumRequest:
    args = build_parser(prog).parse_args(argv)
    return RenyiSumRequest(source=options.source_of(vars(args)), orders=options.check_orders(args.alpha))


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    request = parse_args(argv, prog)
    loaded = reading.load(request.source, ["grad_norm"], one_run=True)
    output = report.output_path(request.source, "renyi_per_instance_sum")
    result, description = sum_rule.per_step_rdp(loaded, request.orders)
    print(description)
    result = result.sort_values(KEYS + ["kind"], kind="mergesort")[COLUMNS]
    report.report(output, result, "rdp", KEYS, ["step", "alpha"], report.correct_table(loaded.rows, ["point", "step"]))


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

A composition is `certified` (a bound along the observed run) only when the rows give every point a
value at every step 0..T-1, as train_dpsgd.py --track-points records them; from checkpoints it holds
each value until the next one and is a `held_estimate` ("Δ* held between checkpoints", accounting.md §4; the
mean rule's Monte Carlo values compose to an `estimate` either way).
The tracked table of a run with per-point clipping (--track-every K, or a filter: --budget-eps) holds each
point's clip bound from one measurement to the next: composed, `certified` however rarely it was measured
(§12.4); a filtered run's points also get their `guarantee`, the filter's budget as ε at --delta (§12.3).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perinstance.accounting import pld_grid, rdp_composition
from perinstance.accounting.guarantees import Kind
from perinstance.analysis import composition, reading, report
from perinstance.cli import options
from perinstance.cli.options import HELP_FORMAT, Parser, add_alpha_argument, non_negative_float, positive_float
from perinstance.errors import UsageError
from perinstance.files import results


@dataclass(frozen=True)
class CompositionRequest:
    source: reading.Source
    delta: float
    orders: np.ndarray
    holder_b: str | None
    rounding: float
    kind: Kind
    failure: float | None
    accountant: str
    pld_interval: float


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    options.add_input_arguments(parser)
    options.add_delta_argument(parser)
    add_alpha_argument(parser, rdp_composition.COMPOSITION_ORDERS,
                       "Rényi orders α > 1 to convert from (default 1.25..256, 47 orders)")
    parser.add_argument("--holder-b", default=None,
                        help="Hölder exponent b in (1, inf] of the composition: a number, inf, or a multiple of the "
                             "number of steps T such as 3T (default 3T for the sum rule by Rényi DP, inf for the mean "
                             "rule and --accountant pld, which take inf only)")
    parser.add_argument("--rounding", type=non_negative_float, default=composition.SUM_RULE_ROUNDING,
                        help="sum rule: round Δ* up to multiples of ROUNDING·Γ before the RDP or PLD lookup "
                             f"(default {composition.SUM_RULE_ROUNDING:g}; 0: exact)")
    parser.add_argument("--kind", choices=[Kind.CERTIFIED.value, Kind.ESTIMATE.value], default=Kind.CERTIFIED.value,
                        help="mean rule: compose the certified per-step bound (default) or the Monte-Carlo estimate")
    options.add_failure_argument(parser)
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp",
                        help="compose by Rényi DP (§4, default) or by privacy loss distributions (§8: dp_accounting, "
                             "pessimistic, both directions, b = inf)")
    parser.add_argument("--pld-interval", type=positive_float, default=pld_grid.DEFAULT_INTERVAL,
                        help=f"--accountant pld: discretisation of the privacy loss (dp_accounting's "
                             f"value_discretization_interval; default {pld_grid.DEFAULT_INTERVAL:g})")
    return parser


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> CompositionRequest:
    args = build_parser(prog).parse_args(argv)
    orders = options.check_orders(args.alpha)
    if not 0 <= args.rounding <= 1:
        raise UsageError("--rounding", f"must be in [0, 1] (a fraction of the clip bound), not {args.rounding:g}")
    return CompositionRequest(source=options.source_of(vars(args)), delta=args.delta, orders=orders,
                   holder_b=args.holder_b, rounding=args.rounding, kind=Kind(args.kind), failure=args.failure,
                   accountant=args.accountant, pld_interval=args.pld_interval)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    request = parse_args(argv, prog)
    loaded = reading.load(request.source, ["grad_norm", *results.COUPLING_QUANTITIES, *results.HELD_QUANTITIES], one_run=False,
                              integer_columns={"sample": 0})
    trained = set(loaded.rows["update_rule"].astype(str))
    if trained != {loaded.mechanism.rule}:
        raise UsageError(loaded.flag, f"{loaded.path}: the rows analyse the {loaded.mechanism.rule} rule of a run "
                         f"trained with the {'/'.join(sorted(trained))} rule; composing over a run needs the rule it "
                         "was trained with (per-step analyses may differ)")
    output = report.output_path(request.source, "renyi_per_instance_sum_compo")
    if composition.has_held_bounds(loaded):
        result, description, notes = composition.sum_rule_held(
            loaded, delta=request.delta, orders=request.orders, holder_b=request.holder_b,
            accountant=request.accountant, rounding=request.rounding, interval=request.pld_interval)
        loaded = dataclasses.replace(loaded, rows=loaded.rows[loaded.rows["quantity"] == "grad_norm"])
    elif loaded.mechanism.rule == "sum" and request.accountant == "pld":
        result, description, notes = composition.sum_rule_pld(loaded, delta=request.delta, holder_b=request.holder_b,
                                                        rounding=request.rounding, interval=request.pld_interval)
    elif loaded.mechanism.rule == "sum":
        result, description, notes = composition.sum_rule(loaded, delta=request.delta, orders=request.orders,
                                                    holder_b=request.holder_b, rounding=request.rounding)
    elif request.accountant == "pld":
        result, description, notes = composition.mean_rule_pld(loaded, delta=request.delta, kind=request.kind,
                                                         holder_b=request.holder_b, failure=request.failure,
                                                         interval=request.pld_interval)
    else:
        result, description, notes = composition.mean_rule_composed(loaded, delta=request.delta, orders=request.orders,
                                                             kind=request.kind, holder_b=request.holder_b,
                                                             failure=request.failure)
    print(description)
    result = result.sort_values(["point", "kind"], kind="mergesort")[composition.COLUMNS]
    report.report(output, result, "eps", ["point"], [], report.correct_at_end(loaded.rows), notes)


"""Per-step per-instance (ε, δ) guarantees of DP-SGD, both update rules (docs/accounting.md §3.3).

    python eps_delta.py --res-name lenet_sum
    python eps_delta.py --res-name lenet_mean --delta 1e-5
    python eps_delta.py --res-name lenet_sum --method holder --holder-p 1e4     # GLA's formula

Sum rule (`grad_norm` rows, Δ* per point and checkpoint): the exact hockey-stick of the
subsampled Gaussian at Δ*, per direction (remove, add) and their max; `kind` certified, next to
the baseline at Δ = Γ. Mean rule (`center_distance`, `spread`, `max_deviation` and `batch_sensitivity`
rows of compute_sensitivity.py --reduction mean): the coupling bound averaged over batch sizes,
as an estimate from the Δ_B samples (with its min..max over Monte-Carlo blocks), a certified bound
from the dataset statistics, and the mean rule's own baseline, each with k_min and delta_fail:
the reported δ includes delta_fail (§3.4).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from perinstance.analysis import mean_rule, reading, report, sum_rule
from perinstance.cli import options
from perinstance.cli.options import HELP_FORMAT, Parser
from perinstance.errors import UsageError
from perinstance.files import results

COLUMNS = ["point", "step", "reduction", "direction", "kind", "eps", "eps_min", "eps_max", "delta", "delta_fail",
           "k_min", "samples", "method"]
KEYS = ["point", "step"]


@dataclass(frozen=True)
class EpsDeltaRequest:
    source: reading.Source
    delta: float
    method: str
    holder_p: str
    gaussian: str
    failure: float | None


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    options.add_input_arguments(parser)
    options.add_delta_argument(parser)
    parser.add_argument("--method", choices=["exact", "holder"], default="exact",
                        help="exact: the hockey-stick of §3.3 by convexity (default); holder: GLA's Hölder formula "
                             "(sum rule only, for reproducing the paper; never tighter)")
    parser.add_argument("--holder-p", default=None,
                        help="--method holder only: Hölder exponent p in (1, inf], a number or inf (default 1e4, GLA's)")
    parser.add_argument("--gaussian", choices=["analytic", "classic"], default=None,
                        help="--method holder only: the Gaussian mechanism's ε, analytic (exact, Balle & Wang 2018) or "
                             "the classic formula (default analytic)")
    options.add_failure_argument(parser)
    return parser


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> EpsDeltaRequest:
    args = build_parser(prog).parse_args(argv)
    for flag, value in (("--holder-p", args.holder_p), ("--gaussian", args.gaussian)):
        if value is not None and args.method != "holder":
            raise UsageError(flag, "belongs to GLA's Hölder formula: add --method holder (the exact method has no "
                                   "such parameter)")
    return EpsDeltaRequest(source=options.source_of(vars(args)), delta=args.delta, method=args.method,
                   holder_p=args.holder_p or "1e4", gaussian=args.gaussian or "analytic", failure=args.failure)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    request = parse_args(argv, prog)
    loaded = reading.load(request.source, ["grad_norm", *results.COUPLING_QUANTITIES], one_run=True,
                              integer_columns={"sample": 0})
    output = report.output_path(request.source, "eps_delta")
    if loaded.mechanism.rule == "sum":
        result, description = sum_rule.per_step_eps(loaded, request.delta, request.method, request.holder_p,
                                                    request.gaussian)
    elif request.method == "holder":
        raise UsageError("--method", "GLA's Hölder formula is kept for the sum rule only; the mean rule uses the "
                         "exact coupling bound (allowed here: exact)")
    else:
        result, description = mean_rule.per_step_eps(loaded, request.delta, request.failure)
    print(description)
    result = result.sort_values(["point", "step", "direction", "kind"], kind="mergesort")[COLUMNS]
    report.report(output, result, "eps", KEYS, ["step"], report.correct_table(loaded.rows, KEYS))


"""Per-point privacy of one trained sum-rule run: points.csv, galleries, ε per class and per group, report.html.

    python report.py --run quick-mnist-embedded-sum                  # -> figures/quick-mnist-embedded-sum/
    python report.py --run RUN --groups groups.csv --out-dir out     # groups.csv: columns point, group
    perinstance report --run models/my-run --delta 1e-6 --device cuda

Every training point's composed ε over the run, by RDP (b = inf) and by PLD (accounting.md §4, §8). Δ* comes from
models/<run>/tracked_norms.csv|parquet when the run tracked every point at every step (train_dpsgd.py
--track-points all): each ε is then `certified`, a bound along the observed run. Otherwise Δ* of every point at
every checkpoint comes from res/<run>.csv|parquet, measured first by compute_sensitivity.py where points or
checkpoints are missing (printed; a rerun skips what is there): each ε is then a `held_estimate` (Δ* held between
checkpoints, not a bound), and the points the run tracked also get their bound. The accountants run as their
scripts would (printed, their outputs in res/, reused when the same command ran on the same input).

Writes to --out-dir (default figures/<run>/): points.csv (one row per training point; Parquet past 100,000 rows;
columns in docs/commands.md), the figures (the 16 points of highest and of lowest ε, and the 16 whose held
estimate falls furthest below their bound, as images for image data; ε per class and per group), report.md and
report.html (one self-contained page: opens offline in any browser). The mean rule is refused: composing a point's
privacy over a run is the sum rule's.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass

from perinstance.cli import options
from perinstance.cli.main import script_mains
from perinstance.cli.options import HELP_FORMAT, Parser, add_delta_argument, add_device_argument
from perinstance.errors import UsageError
from perinstance.experiments import main_run, point_table, run_report
from perinstance.experiments.commands import Commands
from perinstance.files import fileio
from perinstance.plots.report_files import write_report_files
from perinstance.train import runs

DEFAULT_OUT_DIR = "figures"


@dataclass(frozen=True)
class ReportCommand:
    """report.py's flags, typed."""

    run: str
    models_dir: str
    data_root: str
    groups: point_table.Groups | None
    out_dir: str | None
    delta: float
    device: str


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    parser.add_argument("--run", required=True, help="the run: a name in --models-dir, or a run folder")
    parser.add_argument("--models-dir", default="models", help="folder that holds the run folders")
    parser.add_argument("--data-root", default="./data", help="where torchvision datasets live, and cache/ with "
                                                              "scatternet: features")
    options.add_groups_argument(parser)
    parser.add_argument("--out-dir", default=None, help="folder of the figures, points.csv, report.md and report.html "
                                                        f"(default {DEFAULT_OUT_DIR}/<run>/)")
    add_delta_argument(parser)
    add_device_argument(parser)
    return parser


def parse_args(argv: Sequence[str] | None, prog: str | None = None) -> ReportCommand:
    args = build_parser(prog).parse_args(argv)
    groups = None if args.groups is None else point_table.read_groups(args.groups)
    return ReportCommand(run=args.run, models_dir=args.models_dir, data_root=args.data_root, groups=groups,
                         out_dir=args.out_dir, delta=args.delta, device=args.device)


def check_run(run: runs.OpenRun) -> None:
    """A run the per-point report covers: private, trained with the sum rule, to its last step."""
    config = run.config
    if not config.private:
        raise UsageError("--run", f"{config.run} is trained without noise (--no-dp): it has no privacy to report")
    if config.update_rule != "sum":
        raise UsageError("--run", f"{config.run} is trained with the {config.update_rule} rule; composing each "
                                  "point's privacy over a run is the sum rule's (accounting.md §4): report a sum-rule "
                                  "run")
    if config.total_steps not in run.saved_steps():
        raise UsageError("--run", f"{run.run_dir} is trained up to step {run.saved_steps()[-1]} of "
                                  f"{config.total_steps}; finish it first (rerun its train_dpsgd.py command)")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    request = parse_args(argv, prog)
    # Every input is checked before anything is measured or written.
    opened = runs.open_run(request.run, request.models_dir, request.data_root)
    check_run(opened)
    if request.groups is not None:
        request.groups.check(opened.train_columns, opened.name)
    out_dir = request.out_dir or os.path.join(DEFAULT_OUT_DIR, opened.name)
    fileio.writable_folder(out_dir, "--out-dir")

    commands = Commands(script_mains())
    measured = main_run.measured_run(commands, opened.run_dir, ["--run", opened.run_dir, "--data-root",
                                                                request.data_root, "--device", request.device])
    accounted = main_run.account_run(commands, measured, request.delta)
    points = run_report.per_point_report(out_dir, opened, measured, accounted, request.groups, request.device,
                                         request.data_root)
    markdown_path, html_path = write_report_files(out_dir, run_report.run_document(points, measured, commands.lines))
    print(f"\nreport.py --run {opened.name}: {html_path} (one page, figures inlined), {markdown_path}, "
          f"{points.points_path} ({len(accounted.composed):,} points) and {len(points.figures)} figures")
    for label, value in points.summary.rows:
        print(f"  {label}: {value}")

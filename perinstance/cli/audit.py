"""Audit per-instance privacy bounds from below: one DP-SGD step at a checkpoint, released with and without x*.

    python audit.py --run quick-mnist-embedded-sum --points 0-9 --stage final
    python audit.py --run quick-mnist-embedded-sum --spread 50 --trials 1000000 --rule mean

For each point, --trials steps are simulated with x* in the training set and as many without it:
real Poisson batches over the other points, their real transformed gradients at the checkpoint,
real Gaussian noise, all projected on one direction per point (docs/audit.md). A threshold test
on that projection, chosen on half of the trials and counted on the other half, proves
eps_lower <= the step's true per-instance ε at --delta with 95% confidence (Clopper–Pearson).
eps_upper is the accountant's per-step ε (sum rule: exact, accounting.md §3.3; mean rule: its
Monte-Carlo estimate). A point with eps_lower > eps_upper is flagged `violated`, and the script
then exits with status 1. For the mean rule the summary also holds eps_lower against the per-step
ε of the sum rule's accounting at the same σ and q, and against the mean rule's own baseline
(above it: status 1 too).

One-run modes (docs/audit.md §1b, §1d; perinstance/audit/one_run.py):

    python audit.py --in-scores in.txt --out-scores out.txt --significance 0.05 --delta 1e-6
    python audit.py --run NAME --one-run
    python audit.py --self-test

The first prints the one-run (ε, δ), f-DP (Gaussian curves) and Clopper–Pearson lower bounds on ε from
anyone's canary scores (higher = member; one number a line, or .npy), on a grid of guess counts fixed
before the scores are seen. The second audits each canary group of a run trained with --canaries
(insertions into the noisy gradient sum, not examples of the model) or --input-canaries (crafted
examples, sampled and clipped like real points): the f-DP one-run test of the group's per-step
likelihood-ratio scores against the trade-off curve the accountant claims for their sensitivity over
the whole run, the significance split over the groups. It writes res/<run>_one_run_audit.csv and exits
with status 1 when a curve is rejected. The third trains seven small runs, a correct one and faulty ones
of each update rule (faults planted in the trainer: noise ×½, clipping skipped, sampling at 2q, canaries
at Γ/c; under the mean rule, noise added before the division by |B|), audits each, and exits 0 only if
every fault is flagged and no correct run is.
"""

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from perinstance.accounting.mechanism import Mechanism
from perinstance.audit import audit_simulation, canary_audit, one_run, self_test
from perinstance.cli import options
from perinstance.cli.options import (
    HELP_FORMAT,
    Parser,
    add_device_argument,
    non_negative_int,
    probability,
)
from perinstance.errors import UsageError
from perinstance.files import fileio
from perinstance.plots import audit_plots
from perinstance.train import runs
from perinstance.train.points import parse_points


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    parser.add_argument("--run", help="the run: a name under --models-dir, or a run folder")
    parser.add_argument("--models-dir", default="models", help="folder that holds the run folders")
    parser.add_argument("--data-root", default="./data", help="where torchvision datasets live")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--points", nargs="+", help="points to audit: indices (0 1 2), ranges (0-99), all, random:N")
    chosen.add_argument("--spread", type=int,
                        help="audit N points spanning the range of Δ* at each checkpoint (easy to hard, a fifth "
                             "of them misclassified)")
    parser.add_argument("--stage", nargs="+", default=["final"],
                        help="checkpoints: fractions of training in [0, 1], initial, middle, final, or all")
    parser.add_argument("--rule", choices=("sum", "mean"), default=None,
                        help="update rule audited (default: the one the run was trained with)")
    parser.add_argument("--trials", type=int, default=1_000_000,
                        help="simulated steps per point with x* and as many without it (default 1e6)")
    parser.add_argument("--delta", type=probability, default=1e-5,
                        help="δ of the reported guarantee that is audited (default 1e-5)")
    parser.add_argument("--statistic", choices=audit_simulation.STATISTICS, default="whitened",
                        help="the test: projection on Fisher's discriminant against the batch spread and the noise "
                             "(whitened, default), on the shift x* adds (projection), or on that shift by an "
                             "adversary who also knows the other points' batch (known-batch)")
    parser.add_argument("--upper-batches", type=int, default=1000,
                        help="mean rule: batches of Δ_B behind the estimate of eps_upper (default 1000)")
    parser.add_argument("--mc-seed", type=non_negative_int, default=None,
                        help="seed of every Monte-Carlo draw (default: the run's seed)")
    parser.add_argument("--out", default=None, help="output CSV (default res/<run>_audit_<rule>.csv)")
    parser.add_argument("--figure", default=None, help="figure (default figures/<run>_audit_<rule>.png)")
    add_device_argument(parser)
    scores = parser.add_argument_group("one-run audit (canary scores)")
    scores.add_argument("--one-run", action="store_true",
                        help="audit the canaries of --run (trained with --canaries or --input-canaries), group by group")
    scores.add_argument("--in-scores", default=None,
                        help="scores of the held-in canaries, higher = member: one number a line, or .npy")
    scores.add_argument("--out-scores", default=None,
                        help="scores of the held-out canaries: one number a line, or .npy")
    scores.add_argument("--significance", type=probability, default=0.05,
                        help="significance level of the one-run lower bounds, split over a run's canary groups "
                             "(default 0.05)")
    scores.add_argument("--self-test", action="store_true",
                        help="positive controls: train seven small runs, a correct one and faulty ones of each "
                             "update rule (faults planted in the trainer: noise ×½, clipping skipped, sampling at 2q, "
                             "canaries at Γ/c, the mean rule's noise before the division by |B|), audit each as "
                             "--one-run does, exit 0 only if every fault is flagged and no correct run is")
    return parser


@dataclass(frozen=True)
class AuditCommand:
    """audit.py's flags, typed: the run, the points (--points or --spread) and checkpoints, the
    audit's settings (AuditRequest once the run is open) and where the results go."""

    run: str
    models_dir: str
    data_root: str
    points: tuple | None
    spread: int | None
    stages: list
    rule: str | None
    trials: int
    delta: float
    statistic: str
    upper_batches: int
    mc_seed: int | None
    out: str | None
    figure: str | None
    device: str


def command_of(args: argparse.Namespace) -> AuditCommand:
    """The per-step audit that the parsed flags ask for."""
    if args.run is None:
        raise UsageError("--run", "required (or --in-scores and --out-scores)")
    if args.points is None and args.spread is None:
        raise UsageError("--points", "give --points or --spread (or --one-run)")
    if args.trials < 1000:
        raise UsageError("--trials", f"must be >= 1000 (half choose the test, half count it), got {args.trials}")
    if args.upper_batches <= 0:
        raise UsageError("--upper-batches", f"must be > 0, got {args.upper_batches}")
    if args.spread is not None and args.spread <= 0:
        raise UsageError("--spread", f"must be > 0, got {args.spread}")
    return AuditCommand(run=args.run, models_dir=args.models_dir, data_root=args.data_root,
                                    points=None if args.points is None else tuple(args.points), spread=args.spread,
                                    stages=options.parse_stages(args.stage), rule=args.rule,
                                    trials=args.trials, delta=args.delta, statistic=args.statistic,
                                    upper_batches=args.upper_batches, mc_seed=args.mc_seed, out=args.out,
                                    figure=args.figure, device=args.device)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    args = build_parser(prog).parse_args(argv)
    if one_run_requested(args):
        return one_run_main(args)
    command = command_of(args)
    run = runs.open_run(command.run, command.models_dir, command.data_root)
    config = run.config
    if not config.private or config.noise_multiplier == 0:
        raise UsageError("--run", f"{run.name} is trained without noise: it has no privacy to audit")
    rule = command.rule or config.update_rule
    points = None if command.points is None else parse_points(command.points, len(run.dataset.train_y), config.seed)
    seed = config.seed if command.mc_seed is None else command.mc_seed
    request = audit_simulation.AuditRequest(rule=rule, trials=command.trials, delta=command.delta, statistic=command.statistic,
                                            upper_batches=command.upper_batches, seed=seed, points=points, spread=command.spread)
    out, figure = audit_simulation.output_paths(command.out, command.figure, run.name, rule)
    steps = runs.resolve_stages(command.stages, run.saved_steps(), config.total_steps)

    started = time.time()
    frames = [audit_simulation.audit_checkpoint(run, step, request, command.device) for step in steps]
    rows = pd.concat(frames, ignore_index=True)
    fileio.write_csv(out, rows)
    last = rows[rows["step"] == steps[-1]]
    audit_plots.plot_audit_bounds(last["eps_lower"].to_numpy(), last["eps_upper"].to_numpy(),
                                  last["correct"].to_numpy().astype(bool), figure, delta=command.delta,
                                  title=f"Audit of {run.name}\nstep {steps[-1]}, {rule} rule",
                                  upper_kind=last["upper_kind"].iloc[0])

    gaps = audit_simulation.gap_summary(rows, Mechanism.of_run(config)) if rule == "mean" else {}
    for line in audit_simulation.report_lines(rows, out, gaps):
        print(line)
    print(f"audited {rows['point'].nunique()} points at {len(steps)} checkpoint(s) of {run.name} in "
          f"{time.time() - started:.0f}s; wrote {out} and {figure}")
    wrong_baseline = any(gap["above_baseline"] for gap in gaps.values())
    return 1 if np.any(rows["violated"]) or wrong_baseline else 0


def one_run_requested(args: argparse.Namespace) -> bool:
    """Whether the parsed audit.py flags ask for a one-run mode (or its self-test)."""
    return args.one_run or args.self_test or args.in_scores is not None or args.out_scores is not None


def one_run_main(args: argparse.Namespace) -> int:
    """audit.py in a one-run mode (perinstance/audit/one_run.py, canary_audit.py, self_test.py): the parsed flags
    `args`."""
    if args.self_test:
        if args.run is not None or args.one_run or args.in_scores is not None or args.out_scores is not None:
            raise UsageError("--self-test", "trains and audits its own runs: drop --run, --one-run and the scores")
        training_flags = options.parse_training_flags([*self_test.SELF_TEST_FLAGS, "--data-root", args.data_root])
        lines, behaved = self_test.self_test(training_flags=training_flags, significance=args.significance,
                                             delta=args.delta)
        for line in lines:
            print(line)
        return 0 if behaved else 1
    if args.one_run:
        if args.run is None:
            raise UsageError("--one-run", "needs --run NAME (a run trained with --canaries)")
        if args.in_scores is not None or args.out_scores is not None:
            raise UsageError("--in-scores", "give either --in-scores/--out-scores or --run with --one-run, not both")
        started = time.time()
        config, rows = canary_audit.audit_run(args.run, args.models_dir, significance=args.significance,
                                              delta=args.delta)
        out = args.out or os.path.join("res", f"{config.run}_one_run_audit.csv")
        fileio.write_csv(out, rows, flag="--out")
        for line in canary_audit.table_lines(config, rows):
            print(line)
        print(f"audited {rows['canaries'].sum()} canaries in {len(rows)} groups in {time.time() - started:.1f}s; "
              f"wrote {out}")
        violated = rows[rows["violated"]]
        if len(violated):
            print("VIOLATION: the canaries reject the accountant's trade-off curve for "
                  + ", ".join(f"the {row.kind} canaries of norm {row.norm:g}" for row in violated.itertuples())
                  + " (the accounting, or the training code, is wrong)")
        return 1 if len(violated) else 0
    if args.in_scores is None or args.out_scores is None:
        missing = "--out-scores" if args.out_scores is None else "--in-scores"
        raise UsageError(missing, "the scores of the held-out canaries (one number a line, or .npy) are needed too"
                         if missing == "--out-scores" else "the scores of the held-in canaries are needed too")
    if args.run is not None:
        raise UsageError("--run", "scores from files audit no run: drop --run (or use --run NAME --one-run)")
    bounds = one_run.score_bounds(one_run.read_scores(args.in_scores, "--in-scores"),
                                  one_run.read_scores(args.out_scores, "--out-scores"),
                                  significance=args.significance, delta=args.delta)
    for name, value in bounds.items():
        print(f"{name}: {value:.6f}")
    return 0

"""Train a model with DP-SGD and save checkpoints to models/<save-name>/.

    python train_dpsgd.py                      # LeNet-5 on the shipped MNIST subset, ε = 10
    python train_dpsgd.py --sigma 1.0 --reduction mean --batch-size 512
    python train_dpsgd.py --seeds 0-15         # 16 runs, one folder each (composition over runs, §4)
    torchrun --nproc-per-node 4 train_dpsgd.py --seeds 0-15 --device auto   # the 16 runs over 4 processes
    torchrun --nproc-per-node 4 train_dpsgd.py --track-points all   # one run, its tracked points over 4 processes

The mechanism is accounting.md §1: Poisson sampling with q = batch_size/N, per-sample
transform h (flat clipping, psac or psasc) bounded by Γ, Gaussian noise of std σΓ,
sum or mean update rule. Rerunning the same command resumes an interrupted run (every run
of --seeds / --less-points resumes on its own). --track-points records Δ* = ||h(g)||, the loss and
the correctness of those points at the parameters every step starts from, and at the final ones
(models/<run>/tracked_norms.csv, .parquet past 100,000 rows): composed, a bound along the run
(accounting.md §4). Under torchrun with fewer runs than processes, every process follows each
run in lockstep and measures its share of the tracked points.
"""

import dataclasses
import math
import time
from collections.abc import Sequence

from perinstance.cli.options import HELP_FORMAT, Parser, add_training_args, parse_seeds, training_flags
from perinstance.errors import UsageError
from perinstance.files import checkpoints
from perinstance.train import distributed, run_plan, runs, training
from perinstance.train.data import load_dataset
from perinstance.train.points import parse_points

# Runs named in a rank's summary line before it says "and N more".
RUNS_NAMED = 8


def build_parser(prog: str | None = None) -> Parser:
    parser = Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT)
    add_training_args(parser)
    several = parser.add_argument_group("several runs (spread over the processes under torchrun)")
    several.add_argument("--seeds", nargs="+", default=None,
                         help="one run per seed, instead of --seed: 0-15, 0 1 2, 0,4,8")
    several.add_argument("--less-points", nargs="+", default=None,
                         help="leave-one-out runs for the add direction: one run without each of these points "
                              "(as --points: 0-9, random:N), for every seed")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    args = build_parser(prog).parse_args(argv)
    world = distributed.World.from_env()
    planned = run_list(args.seeds, args.less_points, training_flags(vars(args)))
    distributed.make_deterministic(args.device)

    started = time.time()
    if in_lockstep(world, planned):
        with distributed.process_group(world, args.device):
            for run_args in planned:
                outcome = training.train(run_args, quiet=world.rank > 0, world=world)
                print(summary(outcome) if world.rank == 0 else
                      f"{world.label}: {outcome.run.run}: measured {len(world.share(outcome.run.tracked_points))} of "
                      f"{len(outcome.run.tracked_points)} tracked points at {measured_steps(outcome.run)} in "
                      f"{outcome.tracking_seconds:.1f}s "
                      "(rank 0 trains and writes)", flush=True)
        print(f"{world.label}: {len(planned)} run(s) in lockstep, the tracked points shared over {world.size} "
              f"processes; {time.time() - started:.1f}s", flush=True)
        return
    mine = world.share(planned)
    trained = 0
    for run_args in mine:
        outcome = training.train(run_args, quiet=world.size > 1)
        trained += outcome.trained
        print(summary(outcome), flush=True)
    if len(planned) > 1 or world.launched:
        names = ", ".join(run_label(run_args) for run_args in mine[:RUNS_NAMED])
        more = f" and {len(mine) - RUNS_NAMED} more" if len(mine) > RUNS_NAMED else ""
        print(f"{world.label}: {len(mine)} of {len(planned)} runs ({names or 'none'}{more}): {trained} trained, "
              f"{len(mine) - trained} already trained; {time.time() - started:.1f}s", flush=True)


def in_lockstep(world: distributed.World, planned: Sequence[run_plan.TrainingFlags]) -> bool:
    """Whether every process goes through every run together, each measuring its share of the tracked points (a
    filtered run tracks every point): under torchrun with fewer runs than processes (with as many, each process
    trains its own runs whole)."""
    return world.size > 1 and len(planned) < world.size and (planned[0].track_points is not None or planned[0].filtered)


def run_list(seeds: Sequence[str] | None, less_points: Sequence[str] | None,
             flags: run_plan.TrainingFlags) -> list[run_plan.TrainingFlags]:
    """The training flags (run_plan.TrainingFlags) of every run asked for: one per (seed, left-out point)
    of --seeds and --less-points, in a fixed order; each is the run `--seed S --less-point I` names."""
    seeds = [flags.seed] if seeds is None else parse_seeds(seeds)
    left_out = [flags.less_point]
    if less_points is not None:
        if flags.less_point is not None:
            raise UsageError("--less-points", "give either --less-point or --less-points, not both")
        universe = len(load_dataset(flags.dataset, flags.data_root, class_labels=flags.loss is None).train_y)
        left_out = parse_points(less_points, universe, flags.seed, flag="--less-points").tolist()
    planned = [dataclasses.replace(flags, seed=seed, less_point=less_point) for less_point in left_out for seed in seeds]
    if len(planned) > 1 and flags.save_name is not None:
        raise UsageError("--save-name", f"names one run folder, but {len(planned)} runs were asked for; leave it out "
                                        "(each run's name comes from its flags) or tag them with --id")
    return planned


def run_label(run_args: run_plan.TrainingFlags) -> str:
    return f"seed {run_args.seed}" + ("" if run_args.less_point is None else f" without {run_args.less_point}")


def measured_steps(run: runs.RunConfig) -> str:
    """How often a run measures its tracked points."""
    return "every step" if run.measure_every == 1 else f"every {run.measure_every} steps"


def summary(outcome: training.Outcome) -> str:
    """One line per run: what was done, its privacy parameters, accuracy and checkpoints."""
    run = outcome.run
    steps = checkpoints.saved_steps(outcome.run_dir)
    privacy = ("non-private" if not run.private else
               f"sigma={run.noise_multiplier:.4g} q={run.sample_rate:.4g} delta={run.delta:g}"
               + (f" (target eps={run.target_eps:g})" if run.target_eps else ""))
    status = f"trained steps {outcome.resumed_from + 1}-{run.total_steps} in {outcome.train_seconds:.1f}s" \
        if outcome.trained else "already trained"
    tracked = ""
    if run.tracked_points is not None and outcome.trained:
        # What the every-step norms cost against the steps themselves (benchmarks/bench_tracking.py measures it).
        tracked = (f"; tracked {len(run.tracked_points)} points at {measured_steps(run)} in "
                   f"{outcome.tracking_seconds:.1f}s, "
                   f"{outcome.tracking_seconds / max(outcome.steps_seconds, 1e-9):.2f}× the "
                   f"{outcome.steps_seconds:.1f}s of the training steps")
    if math.isnan(outcome.final_test_accuracy):  # the targets are not class labels (a --loss of one's own)
        tested = "no test accuracy (the targets are not class labels)" + \
            ("" if math.isnan(outcome.final_test_loss) else f"; test loss {outcome.final_test_loss:.4g}")
    else:
        tested = f"test accuracy {outcome.final_test_accuracy:.4f}"
    bounds = f"; {outcome.point_bounds}" if outcome.point_bounds else ""
    return f"{run.run}: {status}; {privacy}; {tested}; {len(steps)} checkpoints in {outcome.run_dir}{tracked}{bounds}"


"""Measure how much one training point changes a DP-SGD update at saved checkpoints (accounting.md §2).

    python compute_sensitivity.py --run RUN --reduction mean --points 0-9 --stage final --res-name lenet_mean
    python compute_sensitivity.py --exp eps_delta --reduction sum --points all --stage all --res-name lenet_sum

--reduction sum: Δ* = ||h(g*)|| per point and checkpoint. --reduction mean (coupling, the default
estimator): the dataset statistics d*, v_X, b_X of each point and --num-batches draws of Δ_B from
batches of every size k >= k_min, each with its k (accounting.md §3.2, §3.4; --histogram-precision R
stores them as histograms rounded up by at most 1 + R, an upper bound); --estimator jensen
--exp renyi: GLA's statistic S. --run names a run (its run.json supplies the training flags);
without it the training flags name the run, and a run without checkpoints is trained first
(unless --no-train). Rows go to <res-dir>/<res-name>.csv (.parquet once the file holds more than
100,000 rows, or as named by an extension); rerunning adds only what is missing, so
an interrupted run resumes, and another --mc-seed adds an independent set of rows.

    torchrun --nproc-per-node 4 compute_sensitivity.py --points all --stage all --res-name x ...

splits the checkpoints × chunks of --part-points points over the processes; each writes its own
part files and the last to finish merges them into the result file (perinstance/measure/sharded.py).
"""

import argparse
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import pandas as pd

from perinstance.accounting.guarantees import Direction
from perinstance.cli import options
from perinstance.cli.options import (
    HELP_FORMAT,
    Parser,
    add_alpha_argument,
    add_training_args,
    non_negative_int,
    parse_training_flags,
    positive_float,
    probability,
    training_flag,
    training_flags,
)
from perinstance.errors import UsageError
from perinstance.files import results, storage
from perinstance.files.result_file import ResultFile
from perinstance.measure import measurement, poisson_batches, sharded
from perinstance.measure.measurement import COUPLING, DEFAULT_NUM_BATCHES, JENSEN, MIN_GRID_SIZES, Measurement
from perinstance.train import distributed, planned_run, run_plan, runs
from perinstance.train.points import parse_points

# The result file is rewritten whole on each write, so rows are written at most this often (and at the end or
# on an interruption): a kill loses at most this much measuring, and many checkpoints do not cost a quadratic
# number of rewritten rows.
WRITE_EVERY_SECONDS = 60


def build_parser(prog: str | None = None) -> Parser:
    return add_measurement_args(Parser(prog=prog, description=__doc__, formatter_class=HELP_FORMAT))


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = vars(build_parser(prog).parse_args(argv))
    given = given_flags(argv)

    # Every flag is checked before anything is trained, measured or written.
    command = parse_command(flags, given)
    run = find_run(command.run, command.training, given)
    request = command.request.for_run(run.config, estimator_given="estimator" in given)
    points = parse_points(command.points, run.universe, run.config.seed)
    result_file = ResultFile.open(request.res_path, request.overwrite, results.run_columns(run.config, request.rule),
                                  automatic=request.automatic_format)
    if command.no_train:
        require_finished(run)
    world = distributed.World.from_env()
    distributed.make_deterministic(command.device)
    if world.launched:
        with distributed.process_group(world, command.device):
            return sharded.measure(world, request, run, points, result_file, part_points=command.part_points,
                                   device=command.device)

    started = time.time()
    config = planned_run.ensure_trained(run)
    steps = runs.resolve_stages(request.stages, run.saved_steps(), config.total_steps)
    written, skipped, pending, last_write = 0, 0, [], time.time()
    try:
        for step in steps:
            missing = result_file.missing(config.run, step, points, request)
            skipped += sum(len(points) - len(todo) for todo in missing.values())
            needed = sorted(set().union(*missing.values()))
            if not needed:
                continue
            pending.append(measurement.keep_missing(
                measurement.measure_checkpoint(request, run, step, needed, command.device), missing))
            written += len(pending[-1])
            if time.time() - last_write >= WRITE_EVERY_SECONDS:
                result_file.add(pd.concat(pending, ignore_index=True))
                pending, last_write = [], time.time()
    finally:
        # Checkpoints measured before an interruption or an error are kept: a rerun skips them.
        if pending:
            result_file.add(pd.concat(pending, ignore_index=True))

    print(f"{config.run}: {len(points)} points × {len(steps)} stages (steps {', '.join(map(str, steps))}): "
          f"{written} rows written to {result_file.describe()}, {skipped} (point, stage, experiment) combinations "
          f"already there skipped; {time.time() - started:.1f}s")


# --- flags ---------------------------------------------------------------------------------

def add_measurement_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("measurement")
    group.add_argument("--run", default=None,
                       help="the run to measure: a name in --models-dir, or a folder (a path with a /); its run.json "
                            "supplies every training flag. A run that does not exist yet is trained from the flags")
    group.add_argument("--exp", default="eps_delta", choices=("eps_delta", "renyi"),
                       help="what the accountant will compute: an (ε, δ) or a Rényi guarantee; only the jensen "
                            "estimator measures something else for each")
    group.add_argument("--estimator", default=COUPLING, choices=(COUPLING, JENSEN),
                       help="mean rule: coupling (Δ_B of batches of every size, and the dataset statistics; "
                            "accounting.md §3.2), or jensen: GLA's statistic S, with --exp renyi, to reproduce the paper")
    group.add_argument("--points", nargs="+", required=True,
                       help="training points: indices (0 1 2), ranges (0-99), all, random:N (seeded by the run's seed)")
    group.add_argument("--stage", nargs="+", default=["final"],
                       help="checkpoints: fractions of training in [0, 1] (nearest saved checkpoint), "
                            "initial, middle, final, or all")
    group.add_argument("--res-name", required=True,
                       help="rows go to <res-dir>/<res-name>.csv, or .parquet once the file holds more than "
                            f"{storage.AUTO_PARQUET_ROWS:,} rows; a name ending in .csv or .parquet fixes the format")
    group.add_argument("--res-dir", default="res", help="folder of the result files")
    group.add_argument("--mc-seed", type=non_negative_int, default=None,
                       help="seed of every Monte-Carlo draw (default: the run's seed); another value gives an "
                            "independent set of rows in the same file")
    group.add_argument("--num-batches", type=int, default=None,
                       help=f"mean rule: Δ_B draws per point before rejection (coupling, default "
                            f"{DEFAULT_NUM_BATCHES[COUPLING]:,}; 0: the dataset statistics only, for the certified "
                            f"bound); sets of α batches per target batch (jensen, default {DEFAULT_NUM_BATCHES[JENSEN]})")
    group.add_argument("--mc-blocks", type=int, default=4,
                       help="coupling: independent blocks the draws are split into (their spread is reported)")
    group.add_argument("--size-delta", type=probability, default=None,
                       help="coupling: δ_size, the probability of the batch sizes below k_min left out "
                            "(accounting.md §3.4; default δ/(10·T) of the run)")
    group.add_argument("--max-sizes", type=int, default=MIN_GRID_SIZES,
                       help=f"coupling: most grid sizes in [k_min, k_hi] (>= {MIN_GRID_SIZES}; every size when "
                            "there are fewer)")
    group.add_argument("--histogram-precision", type=positive_float, default=None, metavar="R",
                       help="coupling: store the Δ_B samples as histograms, each rounded UP onto the grid Γ·(1+R)^-j "
                            "(at most a factor 1+R, an upper bound for every accountant; docs/sensitivity.md), one "
                            "row per value and size with its count; R in (0, 1], e.g. 0.01")
    add_alpha_argument(group, [8.0], "--estimator jensen only: the Rényi order α of GLA's statistic, one integer "
                                     ">= 2 (default 8)")
    group.add_argument("--num-iters", type=int, default=20, help="jensen: target batches B_0")
    group.add_argument("--direction", default="both", choices=("remove", "add", "both"),
                       help="jensen: D(P||Q) (remove), D(Q||P) (add) or both")
    group.add_argument("--no-train", action="store_true", help="fail instead of training a run that has no checkpoints")
    group.add_argument("--part-points", type=int, default=None,
                       help="under torchrun: points per unit of work and part file (default 1024 for the sum rule, "
                            "all points of a checkpoint for the mean rule; perinstance/measure/sharded.py)")
    # --reduction (the rule analysed; without --run also the one the run is trained with),
    # --seed (the run's seed) and --overwrite (of the result file here) come with the training flags.
    add_training_args(parser)
    return parser


def given_flags(argv: Sequence[str]) -> dict[str, object]:
    """The flags given on the command line `argv`, by destination, with their values: what a run's
    run.json must agree with, and what overrides its defaults."""
    not_given = object()  # not a string: argparse would run a string default through the flag's type
    parser = add_measurement_args(Parser())
    parser.set_defaults(**{action.dest: not_given for action in parser._actions if action.dest != "help"})
    return {dest: value for dest, value in vars(parser.parse_args(argv)).items() if value is not not_given}


def training_defaults() -> dict[str, object]:
    """Every training flag's destination and default."""
    return parse_training_flags().as_dict()


@dataclass(frozen=True)
class SensitivityCommand:
    """compute_sensitivity.py's flags, typed: the measurement `request`, the run (--run, or the
    `training` flags), the points, and how to run it."""

    request: Measurement
    run: str | None
    training: run_plan.TrainingFlags
    points: tuple
    no_train: bool
    part_points: int | None
    device: str


def parse_command(flags: Mapping, given: Mapping[str, object]) -> SensitivityCommand:
    """The command that the parsed flags (a mapping of destination to value) and the flags `given`
    (given_flags) make, checked before the run or the dataset is touched."""
    return SensitivityCommand(request=parse_request(flags, given), run=flags["run"],
                   training=training_flags(flags), points=tuple(flags["points"]),
                   no_train=bool(flags["no_train"]), part_points=flags["part_points"], device=flags["device"])


def parse_request(flags: Mapping, given: Mapping[str, object]) -> Measurement:
    """The measurement flags (a mapping of destination to value), checked."""
    num_batches, estimator, alpha = flags["num_batches"], flags["estimator"], flags["alpha"]
    if num_batches is not None and (num_batches < 0 or (num_batches == 0 and estimator == JENSEN)):
        raise UsageError("--num-batches", f"must be > 0 (or 0 with the coupling estimator: statistics only), "
                                          f"got {num_batches}")
    for flag, name in (("--num-iters", "num_iters"), ("--mc-blocks", "mc_blocks")):
        if flags[name] <= 0:
            raise UsageError(flag, f"must be > 0, got {flags[name]}")
    if flags["max_sizes"] < MIN_GRID_SIZES:
        raise UsageError("--max-sizes", f"must be >= {MIN_GRID_SIZES} (accounting.md §3.2), got {flags['max_sizes']}")
    if estimator == JENSEN and flags["exp"] != "renyi":
        raise UsageError("--estimator", "jensen is GLA's Rényi statistic S: use it with --exp renyi (the mean "
                                        "rule's (ε, δ) comes from the coupling samples)")
    if "alpha" in given and estimator != JENSEN:
        raise UsageError("--alpha", "is the order of GLA's statistic and belongs to --estimator jensen; the coupling "
                                    "estimator and the sum rule measure no order (the accountants take --alpha)")
    if estimator == JENSEN and not (len(alpha) == 1 and alpha[0].is_integer() and alpha[0] >= 2):
        raise UsageError("--alpha", "the mean-rule Rényi statistic is measured at one integer order >= 2, got "
                                    + " ".join(f"{order:g}" for order in alpha))
    precision = flags["histogram_precision"]
    if precision is not None and not precision <= 1:
        raise UsageError("--histogram-precision", f"must be in (0, 1] (a relative rounding, e.g. 0.01), "
                                                  f"got {precision:g}")
    res_name = flags["res_name"]
    if not res_name.strip() or res_name != os.path.basename(res_name):
        raise UsageError("--res-name", f"{res_name!r} must be a plain file name (rows go to <res-dir>/<res-name>.csv)")
    directions = poisson_batches.DIRECTIONS if flags["direction"] == "both" else (Direction(flags["direction"]),)
    # Without --run the training flags name the run, --reduction included.
    rule = flags["reduction"] if flags["run"] is None or "reduction" in given else None
    return Measurement(exp=flags["exp"], rule=rule, estimator=estimator, stages=options.parse_stages(flags["stage"]),
                   alpha=int(alpha[0]) if estimator == JENSEN else None, num_batches=num_batches,
                   num_iters=flags["num_iters"], directions=directions, mc_seed=flags["mc_seed"],
                   mc_blocks=flags["mc_blocks"], size_delta=flags["size_delta"], max_sizes=flags["max_sizes"],
                   res_path=results.results_path(res_name, flags["res_dir"]), overwrite=bool(flags["overwrite"]),
                   automatic_format=storage.extension(res_name) is None, histogram_precision=precision)


# --- the run --------------------------------------------------------------------------------


def find_run(name: str | None, training_args: run_plan.TrainingFlags,
             given: Mapping[str, object]) -> planned_run.PlannedRun:
    """The run named by --run `name` (None: by the training flags `training_args`), checked against
    what is on disk; nothing is written."""
    if name is not None:
        training_args = named_run_args(name, training_args, given)
    # --overwrite belongs to the result file here: never retrain a run because of it.
    return planned_run.plan(replace(training_args, overwrite=0))


def named_run_args(run: str, training_args: run_plan.TrainingFlags,
                   given: Mapping[str, object]) -> run_plan.TrainingFlags:
    """The training flags of the run that --run names: its run.json's when it exists, else the
    flags given (the run is then trained under that name). A training flag given explicitly must
    agree with run.json, except --reduction: the rule analysed may differ from the rule trained
    (the rows' update_rule keeps the trained one)."""
    if "save_name" in given:
        raise UsageError("--save-name", "--run names the run already; leave --save-name out")
    run_dir = runs.run_folder(run, training_args.models_dir)
    models_dir, save_name = os.path.split(run_dir)
    training_args = replace(training_args, models_dir=models_dir, save_name=save_name)
    path = runs.run_file(run_dir)
    if not os.path.exists(path):
        return training_args
    recorded = runs.load_run(run_dir).flags
    for dest, value in given.items():
        if dest in recorded and dest != "reduction" and value != recorded[dest]:
            raise UsageError(training_flag(dest), f"given {value!r}, but {path} has {recorded[dest]!r}")
    known = training_args.as_dict()
    return replace(training_args, **{dest: value for dest, value in recorded.items() if dest in known})


def require_finished(run: planned_run.PlannedRun) -> None:
    """--no-train: a run without its final checkpoint is an error that says how to train it."""
    if run.finished:
        return
    steps = run.saved_steps()
    state = f"no checkpoints in {run.run_dir}" if not steps else \
        f"{run.run_dir} is trained up to step {steps[-1]} of {run.config.total_steps}"
    raise UsageError("--no-train", f"{state}; train first: {training_command(run.training_args, training_defaults())}")


def training_command(args: run_plan.TrainingFlags, defaults: Mapping[str, object]) -> str:
    """The train_dpsgd.py command line for the training flags that differ from their defaults."""
    words = ["python", "train_dpsgd.py"]
    for dest, default in defaults.items():
        value = getattr(args, dest)
        if value == default or dest == "overwrite":
            continue
        flag = training_flag(dest)
        words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return shlex.join(words)



"""compute_sensitivity.py's flags as one typed command, the run it measures and the stages it resolves
to checkpoints. The rows of a checkpoint are perinstance/measure/measurement.py's, the result file
perinstance/files/result_file.py's."""

import argparse
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from perinstance.accounting.guarantees import Direction
from perinstance.errors import UsageError
from perinstance.files import results, storage
from perinstance.measure import poisson_batches
from perinstance.measure.measurement import COUPLING, JENSEN, NO_DIRECTION, NORM
from perinstance.train import run_plan, runs, training
from perinstance.train.data import load_dataset, without_point
from perinstance.train.options import (
    Parser,
    add_alpha_argument,
    add_training_args,
    non_negative_int,
    positive_float,
    probability,
    training_flag,
)

STAGE_NAMES = ("initial", "middle", "final", "all")
# Defaults of --num-batches: Δ_B draws per point (coupling), or sets of α batches per target (jensen).
DEFAULT_NUM_BATCHES = {COUPLING: 10_000, JENSEN: 100}
# accounting.md §3.2: every size of [k_min, k_hi], or at least 32 grid sizes.
MIN_GRID_SIZES = 32


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
                            "all points of a checkpoint for the mean rule; perinstance/accountants/sharded.py)")
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
    return run_plan.TrainingFlags.parse().as_dict()


@dataclass(frozen=True)
class Request:
    """What to measure, validated. `reduction`, `mc_seed`, `size_delta` and `num_batches` may be
    None until `for_run` fills them from the run (its trained rule, seed, δ and T)."""

    exp: str
    reduction: str | None
    estimator: str
    stages: list
    alpha: int | None
    num_batches: int | None
    num_iters: int
    directions: tuple
    mc_seed: int | None
    mc_blocks: int
    size_delta: float | None
    max_sizes: int
    res_path: str
    overwrite: bool
    automatic_format: bool = False  # --res-name without .csv/.parquet: CSV, Parquet when large
    histogram_precision: float | None = None  # coupling: Δ_B stored as histograms (storage.histogram_rows)

    @property
    def family(self) -> str:
        """What the rows measure, their `exp`: norm (sum rule), coupling or jensen (mean rule)."""
        return NORM if self.reduction == "sum" else self.estimator

    def for_run(self, config: runs.RunConfig, given: Mapping[str, object]) -> "Request":
        """The request completed from the run: the rule analysed defaults to the rule trained (with
        --run), the Monte-Carlo seed to the run's seed, δ_size to δ/(10·T) (accounting.md §3.4)."""
        reduction = self.reduction or config.update_rule
        if reduction == "sum" and "estimator" in given:
            raise UsageError("--estimator", "the sum rule has no estimator: Δ* is measured exactly "
                                            "(use --reduction mean)")
        jensen = reduction == "mean" and self.estimator == JENSEN
        if self.histogram_precision is not None and (reduction == "sum" or jensen):
            raise UsageError("--histogram-precision", "only the mean rule's Δ_B samples (--reduction mean, coupling "
                                                      "estimator) are stored as histograms")
        return replace(
            self, reduction=reduction,
            mc_seed=None if reduction == "sum" else config.seed if self.mc_seed is None else self.mc_seed,
            size_delta=self.size_delta or config.delta / (10 * config.total_steps),
            num_batches=DEFAULT_NUM_BATCHES[self.estimator] if self.num_batches is None else self.num_batches,
            alpha=self.alpha if jensen else None, directions=self.directions if jensen else (NO_DIRECTION,))


@dataclass(frozen=True)
class Command:
    """compute_sensitivity.py's flags, typed: the measurement `request`, the run (--run, or the
    `training` flags), the points, and how to run it."""

    request: Request
    run: str | None
    training: run_plan.TrainingFlags
    points: tuple
    no_train: bool
    part_points: int | None
    device: str


def parse_command(flags: Mapping, given: Mapping[str, object]) -> Command:
    """The command that the parsed flags (a mapping of destination to value) and the flags `given`
    (given_flags) make, checked before the run or the dataset is touched."""
    return Command(request=parse_request(flags, given), run=flags["run"],
                   training=run_plan.TrainingFlags.from_flags(flags), points=tuple(flags["points"]),
                   no_train=bool(flags["no_train"]), part_points=flags["part_points"], device=flags["device"])


def parse_request(flags: Mapping, given: Mapping[str, object]) -> Request:
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
    reduction = flags["reduction"] if flags["run"] is None or "reduction" in given else None
    return Request(exp=flags["exp"], reduction=reduction, estimator=estimator, stages=parse_stages(flags["stage"]),
                   alpha=int(alpha[0]) if estimator == JENSEN else None, num_batches=num_batches,
                   num_iters=flags["num_iters"], directions=directions, mc_seed=flags["mc_seed"],
                   mc_blocks=flags["mc_blocks"], size_delta=flags["size_delta"], max_sizes=flags["max_sizes"],
                   res_path=results.results_path(res_name, flags["res_dir"]), overwrite=bool(flags["overwrite"]),
                   automatic_format=storage.extension(res_name) is None, histogram_precision=precision)


def parse_stages(tokens: Sequence[str]) -> list[str | float]:
    """`--stage` tokens as stage names or fractions in [0, 1]."""
    stages = []
    for token in tokens:
        if token in STAGE_NAMES:
            stages.append(token)
            continue
        try:
            fraction = float(token)
        except ValueError:
            raise UsageError("--stage", f"unknown stage {token!r} (allowed: fractions in [0, 1], "
                                        f"{', '.join(STAGE_NAMES)})") from None
        if not 0 <= fraction <= 1:
            raise UsageError("--stage", f"{token} is outside [0, 1]")
        stages.append(fraction)
    return stages


def resolve_stages(stages: Sequence[str | float], saved_steps: Sequence[int], total_steps: int) -> list[int]:
    """Checkpoint steps for the stages: a fraction f maps to the saved step nearest f·T (ties to the
    earlier), middle to the one nearest T/2, initial/final to the first/last, all to every one."""
    chosen = set()
    for stage in stages:
        if stage == "all":
            chosen.update(saved_steps)
        elif stage == "initial":
            chosen.add(saved_steps[0])
        elif stage == "final":
            chosen.add(saved_steps[-1])
        else:
            fraction = 0.5 if stage == "middle" else stage
            chosen.add(min(saved_steps, key=lambda step: (abs(step - fraction * total_steps), step)))
    return sorted(chosen)


# --- the run --------------------------------------------------------------------------------

@dataclass
class Run(runs.OpenRun):
    """The training run the flags name; its config is planned from the flags until the run is
    trained, then read from its run.json."""

    training_args: run_plan.TrainingFlags
    finished: bool


def find_run(name: str | None, training_args: run_plan.TrainingFlags, given: Mapping[str, object]) -> Run:
    """The run named by --run `name` (None: by the training flags `training_args`), checked against
    what is on disk; nothing is written."""
    if name is not None:
        training_args = named_run_args(name, training_args, given)
    # --overwrite belongs to the result file here: never retrain a run because of it.
    training_args = run_plan.resolve_training_args(replace(training_args, overwrite=0))
    name, root, less_point = training_args.dataset, training_args.data_root, training_args.less_point
    dataset = load_dataset(name, root)
    run_data = dataset if less_point is None else without_point(dataset, less_point)
    planned = run_plan.plan_run(training_args, run_data)
    run_dir = run_plan.run_dir_for(training_args)
    run = Run(run_dir, planned, dataset, run_data.train_x, run_data.train_y, training_args, finished=False)
    if os.path.exists(runs.run_file(run_dir)):
        existing = runs.load_run(run_dir)
        check_same_run(run_dir, existing, planned)
        run.config = existing
        run.finished = existing.total_steps in run.saved_steps()
    return run


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


def require_finished(run: Run) -> None:
    """--no-train: a run without its final checkpoint is an error that says how to train it."""
    if run.finished:
        return
    steps = run.saved_steps()
    state = f"no checkpoints in {run.run_dir}" if not steps else \
        f"{run.run_dir} is trained up to step {steps[-1]} of {run.config.total_steps}"
    raise UsageError("--no-train", f"{state}; train first: {training_command(run.training_args, training_defaults())}")


def check_same_run(run_dir: str, existing: runs.RunConfig, planned: runs.RunConfig) -> None:
    """The run on disk was trained with these flags on this dataset (fingerprints equal)."""
    differing = run_plan.run_differences(existing, planned)
    if differing:
        raise UsageError("--save-name", f"{run_dir} holds a run that differs in {', '.join(differing)}; "
                                        "give the flags it was trained with, or another --save-name")


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


def ensure_trained(run: Run) -> runs.RunConfig:
    """Train the run if it has no final checkpoint (as the paper repository did); returns its config."""
    if not run.finished:
        run.config = training.train(run.training_args).run
        run.finished = True
    return run.config

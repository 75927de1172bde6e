"""What compute_sensitivity.py needs besides the engine: its flags as one typed command, the run it
measures, the stages it resolves to checkpoints, the rows of one checkpoint, and the result file
it appends to."""

import math
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from perinstance import coupling, fileio, poisson_batches, results, runs, storage, training
from perinstance.console import progress_bar
from perinstance.data import load_dataset
from perinstance.errors import UsageError
from perinstance.gradient_rows import Transform, checkpoint_gradients, transformed_norms
from perinstance.guarantees import Direction
from perinstance.options import (
    Parser,
    add_alpha_argument,
    add_training_args,
    non_negative_int,
    positive_float,
    probability,
    training_flag,
)

STAGE_NAMES = ("initial", "middle", "final", "all")
NO_DIRECTION = Direction.NONE.value
# What a row measures, stored in its `exp` column: Δ* (sum rule), the coupling samples and
# dataset statistics (mean rule), GLA's statistic S (mean rule, --estimator jensen). The
# accountant (--exp) does not enter: eps_delta and renyi read the same Δ* or coupling rows.
NORM, COUPLING, JENSEN = "norm", "coupling", "jensen"
# Defaults of --num-batches: Δ_B draws per point (coupling), or sets of α batches per target (jensen).
DEFAULT_NUM_BATCHES = {COUPLING: 10_000, JENSEN: 100}
# accounting.md §3.2: every size of [k_min, k_hi], or at least 32 grid sizes.
MIN_GRID_SIZES = 32
# A row is identified by these; the first seven name a (run, stage, point, measurement) combination.
COMBINATION_COLUMNS = ["run", "step", "point", "exp", "direction", "alpha", "mc_seed"]
ROW_ORDER = COMBINATION_COLUMNS + ["quantity", "block", "target_batch", "sample"]
TEXT_COLUMNS = ["run", "exp", "reduction", "direction", "quantity", "dataset", "model", "clipping", "update_rule"]


# --- flags ---------------------------------------------------------------------------------

def add_measurement_args(parser):
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
                            "all points of a checkpoint for the mean rule; perinstance/sharded.py)")
    # --reduction (the rule analysed; without --run also the one the run is trained with),
    # --seed (the run's seed) and --overwrite (of the result file here) come with the training flags.
    add_training_args(parser)
    return parser


def given_flags(argv):
    """The flags given on the command line `argv`, by destination, with their values: what a run's
    run.json must agree with, and what overrides its defaults."""
    not_given = object()  # not a string: argparse would run a string default through the flag's type
    parser = add_measurement_args(Parser())
    parser.set_defaults(**{action.dest: not_given for action in parser._actions if action.dest != "help"})
    return {dest: value for dest, value in vars(parser.parse_args(argv)).items() if value is not not_given}


def training_defaults():
    """Every training flag's destination and default."""
    return runs.TrainingFlags.parse().as_dict()


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
    def family(self):
        """What the rows measure, their `exp`: norm (sum rule), coupling or jensen (mean rule)."""
        return NORM if self.reduction == "sum" else self.estimator

    def for_run(self, config, given):
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
    training: runs.TrainingFlags
    points: tuple
    no_train: bool
    part_points: int | None
    device: str


def parse_command(flags: Mapping, given):
    """The command that the parsed flags (a mapping of destination to value) and the flags `given`
    (given_flags) make, checked before the run or the dataset is touched."""
    return Command(request=parse_request(flags, given), run=flags["run"],
                   training=runs.TrainingFlags.from_flags(flags), points=tuple(flags["points"]),
                   no_train=bool(flags["no_train"]), part_points=flags["part_points"], device=flags["device"])


def parse_request(flags, given):
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


def parse_stages(tokens):
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


def resolve_stages(stages, saved_steps, total_steps):
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

    training_args: runs.TrainingFlags
    finished: bool


def find_run(name, training_args, given):
    """The run named by --run `name` (None: by the training flags `training_args`), checked against
    what is on disk; nothing is written."""
    if name is not None:
        training_args = named_run_args(name, training_args, given)
    # --overwrite belongs to the result file here: never retrain a run because of it.
    training_args = runs.resolve_training_args(replace(training_args, overwrite=0))
    name, root, less_point = training_args.dataset, training_args.data_root, training_args.less_point
    dataset = load_dataset(name, root)
    run_data = dataset if less_point is None else load_dataset(name, root, less_point)
    planned = runs.plan_run(training_args, run_data)
    run_dir = runs.run_dir_for(training_args)
    run = Run(run_dir, planned, dataset, run_data.train_x, run_data.train_y, training_args, finished=False)
    if os.path.exists(runs.run_file(run_dir)):
        existing = runs.load_run(run_dir)
        check_same_run(run_dir, existing, planned)
        run.config = existing
        run.finished = existing.total_steps in run.saved_steps()
    return run


def named_run_args(run, training_args, given):
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


def require_finished(run):
    """--no-train: a run without its final checkpoint is an error that says how to train it."""
    if run.finished:
        return
    steps = run.saved_steps()
    state = f"no checkpoints in {run.run_dir}" if not steps else \
        f"{run.run_dir} is trained up to step {steps[-1]} of {run.config.total_steps}"
    raise UsageError("--no-train", f"{state}; train first: {training_command(run.training_args, training_defaults())}")


def check_same_run(run_dir, existing, planned):
    """The run on disk was trained with these flags on this dataset (fingerprints equal)."""
    differing = runs.run_differences(existing, planned)
    if differing:
        raise UsageError("--save-name", f"{run_dir} holds a run that differs in {', '.join(differing)}; "
                                        "give the flags it was trained with, or another --save-name")


def training_command(args, defaults):
    """The train_dpsgd.py command line for the training flags that differ from their defaults."""
    words = ["python", "train_dpsgd.py"]
    for dest, default in defaults.items():
        value = getattr(args, dest)
        if value == default or dest == "overwrite":
            continue
        flag = training_flag(dest)
        words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return shlex.join(words)


def ensure_trained(run):
    """Train the run if it has no final checkpoint (as the paper repository did); returns its config."""
    if not run.finished:
        run.config = training.train(run.training_args).run
        run.finished = True
    return run.config


# --- the result file --------------------------------------------------------------------------

def cell_text(value):
    """A cell as the CSV writes it, so that values read back compare equal to fresh ones."""
    if isinstance(value, float | np.floating):
        return "" if math.isnan(value) else f"{value:.10g}"
    return str(value)


class ResultFile:
    """res/<res-name>.csv or .parquet: rows already there, and locked, atomic merges of new rows.

    Several processes (two measurements, the ranks of one torchrun) may add to one file at once:
    each `add` takes the file's lock (fileio.locked on <res-dir>/<name without extension>, one
    lock whatever the format), reads the file as it is now, merges its rows in and rewrites the
    file atomically, so that no writer loses another's rows.

    `automatic`: named without an extension, the file is CSV while it holds at most
    storage.AUTO_PARQUET_ROWS rows, and Parquet from then on (the CSV is then removed).
    """

    def __init__(self, path, rows, config=None, replace_file=False, automatic=False):
        self.path = path  # where the rows are (a new file: where they will go)
        self.config = config  # run columns the rows must agree with (None: not checked)
        self.replace_file = replace_file  # --overwrite 1: the first add replaces the file's rows
        self.automatic = automatic
        self._keep(rows)

    def _keep(self, rows):
        self.rows = rows
        self.done = set(zip(*(self._texts(rows[column]) for column in COMBINATION_COLUMNS)))

    @staticmethod
    def _texts(values):
        """cell_text of every value, computed once per distinct value (a file may hold millions)."""
        codes, distinct = pd.factorize(values, use_na_sentinel=False)
        return np.asarray([cell_text(value) for value in distinct] or [""], dtype=object)[codes]

    @classmethod
    def open(cls, path, overwrite, config, automatic=False):
        """The file's rows (none with --overwrite 1), refusing rows of another run configuration.

        Checks first that its folder can take the file, and removes the temps that killed
        writes left there."""
        folder = os.path.dirname(path) or "."
        fileio.check_folder(folder, "--res-name")
        if os.path.isdir(path):
            raise UsageError("--res-name", f"{path} is a folder, not a result file")
        fileio.remove_stale_temps(folder)
        if overwrite or not os.path.exists(path):
            return cls(path, pd.DataFrame(columns=results.COLUMNS), config, replace_file=bool(overwrite),
                       automatic=automatic)
        return cls(path, cls._read(path, config), config, automatic=automatic)

    @staticmethod
    def _read(path, config):
        rows = results.read_results(path, flag="--res-name")
        rows[TEXT_COLUMNS] = rows[TEXT_COLUMNS].astype(str)
        texts = {} if config is None else {column: ResultFile._texts(rows[column]) for column in results.CONFIG_COLUMNS}
        differing = [f"column {column} has {'/'.join(sorted(set(text)))} in file, {cell_text(config[column])} now"
                     for column, text in texts.items() if (text != cell_text(config[column])).any()]
        if differing:
            raise UsageError("--res-name", f"refusing to mix: {'; '.join(differing)}; "
                                           "use another --res-name or --overwrite 1")
        return rows[results.COLUMNS]

    def missing(self, run_name, step, points, request):
        """{direction: points} whose rows at `step` are not in the file yet (COMBINATION_COLUMNS:
        what was measured and with which Monte-Carlo seed, not the flags that asked for it)."""
        alpha = np.nan if request.alpha is None else float(request.alpha)
        mc_seed = np.nan if request.mc_seed is None else request.mc_seed
        return {direction: [point for point in points
                            if tuple(map(cell_text, (run_name, step, point, request.family, direction, alpha, mc_seed)))
                            not in self.done]
                for direction in request.directions}

    def add(self, rows):
        """Merge `rows` into the file as it is now and rewrite it atomically, in a fixed row order,
        all under the file's lock; a row that another writer added meanwhile is kept once."""
        stem = os.path.splitext(self.path)[0]
        with fileio.locked(stem, "--res-name"):
            if self.automatic:  # another writer may have turned it Parquet meanwhile
                self.path = results.results_path(os.path.basename(stem), os.path.dirname(stem))
            if self.replace_file or not os.path.exists(self.path):
                current = pd.DataFrame(columns=results.COLUMNS)
            else:
                current = self._read(self.path, self.config)
            merged = pd.concat([frame for frame in (current, rows) if len(frame)] or [rows], ignore_index=True)
            keys = pd.DataFrame({column: self._texts(merged[column]) for column in ROW_ORDER})
            merged = merged[~keys.duplicated(keep="first").to_numpy()]
            merged = merged.sort_values(ROW_ORDER, kind="mergesort", na_position="last", ignore_index=True)
            target = self._target(len(merged))
            storage.write_frame(target, merged[results.COLUMNS], "--res-name")
            if target != self.path and os.path.exists(self.path):
                try:  # the rows live on in the Parquet file just written
                    os.remove(self.path)
                except OSError as error:
                    raise fileio.write_error(self.path, error, "--res-name") from None
            self.path = target
            self.replace_file = False
        self._keep(merged)

    def _target(self, rows):
        """Where `rows` rows go: an automatic name turns Parquet above storage.AUTO_PARQUET_ROWS
        rows and stays Parquet once it is (unless --overwrite 1 starts it afresh)."""
        if not self.automatic:
            return self.path
        stays = storage.extension(self.path) == storage.PARQUET and os.path.exists(self.path) and not self.replace_file
        ending = storage.PARQUET if rows > storage.AUTO_PARQUET_ROWS or stays else storage.CSV
        return os.path.splitext(self.path)[0] + ending

    def describe(self):
        """The file's path, and why an automatic name is Parquet (for the summary line)."""
        if not (self.automatic and storage.extension(self.path) == storage.PARQUET):
            return self.path
        stem = os.path.basename(os.path.splitext(self.path)[0])
        why = (f"more than {storage.AUTO_PARQUET_ROWS:,} rows" if len(self.rows) > storage.AUTO_PARQUET_ROWS
               else "the file was Parquet already")
        return f"{self.path} (Parquet: {why}; --res-name {stem}.csv keeps CSV)"


# --- measuring one checkpoint --------------------------------------------------------------------

def measure_checkpoint(request, run, step, points, device, blocks=None):
    """The rows of one checkpoint for `points` (every requested direction). Coupling under
    torchrun: `blocks`, the Monte-Carlo blocks of one part, and the dataset statistics with block 0."""
    config = run.config
    points = np.asarray(points)
    model, payload = training.load_model(config, run.run_dir, step, device)
    transform = Transform.of_run(config)
    point_x, point_y, point_rows = run.dataset.train_x[points], run.dataset.train_y[points], run.train_rows(points)
    statistics_only = request.family == COUPLING and request.num_batches == 0
    with progress_bar(len(points) if request.reduction == "sum" else len(run.train_y),
                      f"per-sample gradients, step {step}") as bar:
        if request.reduction == "sum":
            norms, predictions = transformed_norms(model, point_x, point_y, transform, device, bar)
        elif statistics_only:
            statistics, predictions = coupling.checkpoint_statistics(model, run.train_x, run.train_y, point_x,
                                                                     point_y, point_rows, transform, device, bar)
        else:
            rows, point_gradients = checkpoint_gradients(model, run.train_x, run.train_y, point_x, point_y,
                                                         point_rows, transform, device, progress=bar)
            predictions = point_gradients.predictions
    if request.reduction == "sum":
        columns = norm_columns(norms)
    elif request.family == COUPLING:
        # n = N − 1 for the sizes: a --less-point point has n = N, and k_min computed at N − 1 is no
        # larger, so its δ_size stays below --size-delta.
        plan = coupling.coupling_plan(request.mc_seed, step, config.dataset_size - 1, config.sample_rate,
                                      request.size_delta, request.num_batches, request.mc_blocks, request.max_sizes)
        if statistics_only:
            samples = coupling.CouplingSamples(np.zeros((len(points), 0)), plan)
        else:
            measured = plan.blocks if blocks is None else len(blocks)
            with progress_bar(measured * plan.permutations, f"permutations, step {step}") as bar:
                statistics, samples = coupling.measure_coupling(rows, point_gradients, plan, bar, blocks)
        columns = coupling_columns(config.clip_bound, statistics, samples, blocks)
    else:
        pool = poisson_batches.Pool(request.mc_seed, step, run.universe, config.sample_rate, run.train_columns)
        with progress_bar(request.num_iters * request.num_batches, f"sets of α batches, step {step}") as bar:
            statistics = poisson_batches.renyi_statistics(rows, point_gradients, points, pool, request.alpha,
                                                          request.num_iters, request.num_batches, request.directions,
                                                          bar)
        columns = jensen_columns(request, statistics)
    frame = measurement_rows(request, config, step, payload["test_accuracy"], points,
                             run.dataset.train_y[points].numpy(), predictions, columns)
    if request.histogram_precision is None:
        return frame
    return storage.histogram_rows(frame, request.histogram_precision)


def norm_columns(norms):
    """Sum rule: one grad_norm row (Δ*) per point."""
    return {"position": np.arange(len(norms)), "quantity": "grad_norm", "value": norms, "direction": NO_DIRECTION,
            "target_batch": 0, "sample": 0}


def coupling_columns(clip_bound, statistics, samples, blocks=None):
    """Mean rule by coupling (accounting.md §2): per point the center_distance, spread and
    max_deviation rows, then a batch_sensitivity row (Δ_B with its k and block) per accepted draw.
    With `blocks`, only their draws, and the statistics rows only with block 0 (each part of a
    torchrun measurement holds its own rows)."""
    count = len(statistics.spread) if blocks is None or 0 in blocks else 0
    position, block, sample, size, value = samples.accepted()
    # Δ_B ≤ ||h*|| ≤ Γ for k = 0 and ≤ 2Γ/(k+1) otherwise; float32 products can round one ulp above.
    value = np.minimum(value, np.where(size > 0, 2 * clip_bound / (size + 1), clip_bound))
    stats = [statistics.center_distance[:count], statistics.spread[:count], statistics.max_deviation[:count]]
    return {
        "position": np.concatenate([np.tile(np.arange(count), 3), position]),
        "quantity": np.concatenate([np.repeat(results.STATISTICS, count),
                                    np.full(len(value), "batch_sensitivity")]),
        "value": np.concatenate([*stats, value]),
        "direction": NO_DIRECTION,
        "target_batch": 0,
        "sample": np.concatenate([np.zeros(3 * count, dtype=np.int64), sample]),
        "block": np.concatenate([np.full(3 * count, np.nan), block]),
        "k": np.concatenate([np.full(3 * count, np.nan), size]),
        "k_min": samples.plan.k_min,
    }


def jensen_columns(request, statistics):
    """GLA's statistic S: one renyi_statistic row per direction, point, target batch and set."""
    parts = []
    for direction, array in statistics.items():
        count, targets, samples = array.shape
        parts.append({"position": np.repeat(np.arange(count), targets * samples),
                      "target_batch": np.tile(np.repeat(np.arange(targets), samples), count),
                      "sample": np.tile(np.arange(samples), count * targets),
                      "value": array.reshape(-1), "direction": np.full(array.size, direction)})
    columns = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return {**columns, "quantity": "renyi_statistic", "alpha": float(request.alpha)}


def measurement_rows(request, config, step, accuracy, points, labels, predictions, columns):
    """Long-format rows from `columns` (per-row arrays or one value for all; `position` is the
    point's index in `points`) with the point's label, loss and correctness (results.result_rows)."""
    position = columns.pop("position")
    return results.result_rows(config, request.reduction, step, {
        "point": points[position],
        "label": labels[position],
        "correct": predictions.correct.astype(int)[position],
        "loss": predictions.losses[position],
        "exp": request.family,
        "accuracy": accuracy,
        "mc_seed": np.nan if request.mc_seed is None else request.mc_seed,
        **columns,
    })


def keep_missing(rows, missing):
    """Only the rows of (direction, point) combinations that `missing` lists."""
    wanted = np.zeros(len(rows), dtype=bool)
    for direction, points in missing.items():
        wanted |= (rows["direction"] == direction).to_numpy() & rows["point"].isin(points).to_numpy()
    return rows[wanted].reset_index(drop=True)

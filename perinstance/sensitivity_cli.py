"""What compute_sensitivity.py needs besides the engine: its flags, the run it measures,
the stages it resolves to checkpoints, and the result file it appends to."""

import argparse
import math
import os
import shlex
import sys
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tqdm import tqdm

from perinstance import checkpoints, fileio, results, sensitivity, training
from perinstance.data import load_dataset
from perinstance.errors import UsageError
from perinstance.options import Parser, add_training_args

STAGE_NAMES = ("initial", "middle", "final", "all")
QUANTITY = {"sum": "grad_norm", "eps_delta": "batch_sensitivity", "renyi": "renyi_statistic"}
NO_DIRECTION = "none"
# A row is identified by these; the first six name a (run, stage, point, experiment) combination.
COMBINATION_COLUMNS = ["run", "step", "point", "exp", "direction", "alpha"]
ROW_ORDER = COMBINATION_COLUMNS + ["target_batch", "sample"]
TEXT_COLUMNS = ["run", "exp", "reduction", "direction", "quantity", "dataset", "model", "clipping", "update_rule"]


# --- flags ---------------------------------------------------------------------------------

def add_measurement_args(parser):
    group = parser.add_argument_group("measurement")
    group.add_argument("--exp", default="eps_delta", choices=("eps_delta", "renyi"),
                       help="what the accountant will compute: an (ε, δ) or a Rényi guarantee")
    group.add_argument("--points", nargs="+", required=True,
                       help="training points: indices (0 1 2), ranges (0-99), all, random:N (seeded by --seed)")
    group.add_argument("--stage", nargs="+", default=["final"],
                       help="checkpoints: fractions of training in [0, 1] (nearest saved checkpoint), "
                            "initial, middle, final, or all")
    group.add_argument("--res-name", required=True, help="rows go to res/<res-name>.csv")
    group.add_argument("--alpha", type=float, default=8, help="Rényi order α (integer >= 2) of the mean rule")
    group.add_argument("--num-batches", type=int, default=100,
                       help="mean rule: batches drawn for (ε, δ); sets of α batches per target batch for Rényi")
    group.add_argument("--num-iters", type=int, default=20, help="mean rule, Rényi: target batches B_0")
    group.add_argument("--direction", default="both", choices=("remove", "add", "both"),
                       help="mean rule, Rényi: D(P||Q) (remove), D(Q||P) (add) or both")
    group.add_argument("--no-train", action="store_true", help="fail instead of training a run that has no checkpoints")
    # --reduction (the rule analysed, and the one the run is trained with), --seed (the run's
    # seed, which also seeds the batches drawn here) and --overwrite come with the training flags.
    add_training_args(parser)
    return parser


def training_defaults():
    """Every training flag's destination and default."""
    parser = Parser()
    add_training_args(parser)
    return vars(parser.parse_args([]))


@dataclass(frozen=True)
class Request:
    """What to measure, validated: the flags that do not need the run or the dataset."""

    exp: str
    reduction: str
    stages: list
    alpha: int | None
    num_batches: int
    num_iters: int
    directions: tuple
    res_path: str
    overwrite: bool

    @property
    def quantity(self):
        return QUANTITY["sum" if self.reduction == "sum" else self.exp]


def parse_request(args):
    if args.num_batches <= 0:
        raise UsageError("--num-batches", f"must be > 0, got {args.num_batches}")
    if args.num_iters <= 0:
        raise UsageError("--num-iters", f"must be > 0, got {args.num_iters}")
    renyi_mean = args.exp == "renyi" and args.reduction == "mean"
    if renyi_mean and not (args.alpha.is_integer() and args.alpha >= 2):
        raise UsageError("--alpha", f"the mean-rule Rényi statistic needs an integer order >= 2, got {args.alpha:g}")
    if not args.res_name.strip() or args.res_name != os.path.basename(args.res_name):
        raise UsageError("--res-name", f"{args.res_name!r} must be a plain file name (rows go to res/<res-name>.csv)")
    directions = sensitivity.DIRECTIONS if args.direction == "both" else (args.direction,)
    return Request(exp=args.exp, reduction=args.reduction, stages=parse_stages(args.stage),
                   alpha=int(args.alpha) if renyi_mean else None, num_batches=args.num_batches,
                   num_iters=args.num_iters, directions=directions if renyi_mean else (NO_DIRECTION,),
                   res_path=results.results_path(args.res_name), overwrite=args.overwrite == 1)


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
class Run:
    """The training run the flags name, and the datasets the measurement needs."""

    training_args: argparse.Namespace
    run_dir: str
    metadata: dict  # planned from the flags until the run is trained, then its run.json
    dataset: object  # the full dataset: points index it, including the --less-point point
    train_x: object  # the run's training set
    train_y: object
    finished: bool

    @property
    def less_point(self):
        return self.metadata["less_point"]

    @property
    def universe(self):
        return len(self.dataset.train_y)

    @property
    def train_columns(self):
        """Indices (in the full dataset) of the run's training points, in training-row order."""
        columns = np.arange(self.universe)
        return columns if self.less_point is None else np.delete(columns, self.less_point)

    def train_rows(self, points):
        """Each point's row in the run's training set, -1 for the --less-point point."""
        if self.less_point is None:
            return np.asarray(points)
        return np.where(points == self.less_point, -1, points - (points > self.less_point))

    def saved_steps(self):
        planned = set(self.metadata["checkpoint_steps"])
        return [step for step in checkpoints.saved_steps(self.run_dir) if step in planned]


def find_run(args):
    """The run named by the training flags, checked against what is on disk; nothing is written."""
    defaults = training_defaults()
    training_args = argparse.Namespace(**{dest: getattr(args, dest) for dest in defaults})
    # --overwrite belongs to the result file here: never retrain a run because of it.
    training_args.overwrite = 0
    training.resolve_training_args(training_args)
    dataset = load_dataset(args.dataset, args.data_root)
    run_data = dataset if args.less_point is None else load_dataset(args.dataset, args.data_root, args.less_point)
    metadata = training.plan_run(training_args, run_data)
    run_dir = training.run_dir_for(training_args)
    run = Run(training_args, run_dir, metadata, dataset, run_data.train_x, run_data.train_y, finished=False)
    if os.path.exists(checkpoints.metadata_path(run_dir)):
        existing = checkpoints.load_metadata(run_dir)
        check_same_run(run_dir, existing, metadata)
        run.metadata = existing
        run.finished = existing["total_steps"] in run.saved_steps()
    return run


def require_finished(run, args):
    """--no-train: a run without its final checkpoint is an error that says how to train it."""
    if run.finished:
        return
    steps = run.saved_steps()
    state = f"no checkpoints in {run.run_dir}" if not steps else \
        f"{run.run_dir} is trained up to step {steps[-1]} of {run.metadata['total_steps']}"
    raise UsageError("--no-train", f"{state}; train first: {training_command(args, training_defaults())}")


def check_same_run(run_dir, existing, planned):
    """The run on disk was trained with these flags on this dataset (fingerprints equal)."""
    differing = training.run_differences(existing, planned)
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
        flag = "--" + dest.replace("_", "-")
        words += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return shlex.join(words)


def ensure_trained(run):
    """Train the run if it has no final checkpoint (as the paper repository did); returns its metadata."""
    if not run.finished:
        run.metadata = training.train(run.training_args)
        run.finished = True
    return run.metadata


# --- the result file --------------------------------------------------------------------------

def cell_text(value):
    """A cell as the CSV writes it, so that values read back compare equal to fresh ones."""
    if isinstance(value, float | np.floating):
        return "" if math.isnan(value) else f"{value:.10g}"
    return str(value)


class ResultFile:
    """res/<res-name>.csv: rows already there, and atomic rewrites with new rows merged in."""

    def __init__(self, path, rows):
        self.path = path
        self.rows = rows
        self.done = {tuple(key) for key in rows[COMBINATION_COLUMNS].map(cell_text).itertuples(index=False)}

    @classmethod
    def open(cls, path, overwrite, config):
        """The file's rows (none with --overwrite 1), refusing rows of another run configuration."""
        if overwrite or not os.path.exists(path):
            return cls(path, pd.DataFrame(columns=results.COLUMNS))
        rows = results.read_results(path, flag="--res-name")
        rows[TEXT_COLUMNS] = rows[TEXT_COLUMNS].astype(str)
        differing = [f"column {column} has {'/'.join(sorted(set(rows[column].map(cell_text))))} in file, "
                     f"{cell_text(config[column])} now"
                     for column in results.CONFIG_COLUMNS if (rows[column].map(cell_text) != cell_text(config[column])).any()]
        if differing:
            raise UsageError("--res-name", f"refusing to mix: {'; '.join(differing)}; "
                                           "use another --res-name or --overwrite 1")
        return cls(path, rows[results.COLUMNS])

    def missing(self, run_name, step, points, request):
        """{direction: points} whose rows at `step` are not in the file yet."""
        alpha = np.nan if request.alpha is None else float(request.alpha)
        return {direction: [point for point in points
                            if tuple(map(cell_text, (run_name, step, point, request.exp, direction, alpha)))
                            not in self.done]
                for direction in request.directions}

    def add(self, rows):
        """Merge `rows` in and rewrite the file atomically, in a fixed row order."""
        merged = pd.concat([frame for frame in (self.rows, rows) if len(frame)], ignore_index=True)
        self.rows = merged.sort_values(ROW_ORDER, kind="mergesort", na_position="last", ignore_index=True)
        fileio.write_csv(self.path, self.rows[results.COLUMNS])


# --- measuring one checkpoint --------------------------------------------------------------------

def progress_bar(total, desc):
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, disable=None, leave=False)


def measure_checkpoint(request, run, step, points, device):
    """The rows of one checkpoint for `points` (every requested direction)."""
    metadata = run.metadata
    points = np.asarray(points)
    model, payload = training.load_model(metadata, run.run_dir, step, device)
    transform = sensitivity.Transform.of_run(metadata)
    point_x, point_y = run.dataset.train_x[points], run.dataset.train_y[points]
    with progress_bar(len(points) if request.reduction == "sum" else len(run.train_y),
                      f"per-sample gradients, step {step}") as bar:
        if request.reduction == "sum":
            norms, predictions = sensitivity.transformed_norms(model, point_x, point_y, transform, device, bar)
            values = {NO_DIRECTION: norms[:, None, None]}
        else:
            rows, point_gradients = sensitivity.checkpoint_gradients(
                model, run.train_x, run.train_y, point_x, point_y, run.train_rows(points), transform, device,
                progress=bar)
            predictions = point_gradients.predictions
    if request.reduction == "mean":
        pool = sensitivity.Pool(metadata["seed"], step, run.universe, metadata["sample_rate"], run.train_columns)
        values = monte_carlo(request, rows, point_gradients, points, pool, step)
    return measurement_rows(request, metadata, step, payload["test_accuracy"], points,
                            run.dataset.train_y[points].numpy(), predictions, values)


def monte_carlo(request, rows, point_gradients, points, pool, step):
    """{direction: (points, target batches, samples)} of the mean rule."""
    if request.exp == "eps_delta":
        with progress_bar(request.num_batches, f"batches, step {step}") as bar:
            values = sensitivity.batch_sensitivities(rows, point_gradients, points, pool, request.num_batches, bar)
        return {NO_DIRECTION: values[:, None, :]}
    with progress_bar(request.num_iters * request.num_batches, f"sets of α batches, step {step}") as bar:
        return sensitivity.renyi_statistics(rows, point_gradients, points, pool, request.alpha, request.num_iters,
                                            request.num_batches, request.directions, bar)


def measurement_rows(request, metadata, step, accuracy, points, labels, predictions, values):
    """Long-format rows: one per (direction, point, target batch, sample) value."""
    frames = []
    for direction, array in values.items():
        count, targets, samples = array.shape
        per_point = targets * samples
        frame = pd.DataFrame({
            "step": step,
            "stage": step / metadata["total_steps"],
            "point": np.repeat(points, per_point),
            "label": np.repeat(labels, per_point),
            "correct": np.repeat(predictions.correct.astype(int), per_point),
            "loss": np.repeat(predictions.losses, per_point),
            "exp": request.exp,
            "direction": direction,
            "target_batch": np.tile(np.repeat(np.arange(targets), samples), count),
            "sample": np.tile(np.arange(samples), count * targets),
            "quantity": request.quantity,
            "value": array.reshape(-1),
            "alpha": np.nan if request.alpha is None else float(request.alpha),
            "accuracy": accuracy,
        })
        for column, value in results.run_columns(metadata, request.reduction).items():
            frame[column] = np.nan if value is None else value  # a float column whatever the run
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)[results.COLUMNS]


def keep_missing(rows, missing):
    """Only the rows of (direction, point) combinations that `missing` lists."""
    wanted = np.zeros(len(rows), dtype=bool)
    for direction, points in missing.items():
        wanted |= (rows["direction"] == direction).to_numpy() & rows["point"].isin(points).to_numpy()
    return rows[wanted].reset_index(drop=True)

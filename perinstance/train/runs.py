"""The description of a training run: its typed configuration, run.json, and an opened run.

A run is named once: `RunConfig` holds everything `run.json` records (the flags that determine
what is trained and every derived quantity of accounting.md §1), is read and written only here,
and is what the training loop (training.py), the measurement and the accountants take. The
training flags become a RunConfig in run_plan.py (`plan_run`, `prepare_run_dir`).
"""

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perinstance.errors import UsageError
from perinstance.files import checkpoints, fileio
from perinstance.train.data import load_dataset, without_point

RUN_FILE = "run.json"
# The run.json format this version writes. It reads every earlier one: format 1 kept the
# optimizer's settings only among the flags ("args"), format 2 holds them as fields and calls
# the flags "flags".
RUN_FORMAT = 2
# Every error about the run folder names the flag that chose it.
FLAG = "--save-name"
# The named stages of a run, besides fractions of training in [0, 1] (resolve_stages).
STAGE_NAMES = ("initial", "middle", "final", "all")
# The faults audit.py --self-test plants in its positive controls (docs/audit.md §1d), through the trainer alone:
# the noise added at half the std run.json states, no clipping, Poisson sampling at twice the rate q, gradient
# canaries added at Γ/c instead of c·Γ (a noise multiplier σ·c where σ/c is accounted), and, under the mean rule,
# the noise of the mean (std σΓ/B_exp) added to the sum before the division by the realised batch size. A run that
# carries one records it in run.json, and load_run refuses it: it is never read as a real run.
PLANTED_FAULTS = ("half_noise", "no_clipping", "double_rate", "inverted_norm", "noise_before_division")


@dataclass(frozen=True)
class RunConfig:
    """One training run (accounting.md §1), exactly what its run.json holds."""

    run: str  # the folder's name
    flags: dict  # the training flags that determine what is trained (identity_args)
    seed: int
    dataset: str
    dataset_fingerprint: str
    dataset_size: int  # N, the training set's size (without the --less-point point)
    num_classes: int
    input_shape: tuple
    model: str
    norm_type: str
    dp: int  # 1: DP-SGD, 0: non-private SGD
    clipping: str  # the per-sample transform h: flat, psac or psasc
    clip_norm: float  # C
    scale_r: float | None
    scale_s: float | None
    clip_bound: float  # Γ, the bound on ||h(g)||
    noise_multiplier: float  # σ
    target_eps: float | None  # the ε σ was calibrated for, None when σ was given
    delta: float  # the training δ of that calibration
    sample_rate: float  # q = B_exp/N
    batch_size: int  # B_exp
    total_steps: int  # T
    steps_per_epoch: float
    update_rule: str  # sum or mean
    less_point: int | None  # the point left out of the training set
    checkpoint_steps: tuple
    tracked_points: tuple | None  # points whose ||h(g)|| is recorded at every step
    lr: float
    optimizer: str
    momentum: float
    gamma: float
    dec_lr: tuple  # epochs at which the learning rate decays by gamma
    versions: dict
    canaries: int = 0  # white-box gradient canaries (perinstance/train/canaries.py)
    canary_norms: tuple | None = None  # their norms' groups, as multiples of Γ
    input_canaries: int = 0  # crafted examples audited in the same way (perinstance/train/input_canaries.py)
    # A fault planted by audit.py --self-test (PLANTED_FAULTS); None in every real run.
    planted_fault: str | None = None
    # The files behind --model / --dataset / --loss specs, {"model"|"dataset"|"loss": {spec, path, sha256}}
    # (user_code.sources); None for built-in ones, and in run.json files written before specs existed.
    user_code: dict | None = None
    # The --loss spec of the per-example loss; None: cross-entropy on class indices (and in run.json files written
    # before --loss existed).
    loss: str | None = None
    # The individual Rényi filter (accounting.md §12; train/filtering.py): {"order", "delta", "budget_eps",
    # "budgets_file", "budgets_sha256", "smallest_eps"}; None without one (and in run.json files written before it).
    point_filter: dict | None = None
    # The tracked points are measured at θ_s for every step s that is a multiple of this (and at θ_T); above 1, each
    # is clipped at its own bound between measurements (§12.4).
    measure_every: int = 1
    # m of per-point clipping (§12.4, §13): each point clipped at min(Γ, (1 + m)·Δ*(θ_s)); None without it.
    clip_margin: float | None = None

    @property
    def private(self) -> bool:
        return self.dp == 1

    @property
    def per_point_clipping(self) -> bool:
        """Whether each point is clipped at its own bound (a filter, or measurements every k > 1 steps, §12.4)."""
        return self.clip_margin is not None

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        for name in ("input_shape", "checkpoint_steps", "tracked_points", "dec_lr", "canary_norms"):
            fields[name] = None if fields[name] is None else list(fields[name])
        if fields["loss"] is None:  # the default loss: run.json as it was before --loss existed
            del fields["loss"]
        if not self.per_point_clipping:  # neither filter nor per-point clipping: run.json as it was before them
            for name in ("point_filter", "measure_every", "clip_margin"):
                del fields[name]
        return {"format": RUN_FORMAT, **fields}

    @classmethod
    def from_json(cls, data: dict, path: str) -> "RunConfig":
        """The run that `data` (run.json of any format up to RUN_FORMAT) describes; a UsageError
        naming `path` and the problem when it is not one."""
        if not isinstance(data, dict):
            raise UsageError(FLAG, f"{path} is not run metadata: it holds a JSON {_json_type(data)}, not an object")
        version = data.get("format", 1)  # every format-1 file has the key; default to it all the same
        if not _integer(version) or version < 1:
            raise UsageError(FLAG, f"{path}: format is {version!r}, expected an integer >= 1")
        if version > RUN_FORMAT:
            raise UsageError(FLAG, f"{path} has format {version}, newer than this version reads (up to "
                                   f"{RUN_FORMAT}); update the code, or use another --save-name or --models-dir")
        if version == 1:
            data = _from_format_1(data, path)
        data = {**LATER_KEY_DEFAULTS, **data}
        missing = [key for key in RUN_KEYS if key not in data]
        if missing:
            raise UsageError(FLAG, f"{path} lacks the key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                   "of run metadata; delete the folder to train the run again")
        for key, (expected, valid) in RUN_KEYS.items():
            if not valid(data[key]):
                raise UsageError(FLAG, f"{path}: {key} is {_short(data[key])}, expected {expected}")
        if data["planted_fault"] is not None:
            raise UsageError(FLAG, f"{path} is a positive control of audit.py --self-test, trained with the planted "
                                   f"fault {data['planted_fault']!r}: it is not a real run")
        values = {key: data[key] for key in RUN_KEYS}
        for name in ("input_shape", "checkpoint_steps", "tracked_points", "dec_lr", "canary_norms"):
            values[name] = None if values[name] is None else tuple(values[name])
        return cls(**values)


def run_file(run_dir: str) -> str:
    return os.path.join(run_dir, RUN_FILE)


def load_run(run_dir: str) -> RunConfig:
    """The RunConfig of `run_dir`'s run.json, checked (a one-line error naming the file otherwise)."""
    path = run_file(run_dir)
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise UsageError(FLAG, f"no run metadata at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(FLAG, f"corrupt run metadata {path}: {error}") from None
    except OSError as error:
        raise UsageError(FLAG, f"cannot read {path}: {error.strerror or error}") from None
    return RunConfig.from_json(data, path)


def save_run(run_dir: str, config: RunConfig) -> None:
    fileio.write_json(run_file(run_dir), config.to_json(), flag="--models-dir")


def _from_format_1(data, path):
    """Format 1 named the flags "args" and kept the optimizer's settings only there."""
    if not isinstance(data.get("args"), dict):
        raise UsageError(FLAG, f"{path}: args is {_short(data.get('args'))}, expected an object of flags")
    flags = data["args"]
    settings = {name: flags[name] for name in ("lr", "optimizer", "momentum", "gamma", "dec_lr") if name in flags}
    rest = {key: value for key, value in data.items() if key not in ("args", "format")}
    return {**rest, "flags": flags, **settings}


def _integer(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value):
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


def _optional(check):
    return lambda value: value is None or check(value)


# Every field of RunConfig, with what its value in run.json must be.
RUN_KEYS = {
    "run": ("a text", lambda value: isinstance(value, str) and value != ""),
    "flags": ("an object of flags", lambda value: isinstance(value, dict)),
    "seed": ("an integer >= 0", lambda value: _integer(value) and value >= 0),
    "dataset": ("a text", lambda value: isinstance(value, str)),
    "dataset_fingerprint": ("a text", lambda value: isinstance(value, str)),
    "dataset_size": ("an integer > 0", lambda value: _integer(value) and value > 0),
    "num_classes": ("an integer > 0", lambda value: _integer(value) and value > 0),
    # C×H×W images; any shape for data of a --dataset spec (token ids: a length).
    "input_shape": ("a list of integers > 0",
                    lambda value: isinstance(value, list) and all(_integer(size) and size > 0 for size in value)),
    "model": ("a text", lambda value: isinstance(value, str)),
    "norm_type": ("a text", lambda value: isinstance(value, str)),
    "dp": ("0 or 1", lambda value: _integer(value) and value in (0, 1)),
    "clipping": ("a text", lambda value: isinstance(value, str)),
    "clip_norm": ("a number > 0", lambda value: _number(value) and value > 0),
    "scale_r": ("a number or null", _optional(_number)),
    "scale_s": ("a number or null", _optional(_number)),
    "clip_bound": ("a number > 0", lambda value: _number(value) and value > 0),
    "noise_multiplier": ("a number >= 0", lambda value: _number(value) and value >= 0),
    "target_eps": ("a number or null", _optional(_number)),
    "delta": ("a number in (0, 1)", lambda value: _number(value) and 0 < value < 1),
    "sample_rate": ("a number in (0, 1]", lambda value: _number(value) and 0 < value <= 1),
    "batch_size": ("an integer > 0", lambda value: _integer(value) and value > 0),
    "total_steps": ("an integer > 0", lambda value: _integer(value) and value > 0),
    "steps_per_epoch": ("a number > 0", lambda value: _number(value) and value > 0),
    "update_rule": ("sum or mean", lambda value: value in ("sum", "mean")),
    "less_point": ("an integer or null", _optional(_integer)),
    "checkpoint_steps": ("a list of integers >= 0",
                         lambda value: isinstance(value, list) and all(_integer(step) and step >= 0 for step in value)),
    "tracked_points": ("a list of integers or null",
                       _optional(lambda value: isinstance(value, list) and all(map(_integer, value)))),
    "lr": ("a number > 0", lambda value: _number(value) and value > 0),
    "optimizer": ("sgd or adam", lambda value: value in ("sgd", "adam")),
    "momentum": ("a number in [0, 1)", lambda value: _number(value) and 0 <= value < 1),
    "gamma": ("a number > 0", lambda value: _number(value) and value > 0),
    "dec_lr": ("a list of numbers >= 0", lambda value: isinstance(value, list)
               and all(_number(epoch) and epoch >= 0 for epoch in value)),
    "versions": ("an object", lambda value: isinstance(value, dict)),
    "user_code": ("an object or null", _optional(lambda value: isinstance(value, dict))),
    "loss": ("a text or null", _optional(lambda value: isinstance(value, str))),
    "canaries": ("an integer >= 0", lambda value: _integer(value) and value >= 0),
    "input_canaries": ("an integer >= 0", lambda value: _integer(value) and value >= 0),
    "planted_fault": (f"null or one of {', '.join(PLANTED_FAULTS)}", lambda value: value is None or value in PLANTED_FAULTS),
    "canary_norms": ("a list of numbers in (0, 1] or null",
                     _optional(lambda value: isinstance(value, list) and all(_number(c) and 0 < c <= 1 for c in value))),
    "point_filter": ("an object with an order > 1 and a delta, or null",
                     _optional(lambda value: isinstance(value, dict) and _number(value.get("order")) and
                               value["order"] > 1 and _number(value.get("delta")) and 0 < value["delta"] < 1)),
    "measure_every": ("an integer >= 1", lambda value: _integer(value) and value >= 1),
    "clip_margin": ("a number >= 0 or null", _optional(lambda value: _number(value) and value >= 0)),
}
# Runs written before canaries, before --model / --dataset specs, before --loss, or before filters existed have none.
LATER_KEY_DEFAULTS = {"canaries": 0, "canary_norms": None, "user_code": None, "input_canaries": 0,
                      "planted_fault": None, "loss": None, "point_filter": None, "measure_every": 1,
                      "clip_margin": None}


def _json_type(value):
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _short(value, limit=60):
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class OpenRun:
    """A run's folder and config with the datasets a measurement needs: the full dataset (points
    index it, the --less-point point included) and the run's training set."""

    run_dir: str
    config: RunConfig
    dataset: object
    train_x: object
    train_y: object

    @property
    def name(self) -> str:
        return self.config.run

    @property
    def less_point(self) -> int | None:
        return self.config.less_point

    @property
    def universe(self) -> int:
        return len(self.dataset.train_y)

    @property
    def train_columns(self) -> np.ndarray:
        """Indices (in the full dataset) of the run's training points, in training-row order."""
        columns = np.arange(self.universe)
        return columns if self.less_point is None else np.delete(columns, self.less_point)

    def train_rows(self, points: np.ndarray) -> np.ndarray:
        """Each point's row in the run's training set, -1 for the --less-point point."""
        points = np.asarray(points)
        if self.less_point is None:
            return points
        return np.where(points == self.less_point, -1, points - (points > self.less_point))

    def saved_steps(self) -> list[int]:
        """The planned checkpoints present in the folder, ascending."""
        planned = set(self.config.checkpoint_steps)
        return [step for step in checkpoints.saved_steps(self.run_dir) if step in planned]


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


def run_folder(name: str, models_dir: str, flag: str = "--run") -> str:
    """The folder of the run that `name` (--run) means: a folder holding run.json, else a run name
    in `models_dir` (which may not exist yet). A path that holds no run is an error: it names no run."""
    if os.path.isfile(run_file(name)):
        return os.path.normpath(name)
    if name in ("", ".", "..") or any(separator and separator in name for separator in (os.sep, os.altsep)):
        raise UsageError(flag, f"{name!r} is neither a run folder (no {RUN_FILE} in it) nor a run name in "
                               f"{models_dir} (train it with train_dpsgd.py --save-name NAME)")
    return os.path.join(models_dir, name)


def open_run(name: str, models_dir: str, data_root: str, flag: str = "--run") -> OpenRun:
    """The trained run `name` (run_folder) with its datasets, checked against the dataset
    fingerprint in run.json."""
    run_dir = run_folder(name, models_dir, flag)
    if not os.path.isfile(run_file(run_dir)):
        raise UsageError(flag, f"no run {name!r}: neither a folder with {RUN_FILE} nor {run_dir} (train it with "
                               "train_dpsgd.py --save-name NAME)")
    config = load_run(run_dir)
    dataset = load_dataset(config.dataset, data_root, class_labels=config.loss is None)
    if dataset.fingerprint != config.dataset_fingerprint:
        raise UsageError("--data-root", f"the dataset {config.dataset} under {data_root} is not the one "
                                        f"{run_dir} was trained on (fingerprints differ)")
    training_set = dataset if config.less_point is None else without_point(dataset, config.less_point)
    run = OpenRun(run_dir, config, dataset, training_set.train_x, training_set.train_y)
    if not run.saved_steps():
        raise UsageError(flag, f"{run_dir} has no checkpoints")
    return run

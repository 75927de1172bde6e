"""From the training flags to a run: the flags resolved and checked, the noise calibrated, the checkpoint
schedule, and the run folder checked or created.

`plan_run` turns the training flags into the run's RunConfig (runs.py); `prepare_run_dir` checks an
existing folder against it or creates one.
"""

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass

import numpy as np
import opacus
import torch
from opacus.accountants.utils import get_noise_multiplier

from perinstance.errors import UsageError
from perinstance.files import checkpoints, fileio
from perinstance.train import clipping, filtering, user_code
from perinstance.train.canaries import check_canary_flags, parse_canary_norms
from perinstance.train.data import Dataset
from perinstance.train.points import parse_points
from perinstance.train.runs import RUN_FILE, RunConfig, load_run, run_file, save_run

DEFAULT_EPS = 10.0
DEFAULT_SCALE_R = 0.1
DEFAULT_SCALE_S = 0.9
DEFAULT_CHECKPOINTS = 10
# Flags that do not change what is trained, so a resumed run may differ in them.
NON_IDENTITY_FLAGS = {"overwrite", "device", "eval_freq", "data_root", "models_dir", "save_name", "id"}
# Flags added after runs were first named: left out of a run's identity while not given, so that the default
# names of runs trained before them stay the same.
LATER_FLAGS = {"save_steps", "canaries", "canary_norms", "input_canaries", "loss", "total_steps", "track_every",
               "budget_eps", "budgets", "filter_order", "filter_every", "filter_margin"}
# A larger target ε promises no privacy, and Opacus's calibration of σ does not end for ~1e15.
MAX_TARGET_EPS = 1e6
# Bounds T = round(epochs·N/B_exp) far below where it overflows.
MAX_EPOCHS = 1e6
# σ² underflows (RDP divides by it) below ~1e-154 and overflows above ~1e154; these bounds are
# far inside, the upper one is Opacus's own for calibration.
MIN_SIGMA, MAX_SIGMA = 1e-6, 1e6
# Keep the noise std σC and the step lr·update (float32 tensors) far from overflowing.
MAX_CLIP_NORM = 1e6
MAX_LEARNING_RATE = 1e6
VERSIONS = {"torch": torch.__version__, "opacus": opacus.__version__, "numpy": np.__version__}


@dataclass(frozen=True)
class TrainingFlags:
    """Every flag of options.add_training_args, by destination: what names and defines a run
    (options.training_flags reads them from parsed flags)."""

    dataset: str
    data_root: str
    model: str
    loss: str | None
    norm_type: str
    batch_size: int
    lr: float
    optimizer: str
    momentum: float
    gamma: float
    dec_lr: list
    epochs: float
    dp: int
    eps: float | None
    sigma: float | None
    delta: float
    cn: float
    clipping: str
    scale_r: float | None
    scale_s: float | None
    reduction: str
    seed: int
    less_point: int | None
    save_freq: int | None
    save_steps: list | None
    save_name: str | None
    id: str | None
    models_dir: str
    overwrite: int
    device: str
    eval_freq: int | None
    track_points: list | None
    canaries: int | None
    canary_norms: str | None
    input_canaries: int | None
    total_steps: int | None = None
    track_every: int | None = None
    budget_eps: float | None = None
    budgets: str | None = None
    filter_order: float | None = None
    filter_every: int | None = None
    filter_margin: float | None = None

    @property
    def filtered(self) -> bool:
        """Whether the run has an individual Rényi filter (--budget-eps or --budgets)."""
        return self.budget_eps is not None or self.budgets is not None

    @property
    def measure_every(self) -> int:
        """Every how many steps the run measures its tracked points' Δ* (--filter-every, --track-every; 1: every
        step), run.json's measure_every."""
        return self.filter_every or self.track_every or 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def resolve_training_args(args: TrainingFlags) -> TrainingFlags:
    """The TrainingFlags `args` with their derived defaults filled in, bad ones refused (no dataset needed).

    The parser's types (options.py) refuse NaN, ±inf and out-of-domain numbers already; the
    checks here repeat them for callers that build the flags themselves, and add those that
    involve several flags (the learning-rate schedule).
    """
    if args.dp == 1:
        if args.eps is not None and args.sigma is not None:
            raise UsageError("--eps", "give either --eps (target ε) or --sigma, not both")
        if args.sigma is None and args.eps is None:
            args = dataclasses.replace(args, eps=DEFAULT_EPS)
    for flag, value in (("--eps", args.eps), ("--sigma", args.sigma), ("--epochs", args.epochs), ("--cn", args.cn),
                        ("--lr", args.lr), ("--gamma", args.gamma)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(flag, f"must be a finite number > 0, got {value:g}")
    if args.eps is not None and args.eps > MAX_TARGET_EPS:
        raise UsageError("--eps", f"must be at most {MAX_TARGET_EPS:g}, got {args.eps:g} (such a target promises "
                                  "no privacy, and calibrating sigma for it does not end; give --sigma instead)")
    if args.sigma is not None and not MIN_SIGMA <= args.sigma <= MAX_SIGMA:
        raise UsageError("--sigma", f"must be in [{MIN_SIGMA:g}, {MAX_SIGMA:g}], got {args.sigma:g} (outside it the "
                                    "accounting's arithmetic under- or overflows; --no-dp trains without noise)")
    if args.cn > MAX_CLIP_NORM:
        raise UsageError("--cn", f"must be at most {MAX_CLIP_NORM:g}, got {args.cn:g} (the noise std sigma·C would overflow)")
    if args.epochs > MAX_EPOCHS:
        raise UsageError("--epochs", f"must be at most {MAX_EPOCHS:g}, got {args.epochs:g}")
    if not 0 < args.delta < 1:
        raise UsageError("--target-delta", f"must be in (0, 1), got {args.delta:g}")
    if not 0 <= args.momentum < 1:
        raise UsageError("--momentum", f"must be in [0, 1), got {args.momentum:g}")
    if args.seed < 0:
        raise UsageError("--seed", f"must be >= 0, got {args.seed}")
    _check_schedule(args)
    check_canary_flags(args.canaries, parse_canary_norms(args.canary_norms), args.dp == 1, args.input_canaries)
    if args.loss is not None and args.input_canaries:
        raise UsageError("--input-canaries", "crafted input canaries carry random class labels, which only the default "
                                             "loss (cross-entropy) takes; with --loss, audit with gradient canaries "
                                             "(--canaries)")
    args = filtering.check_flags(args)
    if args.save_freq is not None and args.save_freq <= 0:
        raise UsageError("--save-freq", f"must be > 0, got {args.save_freq}")
    if args.eval_freq is not None and args.eval_freq <= 0:
        raise UsageError("--eval-freq", f"must be > 0, got {args.eval_freq}")
    args = _resolve_scaling(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device", f"{args.device} requested but no CUDA device is available (allowed: cpu, cuda)")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError("--device", f"unknown device {args.device!r} (allowed: cpu, cuda, cuda:N)")
    return args


def _check_schedule(args):
    """The learning rate must stay in (0, MAX_LEARNING_RATE] at every point of the schedule:
    lr·γ^k after the k-th --dec-lr milestone, for every k (a milestone past the end changes nothing)."""
    if args.lr > MAX_LEARNING_RATE:
        raise UsageError("--lr", f"must be at most {MAX_LEARNING_RATE:g}, got {args.lr:g}")
    for milestone in args.dec_lr:
        if not (math.isfinite(milestone) and milestone >= 0):
            raise UsageError("--dec-lr", f"milestones are epochs >= 0, got {milestone:g}")
    for decays in range(1, len(args.dec_lr) + 1):
        try:
            rate = args.lr * args.gamma ** decays
        except OverflowError:
            rate = math.inf
        if not 0 < rate <= MAX_LEARNING_RATE:
            raise UsageError("--gamma", f"the learning rate after {decays} decay(s) by {args.gamma:g} would be "
                                        f"{rate:g}; it must stay in (0, {MAX_LEARNING_RATE:g}]")


def _resolve_scaling(args):
    """The flags with r and s defaulted for the transforms that take them."""
    if args.clipping == "flat":
        if args.scale_r is not None:
            raise UsageError("--scale-r", "only psac and psasc take --scale-r")
    elif args.scale_r is None:
        args = dataclasses.replace(args, scale_r=DEFAULT_SCALE_R)
    if args.clipping != "psasc":
        if args.scale_s is not None:
            raise UsageError("--scale-s", "only psasc takes --scale-s")
    elif args.scale_s is None:
        args = dataclasses.replace(args, scale_s=DEFAULT_SCALE_S)
    if args.scale_r is not None and not (math.isfinite(args.scale_r) and 0 < args.scale_r <= MAX_CLIP_NORM):
        raise UsageError("--scale-r", f"must be in (0, {MAX_CLIP_NORM:g}], got {args.scale_r:g} (a larger r "
                                      "overflows the float32 gradients' scale)")
    if args.scale_s is not None and not (math.isfinite(args.scale_s) and args.scale_s > 0):
        raise UsageError("--scale-s", f"must be a finite number > 0, got {args.scale_s:g}")
    if args.scale_s is not None and args.cn / args.scale_s > MAX_CLIP_NORM:
        raise UsageError("--scale-s", f"the bound Γ = C/s = {args.cn / args.scale_s:g} must be at most "
                                      f"{MAX_CLIP_NORM:g} (the noise std sigma·Γ would overflow)")
    return args


def identity_args(args: TrainingFlags) -> dict:
    """The flags that determine what is trained (a resumed run must agree on all of them); --epochs does not where
    --total-steps gives T."""
    return {key: value for key, value in sorted(args.as_dict().items())
            if key not in NON_IDENTITY_FLAGS and not (key in LATER_FLAGS and value is None)
            and not (key == "epochs" and args.total_steps is not None)}


def default_save_name(args: TrainingFlags) -> str:
    """Readable main flags plus a hash of all of them, so runs that differ in any flag never share a folder."""
    privacy = "nodp" if args.dp == 0 else (f"eps{args.eps:g}" if args.sigma is None else f"sigma{args.sigma:g}")
    parts = [user_code.short_name(args.dataset), user_code.short_name(args.model),
             *([] if args.loss is None else [user_code.short_name(args.loss)]), args.reduction, args.clipping, privacy,
             f"bs{args.batch_size}", f"seed{args.seed}"]
    if args.less_point is not None:
        parts.append(f"less{args.less_point}")
    if args.canaries is not None:
        parts.append(f"canaries{args.canaries}")
    if args.input_canaries is not None:
        parts.append(f"inputcanaries{args.input_canaries}")
    if args.filtered:
        parts.append("filter" + ("" if args.budget_eps is None else f"{args.budget_eps:g}"))
    if args.id is not None:
        parts.append(str(args.id))
    digest = hashlib.sha256(json.dumps(identity_args(args), sort_keys=True).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", "_".join(parts)).strip("-") + f"_{digest}"


def run_dir_for(args: TrainingFlags) -> str:
    return os.path.join(args.models_dir, args.save_name or default_save_name(args))


def plan_run(args: TrainingFlags, dataset: Dataset) -> RunConfig:
    """The run the training flags describe on `dataset`: every derived quantity, as run.json records it."""
    dataset_size = len(dataset.train_y)
    if not 0 < args.batch_size <= dataset_size:
        raise UsageError("--batch-size", f"must be in 1..{dataset_size} (the training set size), got {args.batch_size}")
    sample_rate = args.batch_size / dataset_size
    total_steps = args.total_steps or max(1, round(args.epochs * dataset_size / args.batch_size))
    checkpoint_steps = checkpoint_schedule(args.save_freq, args.save_steps, total_steps)
    if args.dp == 0:
        noise_multiplier = 0.0
    elif args.sigma is not None:
        noise_multiplier = args.sigma
    else:
        noise_multiplier = calibrated_noise_multiplier(args.eps, args.delta, sample_rate, total_steps)
    tracked = None
    if args.track_points is not None:
        tracked = tuple(parse_points(args.track_points, dataset_size, args.seed, flag="--track-points").tolist())
    point_filter = filtering.plan_filter(args, dataset_size, sample_rate, noise_multiplier) if args.filtered else None
    return RunConfig(
        run=os.path.basename(os.path.normpath(run_dir_for(args))),
        flags=identity_args(args),
        seed=args.seed,
        dataset=dataset.name,
        dataset_fingerprint=dataset.fingerprint,
        dataset_size=dataset_size,
        num_classes=dataset.num_classes,
        input_shape=tuple(dataset.train_x.shape[1:]),
        model=args.model,
        loss=args.loss,
        norm_type=args.norm_type,
        dp=args.dp,
        clipping=args.clipping,
        clip_norm=args.cn,
        scale_r=args.scale_r,
        scale_s=args.scale_s,
        clip_bound=clipping.clip_bound(args.clipping, args.cn, args.scale_s),
        noise_multiplier=noise_multiplier,
        target_eps=args.eps if args.dp == 1 and args.sigma is None else None,
        delta=args.delta,
        sample_rate=sample_rate,
        batch_size=args.batch_size,
        total_steps=total_steps,
        steps_per_epoch=dataset_size / args.batch_size,
        update_rule=args.reduction,
        less_point=args.less_point,
        checkpoint_steps=tuple(checkpoint_steps),
        tracked_points=tracked,
        lr=args.lr,
        optimizer=args.optimizer,
        momentum=args.momentum,
        gamma=args.gamma,
        dec_lr=tuple(args.dec_lr),
        versions=VERSIONS,
        canaries=args.canaries or 0,
        canary_norms=(parse_canary_norms(args.canary_norms) or (1.0,)) if args.canaries else None,
        input_canaries=args.input_canaries or 0,
        user_code=user_code.sources(args.model, args.dataset, args.loss),
        point_filter=point_filter,
        measure_every=args.measure_every,
        clip_margin=filtering.clip_margin(args),
    )


@functools.lru_cache(maxsize=256)
def calibrated_noise_multiplier(target_eps: float, delta: float, sample_rate: float, steps: int) -> float:
    """σ for which Opacus's RDP accountant gives the sum rule ε = target_eps at δ over `steps` steps at
    sampling rate q (what --eps trains with). Remembered: every command that names a run plans it again, and
    Opacus's search takes seconds at large q."""
    with warnings.catch_warnings():
        # Opacus warns when the best order is its largest; the calibration is still valid.
        warnings.simplefilter("ignore")
        try:
            return get_noise_multiplier(target_epsilon=target_eps, target_delta=delta, sample_rate=sample_rate,
                                        steps=steps, accountant="rdp")
        except ValueError:  # Opacus: "The privacy budget is too low." (σ would exceed its bound)
            raise UsageError("--eps", f"{target_eps:g} cannot be reached with δ={delta:g}, q={sample_rate:.4g} "
                                      f"over {steps} steps (sigma would exceed Opacus's bound)") from None


def analysed_config(run: RunConfig, batch_size: int, calibration_steps: int, target_eps: float) -> RunConfig:
    """`run` (a RunConfig) analysed under the mean rule with expected batch size `batch_size`, σ calibrated so that
    the sum rule's worst case over `calibration_steps` steps at that sampling rate is `target_eps` at the run's δ:
    the mechanism of one step that one of its checkpoints is analysed under (reproduce.py's fixed-checkpoint
    design). Everything the checkpoint's gradients depend on, T included, stays the run's."""
    sample_rate = batch_size / run.dataset_size
    return dataclasses.replace(
        run, batch_size=batch_size, sample_rate=sample_rate, steps_per_epoch=1 / sample_rate,
        noise_multiplier=calibrated_noise_multiplier(target_eps, run.delta, sample_rate, calibration_steps),
        target_eps=target_eps, update_rule="mean")


def checkpoint_schedule(save_freq: int | None, save_steps: str | None, total_steps: int) -> list[int]:
    """The steps a run saves: 0 and T always; every `save_freq` steps; the steps of --save-steps. Without
    either flag, every ceil(T / DEFAULT_CHECKPOINTS) steps."""
    steps = {0, total_steps}
    if save_freq is None and save_steps is None:
        save_freq = max(1, math.ceil(total_steps / DEFAULT_CHECKPOINTS))
    if save_freq is not None:
        steps.update(range(0, total_steps, save_freq))
    if save_steps is not None:
        steps.update(int(step) for step in parse_points(save_steps, total_steps + 1, flag="--save-steps"))
    return sorted(steps)


def run_differences(existing: RunConfig, planned: RunConfig) -> list[str]:
    """What differs between a run on disk and the run the flags describe (RunConfigs): flag names,
    and the dataset."""
    differing = sorted(key for key in set(existing.flags) | set(planned.flags)
                       if existing.flags.get(key) != planned.flags.get(key))
    if existing.dataset_fingerprint != planned.dataset_fingerprint:
        differing.append("dataset contents")
    return differing


def prepare_run_dir(args: TrainingFlags, run_dir: str, config: RunConfig) -> None:
    """Create the run folder, or check that an existing one holds this same run.

    Checks first that the folder can be written (unless the run is finished: then nothing is
    written), and removes the temp files that killed writes left in it. --overwrite deletes
    an existing run folder, never a folder that holds anything but a run.
    """
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise UsageError("--save-name", f"{run_dir} is a file, not a run folder")
    if os.path.isdir(run_dir) and args.overwrite == 1:
        if not os.path.exists(run_file(run_dir)) and _foreign_files(run_dir):
            raise UsageError("--overwrite", f"{run_dir} is not a run folder (no {RUN_FILE}; it holds "
                                            f"{', '.join(_foreign_files(run_dir)[:3])}); refusing to delete it")
        fileio.check_folder(args.models_dir, "--models-dir")
        fileio.check_folder(run_dir, "--save-name")
        shutil.rmtree(run_dir)
    finished = config.total_steps in checkpoints.saved_steps(run_dir)
    if not finished:
        fileio.writable_folder(args.models_dir, "--models-dir")
        fileio.writable_folder(run_dir, "--save-name")
    fileio.remove_stale_temps(run_dir)
    if os.path.exists(run_file(run_dir)):
        existing = load_run(run_dir)
        user_code.check_unchanged(existing.user_code, config.user_code, run_dir)
        differing = run_differences(existing, config)
        if not differing and existing.point_filter != config.point_filter:
            raise UsageError("--budgets", f"{run_dir} holds a run filtered with other budgets (their file's sha256 "
                                          "or order differ); use another --save-name or --overwrite")
        if differing:
            raise UsageError("--overwrite", f"{run_dir} holds a run with different flags ({', '.join(differing)}); "
                             "use another --save-name or --overwrite")
        return
    if checkpoints.saved_steps(run_dir):
        raise UsageError("--save-name", f"{run_dir} holds checkpoints but no {RUN_FILE}, so they "
                                        "may be another run's; delete them or use --overwrite")
    save_run(run_dir, config)


def _foreign_files(run_dir):
    """Names in `run_dir` that a run does not write (checkpoints, lock and temp files are a run's)."""
    own = re.compile(r"^(step_\d{7}\.pt|(tracked_norms|filter_points)\.(csv|parquet)(\.lock)?|tracked|canaries\.csv|canary_projections\.npy|\.tmp-.*)$")
    return sorted(name for name in os.listdir(run_dir) if not own.match(name))

"""DP-SGD training as specified in accounting.md §1, resumable and bitwise reproducible.

Step t (1..T) maps θ_{t−1} to θ_t. Its Poisson batch and its noise are drawn from
(seed, step) alone (sampling.py), so resuming from any checkpoint needs no generator
state and ends with the same bytes as an uninterrupted run.
"""

import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import warnings

import numpy as np
import opacus
import pandas as pd
import torch
import torch.nn.functional as F
from opacus.accountants.utils import get_noise_multiplier
from tqdm import tqdm

from perinstance import accounting, checkpoints, clipping, fileio, gradients, results, sampling
from perinstance.data import load_dataset
from perinstance.errors import UsageError
from perinstance.nets import build_model
from perinstance.options import parse_points

DEFAULT_EPS = 10.0
DEFAULT_SCALE_R = 0.1
DEFAULT_SCALE_S = 0.9
DEFAULT_CHECKPOINTS = 10
# Per-sample gradients are computed in chunks of this many examples; fixed so that the
# summation order, hence every bit of the result, does not depend on the batch drawn.
PHYSICAL_BATCH = 1024
# Flags that do not change what is trained, so a resumed run may differ in them.
NON_IDENTITY_FLAGS = {"overwrite", "device", "eval_freq", "data_root", "models_dir", "save_name", "id"}
METADATA_FORMAT = checkpoints.METADATA_FORMAT
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


def resolve_training_args(args):
    """Fill derived defaults and reject bad training flags (no dataset needed).

    The parser's types (options.py) refuse NaN, ±inf and out-of-domain numbers already; the
    checks here repeat them for callers that build `args` themselves, and add those that
    involve several flags (the learning-rate schedule).
    """
    if args.dp == 1:
        if args.eps is not None and args.sigma is not None:
            raise UsageError("--eps", "give either --eps (target ε) or --sigma, not both")
        if args.sigma is None and args.eps is None:
            args.eps = DEFAULT_EPS
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
    if args.save_freq is not None and args.save_freq <= 0:
        raise UsageError("--save-freq", f"must be > 0, got {args.save_freq}")
    if args.eval_freq is not None and args.eval_freq <= 0:
        raise UsageError("--eval-freq", f"must be > 0, got {args.eval_freq}")
    _resolve_scaling(args)
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
    if args.clipping == "flat":
        if args.scale_r is not None:
            raise UsageError("--scale-r", "only psac and psasc take --scale-r")
    elif args.scale_r is None:
        args.scale_r = DEFAULT_SCALE_R
    if args.clipping != "psasc":
        if args.scale_s is not None:
            raise UsageError("--scale-s", "only psasc takes --scale-s")
    elif args.scale_s is None:
        args.scale_s = DEFAULT_SCALE_S
    if args.scale_r is not None and not (math.isfinite(args.scale_r) and 0 < args.scale_r <= MAX_CLIP_NORM):
        raise UsageError("--scale-r", f"must be in (0, {MAX_CLIP_NORM:g}], got {args.scale_r:g} (a larger r "
                                      "overflows the float32 gradients' scale)")
    if args.scale_s is not None and not (math.isfinite(args.scale_s) and args.scale_s > 0):
        raise UsageError("--scale-s", f"must be a finite number > 0, got {args.scale_s:g}")
    if args.scale_s is not None and args.cn / args.scale_s > MAX_CLIP_NORM:
        raise UsageError("--scale-s", f"the bound Γ = C/s = {args.cn / args.scale_s:g} must be at most "
                                      f"{MAX_CLIP_NORM:g} (the noise std sigma·Γ would overflow)")


def identity_args(args):
    """The flags that determine what is trained (a resumed run must agree on all of them)."""
    return {key: value for key, value in sorted(vars(args).items()) if key not in NON_IDENTITY_FLAGS}


def default_save_name(args):
    """Readable main flags plus a hash of all of them, so runs that differ in any flag never share a folder."""
    privacy = "nodp" if args.dp == 0 else (f"eps{args.eps:g}" if args.sigma is None else f"sigma{args.sigma:g}")
    parts = [args.dataset, args.model, args.reduction, args.clipping, privacy, f"bs{args.batch_size}", f"seed{args.seed}"]
    if args.less_point is not None:
        parts.append(f"less{args.less_point}")
    if args.id is not None:
        parts.append(str(args.id))
    digest = hashlib.sha256(json.dumps(identity_args(args), sort_keys=True).encode()).hexdigest()[:8]
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", "_".join(parts)).strip("-") + f"_{digest}"


def run_dir_for(args):
    return os.path.join(args.models_dir, args.save_name or default_save_name(args))


def plan_run(args, dataset):
    """Every derived quantity of the run, as recorded in run.json (the accountants read these)."""
    dataset_size = len(dataset.train_y)
    if not 0 < args.batch_size <= dataset_size:
        raise UsageError("--batch-size", f"must be in 1..{dataset_size} (the training set size), got {args.batch_size}")
    sample_rate = args.batch_size / dataset_size
    total_steps = max(1, round(args.epochs * dataset_size / args.batch_size))
    save_freq = args.save_freq or max(1, math.ceil(total_steps / DEFAULT_CHECKPOINTS))
    checkpoint_steps = sorted(set(range(0, total_steps, save_freq)) | {total_steps})
    if args.dp == 0:
        noise_multiplier = 0.0
    elif args.sigma is not None:
        noise_multiplier = args.sigma
    else:
        with warnings.catch_warnings():
            # Opacus warns when the best order is its largest; the calibration is still valid.
            warnings.simplefilter("ignore")
            try:
                noise_multiplier = get_noise_multiplier(target_epsilon=args.eps, target_delta=args.delta,
                                                        sample_rate=sample_rate, steps=total_steps, accountant="rdp")
            except ValueError:  # Opacus: "The privacy budget is too low." (σ would exceed its bound)
                raise UsageError("--eps", f"{args.eps:g} cannot be reached with δ={args.delta:g}, q={sample_rate:.4g} "
                                          f"over {total_steps} steps (sigma would exceed Opacus's bound)") from None
    tracked = None
    if args.track_points is not None:
        tracked = parse_points(args.track_points, dataset_size, args.seed, flag="--track-points").tolist()
    return {
        "format": METADATA_FORMAT,
        "run": os.path.basename(os.path.normpath(run_dir_for(args))),
        "args": identity_args(args),
        "seed": args.seed,
        "dataset": dataset.name,
        "dataset_fingerprint": dataset.fingerprint,
        "dataset_size": dataset_size,
        "num_classes": dataset.num_classes,
        "input_shape": list(dataset.train_x.shape[1:]),
        "model": args.model,
        "norm_type": args.norm_type,
        "dp": args.dp,
        "clipping": args.clipping,
        "clip_norm": args.cn,
        "scale_r": args.scale_r,
        "scale_s": args.scale_s,
        "clip_bound": clipping.clip_bound(args.clipping, args.cn, args.scale_s),
        "noise_multiplier": noise_multiplier,
        "target_eps": args.eps if args.dp == 1 and args.sigma is None else None,
        "delta": args.delta,
        "sample_rate": sample_rate,
        "batch_size": args.batch_size,
        "total_steps": total_steps,
        "steps_per_epoch": dataset_size / args.batch_size,
        "update_rule": args.reduction,
        "less_point": args.less_point,
        "checkpoint_steps": checkpoint_steps,
        "tracked_points": tracked,
        "versions": VERSIONS,
    }


def model_for_run(metadata):
    """The untrained architecture of a run (weights come from a checkpoint or the init seed)."""
    channels, height, _ = metadata["input_shape"]
    return build_model(metadata["model"], channels, height, metadata["num_classes"], metadata["norm_type"],
                       dp=metadata["dp"] == 1)


def load_model(metadata, run_dir, step, device="cpu"):
    """The run's model with the weights of checkpoint `step`, in eval mode, and the payload."""
    payload = checkpoints.load_checkpoint(run_dir, step, device)
    model = model_for_run(metadata).to(device)
    with checkpoints.restoring(run_dir, step):
        model.load_state_dict(payload["model"])
    model.eval()
    return model, payload


def learning_rate(args, step, steps_per_epoch):
    """lr decayed by --gamma at each --dec-lr epoch passed before `step`."""
    epoch = (step - 1) / steps_per_epoch
    return args.lr * args.gamma ** sum(epoch >= milestone for milestone in args.dec_lr)


def make_optimizer(args, params):
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)


def epsilon_curve(metadata):
    """ε spent after t steps by the data-independent RDP accountant (the worst-case baseline)."""
    if metadata["dp"] == 0:
        return None
    orders = accounting.COMPOSITION_ORDERS
    rdp_step = accounting.baseline_rdp(metadata["noise_multiplier"], metadata["sample_rate"], orders)
    return lambda steps: float(accounting.rdp_to_eps(orders, rdp_step * steps, metadata["delta"])[0])


@torch.no_grad()
def evaluate(model, inputs, labels, device, chunk=1024):
    """Accuracy and mean loss of `model` on a tensor dataset."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, len(labels), chunk):
        x = inputs[start:start + chunk].to(device)
        y = labels[start:start + chunk].to(device)
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(dim=1) == y).sum().item()
    return correct / len(labels), loss_sum / len(labels)


@torch.no_grad()
def per_class_accuracy(model, inputs, labels, num_classes, device, chunk=1024):
    """Test accuracy of each class (nan for a class without test points)."""
    model.eval()
    predictions = torch.cat([model(inputs[start:start + chunk].to(device)).argmax(dim=1).cpu()
                             for start in range(0, len(labels), chunk)])
    hits = torch.bincount(labels[predictions == labels], minlength=num_classes).double()
    counts = torch.bincount(labels, minlength=num_classes).double()
    return (hits / counts).tolist()


class Trainer:
    """One DP-SGD run: the model, its optimizer, and the step function of accounting.md §1."""

    def __init__(self, args, metadata, dataset):
        self.args = args
        self.metadata = metadata
        self.device = torch.device(args.device)
        self.train_x = dataset.train_x.to(self.device)
        self.train_y = dataset.train_y.to(self.device)
        self.test_x, self.test_y = dataset.test_x, dataset.test_y
        torch.manual_seed(int(np.random.SeedSequence([args.seed, sampling.INIT_STREAM]).generate_state(1)[0]))
        self.model = model_for_run(metadata).to(self.device)
        self.per_sample = gradients.wrap_per_sample(self.model)
        self.params = gradients.trainable_parameters(self.model)
        self.optimizer = make_optimizer(args, self.params)
        self.tracked = metadata["tracked_points"]
        self.tracked_rows = []

    def state(self, step, accuracy):
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "test_accuracy": accuracy,
            "tracked_norms": torch.tensor(self.tracked_rows, dtype=torch.float64),
        }

    def restore(self, payload):
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.tracked_rows = payload["tracked_norms"].tolist()

    def per_sample_pass(self, indices):
        """Over `indices`: the transformed-gradient sum u(B), and per sample the loss, the norm
        ||h(g_i)|| and whether the model classifies it correctly."""
        summed = [torch.zeros_like(param) for param in self.params]
        losses, transformed, correct = [], [], []
        self.model.train()  # Opacus records activations in training mode only
        for start in range(0, len(indices), PHYSICAL_BATCH):
            chunk = indices[start:start + PHYSICAL_BATCH]
            grad_samples, chunk_losses, logits = gradients.per_sample_gradients(
                self.per_sample, self.train_x[chunk], self.train_y[chunk])
            norms = gradients.grad_norms(grad_samples)
            if self.metadata["dp"] == 1:
                weights = clipping.scale_weights(norms, self.args.clipping, self.args.cn, self.args.scale_r,
                                                 self.args.scale_s)
            else:
                weights = torch.ones_like(norms)
            for total, part in zip(summed, gradients.weighted_sum(grad_samples, weights)):
                total.add_(part)
            losses.append(chunk_losses)
            transformed.append(clipping.transformed_norm(norms, self.args.clipping, self.args.cn, self.args.scale_r,
                                                         self.args.scale_s).detach()
                               if self.metadata["dp"] == 1 else norms.detach())
            correct.append(logits.argmax(dim=1) == self.train_y[chunk])
        return summed, torch.cat(losses), torch.cat(transformed), torch.cat(correct)

    def privatised_gradient(self, step, batch):
        """ũ/B_exp (sum rule) or m(B) + noise (mean rule), in average-gradient units (§1)."""
        meta = self.metadata
        if len(batch):
            summed, losses, _, _ = self.per_sample_pass(torch.as_tensor(batch, device=self.device))
        else:
            summed, losses = [torch.zeros_like(param) for param in self.params], torch.zeros(0)
        if meta["dp"] == 0:
            return [total / max(len(batch), 1) for total in summed], losses
        generator = sampling.torch_generator(self.args.seed, sampling.NOISE_STREAM, step, self.device)
        noise_std = results.noise_std(meta, "sum")
        noises = [torch.normal(0.0, noise_std, param.shape, generator=generator, device=self.device)
                  for param in self.params]
        if meta["update_rule"] == "sum":
            return [(total + noise) / meta["batch_size"] for total, noise in zip(summed, noises)], losses
        realised = max(len(batch), 1)
        return [total / realised + noise / meta["batch_size"] for total, noise in zip(summed, noises)], losses

    def track(self):
        """||h(g)|| of the tracked points at the current parameters (those step t+1 uses)."""
        indices = torch.as_tensor(self.tracked, device=self.device)
        _, losses, norms, correct = self.per_sample_pass(indices)
        self.tracked_rows.append(torch.stack([norms, losses, correct]).double().cpu().numpy().ravel().tolist())

    def step(self, step):
        """Apply training step `step` (θ_{step−1} → θ_step); returns the mean loss of its batch."""
        if self.tracked is not None:
            self.track()
        batch = sampling.poisson_batch(self.args.seed, step, self.metadata["dataset_size"], self.metadata["sample_rate"])
        update, losses = self.privatised_gradient(step, batch)
        for param, grad in zip(self.params, update):
            param.grad = grad
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.args, step, self.metadata["steps_per_epoch"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses.mean().item() if len(losses) else float("nan")

    def test_accuracy(self):
        return evaluate(self.model, self.test_x, self.test_y, self.device)[0]


def run_differences(existing, planned):
    """What differs between a run on disk and the run the flags describe: flag names, and the dataset."""
    existing_args = existing.get("args", {})
    differing = sorted(key for key in set(existing_args) | set(planned["args"])
                       if existing_args.get(key) != planned["args"].get(key))
    if existing.get("dataset_fingerprint") != planned["dataset_fingerprint"]:
        differing.append("dataset contents")
    return differing


def prepare_run_dir(args, run_dir, metadata):
    """Create the run folder, or check that an existing one holds this same run.

    Checks first that the folder can be written (unless the run is finished: then nothing is
    written), and removes the temp files that killed writes left in it. --overwrite deletes
    an existing run folder, never a folder that holds anything but a run.
    """
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):
        raise UsageError("--save-name", f"{run_dir} is a file, not a run folder")
    if os.path.isdir(run_dir) and args.overwrite == 1:
        if not os.path.exists(checkpoints.metadata_path(run_dir)) and _foreign_files(run_dir):
            raise UsageError("--overwrite", f"{run_dir} is not a run folder (no {checkpoints.METADATA_FILE}; it holds "
                                            f"{', '.join(_foreign_files(run_dir)[:3])}); refusing to delete it")
        fileio.check_folder(args.models_dir, "--models-dir")
        fileio.check_folder(run_dir, "--save-name")
        shutil.rmtree(run_dir)
    finished = metadata["total_steps"] in checkpoints.saved_steps(run_dir)
    if not finished:
        fileio.writable_folder(args.models_dir, "--models-dir")
        fileio.writable_folder(run_dir, "--save-name")
    fileio.remove_stale_temps(run_dir)
    if os.path.exists(checkpoints.metadata_path(run_dir)):
        differing = run_differences(checkpoints.load_metadata(run_dir), metadata)
        if differing:
            raise UsageError("--overwrite", f"{run_dir} holds a run with different flags ({', '.join(differing)}); "
                             "use another --save-name or --overwrite")
        return
    if checkpoints.saved_steps(run_dir):
        raise UsageError("--save-name", f"{run_dir} holds checkpoints but no {checkpoints.METADATA_FILE}, so they "
                                        "may be another run's; delete them or use --overwrite")
    checkpoints.save_metadata(run_dir, metadata)


def _foreign_files(run_dir):
    """Names in `run_dir` that a run does not write (checkpoints, lock and temp files are a run's)."""
    own = re.compile(r"^(step_\d{7}\.pt|tracked_norms\.csv(\.lock)?|\.tmp-.*)$")
    return sorted(name for name in os.listdir(run_dir) if not own.match(name))


def latest_checkpoint(run_dir, planned):
    steps = [step for step in checkpoints.saved_steps(run_dir) if step in planned]
    return steps[-1] if steps else None


def train(args, quiet=False):
    """Train (or resume, or find finished) the run named by `args`; returns its metadata."""
    resolve_training_args(args)
    dataset = load_dataset(args.dataset, args.data_root, less_point=args.less_point)
    metadata = plan_run(args, dataset)
    run_dir = run_dir_for(args)
    started = time.time()
    trainer = Trainer(args, metadata, dataset)
    prepare_run_dir(args, run_dir, metadata)
    planned = set(metadata["checkpoint_steps"])
    total_steps = metadata["total_steps"]
    resume_step = latest_checkpoint(run_dir, planned)
    if resume_step is None:
        accuracy = trainer.test_accuracy()
        checkpoints.save_checkpoint(run_dir, 0, trainer.state(0, accuracy))
        resume_step = 0
    else:
        payload = checkpoints.load_checkpoint(run_dir, resume_step, args.device)
        with checkpoints.restoring(run_dir, resume_step):
            trainer.restore(payload)
        accuracy = payload["test_accuracy"]
    metadata["resumed_from"] = resume_step
    epsilon_spent = epsilon_curve(metadata)
    eval_freq = args.eval_freq
    progress = tqdm(range(resume_step + 1, total_steps + 1), initial=resume_step, total=total_steps,
                    desc=f"train {metadata['run']}", disable=quiet, file=sys.stderr, dynamic_ncols=True)
    for step in progress:
        loss = trainer.step(step)
        at_checkpoint = step in planned
        if at_checkpoint or (eval_freq and step % eval_freq == 0):
            accuracy = trainer.test_accuracy()
        if at_checkpoint:
            checkpoints.save_checkpoint(run_dir, step, trainer.state(step, accuracy))
        postfix = {"loss": f"{loss:.3f}", "test_acc": f"{accuracy:.3f}"}
        if epsilon_spent:
            postfix["eps"] = f"{epsilon_spent(step):.2f}"
        progress.set_postfix(postfix, refresh=False)
    progress.close()
    if trainer.tracked is not None:
        write_tracked_norms(run_dir, metadata, trainer.tracked_rows, dataset)
    metadata["final_test_accuracy"] = accuracy
    metadata["train_seconds"] = time.time() - started
    return metadata


def write_tracked_norms(run_dir, metadata, tracked_rows, dataset):
    """The tracked points' ||h(g)|| at every step as a sensitivity CSV (quantity grad_norm).

    Row step s holds the norm at θ_s, which is what step s+1 uses (accounting.md §4).
    """
    points = np.asarray(metadata["tracked_points"])
    table = np.asarray(tracked_rows).reshape(len(tracked_rows), 3, len(points))
    steps = np.repeat(np.arange(len(tracked_rows)), len(points))
    frame = pd.DataFrame({column: None for column in results.COLUMNS}, index=range(len(steps)))
    for column, value in results.run_columns(metadata, "sum").items():
        frame[column] = value
    frame["step"] = steps
    frame["stage"] = steps / metadata["total_steps"]
    frame["point"] = np.tile(points, len(tracked_rows))
    frame["label"] = dataset.train_y.numpy()[frame["point"].to_numpy()]
    frame["value"] = table[:, 0, :].ravel()
    frame["loss"] = table[:, 1, :].ravel()
    frame["correct"] = table[:, 2, :].ravel().astype(int)
    frame["exp"] = "tracked"
    frame["direction"] = "none"
    frame["target_batch"] = 0
    frame["sample"] = 0
    frame["quantity"] = "grad_norm"
    fileio.write_csv(os.path.join(run_dir, "tracked_norms.csv"), frame[results.COLUMNS])

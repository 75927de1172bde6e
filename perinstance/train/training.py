"""The DP-SGD training loop of accounting.md §1, resumable and bitwise reproducible.

It takes a typed run (runs.RunConfig); the flags become one in runs.py. Step t (1..T) maps
θ_{t−1} to θ_t. Its Poisson batch and its noise are drawn from (seed, step) alone
(sampling.py), so resuming from any checkpoint needs no generator state and ends with the
same bytes as an uninterrupted run.
"""

import math
import sys
import time
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from perinstance.accounting.mechanism import Mechanism
from perinstance.errors import UsageError
from perinstance.files import checkpoints, fileio, tracked_rows
from perinstance.persample import batches, gradients, layer_pass
from perinstance.persample.finite import NonFiniteValues
from perinstance.train import (
    canaries,
    clipping,
    distributed,
    evaluation,
    filtering,
    non_finite,
    run_plan,
    runs,
    sampling,
    tracking,
    user_code,
)
from perinstance.train.data import Dataset, load_dataset
from perinstance.train.input_canaries import InputCanaries
from perinstance.train.nets import build_model

# Steps between reads of the batch losses: reading a value back from a GPU waits for the queued work, so reading
# it at every step would keep the host from launching the next step's kernels while the device runs this one.
# Checkpoint steps always read (and T is one).
LOSS_READ_STEPS = 16


@dataclass(frozen=True)
class Outcome:
    """What a call of `train` did to its run."""

    run: runs.RunConfig
    run_dir: str
    resumed_from: int  # the checkpoint it started from (T: the run was already trained)
    final_test_accuracy: float  # nan where the targets are not class labels (batches.correct_predictions)
    train_seconds: float
    steps_seconds: float = 0.0  # in the training steps themselves (batches, gradients, noise, update)
    tracking_seconds: float = 0.0  # measuring the tracked points (tracking.py)
    final_test_loss: float = math.nan  # the mean test loss, where this call evaluated the final parameters
    point_bounds: str = ""  # what per-point clipping and the filter did (filtering.PerPointBounds.summary)

    @property
    def trained(self) -> bool:
        return self.resumed_from != self.run.total_steps


def model_for_run(run: runs.RunConfig) -> nn.Module:
    """The untrained architecture of a run (weights come from a checkpoint or the init seed)."""
    if user_code.is_spec(run.model):  # the user's own network, from the file the run was trained with
        return user_code.build_model(run.model, run.input_shape, run.num_classes, run.private,
                                     (run.user_code or {}).get("model"))
    if len(run.input_shape) != 3:
        raise UsageError("--model", f"{run.model} takes C×H×W images, but one input of {run.dataset} has shape "
                                    f"{tuple(run.input_shape)}; give a network of your own (--model PATH.py:NAME)")
    channels, height, _ = run.input_shape
    return build_model(run.model, channels, height, run.num_classes, run.norm_type, dp=run.private)


def loss_for_run(run: runs.RunConfig) -> batches.LossFn | None:
    """The per-example loss a run is trained and measured with: None for the default (cross-entropy on class
    indices), else its --loss spec's function, from the file the run was trained with."""
    if run.loss is None:
        return None
    return user_code.load_loss(run.loss, (run.user_code or {}).get("loss"))


def load_model(run: runs.RunConfig, run_dir: str, step: int, device: str = "cpu") -> tuple[nn.Module, dict]:
    """The run's model with the weights of checkpoint `step`, in eval mode, and the payload."""
    payload = checkpoints.load_checkpoint(run_dir, step, device)
    model = model_for_run(run).to(device)
    with checkpoints.restoring(run_dir, step):
        model.load_state_dict(payload["model"])
    model.eval()
    return model, payload


@torch.no_grad()
def weight_change(run: runs.RunConfig, run_dir: str, start: int, end: int) -> float:
    """||θ_end − θ_start||₂ over every parameter of the model, from the run's checkpoints `start` and `end`."""
    (first, _), (last, _) = (load_model(run, run_dir, step) for step in (start, end))
    return math.sqrt(sum(float(((after - before) ** 2).sum())
                         for before, after in zip(first.parameters(), last.parameters(), strict=True)))


def learning_rate(run: runs.RunConfig, step: int) -> float:
    """lr decayed by gamma at each dec_lr epoch passed before `step`."""
    epoch = (step - 1) / run.steps_per_epoch
    return run.lr * run.gamma ** sum(epoch >= milestone for milestone in run.dec_lr)


def make_optimizer(run: runs.RunConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if run.optimizer == "adam":
        return torch.optim.Adam(params, lr=run.lr)
    return torch.optim.SGD(params, lr=run.lr, momentum=run.momentum)


def epsilon_curve(run: runs.RunConfig) -> Callable[[int], float] | None:
    """ε spent after t steps by the data-independent RDP accountant (the worst-case baseline)."""
    if not run.private:
        return None
    mechanism = Mechanism.of_run(run)
    return lambda steps: mechanism.baseline_eps(run.delta, steps)[0]


class Trainer:
    """One DP-SGD run: the model, its optimizer, and the step function of accounting.md §1; `tracker` measures the
    tracked points (tracking.py; under torchrun in lockstep with the ranks of `world`)."""

    def __init__(self, run: runs.RunConfig, dataset: Dataset, device: str | torch.device = "cpu",
                 world: distributed.World | None = None) -> None:
        self.run = run
        self.device = torch.device(device)
        self.train_x = dataset.train_x.to(self.device)
        self.train_y = dataset.train_y.to(self.device)
        self.test_x, self.test_y = dataset.test_x, dataset.test_y
        torch.manual_seed(sampling.init_seed(run.seed))
        self.model = model_for_run(run).to(self.device)
        # Every step takes its per-sample gradients in eval mode (dropout off, docs/flags.md), the mode in which
        # compute_sensitivity.py and the tracking measure Δ*, so that the norms a step clips are the ones measured.
        # Set here rather than left to the first evaluation: a resumed run, which does not evaluate before its first
        # step, then steps in the same mode as an uninterrupted one.
        self.model.eval()
        self.loss_fn = loss_for_run(run)
        if self.loss_fn is not None:  # a loss that cannot take the model's outputs is refused before any write
            user_code.check_loss(self.loss_fn, run.loss, self.model, self.train_x, self.train_y)
        self.params = layer_pass.trainable_parameters(self.model)
        self.optimizer = make_optimizer(run, self.params)
        # A planted fault (runs.PLANTED_FAULTS, audit.py --self-test only) is applied where the real step does the
        # thing it breaks; run.json still states the mechanism without it.
        self.noise_std = Mechanism.of_run(run, "sum").noise_std / (2 if run.planted_fault == "half_noise" else 1)
        self.canaries = canaries.Canaries(run, self.params, self.device) if run.canaries else None
        self.input_canaries = InputCanaries(run, dataset.train_x, self.device) if run.input_canaries else None
        if self.input_canaries:  # an included input canary is a training example after the real ones
            self.train_x = torch.cat([self.train_x, self.input_canaries.inputs])
            self.train_y = torch.cat([self.train_y, self.input_canaries.labels])
        self.projections = canaries.ProjectionLog() if run.canaries or run.input_canaries else None
        # Examples per pass, from the model's shapes and the device's kind alone: the passes a batch is cut into
        # (gradients.batch_passes, of its size and this), hence the order of its sums and every bit of a step,
        # depend on nothing but the batch drawn.
        self.chunk = gradients.examples_per_pass(self.model, self.train_x, self.device)
        # The values of the steps whose loss is not read yet, and the run's folder, latest step and progress bar
        # for an error (non_finite.py).
        self.log, self.run_dir, self.latest_step, self.progress = non_finite.StepLog(), "", 0, None
        # The tracker asks the trainer why training stops; it holds the trainer weakly, so that a finished trainer
        # (its data, model and canaries) is freed when its run returns, not at the next cycle collection.
        stopped = weakref.WeakMethod(self.stopped)
        self.tracker = None if run.tracked_points is None else \
            tracking.Tracker(run, self.model, self.train_x, self.train_y, self.device, self.chunk, world, self.loss_fn,
                             refuse=lambda step, met: stopped()(step, met))
        # Each point clipped at its own bound, and the filter (§12.2, §12.4), where the run has them.
        self.point_bounds = filtering.PerPointBounds(run, self.device) if run.per_point_clipping else None

    def state(self, step: int, accuracy: float) -> dict:
        return {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "test_accuracy": accuracy,
            **(self.projections.payload(step, self.run.canaries + self.run.input_canaries) if self.projections
               else {}),
            **(self.point_bounds.payload() if self.point_bounds else {}),
        }

    def restore(self, payload: dict) -> None:
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.latest_step = payload["step"]
        if self.projections:
            if canaries.PROJECTIONS_KEY not in payload:
                raise UsageError("--save-name", f"checkpoint {payload['step']} of {self.run.run} holds no canary "
                                                "projections (an earlier version's); train the run again")
            self.projections.restart(payload["step"])
        if self.point_bounds:
            self.point_bounds.restore(payload, payload["step"])

    def per_sample_pass(self, indices: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Under privacy, over `indices`: the transformed-gradient sum u(B) and the per-sample losses."""
        summed, losses = None, []
        for span in gradients.batch_passes(len(indices), self.chunk):
            weights = self.point_bounds.weights(indices[span]) if self.point_bounds else self._weights
            examples = self._examples(indices[span])
            try:
                chunk_sums, chunk_losses, norms, outputs = gradients.clipped_gradient_sum(self.model, *examples,
                                                                                          weights, self.loss_fn)
            except NonFiniteValues as error:  # met by the engine's check of a user's model (fallback_norms.py)
                row = int(indices[span][error.found.position])
                raise self.stopped(self.latest_step + 1, non_finite.seen(
                    self.model, *examples, self.loss_fn, error, self.latest_step,
                    non_finite.training_example(self.run, row))) from None
            self.log.add(norms, outputs, len(chunk_losses))
            # Chunk by chunk in order (the first chunk's sums are their own buffers): the same bits as adding
            # every chunk to zeros.
            summed = chunk_sums if summed is None else [total.add_(part) for total, part in zip(summed, chunk_sums)]
            losses.append(chunk_losses)
        return summed, torch.cat(losses)

    def gradient_sum(self, indices: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Without privacy: Σ_i ∇ℓ_i over `indices` and the losses, by ordinary backward passes (no per-sample
        norm is needed)."""
        summed = [torch.zeros_like(param) for param in self.params]
        losses = []
        for span in gradients.batch_passes(len(indices), self.chunk):
            inputs, labels = self._examples(indices[span])
            outputs = self.model(inputs)
            chunk_losses = batches.per_example_loss(outputs, labels, self.loss_fn)
            self.log.add(None, outputs, len(chunk_losses))
            parts = torch.autograd.grad(chunk_losses.sum(), self.params, allow_unused=True)
            for total, part in zip(summed, parts):
                if part is not None:
                    total.add_(part)
            losses.append(chunk_losses.detach())
        return summed, torch.cat(losses)

    def _examples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training inputs and labels at `indices` (index_select: 3.5× faster than indexing on a CPU)."""
        return self.train_x.index_select(0, indices), self.train_y.index_select(0, indices)

    def _weights(self, norms):
        """w(||g_i||) of h(g) = w·g (§1)."""
        run = self.run
        if run.planted_fault == "no_clipping":
            return torch.ones_like(norms)
        return clipping.scale_weights(norms, run.clipping, run.clip_norm, run.scale_r, run.scale_s)

    def draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Step `step`'s Poisson batch: (the training examples in it, real points and included input canaries, as
        indices into train_x; the included gradient canaries in it). One draw over the real points, then the
        gradient canaries, then the input canaries: the real points' batch is the one a run without canaries
        draws."""
        run = self.run
        rate = min(1.0, 2 * run.sample_rate) if run.planted_fault == "double_rate" else run.sample_rate
        drawn = sampling.poisson_batch(run.seed, step, run.dataset_size + run.canaries + run.input_canaries, rate)
        extra = drawn[drawn >= run.dataset_size] - run.dataset_size
        gradient_members = self.canaries.members(extra[extra < run.canaries]) if self.canaries else extra[:0]
        batch = drawn[drawn < run.dataset_size]
        if self.point_bounds:  # a point out of the filter is dropped; the others' draws stay the same
            batch = self.point_bounds.keep(batch)
        if self.input_canaries:
            batch = np.concatenate([batch, run.dataset_size + self.input_canaries.members(
                extra[extra >= run.canaries] - run.canaries)])
        return batch, gradient_members

    def project(self, update: list[torch.Tensor]) -> torch.Tensor:
        """Every canary's x at this step (gradient canaries, then input canaries), at θ_{t−1}."""
        rows = [self.canaries.project(update)] if self.canaries else []
        if self.input_canaries:
            rows.append(self.input_canaries.project(self.model, update, self.chunk))
        return torch.cat(rows)

    def canary_record(self, run_dir: str) -> canaries.CanaryRecord:
        """The run's canaries with their projections at every step, from its checkpoints."""
        run = self.run
        kinds = np.repeat([canaries.GRADIENT, canaries.INPUT], [run.canaries, run.input_canaries])
        norms = np.concatenate([self.canaries.norms if self.canaries else [], np.ones(run.input_canaries)])
        included = np.concatenate([self.canaries.included if self.canaries else np.zeros(0, dtype=bool),
                                   self.input_canaries.included if self.input_canaries else np.zeros(0, dtype=bool)])
        return canaries.CanaryRecord(kinds=kinds, norms=norms, included=included,
                                     projections=canaries.gather_projections(run_dir, run, len(kinds)))

    def privatised_gradient(self, step: int, batch: np.ndarray, gradient_canaries: np.ndarray = ()
                            ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """ũ/B_exp (sum rule) or m(B) + noise (mean rule), in average-gradient units (§1), with the gradient
        canaries `gradient_canaries` added to the clipped sum."""
        run = self.run
        if not len(batch):
            summed, losses = [torch.zeros_like(param) for param in self.params], torch.zeros(0)
        elif run.private:
            summed, losses = self.per_sample_pass(torch.as_tensor(batch, device=self.device))
        else:
            summed, losses = self.gradient_sum(torch.as_tensor(batch, device=self.device))
        if not run.private:
            return [total / max(len(batch), 1) for total in summed], losses
        if len(gradient_canaries):
            self.canaries.add_to(summed, gradient_canaries)
        generator = sampling.torch_generator(run.seed, sampling.NOISE_STREAM, step, self.device)
        noises = [torch.normal(0.0, self.noise_std, param.shape, generator=generator, device=self.device)
                  for param in self.params]
        # In place (the sums are this step's own buffers), all parameters in one call: the same arithmetic as one
        # operation per parameter, without the dispatch of each.
        if run.update_rule == "sum":
            torch._foreach_add_(summed, noises)
            torch._foreach_div_(summed, run.batch_size)
        elif run.planted_fault == "noise_before_division":
            torch._foreach_div_(noises, run.batch_size)
            torch._foreach_add_(summed, noises)
            torch._foreach_div_(summed, max(len(batch) + len(gradient_canaries), 1))
        else:
            torch._foreach_div_(summed, max(len(batch) + len(gradient_canaries), 1))
            torch._foreach_div_(noises, run.batch_size)
            torch._foreach_add_(summed, noises)
        return summed, losses

    def step(self, step: int) -> torch.Tensor | None:
        """Apply training step `step` (θ_{step−1} → θ_step); returns the mean loss of its batch (at
        θ_{step−1}) as a tensor on the device, not read back (see train_run), None for an empty batch: NaN where a
        value of the step is not finite (then `stopped` says which)."""
        batch, gradient_canaries = self.draw(step)
        self.log.begin(step, batch)
        update, losses = self.privatised_gradient(step, batch, gradient_canaries)
        batch_loss = self.log.end(losses, None if self.run.private else update)
        if self.projections:
            self.projections.append(self.project(update))
        for param, grad in zip(self.params, update):
            param.grad = grad
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.run, step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.latest_step = step
        return batch_loss

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(param).all()) for param in self.params)

    def stopped(self, step: int, met: non_finite.Seen | None = None) -> UsageError:
        """The error that stops training at `step` (a batch loss that is not finite, or `met`, a value that a pass
        met before it): the user's code's, or the learning rate's (non_finite.training_stop). The progress bar is
        erased: the error is the one line left."""
        self.erase_progress()
        return non_finite.training_stop(self.run, self.log, self.weights_finite,
                                        lambda at, what: diverged(self.run, self.run_dir, at, what), step, met)

    def erase_progress(self) -> None:
        if self.progress is not None:
            self.progress.leave = False
            self.progress.close()

    def evaluate(self) -> tuple[float, float]:
        """Test accuracy (nan where the targets are not class labels) and mean test loss; a test loss that is not
        finite stops training (non_finite.test_stop)."""
        accuracy, loss = evaluation.evaluate(self.model, self.test_x, self.test_y, self.device, loss_fn=self.loss_fn)
        if not math.isfinite(loss):
            error = non_finite.test_stop(self.run, self.model, self.test_x, self.test_y, self.device, self.chunk,
                                         self.loss_fn, self.latest_step)
            if error is not None:
                self.erase_progress()
                raise error
        return accuracy, loss


def latest_checkpoint(run_dir: str, planned: Collection[int]) -> int | None:
    steps = [step for step in checkpoints.saved_steps(run_dir) if step in planned]
    return steps[-1] if steps else None


def train(args: run_plan.TrainingFlags, quiet: bool = False, world: distributed.World | None = None) -> Outcome:
    """Train (or resume, or find finished) the run that the training flags `args` (run_plan.TrainingFlags) name.
    `world`: the ranks of a torchrun launch (its process group started) that go through this run in lockstep, each
    measuring its share of the tracked points (tracking.py); rank 0 trains and writes."""
    args = run_plan.resolve_training_args(args)
    dataset = load_dataset(args.dataset, args.data_root, less_point=args.less_point,
                           class_labels=args.loss is None)
    run = run_plan.plan_run(args, dataset)
    run_dir = run_plan.run_dir_for(args)
    trainer = Trainer(run, dataset, args.device, world)  # builds the model: refuses a bad architecture before any write
    if world is None:
        # A run that the user's code stops leaves nothing of this call (non_finite.py): a new run no file.
        with fileio.removing_new_files(run_dir, non_finite.UserCodeStop):
            run_plan.prepare_run_dir(args, run_dir, run)
            return train_run(trainer, run_dir, args.eval_freq, quiet)

    def prepared() -> int:
        run_plan.prepare_run_dir(args, run_dir, run)
        resumed = latest_checkpoint(run_dir, set(run.checkpoint_steps))
        return 0 if resumed is None else resumed

    if trainer.tracker is None:
        raise ValueError("a run is trained in lockstep only to share its tracked points (--track-points)")
    if world.rank:
        started = time.time()
        resumed_from = tracking.follow(trainer.tracker, distributed.from_rank0(world, prepared))
        return Outcome(run=run, run_dir=run_dir, resumed_from=resumed_from, final_test_accuracy=math.nan,
                       train_seconds=time.time() - started, tracking_seconds=trainer.tracker.seconds)
    try:
        with fileio.removing_new_files(run_dir, non_finite.UserCodeStop):
            trainer.tracker.following = distributed.from_rank0(world, prepared) < run.total_steps
            return train_run(trainer, run_dir, args.eval_freq, quiet)
    except UsageError as error:
        trainer.tracker.stop(error)
        raise


def train_run(trainer: Trainer, run_dir: str, eval_freq: int | None = None, quiet: bool = False) -> Outcome:
    """Train the trainer's run (its folder `run_dir` prepared) from its latest checkpoint to
    step T, saving a checkpoint at every planned step; the tracked points' values at θ_{t−1} before each step t,
    and at θ_T, are written before the checkpoint that ends their span, and as one table at the end."""
    started = time.time()
    run, device, tracker = trainer.run, trainer.device, trainer.tracker
    trainer.run_dir = run_dir
    planned = set(run.checkpoint_steps)
    resume_step = latest_checkpoint(run_dir, planned)
    test_loss = math.nan  # known once evaluated in this call (a checkpoint keeps the accuracy alone)
    if resume_step is None:
        accuracy, test_loss = trainer.evaluate()
        checkpoints.save_checkpoint(run_dir, 0, trainer.state(0, accuracy))
        resume_step, payload = 0, {}
    else:
        payload = checkpoints.load_checkpoint(run_dir, resume_step, device)
        with checkpoints.restoring(run_dir, resume_step):
            trainer.restore(payload)
        accuracy = payload["test_accuracy"]
    if tracker:
        tracker.resume(run_dir, resume_step, payload)
    epsilon_spent = epsilon_curve(run)
    progress = tqdm(range(resume_step + 1, run.total_steps + 1), initial=resume_step, total=run.total_steps,
                    desc=f"train {run.run}", disable=quiet, file=sys.stderr, dynamic_ncols=True)
    unread, loss, steps_seconds = [], None, 0.0
    bounds = trainer.point_bounds
    trainer.progress = progress
    for step in progress:
        if tracker and tracker.due(step - 1):
            values = tracker.measure(step - 1, bounds.measuring() if bounds else None)
            if bounds:
                bounds.measured(values[0])
        if bounds:
            bounds.before_step(step)
        step_started = time.perf_counter()
        batch_loss = trainer.step(step)
        steps_seconds += time.perf_counter() - step_started
        if batch_loss is not None:
            unread.append((step, batch_loss))
        at_checkpoint = step in planned
        if at_checkpoint or step % LOSS_READ_STEPS == 0:
            # Every loss since the last read, in one transfer; the first that is not finite stops the run before
            # any later checkpoint is saved.
            values = torch.stack([value for _, value in unread]).tolist() if unread else []
            for (loss_step, _), value in zip(unread, values):
                if not math.isfinite(value):
                    raise trainer.stopped(loss_step)
            loss, unread = (values[-1] if values else loss), []
            trainer.log.clear()
        if at_checkpoint and not trainer.weights_finite():
            raise trainer.stopped(step + 1)
        if at_checkpoint or (eval_freq and step % eval_freq == 0):
            accuracy, test_loss = trainer.evaluate()
        if at_checkpoint:
            if tracker:
                tracker.checkpoint(run_dir, step)
            checkpoints.save_checkpoint(run_dir, step, trainer.state(step, accuracy))
        postfix = {"loss": "-" if loss is None else f"{loss:.3f}"}
        if math.isnan(accuracy):  # targets that are not class labels: the test loss instead
            postfix["test_loss"] = f"{test_loss:.4g}"
        else:
            postfix["test_acc"] = f"{accuracy:.3f}"
        if bounds and bounds.filter is not None:  # each point's own ε is its budget: show who is still in
            postfix["in"] = int(bounds.filter.active.sum())
        elif epsilon_spent:
            postfix["eps"] = f"{epsilon_spent(step):.2f}"
        progress.set_postfix(postfix, refresh=False)
    progress.close()
    if tracker and not tracked_rows.has_table(run_dir):
        tracker.write_table(run_dir, trainer.train_y, bounds)
    if trainer.projections:
        canaries.write_canaries(run_dir, run, trainer.canary_record(run_dir))
    return Outcome(run=run, run_dir=run_dir, resumed_from=resume_step, final_test_accuracy=accuracy,
                   final_test_loss=test_loss, train_seconds=time.time() - started, steps_seconds=steps_seconds,
                   tracking_seconds=tracker.seconds if tracker else 0.0,
                   point_bounds=bounds.summary() if bounds else "")


class Diverged(UsageError):
    """A run whose loss or weights stopped being finite (diverged): a usage error of its --lr."""


def diverged(run: runs.RunConfig, run_dir: str, step: int, what: str) -> Diverged:
    """The one-line error of a run whose values at θ_{step−1} or weights at θ_step (`what`, "the loss is nan at
    step 12") are no longer finite where the suite's own code made them (non_finite.training_stop): training
    stops there, and the checkpoints before keep their finite weights."""
    latest = latest_checkpoint(run_dir, set(run.checkpoint_steps))
    return Diverged("--lr", f"training diverged: {what} of {run.total_steps} (learning rate "
                              f"{learning_rate(run, step):g}); the checkpoints up to step {latest} in {run_dir} are "
                              "kept; train with a smaller --lr")

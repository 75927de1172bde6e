"""Δ* of the tracked points at every step of a run (docs/accounting.md §4): ||h(g)||, the loss and correctness of each
tracked point at θ_0 .. θ_T, the parameters each step t starts from (θ_{t−1}) and the final ones, in eval mode, by
compute_sensitivity.py's norms pass (gradients.per_sample_norms over chunks of gradients.examples_per_pass examples,
then the transform's clipping.Transform.norms; norms only: no clipped sum, no weight gradient).

The values of the steps between two checkpoints are written as one segment before the later checkpoint
(files/tracked_rows.py), so that a resumed run ends with the values of an uninterrupted one and no checkpoint carries
them; at the end they become models/<run>/tracked_norms.csv (.parquet past the storage threshold), a result table
the accountants read. Under torchrun with fewer runs than processes, every rank follows rank 0 through the run in
lockstep: rank 0 trains and sends θ_{t−1} before each step, each rank measures its share of the points (item i to rank
i mod W), and rank 0 gathers the shares and writes them.

A run with per-point clipping (filtering.py: a filter, or --track-every k) measures at θ_0, θ_k, θ_2k, ... and θ_T
only, and its rank 0 gathers the shares at each measurement, since the next step's bounds and charges need them; a
filter's points out of training are not measured until θ_T (NaN, left out of the table).
"""

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from torch import nn

from perinstance.errors import UsageError
from perinstance.files import results, tracked_rows
from perinstance.persample import batches, finite, gradients
from perinstance.persample.layer_pass import eval_mode
from perinstance.train import distributed, filtering, non_finite, runs
from perinstance.train.clipping import Transform

# The values recorded per point and step, in the order of a segment's second axis.
VALUES = ("value", "loss", "correct")


class Tracker:
    """The tracked points of one run: measures them at the current parameters, holds the values since the last
    checkpoint, and writes them. `world`: a torchrun launch whose ranks share the points in lockstep (None: this
    process measures them all). `refuse(step, met)`: the error that stops training at `step` for `met`, a
    value that is not finite at θ_{step−1} (the trainer's `stopped`, which knows whether the steps before made it)."""

    def __init__(self, run: runs.RunConfig, model: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor,
                 device: torch.device, per_pass: int, world: distributed.World | None,
                 loss_fn: batches.LossFn | None, refuse: Callable[[int, non_finite.Seen], Exception]) -> None:
        self.run, self.model, self.world, self.loss_fn, self.refuse = run, model, world, loss_fn, refuse
        self.points = np.asarray(run.tracked_points, dtype=np.int64)
        mine = self.points if world is None else np.asarray(world.share(self.points), dtype=np.int64)
        self.indices = torch.as_tensor(mine, device=device)
        self.train_x, self.train_y = train_x, train_y
        self.transform = Transform.of_run(run) if run.private else None
        self.chunk = per_pass  # the trainer's examples per pass (gradients.examples_per_pass)
        self.held, self.held_steps = [], []
        self.seconds = 0.0
        self.following = False  # rank 0: the other ranks are in the lockstep and wait for it
        # Per-point clipping (filtering.py) needs every point's value before the next step: rank 0 gathers the shares
        # at each measurement rather than at each checkpoint.
        self.gather_each = world is not None and run.per_point_clipping

    @property
    def leads(self) -> bool:
        """Whether this process writes the values (rank 0, or a process alone)."""
        return self.world is None or self.world.rank == 0

    def due(self, step: int) -> bool:
        """Whether θ_step is measured: every run.measure_every steps from θ_0, and θ_T."""
        return step % self.run.measure_every == 0 or step == self.run.total_steps

    def measure(self, step: int, wanted: np.ndarray | None = None) -> np.ndarray:
        """Hold the values at the current parameters as those of θ_step (under lockstep, rank 0's parameters), and
        return them: every tracked point's where this process leads and gathers at each measurement, else its own.
        `wanted`: which tracked points to measure (a filter's points still in training; rank 0's under lockstep;
        None: all); the others' values are NaN."""
        started = time.perf_counter()
        if self.world is not None:
            distributed.rank0_says_go(self.world)
            distributed.broadcast_from_rank0(self.model.state_dict().values())
            if self.gather_each:
                shared = torch.ones(len(self.points), dtype=torch.uint8, device=self.indices.device)
                if wanted is not None:
                    shared.copy_(torch.as_tensor(wanted, dtype=torch.uint8))
                distributed.broadcast_from_rank0([shared])
                wanted = shared.bool().cpu().numpy()[self.world.rank::self.world.size]
        with eval_mode(self.model):
            values = self.values(step, wanted)
        if self.gather_each:
            values = self._gathered(values)
        self.held.append(values)
        self.held_steps.append(step)
        self.seconds += time.perf_counter() - started
        return values

    def _gathered(self, values):
        """Rank 0: every rank's share of `values` (..., points of the rank) put together as (..., points), a rank's
        points being every world.size-th from its rank; the others: their own share."""
        distributed.rank0_says_go(self.world)
        shares = distributed.gather_to_rank0(self.world, values)
        if shares is None:
            return values
        whole = np.empty(values.shape[:-1] + (len(self.points),), dtype=np.float32)
        for rank, share in enumerate(shares):
            whole[..., rank::self.world.size] = share
        return whole

    def values(self, step: int, wanted: np.ndarray | None = None) -> np.ndarray:
        """(3, points of this process) float32 at θ_step: ||h(g)|| (||g|| without privacy), loss, correctness (nan
        where the targets are not class labels, batches.correct_predictions); NaN for the points `wanted` leaves
        out. A norm, loss or output that is not finite is refused (`refuse`), read back with the values."""
        if wanted is not None:
            values = np.full((len(VALUES), len(self.indices)), np.nan, dtype=np.float32)
            if wanted.any():
                chosen = self.indices[torch.as_tensor(wanted, device=self.indices.device)]
                values[:, wanted] = self._measured(step, chosen)
            return values
        return self._measured(step, self.indices)

    def _measured(self, step: int, indices: torch.Tensor) -> np.ndarray:
        if not len(indices):  # more ranks than points
            return np.zeros((len(VALUES), 0), dtype=np.float32)
        norms, losses, correct, grad_norms_seen, outputs_finite = [], [], [], [], []
        for start in range(0, len(indices), self.chunk):
            chunk = indices[start:start + self.chunk]
            inputs, labels = self.train_x.index_select(0, chunk), self.train_y.index_select(0, chunk)
            try:
                grad_norms, chunk_losses, outputs = gradients.per_sample_norms(self.model, inputs, labels,
                                                                               self.loss_fn)
            except finite.NonFiniteValues as error:  # met by the engine's check of a user's model
                point = int(chunk[error.found.position])
                raise self.refuse(step + 1, non_finite.seen(self.model, inputs, labels, self.loss_fn, error, step,
                                                            f"tracked point {point}")) from None
            norms.append(grad_norms if self.transform is None else self.transform.norms(grad_norms))
            losses.append(chunk_losses)
            hits = batches.correct_predictions(outputs, labels)
            correct.append(torch.full_like(chunk_losses, torch.nan) if hits is None else hits)
            grad_norms_seen.append(grad_norms)
            outputs_finite.append(finite.finite_examples(outputs, len(chunk)))
        values = torch.stack([torch.cat(norms), torch.cat(losses), torch.cat(correct).float(),
                              torch.cat(grad_norms_seen), torch.cat(outputs_finite).float()]).cpu().numpy()
        if not (np.isfinite(values[1]).all() and np.isfinite(values[3]).all() and values[4].all()):
            self._refuse(step, indices, values)
        return values[:len(VALUES)]

    def _refuse(self, step: int, indices: torch.Tensor, values: np.ndarray) -> None:
        """Raise `refuse`'s error for the first of `indices` whose output, loss or gradient norm at θ_step is not
        finite (`values` rows: as `values`, then ||g|| and whether the outputs are finite)."""
        losses, grad_norms, outputs_finite = (torch.from_numpy(values[row]) for row in (1, 3, 4))
        found = finite.first_non_finite(losses, grad_norms, outputs_finite=outputs_finite.bool())
        point = indices[found.position:found.position + 1]
        source = finite.source_of(self.model, self.train_x.index_select(0, point), self.train_y.index_select(0, point),
                                  self.loss_fn, replace(found, position=0))
        raise self.refuse(step + 1, non_finite.Seen(step, f"tracked point {int(point[0])}", found, source))

    def checkpoint(self, run_dir: str, step: int) -> None:
        """At checkpoint `step`: the values of θ_T too if it is the last, then the segment written (flush)."""
        if step == self.run.total_steps:
            self.measure(step)
        self.flush(run_dir)

    def flush(self, run_dir: str) -> None:
        """Write the values held as one segment (rank 0 gathers the others' shares first, unless it gathered them at
        each measurement) and let them go; a span without a measurement writes nothing."""
        started = time.perf_counter()
        if self.held and self.world is not None and not self.gather_each:
            self.held = list(self._gathered(np.stack(self.held)))
        if self.held and self.leads:
            tracked_rows.save_segment(run_dir, self.held_steps, self.points, np.stack(self.held))
        if self.held_steps and self.held_steps[-1] == self.run.total_steps:  # θ_T is in: the lockstep is over
            self.following = False
        self.held, self.held_steps = [], []
        self.seconds += time.perf_counter() - started

    def stop(self, error: UsageError) -> None:
        """Rank 0: tell the ranks still waiting for it to stop with `error`."""
        if self.following and self.world is not None and self.world.rank == 0:
            self.following = False
            distributed.rank0_says_go(self.world, error)

    def resume(self, run_dir: str, step: int, payload: dict) -> None:
        """Before resuming from checkpoint `step`: drop the segments written after it (their checkpoint was never
        saved); a checkpoint of an earlier version holds the rows of steps 0..step−1 itself (its
        "tracked_norms"): they become the first segment."""
        tracked_rows.drop_segments_from(run_dir, step)
        legacy = payload.get("tracked_norms")
        if legacy is not None and step and not tracked_rows.segments(run_dir):
            rows = legacy.numpy().reshape(step, len(VALUES), len(self.points))
            tracked_rows.save_segment(run_dir, list(range(step)), self.points, rows)

    def write_table(self, run_dir: str, labels: torch.Tensor, bounds: "filtering.PerPointBounds | None" = None) -> str:
        """models/<run>/tracked_norms.csv (or .parquet) from the segments, with the rows of the per-point bounds
        `bounds` (filtering.py) and its filter's record first; returns its path."""
        labels = labels.cpu().numpy()
        schedule = [step for step in range(self.run.total_steps + 1) if self.due(step)]
        points, steps, values = tracked_rows.gather(run_dir, schedule)
        frame = table(self.run, points, steps, values, labels)
        if bounds is not None and bounds.filter is not None:  # a point out of training is measured again at θ_T only
            left, step_of = np.tile(bounds.filter.left_at[points], len(steps)), np.repeat(steps, len(points))
            frame = frame[(left == 0) | (step_of < left) | (step_of == self.run.total_steps)].reset_index(drop=True)
        if bounds is not None:
            if bounds.filter is not None:
                results.write_sized(filtering.RECORD, run_dir, bounds.record(labels), "--models-dir")
            frame = pd.concat([frame, bounds.table_rows(steps, values, labels)], ignore_index=True)
        return tracked_rows.write_table(run_dir, frame)


def table(run: runs.RunConfig, points: np.ndarray, steps: np.ndarray, values: np.ndarray,
          labels: np.ndarray) -> pd.DataFrame:
    """The tracked values as result rows (quantity grad_norm, exp "tracked"): row (step s, point) holds the values at
    θ_s, which step s + 1 uses (accounting.md §4); step T holds the final parameters'. `steps`: the steps measured."""
    frame = results.result_rows(run, "sum", np.repeat(np.asarray(steps), len(points)), {
        "point": np.tile(points, len(steps)),
        "label": results.class_labels(labels)[np.tile(points, len(steps))],
        "value": values[:, 0, :].astype(np.float64).ravel(),
        "loss": values[:, 1, :].astype(np.float64).ravel(),
        "correct": results.correct_column(values[:, 2, :].ravel()),
        "exp": "tracked",
        "direction": "none",
        "target_batch": 0,
        "sample": 0,
        "quantity": "grad_norm",
    })
    return frame


def follow(tracker: Tracker, resumed_from: int) -> int:
    """A rank other than 0 through one run in lockstep, from the checkpoint rank 0 resumes from: the values of its
    share at every step, gathered at every checkpoint. Returns that checkpoint."""
    run = tracker.run
    planned = set(run.checkpoint_steps)
    for step in range(resumed_from + 1, run.total_steps + 1):
        if tracker.due(step - 1):
            tracker.measure(step - 1)
        if step in planned:
            tracker.checkpoint("", step)
    return resumed_from

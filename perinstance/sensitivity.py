"""Per-instance sensitivities of DP-SGD at one checkpoint (accounting.md §2).

Gradients at a fixed checkpoint do not depend on which batch an example sits in (no
BatchNorm), so every quantity of §2 is assembled from per-sample transformed gradients
h_i = h(g_i), computed once per checkpoint, never from a forward/backward per batch:

- Sum rule: Δ* = ||h(g*)|| needs only per-sample gradient norms (ghost norms).
- Mean rule, coupling (the default, §2, §3.2, §3.4): the dataset statistics d*, v_X, b_X of
  every point from all-row sums, and Δ_B = ||h* − m(B)||/(k+1) for uniform k-subsets B of X
  on a grid of sizes k: the prefixes of one random permutation of the training rows give a
  batch of every size at once, and one matrix product of the centred points with the
  centred batch means gives every point × every batch.
- Mean rule, GLA's statistic S (`--estimator jensen`) and version 1's Poisson Δ_B: one pool
  of Poisson batches D, drawn over the whole index range, serves every point x* exactly in
  distribution: D without x* ~ Poisson_q(X), and D with x* kept only if its own Bernoulli(q)
  bit says so ~ Poisson_q(X'). Δ_B and S are quadratic forms in batch means
  m = (s_D ± h*)/(|D| ± 1) with s_D = Σ_{i∈D} h_i, so they need only the Gram matrix of each
  set's batch sums (shared by all points), the products s_D·h* and ||h*||². These are
  float64: S is a small difference of large terms.

Every random draw comes from (seed, step, key) alone, never from a running generator, so a
point's draws do not depend on the other points measured with it or on resuming (its values only
up to the rounding of the matrix products, whose shapes do).

The reference functions do one forward/backward per batch, as the paper repository did;
they are kept for the tests and the benchmarks.
"""

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from perinstance import accounting, clipping, gradients, sampling

DIRECTIONS = ("remove", "add")
# Examples per per-sample pass, as training's PHYSICAL_BATCH.
ROW_CHUNK = 256
# Examples per pass of the statistics without rows, which hold no per-sample gradient: as large as training's
# physical batch.
STATISTICS_CHUNK = 1024
# Columns of the held gradient matrix per block: batch sums over narrow blocks measured
# about 1.5× faster than over whole 62k-float rows (LeNet-5), and the float64 copies a
# block needs stay small.
COLUMN_BLOCK = 2048
# A pass of the Monte Carlo over held gradients holds at most PASS_OUTPUT_BYTES of (batches, points)
# float64 products and HELD_PASS_BATCHES batches per PASS_OUTPUT_BYTES. The coupling engine's own
# output is (points, draws) float64 anyway, so its passes may be 4× larger: one pass of 10,000
# draws for 8,000 points, which centres the points once instead of three times.
PASS_OUTPUT_BYTES, COUPLING_PASS_BYTES = 1 << 28, 1 << 30
HELD_PASS_BATCHES = 4096
# Float32 batch sums (batches × d) of one pass, at most: what RecomputedRows holds while it adds
# the chunks in. Held rows' passes are cut alike, so that results do not depend on what is held.
PASS_SUM_BYTES = 1 << 30
# Per-sample gradients held on a CPU, at most: with what torch, Opacus and pandas take (~0.7 GB),
# a pass's batch sums and a chunk's per-sample pass, the quick preset stays under 2 GB resident
# (benchmarks/bench_memory.py). Further rows are recomputed on each pass, at the cost of one more
# per-sample pass over them per pass.
HELD_BYTES_CPU = 1 << 28
# Column blocks per product of the coupling engine: each float32 product sums over 8,192 columns
# before it is added to the float64 total, a quarter of the float64 additions of one per block.
PRODUCT_BLOCKS = 4
# Points per slice of the quadratic forms, which hold sets × points × (α+1)² floats.
POINT_SLICE = 256
# Keys that separate the random draws of the experiments within one (seed, step).
EPS_DELTA_KEY, RENYI_TARGET_KEY, RENYI_SET_KEY, COUPLING_KEY = 1, 2, 3, 4


@dataclass(frozen=True)
class Transform:
    """The per-sample transform h(g) = w(||g||)·g of a run (accounting.md §1)."""

    clipping: str
    clip_norm: float
    scale_r: float | None = None
    scale_s: float | None = None

    @classmethod
    def of_run(cls, run):
        """The transform of a runs.RunConfig."""
        return cls(run.clipping, run.clip_norm, run.scale_r, run.scale_s)

    @property
    def bound(self):
        """Γ, the hard bound on ||h(g)||."""
        return clipping.clip_bound(self.clipping, self.clip_norm, self.scale_s)

    def weights(self, grad_norms):
        return clipping.scale_weights(grad_norms, self.clipping, self.clip_norm, self.scale_r, self.scale_s)

    def norms(self, grad_norms):
        """Δ* = ||h(g)||, capped at Γ against one-ulp rounding (clipping.transformed_norm)."""
        return clipping.transformed_norm(grad_norms, self.clipping, self.clip_norm, self.scale_r, self.scale_s)


@dataclass
class Predictions:
    """Per example: the cross-entropy loss at the checkpoint and whether it is classified correctly."""

    losses: np.ndarray
    correct: np.ndarray

    @classmethod
    def concat(cls, parts):
        return cls(np.concatenate([part.losses for part in parts]), np.concatenate([part.correct for part in parts]))

    def take(self, indices):
        return Predictions(self.losses[indices], self.correct[indices])


@dataclass
class PointGradients:
    """The points under study: h* as rows (P × d; None when not needed), and each point's row in
    the training set, -1 for a point outside it (the --less-point point). Without `rows`,
    `outside_rows` holds the h* of the points outside the training set, in their order."""

    rows: torch.Tensor | None
    train_rows: np.ndarray
    predictions: Predictions
    outside_rows: torch.Tensor | None = None

    @property
    def in_training(self):
        """Whether each point is one of the training rows (then its h* is inside every batch sum
        that contains its row)."""
        return self.train_rows >= 0


@dataclass(frozen=True)
class Pool:
    """Poisson batches of one checkpoint over the index range 0..universe-1.

    `train_columns` are the indices of the run's training points, in the order of the
    gradient rows; an index outside it (the --less-point point) only contributes its
    own membership bit.
    """

    seed: int
    step: int
    universe: int
    sample_rate: float
    train_columns: np.ndarray

    def draw(self, count, *key):
        """`count` batches as a boolean (count, universe) mask, from (seed, step, key) alone."""
        entropy = [int(self.seed), sampling.SENSITIVITY_STREAM, int(self.step), *map(int, key)]
        rng = np.random.default_rng(np.random.SeedSequence(entropy))
        return rng.random((count, self.universe)) < self.sample_rate


# --- per-sample passes -------------------------------------------------------------------

@contextmanager
def _training_mode(model):
    """Opacus's hooks record only in training mode. The models here have no BatchNorm and no
    dropout, so training mode computes the same function as eval mode."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def _advance(progress, count):
    if progress is not None:
        progress.update(count)


def _chunks(inputs, labels, device, size=None):
    size = size or ROW_CHUNK  # read at call time: tests shrink ROW_CHUNK
    for start in range(0, len(labels), size):
        yield start, inputs[start:start + size].to(device), labels[start:start + size].to(device)


def _predictions(losses, logits, labels):
    return Predictions(losses.double().cpu().numpy(), (logits.argmax(dim=1) == labels).cpu().numpy())


def transformed_norms(model, inputs, labels, transform, device="cpu", progress=None):
    """Δ* = ||h(g_i)|| of each example (float64 array, accounting.md §2 sum rule) and its Predictions.

    Per-sample gradients are never materialised (gradients.per_sample_norms).
    """
    norms, predictions = [], []
    for _, x, y in _chunks(inputs, labels, device):
        grad_norms, losses, logits = gradients.per_sample_norms(model, x, y)
        norms.append(transform.norms(grad_norms).double().cpu())
        predictions.append(_predictions(losses, logits, y))
        _advance(progress, len(y))
    return torch.cat(norms).numpy(), Predictions.concat(predictions)


def transformed_gradient_chunks(model, inputs, labels, transform, device="cpu", progress=None):
    """Yield (start, rows, Predictions) per chunk of examples: rows are h_i = w(||g_i||)·g_i, flattened."""
    module = gradients.wrap_per_sample(model)
    try:
        with _training_mode(model):
            for start, x, y in _chunks(inputs, labels, device):
                grad_samples, losses, logits = gradients.per_sample_gradients(module, x, y)
                weights = transform.weights(gradients.grad_norms(grad_samples))
                yield start, gradients.flatten(grad_samples).mul_(weights[:, None]), _predictions(losses, logits, y)
                _advance(progress, len(y))
    finally:
        module.cleanup()


def parameter_count(model):
    return sum(param.numel() for param in gradients.trainable_parameters(model))


def column_spans(dim):
    """(first, end) columns of each block of COLUMN_BLOCK columns."""
    return [(start, min(start + COLUMN_BLOCK, dim)) for start in range(0, dim, COLUMN_BLOCK)]


class _Bags:
    """The members of each batch of a boolean (batches, rows) mask, as embedding_bag input:
    batch sums over any row-indexed matrix are then one gather-and-add call, which adds each
    batch's members one after the other in row order.

    leading: the matrix starts with one row per batch (the sums so far) and each batch adds its
    members onto its own row, so that sums chained over chunks of rows equal one sum over all."""

    def __init__(self, mask, device, leading=False):
        batch_of_member, members = np.nonzero(mask)
        counts = np.bincount(batch_of_member, minlength=mask.shape[0])
        self.count = mask.shape[0]
        if leading:
            counts = counts + 1
            # np.nonzero lists the members batch by batch: each batch's block moves up by its own row.
            members = np.insert(members + self.count, np.concatenate([[0], np.cumsum(counts - 1)[:-1]]),
                                np.arange(self.count))
        self.indices = torch.from_numpy(members).to(device)
        self.offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)[:-1]])).to(device)

    def sums(self, matrix):
        """Σ over each batch's members of `matrix`'s rows: (batches, columns); 0 for an empty batch."""
        if len(self.indices) == 0:
            return matrix.new_zeros((self.count, matrix.shape[1]))
        return F.embedding_bag(self.indices, matrix, self.offsets, mode="sum")


class _Rows:
    """What HeldRows and RecomputedRows share: every quantity assembled chunk by chunk (ROW_CHUNK
    rows, in row order) and column block by column block, the same whichever rows are held, so
    that results do not depend on the memory budget. Subclasses provide `chunks()`."""

    def chunks(self):
        """(start, column blocks) of each chunk of ROW_CHUNK rows, in row order."""
        raise NotImplementedError

    def pass_batches(self, num_points, output_bytes=PASS_OUTPUT_BYTES):
        """Batches per Monte Carlo pass: the (batches, points) float64 products stay under
        `output_bytes` and the float32 batch sums under PASS_SUM_BYTES, whichever rows are held
        (the products' rounding follows their shapes)."""
        most = HELD_PASS_BATCHES * max(1, output_bytes // PASS_OUTPUT_BYTES)
        sums = PASS_SUM_BYTES // (self.dtype.itemsize * self.dim)
        return max(1, min(most, output_bytes // (8 * num_points), sums))

    def column_sums(self):
        """Σ_i h_i (float64, (d,)): float64 sums of each chunk, added in row order."""
        total = None
        for _, blocks in self.chunks():
            part = torch.cat([block.sum(dim=0, dtype=torch.float64) for block in blocks])
            total = part if total is None else total.add_(part)
        return total

    def moments(self):
        """μ = (1/N) Σ_i h_i (float64, (d,)) and ||h_i − μ||² of every row (float64, (N,)); the rows are
        centred in their own dtype, the sums are float64."""
        mean = self.column_sums() / self.num_rows
        spans = column_spans(self.dim)
        centred_sq = torch.cat([sum(_square_norms(block - mean[low:high].to(block.dtype))
                                    for block, (low, high) in zip(blocks, spans)) for _, blocks in self.chunks()])
        return mean, centred_sq

    def dots(self, point_rows):
        """h_i·h*_p for every row i and point p: (rows, points) float64."""
        points = [point_rows[:, low:high].double() for low, high in column_spans(self.dim)]
        return torch.cat([sum(block.double() @ part.T for block, part in zip(blocks, points))
                          for _, blocks in self.chunks()])


class HeldRows(_Rows):
    """h_i of every training point at one checkpoint, computed once and kept as column blocks."""

    def __init__(self, blocks, predictions):
        self.blocks = blocks
        self.predictions = predictions

    @classmethod
    def compute(cls, model, inputs, labels, transform, device="cpu", progress=None):
        dtype = next(model.parameters()).dtype
        spans = column_spans(parameter_count(model))
        blocks = [torch.empty((len(labels), high - low), dtype=dtype, device=device) for low, high in spans]
        predictions = []
        for start, rows, chunk_predictions in transformed_gradient_chunks(model, inputs, labels, transform, device,
                                                                          progress):
            for block, (low, high) in zip(blocks, spans):
                block[start:start + len(rows)] = rows[:, low:high]
            predictions.append(chunk_predictions)
        return cls(blocks, Predictions.concat(predictions))

    @property
    def num_rows(self):
        return self.blocks[0].shape[0]

    @property
    def dim(self):
        return sum(block.shape[1] for block in self.blocks)

    @property
    def dtype(self):
        return self.blocks[0].dtype

    @property
    def device(self):
        return self.blocks[0].device

    def chunks(self):
        for start in range(0, self.num_rows, ROW_CHUNK):
            yield start, [block[start:start + ROW_CHUNK] for block in self.blocks]

    def take(self, indices):
        """Rows `indices` as one (len, d) matrix."""
        index = torch.as_tensor(indices, device=self.device)
        return torch.cat([block[index] for block in self.blocks], dim=1)

    def sum_blocks(self, mask, dtype=torch.float64):
        """Column blocks (in `dtype`) of the batch sums s_D for a boolean (batches, rows) mask; a
        batch's members are added one after the other, in row order."""
        bags = _Bags(mask, self.device)
        for block in self.blocks:
            yield bags.sums(block).to(dtype)


class RecomputedRows(_Rows):
    """h_i of every training point: the first `held` rows (a multiple of ROW_CHUNK) computed once and
    kept, the others recomputed chunk by chunk on each pass, never all in memory.

    For training sets whose gradient matrix does not fit (CIFAR-10 × ResNet-20 is 50k × 0.27M
    floats; on a CPU, more than HELD_BYTES_CPU). Its chunks are those of HeldRows.compute, computed
    alike, so every result equals HeldRows' bit for bit (tests/test_sensitivity.py).
    """

    def __init__(self, model, inputs, labels, transform, device="cpu", held=0, progress=None, keep=()):
        self.pass_args = (model, inputs, labels, transform, device)
        self.num_rows = len(labels)
        # Whole chunks: the recomputed chunks start where HeldRows.compute's would.
        self.held = min(held // ROW_CHUNK * ROW_CHUNK, self.num_rows)
        self.dim, self.dtype, self.device = parameter_count(model), next(model.parameters()).dtype, device
        # One pass: the held rows, every row's predictions, the column sums (chunk by chunk in
        # row order, as _Rows.column_sums) and the recomputed rows listed in `keep` (for take).
        self.rows = HeldRows.compute(model, inputs[:self.held], labels[:self.held], transform, device,
                                     progress) if self.held else None
        self._sums = self.rows.column_sums() if self.held else None
        keep = np.unique(np.asarray(keep, dtype=np.int64))
        self._kept_index = keep[keep >= self.held]
        self._kept = torch.empty((len(self._kept_index), self.dim), dtype=self.dtype, device=device)
        parts = [self.rows.predictions] if self.held else []
        spans = column_spans(self.dim)
        for start, rows, chunk_predictions in self._recomputed(progress):
            part = torch.cat([rows[:, low:high].contiguous().sum(dim=0, dtype=torch.float64) for low, high in spans])
            self._sums = part if self._sums is None else self._sums.add_(part)
            wanted = np.flatnonzero((self._kept_index >= start) & (self._kept_index < start + len(rows)))
            self._kept[torch.as_tensor(wanted)] = rows[torch.as_tensor(self._kept_index[wanted] - start)]
            parts.append(chunk_predictions)
        self.predictions = Predictions.concat(parts)

    def column_sums(self):
        return self._sums.clone()

    def _recomputed(self, progress=None, start=None, stop=None):
        """(start, rows, predictions) of the chunks after the held rows (or of rows start..stop)."""
        model, inputs, labels, transform, device = self.pass_args
        start = self.held if start is None else start
        stop = self.num_rows if stop is None else stop
        for offset, rows, predictions in transformed_gradient_chunks(model, inputs[start:stop], labels[start:stop],
                                                                     transform, device, progress):
            yield start + offset, rows, predictions

    def chunks(self):
        if self.held:
            yield from self.rows.chunks()
        spans = column_spans(self.dim)
        for start, rows, _ in self._recomputed():
            # Contiguous column blocks, as HeldRows' (a reduction's order may follow the strides).
            yield start, [rows[:, low:high].contiguous() for low, high in spans]

    def take(self, indices):
        """Rows `indices` as one (len, d) matrix: the held ones copied, the others from their chunk."""
        indices = np.asarray(indices, dtype=np.int64)
        result = torch.empty((len(indices), self.dim), dtype=self.dtype, device=self.device)
        held = np.flatnonzero(indices < self.held)
        if len(held):
            result[torch.as_tensor(held, device=self.device)] = self.rows.take(indices[held])
        position = np.searchsorted(self._kept_index, indices)
        kept = np.flatnonzero((indices >= self.held) & (position < len(self._kept_index))
                              & (self._kept_index[np.minimum(position, len(self._kept_index) - 1)] == indices)
                              if len(self._kept_index) else np.zeros(len(indices), dtype=bool))
        result[torch.as_tensor(kept, device=self.device)] = self._kept[torch.as_tensor(position[kept])]
        missing = np.setdiff1d(np.flatnonzero(indices >= self.held), kept)
        for first in np.unique(indices[missing] // ROW_CHUNK * ROW_CHUNK):
            for start, rows, _ in self._recomputed(start=first, stop=min(first + ROW_CHUNK, self.num_rows)):
                wanted = np.flatnonzero((indices >= start) & (indices < start + len(rows)))
                result[torch.as_tensor(wanted, device=self.device)] = rows[torch.as_tensor(indices[wanted] - start)]
        return result

    def sum_blocks(self, mask, dtype=torch.float64):
        """As HeldRows.sum_blocks, bit for bit: each chunk's members are added onto the sums so far
        (the sums lead every bag), so a batch's members are still added one after the other."""
        sums = list(self.rows.sum_blocks(mask[:, :self.held], self.dtype)) if self.held else None
        spans = column_spans(self.dim)
        for start, rows, _ in self._recomputed():
            bags = _Bags(mask[:, start:start + len(rows)], rows.device, leading=sums is not None)
            if sums is None:
                sums = [bags.sums(rows[:, low:high]) for low, high in spans]
                continue
            for number, (low, high) in enumerate(spans):  # block by block: one block's old sums at a time
                sums[number] = bags.sums(torch.cat([sums[number], rows[:, low:high]]))
        for block in sums:
            yield block.to(dtype)


def _square_norms(matrix):
    """||row||² of every row of one column block, summed in the block's dtype and returned as
    float64, in which the callers add the blocks (measured 2× faster than a float64 reduction)."""
    return torch.einsum("ij,ij->i", matrix, matrix).double()


def memory_budget(device):
    """Bytes this process may fill: half of what is free on `device` now."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            available_kib = next(int(line.split()[1]) for line in handle if line.startswith("MemAvailable:"))
        return available_kib * 1024 // 2
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def held_rows(model, num_rows, device):
    """Training rows to hold: as many whole chunks as fit in half the memory budget, and on a CPU
    in HELD_BYTES_CPU; all of them when they all fit."""
    row_bytes = parameter_count(model) * next(model.parameters()).element_size()
    fit = memory_budget(device) // 2
    if torch.device(device).type == "cpu":
        fit = min(fit, HELD_BYTES_CPU)
    if num_rows * row_bytes <= fit:
        return num_rows
    return fit // row_bytes // ROW_CHUNK * ROW_CHUNK


def checkpoint_gradients(model, train_x, train_y, point_x, point_y, point_train_rows, transform, device="cpu",
                         hold=None, progress=None, point_rows=True):
    """The training rows and the points, for the mean rule.

    The first rows, as many as `held_rows` allows, are held, the others recomputed on each pass
    (`hold` True or False holds all or none). A point that is a training row takes its h* and its
    predictions from its training chunk, so that neither depends on what is held.
    `point_train_rows[p]` is point p's training row, or -1 when it is not a training point (the
    --less-point point). point_rows=False keeps only the h* of the points outside the rows (the
    dataset statistics need no other).
    """
    point_train_rows = np.asarray(point_train_rows)
    in_training = point_train_rows >= 0
    held = held_rows(model, len(train_y), device) if hold is None else len(train_y) if hold else 0
    if held >= len(train_y):
        rows = HeldRows.compute(model, train_x, train_y, transform, device, progress)
    else:
        keep = point_train_rows[in_training] if point_rows else ()
        rows = RecomputedRows(model, train_x, train_y, transform, device, held, progress, keep)
    inside, outside = np.flatnonzero(in_training), np.flatnonzero(~in_training)
    parts = [(inside, rows.take(point_train_rows[inside]) if point_rows else None,
              rows.predictions.take(point_train_rows[inside]))]
    outside_rows = None
    if len(outside):
        outside_rows, outside_predictions = _rows_of(model, point_x[outside], point_y[outside], transform, device)
        parts.append((outside, outside_rows, outside_predictions))
    order = np.argsort(np.concatenate([positions for positions, _, _ in parts]))
    predictions = Predictions.concat([part for _, _, part in parts]).take(order)
    if not point_rows:
        return rows, PointGradients(None, point_train_rows, predictions, outside_rows)
    point_rows = torch.cat([part_rows for _, part_rows, _ in parts])[torch.as_tensor(order).to(rows.device)]
    return rows, PointGradients(point_rows, point_train_rows, predictions)


def _rows_of(model, inputs, labels, transform, device):
    parts = list(transformed_gradient_chunks(model, inputs, labels, transform, device))
    return torch.cat([rows for _, rows, _ in parts]), Predictions.concat([part for _, _, part in parts])


# --- the mean rule by coupling: dataset statistics and Δ_B of uniform k-subsets ----------------

@dataclass(frozen=True)
class DatasetStatistics:
    """Per point (accounting.md §2): d* = ||h* − μ_X||, v_X = (1/n) Σ_{i∈X} ||h_i − μ_X||², and
    an upper bound on b_X = max_{i∈X} ||h_i − μ_X|| (see dataset_statistics)."""

    center_distance: np.ndarray
    spread: np.ndarray
    max_deviation: np.ndarray


def dataset_statistics(row_centred_sq, point_centred_sq, in_training):
    """accounting.md §2's dataset statistics of every point, from all-row sums.

    row_centred_sq: ||h_i − μ||² of the N training rows, μ their mean; point_centred_sq:
    ||h* − μ||² per point; in_training: whether the point is one of the rows.

    For a training point X is the rows without it (n = N − 1), and μ_X − μ = −(h* − μ)/n, so
    d* = ||h* − μ||·N/n and v_X = (Σ_i ||h_i − μ||² − ||h* − μ||²)/n − ||h* − μ||²/n². b_X exactly
    needs every ||h_i − μ_X||, i.e. a Gram matrix; the triangle inequality gives the upper bound
    max_i ||h_i − μ|| + ||μ − μ_X||, and an upper bound keeps §3.2's certified bound valid (it
    only widens r_k). For a point outside the rows (the --less-point point) X is all N rows and
    μ_X = μ: all three are exact.
    """
    row_centred_sq = np.asarray(row_centred_sq, dtype=np.float64)
    point_sq = np.asarray(point_centred_sq, dtype=np.float64)
    count = len(row_centred_sq)
    if count < 2:
        raise ValueError(f"the mean rule needs at least 2 training rows, got {count}")
    total, n = row_centred_sq.sum(), count - 1
    distance = np.sqrt(point_sq)
    center_distance = np.where(in_training, distance * count / n, distance)
    spread = np.where(in_training, (total - point_sq) / n - point_sq / n ** 2, total / count)
    max_deviation = np.sqrt(row_centred_sq.max()) + np.where(in_training, distance / n, 0.0)
    return DatasetStatistics(center_distance, np.maximum(spread, 0.0), max_deviation)


def _centred_square_norms_without_rows(model, inputs, labels, transform, mean, grad_norms, device):
    """||h_i − μ||² = ||h_i||² − 2·w_i·⟨g_i, μ⟩ + ||μ||² of each example (float64), h_i = w_i·g_i, from its
    gradient norm ||g_i|| and one forward-mode pass along μ (the float64 sum keeps the cancellation small)."""
    mean_square = sum(float((part ** 2).sum()) for part in mean)
    dots = []
    for _, x, y in _chunks(inputs, labels, device, STATISTICS_CHUNK):
        with torch.no_grad():
            dots.append(gradients.directional_derivatives(model, x, y, mean)[0].double().cpu())
    grad_norms = grad_norms.double()
    squares = transform.norms(grad_norms) ** 2 - 2 * transform.weights(grad_norms) * torch.cat(dots) + mean_square
    return squares.clamp_min(0.0).numpy()


def statistics_without_rows(model, train_x, train_y, point_x, point_y, point_train_rows, transform, device="cpu",
                            progress=None):
    """accounting.md §2's dataset statistics of every point, with no per-sample gradient held or recomputed.

    One pass gives ||g_i|| and μ = (1/N) Σ_i h_i (the trainer's clipped sum, gradients.clipped_gradient_sum);
    a second, forward-mode pass gives ⟨g_i, μ⟩ for every row (gradients.directional_derivatives), hence
    ||h_i − μ||² = ||h_i||² − 2·w_i·⟨g_i, μ⟩ + ||μ||², and dataset_statistics turns those into d*, v_X, b_X.
    Two passes over the training set, whatever the number of parameters. Returns (DatasetStatistics of the
    points, their Predictions).
    """
    total, grad_norms, predictions = None, [], []
    for _, x, y in _chunks(train_x, train_y, device, STATISTICS_CHUNK):
        summed, losses, norms, logits = gradients.clipped_gradient_sum(model, x, y, transform.weights)
        summed = [part.detach().double() for part in summed]
        total = summed if total is None else [left + right for left, right in zip(total, summed)]
        grad_norms.append(norms.detach().cpu())
        predictions.append(_predictions(losses, logits, y))
        _advance(progress, len(y))
    mean = [part / len(train_y) for part in total]
    row_centred_sq = _centred_square_norms_without_rows(model, train_x, train_y, transform, mean,
                                                        torch.cat(grad_norms), device)
    point_train_rows = np.asarray(point_train_rows)
    in_training = point_train_rows >= 0
    point_centred_sq = row_centred_sq[np.maximum(point_train_rows, 0)]
    predictions = Predictions.concat(predictions).take(np.maximum(point_train_rows, 0))
    outside = np.flatnonzero(~in_training)
    if len(outside):
        outside_norms, outside_predictions = [], []
        for _, x, y in _chunks(point_x[outside], point_y[outside], device, STATISTICS_CHUNK):
            norms, losses, logits = gradients.per_sample_norms(model, x, y)
            outside_norms.append(norms.cpu())
            outside_predictions.append(_predictions(losses, logits, y))
        point_centred_sq[outside] = _centred_square_norms_without_rows(
            model, point_x[outside], point_y[outside], transform, mean, torch.cat(outside_norms), device)
        outside_predictions = Predictions.concat(outside_predictions)
        predictions.losses[outside], predictions.correct[outside] = outside_predictions.losses, outside_predictions.correct
    return dataset_statistics(row_centred_sq, point_centred_sq, in_training), predictions


@dataclass(frozen=True)
class CouplingPlan:
    """The Δ_B draws of one checkpoint (accounting.md §3.2, §3.4).

    In each of `blocks` independent blocks, `permutations` random permutations of the N
    training rows. The prefix of length k of a permutation is a uniform k-subset of the rows,
    for every grid size k at once. For a training point x*, a prefix that holds x* is rejected:
    given that it does not, the prefix is a uniform k-subset of X (exact), and k = |B ∩ X|.
    Each permutation comes from (seed, step, block, index) alone.
    """

    seed: int
    step: int
    sizes: np.ndarray  # the grid sizes, ascending; sizes[0] is k_min
    blocks: int
    permutations: int

    @property
    def k_min(self):
        return int(self.sizes[0])

    @property
    def draws(self):
        """Δ_B draws per point before rejection."""
        return self.blocks * self.permutations * len(self.sizes)

    @property
    def draw_sizes(self):
        """k of each draw, in the order drawn: block, then permutation, then grid size."""
        return np.tile(self.sizes, self.blocks * self.permutations)

    @property
    def draw_blocks(self):
        return np.repeat(np.arange(self.blocks), self.permutations * len(self.sizes))

    def permutation(self, block, index, num_rows):
        entropy = [int(self.seed), sampling.SENSITIVITY_STREAM, int(self.step), COUPLING_KEY, int(block), int(index)]
        return np.random.default_rng(np.random.SeedSequence(entropy)).permutation(num_rows)


def coupling_plan(seed, step, n, sample_rate, size_delta, num_batches, blocks, max_sizes):
    """accounting.md §3.4: k_min from δ_size, the grid of sizes over [k_min, k_hi] (§3.2), and
    ceil(num_batches / (blocks·G)) permutations per block for G grid sizes, so that every point
    gets at least `num_batches` draws (before rejection)."""
    k_min = accounting.size_threshold(n, sample_rate, size_delta)
    sizes = np.asarray(accounting.size_grid(n, sample_rate, k_min, max_sizes), dtype=np.int64)
    return CouplingPlan(int(seed), int(step), sizes, int(blocks), math.ceil(num_batches / (blocks * len(sizes))))


@dataclass
class CouplingSamples:
    """Δ_B of every point for every draw of `plan`: values (P, draws), NaN where the draw was
    rejected because its batch held the point."""

    values: np.ndarray
    plan: CouplingPlan

    def accepted(self):
        """(point position, block, sample, k, Δ_B) arrays of the accepted draws, point by point in
        the order drawn; `sample` numbers a point's accepted draws within each block from 0."""
        kept = ~np.isnan(self.values)
        samples = np.cumsum(kept.reshape(len(kept), self.plan.blocks, -1), axis=2).reshape(kept.shape) - 1
        position, column = np.nonzero(kept)
        return (position, self.plan.draw_blocks[column], samples[position, column], self.plan.draw_sizes[column],
                self.values[position, column])


def _centred_square_norms(matrix, mean):
    """||row − μ||² of every row of `matrix` (float64), one column block at a time."""
    return sum(_square_norms(matrix[:, low:high] - mean[low:high].to(matrix.dtype))
               for low, high in column_spans(matrix.shape[1]))


def _prefix_masks(ranks, sizes):
    """Boolean (permutations·G, rows) mask of the segments between consecutive grid sizes:
    segment j of a permutation holds the rows ranked in [sizes[j−1], sizes[j]), so the prefix
    of size sizes[j] is the union of segments 0..j."""
    grid = len(sizes)
    segment = np.searchsorted(sizes, ranks, side="right")
    permutation, row = np.nonzero(segment < grid)
    mask = np.zeros((len(ranks) * grid, ranks.shape[1]), dtype=bool)
    mask[permutation * grid + segment[permutation, row], row] = True
    return mask


def measure_coupling(rows, points, plan, progress=None, blocks=None):
    """The mean rule by coupling at one checkpoint (accounting.md §2): every point's
    DatasetStatistics and its CouplingSamples (of the Monte-Carlo `blocks` only, when given)."""
    mean, row_centred_sq = rows.moments()
    # A training point's ||h* − μ||² is its row's; only a point outside the rows needs its own.
    device = row_centred_sq.device
    point_centred_sq = row_centred_sq[torch.as_tensor(np.maximum(points.train_rows, 0), device=device)]
    outside = torch.as_tensor(np.flatnonzero(~points.in_training), device=device)
    if len(outside):
        outside_rows = points.outside_rows if points.rows is None else points.rows[outside.to(points.rows.device)]
        point_centred_sq[outside] = _centred_square_norms(outside_rows, mean).to(device)
    statistics = dataset_statistics(row_centred_sq.cpu().numpy(), point_centred_sq.cpu().numpy(),
                                    points.in_training)
    return statistics, coupling_sensitivities(rows, points, plan, mean, point_centred_sq, progress, blocks)


def coupling_sensitivities(rows, points, plan, mean, point_centred_sq, progress=None, blocks=None):
    """Δ_B = ||h* − m(B)||/(k+1) (k ≥ 1; ||h*|| for k = 0, m(∅) = 0) of every point for every
    draw of `plan` (accounting.md §2), as CouplingSamples; with `blocks`, only the draws of those
    Monte-Carlo blocks, the others NaN (as rejected draws: CouplingSamples.accepted leaves them out).

    mean: μ of the rows (float64); point_centred_sq: ||h* − μ||². With c = centred at μ,
    ||h* − m||² = ||h*_c||² − 2⟨h*_c, m_c⟩ + ||m_c||²: one product of the centred points with
    the centred batch means per group of column blocks, in the rows' dtype (as are the batch
    means), accumulated in float64 across the groups. Centring keeps the terms near the size of
    the result, which uncentred terms (both near ||μ||²) would not for a point near the mean.
    """
    sizes, grid = plan.sizes, len(plan.sizes)
    dtype, device = rows.dtype, rows.device
    mean = mean.to(device=device, dtype=dtype)
    point_sq = point_centred_sq.to(device)
    point_rows = points.train_rows
    inside = points.in_training
    divisors = torch.as_tensor(np.maximum(sizes, 1), dtype=dtype, device=device)[None, :, None]
    values = np.full((len(point_rows), plan.draws), np.nan)
    per_pass = max(1, rows.pass_batches(len(point_rows), COUPLING_PASS_BYTES) // grid)
    # A product never spans two blocks, so that a block's values do not depend on the blocks
    # measured with it (the products' rounding follows their shapes): torchrun ranks share out the
    # blocks. The batch sums of several blocks' chunks still come from one pass over the rows (a
    # pass of RecomputedRows recomputes them).
    chunks = [[(block, index) for index in range(first, min(first + per_pass, plan.permutations))]
              for block in (range(plan.blocks) if blocks is None else blocks)
              for first in range(0, plan.permutations, per_pass)]
    passes = []
    for chunk in chunks:
        if passes and sum(map(len, passes[-1])) + len(chunk) <= per_pass:
            passes[-1].append(chunk)
        else:
            passes.append([chunk])
    spans = column_spans(rows.dim)
    for chunks in passes:
        draws = [draw for chunk in chunks for draw in chunk]
        ranks = np.empty((len(draws), rows.num_rows), dtype=np.int64)
        for position, (block, index) in enumerate(draws):
            ranks[position, plan.permutation(block, index, rows.num_rows)] = np.arange(rows.num_rows)
        firsts = np.cumsum([0] + [len(chunk) for chunk in chunks])
        cross = [torch.zeros((len(point_rows), len(chunk) * grid), dtype=torch.float64, device=device)
                 for chunk in chunks]
        mean_sq = [torch.zeros(len(chunk) * grid, dtype=torch.float64, device=device) for chunk in chunks]
        group, group_low = [], 0
        segment_sums = rows.sum_blocks(_prefix_masks(ranks, sizes), dtype)
        for number, (block_sums, (low, high)) in enumerate(zip(segment_sums, spans)):
            prefix_means = block_sums.reshape(len(draws), grid, -1).cumsum_(dim=1).div_(divisors)
            centred_means = prefix_means.sub_(mean[low:high])
            parts = [centred_means[first:end].reshape((end - first) * grid, -1)
                     for first, end in zip(firsts[:-1], firsts[1:])]
            for total, part in zip(mean_sq, parts):
                total += _square_norms(part)
            group.append(parts)
            if len(group) == PRODUCT_BLOCKS or number == len(spans) - 1:
                centred_points = points.rows[:, group_low:high] - mean[group_low:high]
                for total, grouped in zip(cross, zip(*group)):
                    total.add_(centred_points @ torch.cat(grouped, dim=1).T)
                group, group_low = [], high
        for chunk, chunk_cross, chunk_mean_sq, first in zip(chunks, cross, mean_sq, firsts):
            (block, index), count = chunk[0], len(chunk)
            start = block * plan.permutations + index  # the chunk's first draw, in the order drawn
            # In place: at 8,000 points × 10,000 draws every (points, draws) float64 array is 640 MB.
            squared = chunk_cross.mul_(-2.0).add_(point_sq[:, None]).add_(chunk_mean_sq[None, :]).clamp_min_(0.0)
            chunk_values = values[:, start * grid:(start + count) * grid]
            chunk_values[:] = squared.sqrt_().cpu().numpy()
            chunk_values *= np.tile(1.0 / (sizes + 1), count)
            # A training point's draw is rejected when the point is in the prefix: its rank < k.
            point_ranks = ranks[first:first + count][:, np.where(inside, point_rows, 0)].T
            rejected = inside[:, None, None] & (point_ranks[:, :, None] < sizes[None, None, :])
            chunk_values[rejected.reshape(len(point_rows), -1)] = np.nan
        del cross, squared  # freed before the next pass allocates its own
        _advance(progress, len(draws))
    return CouplingSamples(values, plan)


# --- the mean rule: quadratic forms in batch means ------------------------------------------

def _mean_coefficients(sizes, removed, kept):
    """Batch means m = a·s_D + e·h* (accounting.md §1, m(∅) = 0) from a pool batch D.

    `sizes`: training rows in D. The pool sum s_D holds h* when x* is a training row in D;
    that term is taken out (`removed`), and h* is put in where the batch keeps x* (`kept`).
    """
    size = sizes - removed + kept
    coef_sum = np.where(size > 0, 1.0 / np.maximum(size, 1), 0.0)
    return coef_sum, coef_sum * (kept.astype(np.float64) - removed)


def sensitivities_from_gram(sum_sq, point_dots, point_sq, sizes, members, in_training):
    """Δ_B = ||m(B ∪ {x*}) − m(B)|| for B = D without x*, per pool batch D and point.

    sum_sq: ||s_D||² (batches,); point_dots: s_D·h* (batches, points); point_sq: ||h*||²
    (points,); sizes: training rows in D (batches,); members: x* ∈ D (batches, points);
    in_training: x* is a training row (points,).
    """
    removed = members & in_training
    coef_sum, coef_point = _mean_coefficients(sizes[:, None], removed, np.zeros_like(removed))
    coef_sum_with, coef_point_with = _mean_coefficients(sizes[:, None], removed, np.ones_like(removed))
    diff_sum, diff_point = coef_sum_with - coef_sum, coef_point_with - coef_point
    squared = diff_sum ** 2 * sum_sq[:, None] + 2 * diff_sum * diff_point * point_dots + diff_point ** 2 * point_sq
    return np.sqrt(np.maximum(squared, 0.0))


def renyi_from_gram(set_gram, point_dots, point_sq, sizes, members, in_training, direction):
    """S = Σ_j ||m_j||² − (α−1)||m_0||² − ||Σ_j m_j − (α−1)m_0||² per set and point (§2).

    set_gram: s_j·s_l within each set (sets, α+1, α+1), batch 0 the target; point_dots:
    s_j·h* (sets, α+1, points); point_sq: ||h*||² (points,); sizes (sets, α+1);
    members: x* ∈ D_j (sets, α+1, points). Direction remove: B_0 from X, B_j from X';
    add: B_0 from X', B_j from X. Evaluated as S = Σ_j ||e_j||² − ||Σ_j e_j||² with
    e_j = m_j − m_0, which is algebraically the same and keeps the m_0 terms from cancelling.
    """
    from_x_prime = np.zeros((1, members.shape[1], 1), dtype=bool)
    from_x_prime[:, 1:] = direction == "remove"
    from_x_prime[:, 0] = direction == "add"
    coef_sum, coef_point = _mean_coefficients(sizes[:, :, None], members & in_training, members & from_x_prime)
    coef_sum, coef_point = coef_sum.transpose(0, 2, 1), coef_point.transpose(0, 2, 1)  # (sets, points, α+1)
    weighted_dots = coef_sum * point_dots.transpose(0, 2, 1)
    cross = weighted_dots[..., :, None] * coef_point[..., None, :]
    mean_gram = (coef_sum[..., :, None] * coef_sum[..., None, :] * set_gram[:, None] + cross
                 + cross.swapaxes(-1, -2) + coef_point[..., :, None] * coef_point[..., None, :]
                 * point_sq[None, :, None, None])
    diff_gram = (mean_gram[..., 1:, 1:] - mean_gram[..., 1:, :1] - mean_gram[..., :1, 1:] + mean_gram[..., :1, :1])
    return np.trace(diff_gram, axis1=-2, axis2=-1) - diff_gram.sum(axis=(-2, -1))


def _point_square_norms(points):
    return (points.rows.double() ** 2).sum(dim=1).cpu().numpy()


def _pass_quantities(rows, masks, pool, point_columns, dots, set_layout):
    """Gram of each set's batch sums, s_D·h*, sizes and memberships for one pass of batches."""
    train_masks = masks[:, pool.train_columns]
    set_gram = None
    layout = torch.as_tensor(set_layout, device=dots.device)
    for block in rows.sum_blocks(train_masks):
        set_sums = block[layout]
        part = set_sums @ set_sums.transpose(1, 2)
        set_gram = part if set_gram is None else set_gram.add_(part)
    point_dots = _Bags(train_masks, dots.device).sums(dots).cpu().numpy()
    return (set_gram.cpu().numpy(), point_dots, train_masks.sum(axis=1), masks[:, point_columns])


def batch_sensitivities(rows, points, point_columns, pool, num_batches, progress=None):
    """Δ_B for each point and each of `num_batches` pool batches: (points, num_batches) float64."""
    dots = rows.dots(points.rows)
    point_sq = _point_square_norms(points)
    result = np.empty((len(point_columns), num_batches))
    pass_batches = rows.pass_batches(len(point_columns))
    for start in range(0, num_batches, pass_batches):
        keys = range(start, min(start + pass_batches, num_batches))
        masks = np.concatenate([pool.draw(1, EPS_DELTA_KEY, key) for key in keys])
        set_gram, point_dots, sizes, members = _pass_quantities(rows, masks, pool, point_columns, dots,
                                                                np.arange(len(keys))[:, None])
        result[:, keys.start:keys.stop] = sensitivities_from_gram(set_gram[:, 0, 0], point_dots, point_sq, sizes,
                                                                  members, points.in_training).T
        _advance(progress, len(keys))
    return result


def renyi_slices(num_iters, num_batches, alpha, max_batches):
    """(target, first set, end set) slices of the sets, each at most `max_batches` batches
    (the target and α per set), grouped into passes of at most `max_batches` batches."""
    sets_per_slice = max(1, (max_batches - 1) // alpha)
    passes, current, used = [], [], 0
    for target in range(num_iters):
        for first in range(0, num_batches, sets_per_slice):
            end = min(first + sets_per_slice, num_batches)
            size = 1 + (end - first) * alpha
            if current and used + size > max_batches:
                passes.append(current)
                current, used = [], 0
            current.append((target, first, end))
            used += size
    return passes + [current] if current else passes


def renyi_statistics(rows, points, point_columns, pool, alpha, num_iters, num_batches, directions=DIRECTIONS,
                     progress=None):
    """S for each direction, point, target batch and set: {direction: (points, num_iters, num_batches)}.

    For each target t: B_0 from pool batch (t), and num_batches sets of α pool batches
    (t, k); the direction decides which of them keep x* (see renyi_from_gram).
    """
    dots = rows.dots(points.rows)
    point_sq = _point_square_norms(points)
    result = {direction: np.empty((len(point_columns), num_iters, num_batches)) for direction in directions}
    for slices in renyi_slices(num_iters, num_batches, alpha, rows.pass_batches(len(point_columns))):
        masks, set_layout = _renyi_pass_masks(pool, slices, alpha)
        set_gram, point_dots, sizes, members = _pass_quantities(rows, masks, pool, point_columns, dots,
                                                                set_layout)
        for direction in directions:
            values = _renyi_by_point_slice(set_gram, point_dots[set_layout], point_sq, sizes[set_layout],
                                           members[set_layout], points.in_training, direction)
            offset = 0
            for target, first, end in slices:
                result[direction][:, target, first:end] = values[offset:offset + end - first].T
                offset += end - first
        _advance(progress, sum(end - first for _, first, end in slices))
    return result


def _renyi_pass_masks(pool, slices, alpha):
    """Masks of one pass (each slice: its target, then α batches per set) and, per set, the
    rows of its α+1 batches."""
    masks, layout, row = [], [], 0
    for target, first, end in slices:
        masks.append(pool.draw(1, RENYI_TARGET_KEY, target))
        target_row, row = row, row + 1
        for key in range(first, end):
            masks.append(pool.draw(alpha, RENYI_SET_KEY, target, key))
            layout.append([target_row, *range(row, row + alpha)])
            row += alpha
    return np.concatenate(masks), np.asarray(layout)


def _renyi_by_point_slice(set_gram, point_dots, point_sq, sizes, members, in_training, direction):
    return np.concatenate([
        renyi_from_gram(set_gram, point_dots[:, :, start:start + POINT_SLICE], point_sq[start:start + POINT_SLICE],
                        sizes, members[:, :, start:start + POINT_SLICE], in_training[start:start + POINT_SLICE],
                        direction)
        for start in range(0, len(point_sq), POINT_SLICE)], axis=1)


# --- reference: one forward/backward per batch, as the paper repository -------------------

def reference_batch_means(model, inputs, labels, transform, batches, device="cpu"):
    """m(B) = (1/|B|) Σ_{i∈B} h(g_i) for each index list B (m(∅) = 0): (len(batches), d) float64."""
    module = gradients.wrap_per_sample(model)
    means = []
    try:
        with _training_mode(model):
            for batch in batches:
                batch = torch.as_tensor(np.asarray(batch, dtype=np.int64))
                if len(batch) == 0:
                    means.append(torch.zeros(parameter_count(model), dtype=torch.float64))
                    continue
                grad_samples, _, _ = gradients.per_sample_gradients(module, inputs[batch].to(device),
                                                                    labels[batch].to(device))
                weights = transform.weights(gradients.grad_norms(grad_samples))
                summed = torch.cat([part.reshape(-1) for part in gradients.weighted_sum(grad_samples, weights)])
                means.append(summed.double().cpu() / len(batch))
    finally:
        module.cleanup()
    return torch.stack(means).numpy()


def reference_batch_sensitivities(model, inputs, labels, transform, point, batches, device="cpu"):
    """Δ_B = ||m(B ∪ {x*}) − m(B)|| for each index list B (not containing `point`)."""
    with_point = [list(batch) + [point] for batch in batches]
    means = reference_batch_means(model, inputs, labels, transform, list(batches) + with_point, device)
    return np.linalg.norm(means[len(batches):] - means[:len(batches)], axis=1)


def reference_renyi_statistics(model, inputs, labels, transform, target_batch, set_batches, device="cpu"):
    """S of accounting.md §2, by its defining formula, for one target batch B_0 and each set
    [B_1..B_α] of index lists."""
    target_mean = reference_batch_means(model, inputs, labels, transform, [target_batch], device)[0]
    statistics = []
    for batches in set_batches:
        means = reference_batch_means(model, inputs, labels, transform, batches, device)
        alpha = len(batches)
        statistics.append((means ** 2).sum() - (alpha - 1) * (target_mean ** 2).sum()
                          - ((means.sum(axis=0) - (alpha - 1) * target_mean) ** 2).sum())
    return np.asarray(statistics)

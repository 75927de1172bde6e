"""Per-instance sensitivities of DP-SGD at one checkpoint (accounting.md §2).

Gradients at a fixed checkpoint do not depend on which batch an example sits in (no
BatchNorm), so every quantity of §2 is assembled from per-sample transformed gradients
h_i = h(g_i), computed once per checkpoint, never from a forward/backward per batch:

- Sum rule: Δ* = ||h(g*)|| needs only per-sample gradient norms (ghost norms).
- Mean rule: one pool of Poisson batches D, drawn over the whole index range, serves every
  point x* exactly in distribution: D without x* ~ Poisson_q(X), and D with x* kept only if
  its own Bernoulli(q) bit says so ~ Poisson_q(X'). Δ_B and S are quadratic forms in batch
  means m = (s_D ± h*)/(|D| ± 1) with s_D = Σ_{i∈D} h_i, so they need only the Gram matrix
  of each set's batch sums (shared by all points), the products s_D·h* and ||h*||². These
  are float64: S is a small difference of large terms.

Pool batches come from (seed, step, key) alone, never from a running generator, so a
point's values do not depend on the other points measured with it or on resuming.

The reference functions do one forward/backward per batch, as the paper repository did;
they are kept for the tests and the benchmark.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from perinstance import clipping, gradients, sampling

DIRECTIONS = ("remove", "add")
# Examples per per-sample pass, as training's PHYSICAL_BATCH.
ROW_CHUNK = 256
# Columns of the held gradient matrix per block: batch sums over narrow blocks measured
# about 1.5× faster than over whole 62k-float rows (LeNet-5), and the float64 copies a
# block needs stay small.
COLUMN_BLOCK = 2048
# Batches per pass of the Monte Carlo when the gradients are held in memory.
HELD_PASS_BATCHES = 4096
# Points per slice of the quadratic forms, which hold sets × points × (α+1)² floats.
POINT_SLICE = 256
# Keys that separate the pools of the experiments within one (seed, step).
EPS_DELTA_KEY, RENYI_TARGET_KEY, RENYI_SET_KEY = 1, 2, 3


@dataclass(frozen=True)
class Transform:
    """The per-sample transform h(g) = w(||g||)·g of a run (accounting.md §1)."""

    clipping: str
    clip_norm: float
    scale_r: float | None = None
    scale_s: float | None = None

    @classmethod
    def of_run(cls, metadata):
        return cls(metadata["clipping"], metadata["clip_norm"], metadata["scale_r"], metadata["scale_s"])

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
    """The points under study: h* as rows (P × d), and whether each is one of the training rows
    (then its h* is inside every pool batch sum that contains it)."""

    rows: torch.Tensor
    in_training: np.ndarray
    predictions: Predictions


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


def _chunks(inputs, labels, device):
    for start in range(0, len(labels), ROW_CHUNK):
        yield start, inputs[start:start + ROW_CHUNK].to(device), labels[start:start + ROW_CHUNK].to(device)


def _predictions(losses, logits, labels):
    return Predictions(losses.double().cpu().numpy(), (logits.argmax(dim=1) == labels).cpu().numpy())


def transformed_norms(model, inputs, labels, transform, device="cpu", progress=None):
    """Δ* = ||h(g_i)|| of each example (float64 array, accounting.md §2 sum rule) and its Predictions.

    Ghost norms: per-sample gradients are never materialised.
    """
    module = gradients.wrap_norms_only(model)
    norms, predictions = [], []
    try:
        with _training_mode(model):
            for _, x, y in _chunks(inputs, labels, device):
                grad_norms, losses, logits = gradients.per_sample_norms(module, x, y)
                norms.append(transform.norms(grad_norms).double().cpu())
                predictions.append(_predictions(losses, logits, y))
                _advance(progress, len(y))
    finally:
        module.cleanup()
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


def _column_spans(dim):
    return [(start, min(start + COLUMN_BLOCK, dim)) for start in range(0, dim, COLUMN_BLOCK)]


class _Bags:
    """The members of each batch of a boolean (batches, rows) mask, as embedding_bag input:
    batch sums over any row-indexed matrix are then one gather-and-add call."""

    def __init__(self, mask, device):
        batch_of_member, members = np.nonzero(mask)
        counts = np.bincount(batch_of_member, minlength=mask.shape[0])
        self.count = mask.shape[0]
        self.indices = torch.from_numpy(members).to(device)
        self.offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)[:-1]])).to(device)

    def sums(self, matrix):
        """Σ over each batch's members of `matrix`'s rows: (batches, columns); 0 for an empty batch."""
        if len(self.indices) == 0:
            return matrix.new_zeros((self.count, matrix.shape[1]))
        return F.embedding_bag(self.indices, matrix, self.offsets, mode="sum")


class HeldRows:
    """h_i of every training point at one checkpoint, computed once and kept as column blocks."""

    def __init__(self, blocks, predictions):
        self.blocks = blocks
        self.predictions = predictions

    @classmethod
    def compute(cls, model, inputs, labels, transform, device="cpu", progress=None):
        dtype = next(model.parameters()).dtype
        spans = _column_spans(parameter_count(model))
        blocks = [torch.empty((len(labels), high - low), dtype=dtype, device=device) for low, high in spans]
        predictions = []
        for start, rows, chunk_predictions in transformed_gradient_chunks(model, inputs, labels, transform, device,
                                                                          progress):
            for block, (low, high) in zip(blocks, spans):
                block[start:start + len(rows)] = rows[:, low:high]
            predictions.append(chunk_predictions)
        return cls(blocks, Predictions.concat(predictions))

    def pass_batches(self, num_points):
        """Batches per Monte Carlo pass: the (batches, points) float64 products stay under 256 MB."""
        return max(1, min(HELD_PASS_BATCHES, (1 << 28) // (8 * num_points)))

    def take(self, indices):
        """Rows `indices` as one (len, d) matrix."""
        index = torch.as_tensor(indices, device=self.blocks[0].device)
        return torch.cat([block[index] for block in self.blocks], dim=1)

    def sum_blocks(self, mask):
        """Column blocks (float64) of the batch sums s_D for a boolean (batches, rows) mask."""
        bags = _Bags(mask, self.blocks[0].device)
        for block in self.blocks:
            yield bags.sums(block).double()

    def dots(self, point_rows):
        """h_i·h*_p for every row i and point p: (rows, points) float64."""
        products = None
        for block, (low, high) in zip(self.blocks, _column_spans(point_rows.shape[1])):
            part = block.double() @ point_rows[:, low:high].double().T
            products = part if products is None else products.add_(part)
        return products


class RecomputedRows:
    """h_i of every training point, recomputed chunk by chunk on each pass, never all in memory.

    For training sets whose gradient matrix does not fit (CIFAR-10 × ResNet-20 is
    50k × 0.27M floats): each Monte Carlo pass recomputes the per-sample gradients.
    """

    def __init__(self, model, inputs, labels, transform, device="cpu"):
        self.pass_args = (model, inputs, labels, transform, device)
        self.dim = parameter_count(model)
        self.device = device

    def pass_batches(self, num_points):
        """Batches per pass: their float32 sums (and a float64 block) fit in the memory budget."""
        return max(1, memory_budget(self.device) // (4 * self.dim + 8 * (COLUMN_BLOCK + num_points)))

    def _chunks(self):
        for start, rows, _ in transformed_gradient_chunks(*self.pass_args):
            yield start, rows

    def sum_blocks(self, mask):
        sums = None
        for start, rows in self._chunks():
            part = _Bags(mask[:, start:start + len(rows)], rows.device).sums(rows)
            sums = part if sums is None else sums.add_(part)
        for low, high in _column_spans(self.dim):
            yield sums[:, low:high].double()

    def dots(self, point_rows):
        points = point_rows.double()
        return torch.cat([rows.double() @ points.T for _, rows in self._chunks()])


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


def checkpoint_gradients(model, train_x, train_y, point_x, point_y, point_train_rows, transform, device="cpu",
                         hold=None, progress=None):
    """The training rows and the points' h*, for the mean rule.

    The rows are held when they fit in half the memory budget, else recomputed on each
    pass (`hold` forces either). `point_train_rows[p]` is point p's training row, or -1
    when it is not a training point (the --less-point point).
    """
    point_train_rows = np.asarray(point_train_rows)
    in_training = point_train_rows >= 0
    if hold is None:
        itemsize = next(model.parameters()).element_size()
        hold = len(train_y) * parameter_count(model) * itemsize <= memory_budget(device) // 2
    if not hold:
        point_rows, predictions = _rows_of(model, point_x, point_y, transform, device)
        return RecomputedRows(model, train_x, train_y, transform, device), PointGradients(point_rows, in_training,
                                                                                          predictions)
    rows = HeldRows.compute(model, train_x, train_y, transform, device, progress)
    inside, outside = np.flatnonzero(in_training), np.flatnonzero(~in_training)
    parts = [(inside, rows.take(point_train_rows[inside]), rows.predictions.take(point_train_rows[inside]))]
    if len(outside):
        parts.append((outside, *_rows_of(model, point_x[outside], point_y[outside], transform, device)))
    order = torch.as_tensor(np.argsort(np.concatenate([positions for positions, _, _ in parts])))
    point_rows = torch.cat([part_rows for _, part_rows, _ in parts])[order.to(device)]
    predictions = Predictions.concat([part for _, _, part in parts]).take(order.numpy())
    return rows, PointGradients(point_rows, in_training, predictions)


def _rows_of(model, inputs, labels, transform, device):
    parts = list(transformed_gradient_chunks(model, inputs, labels, transform, device))
    return torch.cat([rows for _, rows, _ in parts]), Predictions.concat([part for _, _, part in parts])


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

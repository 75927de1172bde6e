"""Quadratic forms in the means of Poisson batches, at one checkpoint (accounting.md §2).

Δ_B of Poisson batches (the audit's mean-rule upper bound) and GLA's statistic S
(`--estimator jensen`) are quadratic forms in batch means m = (s_D ± h*)/(|D| ± 1) with
s_D = Σ_{i∈D} h_i, so they need only the Gram matrix of each set's batch sums (shared by all
points), the products s_D·h* and ||h*||². These are float64: S is a small difference of large
terms.

One pool of Poisson batches D, drawn over the whole index range, serves every point x* exactly
in distribution: D without x* ~ Poisson_q(X), and D with x* kept only if its own Bernoulli(q)
bit says so ~ Poisson_q(X').
"""

from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from perinstance.accounting.guarantees import Direction
from perinstance.measure.batch_sums import Bags
from perinstance.measure.gradient_rows import HeldRows, PointGradients, RecomputedRows, advance, pass_batches
from perinstance.measure.gram import CheckpointGram, Workload
from perinstance.train import sampling

DIRECTIONS = (Direction.REMOVE, Direction.ADD)
# Points per slice of the quadratic forms, which hold sets × points × (α+1)² floats.
POINT_SLICE = 256


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

    def draw(self, count: int, *key: int) -> np.ndarray:
        """`count` batches as a boolean (count, universe) mask, from (seed, step, key) alone."""
        rng = sampling.stream_rng(self.seed, sampling.SENSITIVITY_STREAM, self.step, *key)
        return sampling.poisson_masks(rng, count, self.universe, self.sample_rate)


def _mean_coefficients(sizes, removed, kept):
    """Batch means m = a·s_D + e·h* (accounting.md §1, m(∅) = 0) from a pool batch D.

    `sizes`: training rows in D. The pool sum s_D holds h* when x* is a training row in D;
    that term is taken out (`removed`), and h* is put in where the batch keeps x* (`kept`).
    """
    size = sizes - removed + kept
    coef_sum = np.where(size > 0, 1.0 / np.maximum(size, 1), 0.0)
    return coef_sum, coef_sum * (kept.astype(np.float64) - removed)


def sensitivities_from_gram(sum_sq: np.ndarray, point_dots: np.ndarray, point_sq: np.ndarray, sizes: np.ndarray,
                            members: np.ndarray, in_training: np.ndarray) -> np.ndarray:
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


def renyi_from_gram(set_gram: np.ndarray, point_dots: np.ndarray, point_sq: np.ndarray, sizes: np.ndarray,
                    members: np.ndarray, in_training: np.ndarray, direction: Direction) -> np.ndarray:
    """S = Σ_j ||m_j||² − (α−1)||m_0||² − ||Σ_j m_j − (α−1)m_0||² per set and point (§2).

    set_gram: s_j·s_l within each set (sets, α+1, α+1), batch 0 the target; point_dots:
    s_j·h* (sets, α+1, points); point_sq: ||h*||² (points,); sizes (sets, α+1);
    members: x* ∈ D_j (sets, α+1, points). Direction remove: B_0 from X, B_j from X';
    add: B_0 from X', B_j from X. Evaluated as S = Σ_j ||e_j||² − ||Σ_j e_j||² with
    e_j = m_j − m_0, which is algebraically the same and keeps the m_0 terms from cancelling.
    """
    from_x_prime = np.zeros((1, members.shape[1], 1), dtype=bool)
    from_x_prime[:, 1:] = direction == Direction.REMOVE
    from_x_prime[:, 0] = direction == Direction.ADD
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


def _pass_quantities(rows, train_masks, dots, set_layout):
    """Gram of each set's batch sums (float64), s_D·h* and the sizes, for one pass of batches
    given as a boolean (batches, rows) mask; set_layout: the batches of each set."""
    set_gram = None
    layout = torch.as_tensor(set_layout, device=dots.device)
    for panel in rows.sum_panels(train_masks):
        set_sums = panel[layout]
        part = set_sums @ set_sums.transpose(1, 2)
        set_gram = part if set_gram is None else set_gram.add_(part)
    point_dots = Bags.of_mask(train_masks, dots.device).sums(dots).cpu().numpy()
    return set_gram.cpu().numpy(), point_dots, train_masks.sum(axis=1)


def batch_sensitivities(rows: HeldRows | RecomputedRows, points: PointGradients, train_masks: np.ndarray,
                        progress: tqdm | None = None, most_per_pass: int | None = None) -> np.ndarray:
    """Δ_B = ||m(B ∪ {x*}) − m(B)|| (accounting.md §2) for each batch D of a boolean (batches, rows)
    mask over the training rows, with B = D without x*: (points, batches) float64.

    points: gradient_rows.PointGradients; a point outside the training set is never in D.
    most_per_pass: at most this many batches' sums held at once (default: rows.pass_batches).
    """
    dots = rows.products(points.rows)
    point_sq = _point_square_norms(points)
    inside = points.in_training
    result = np.empty((len(inside), len(train_masks)))
    per_pass = min(rows.pass_batches(len(inside)), most_per_pass or len(train_masks) or 1)
    for start in range(0, len(train_masks), per_pass):
        masks = train_masks[start:start + per_pass]
        set_gram, point_dots, sizes = _pass_quantities(rows, masks, dots, np.arange(len(masks))[:, None])
        members = masks[:, np.maximum(points.train_rows, 0)] & inside
        result[:, start:start + len(masks)] = sensitivities_from_gram(set_gram[:, 0, 0], point_dots, point_sq, sizes,
                                                                      members, inside).T
        advance(progress, len(masks))
    return result


# --- GLA's statistic S ---------------------------------------------------------------------------

def renyi_workload(num_points: int, pool: Pool, alpha: int, num_iters: int, num_batches: int) -> Workload:
    """What renyi_statistics asks of a checkpoint's Gram (gram.Workload): every target and set batch, of
    q·N expected members each, in sets of α + 1."""
    batches = num_iters * (1 + alpha * num_batches)
    return Workload(points=num_points, batches=batches, members=round(batches * pool.sample_rate * pool.universe),
                    group=alpha + 1)


def renyi_slices(num_iters: int, num_batches: int, alpha: int, max_batches: int) -> list[list[tuple[int, int, int]]]:
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


def renyi_statistics(rows: HeldRows | RecomputedRows | CheckpointGram, points: PointGradients,
                     point_columns: np.ndarray, pool: Pool, alpha: int, num_iters: int, num_batches: int,
                     directions: tuple[Direction, ...] = DIRECTIONS,
                     progress: tqdm | None = None) -> dict[Direction, np.ndarray]:
    """S for each direction, point, target batch and set: {direction: (points, num_iters, num_batches)}.

    For each target t: B_0 from pool batch (t), and num_batches sets of α pool batches
    (t, k); the direction decides which of them keep x* (see renyi_from_gram). `rows`: the gradient rows
    (their batch sums), or the checkpoint's Gram (gram.py; `points` then need no rows).
    """
    quantities = _GramQuantities(rows, points) if isinstance(rows, CheckpointGram) else _RowQuantities(rows, points)
    result = {direction: np.empty((len(point_columns), num_iters, num_batches)) for direction in directions}
    for slices in renyi_slices(num_iters, num_batches, alpha, quantities.pass_batches):
        masks, set_layout = _renyi_pass_masks(pool, slices, alpha)
        # take, not masks[:, columns]: that indexing returns a column-major array, slow to walk by rows.
        set_gram, point_dots, sizes = quantities.of_pass(masks.take(pool.train_columns, axis=1), set_layout)
        members = masks[:, point_columns]
        for direction in directions:
            values = _renyi_by_point_slice(set_gram, point_dots[set_layout], quantities.point_sq, sizes[set_layout],
                                           members[set_layout], points.in_training, direction)
            offset = 0
            for target, first, end in slices:
                result[direction][:, target, first:end] = values[offset:offset + end - first].T
                offset += end - first
        advance(progress, sum(end - first for _, first, end in slices))
    return result


class _RowQuantities:
    """renyi_statistics' quantities from the gradient rows: the Gram of each set's batch sums, s_D·h*, ||h*||²."""

    def __init__(self, rows, points):
        self.rows, self.dots = rows, rows.products(points.rows)
        self.point_sq = _point_square_norms(points)
        self.pass_batches = rows.pass_batches(len(points.train_rows))

    def of_pass(self, train_masks, set_layout):
        return _pass_quantities(self.rows, train_masks, self.dots, set_layout)


class _GramQuantities:
    """The same quantities from the checkpoint's centred Gram (gram.py), made uncentred in float64: with
    c_D = Σ_{a∈D} (h_a − μ)·μ, n = |D| and t = ||μ||², s_D·s_E = Σ G_c + n_D·c_E + n_E·c_D + n_D·n_E·t and
    s_D·h* = Σ_{a∈D} G_c[a, *] + c_D + n_D·h*·μ. Only the centred parts carry the Gram's rounding."""

    def __init__(self, gram, points):
        self.gram, self.point_rows = gram, gram.rows_of(points)
        self.columns = gram.point_columns(self.point_rows)
        self.point_sq = gram.point_squares(self.point_rows).cpu().numpy()
        self.point_mean_dots = gram.mean_dots[torch.as_tensor(self.point_rows, device=gram.device)].cpu().numpy()
        self.pass_batches = pass_batches(len(self.point_rows), gram.size, 8)

    def of_pass(self, train_masks, set_layout):
        grams, point_sums, mean_sums = self.gram.batch_sums(train_masks, set_layout, self.columns)
        grams, point_sums, mean_sums = grams.cpu().numpy(), point_sums.cpu().numpy(), mean_sums.cpu().numpy()
        sizes = train_masks.sum(axis=1)
        size, mean_sum = sizes[set_layout].astype(np.float64), mean_sums[set_layout]
        set_gram = (grams + size[:, :, None] * mean_sum[:, None, :] + size[:, None, :] * mean_sum[:, :, None]
                    + size[:, :, None] * size[:, None, :] * self.gram.mean_square)
        point_dots = point_sums + mean_sums[:, None] + sizes[:, None] * self.point_mean_dots[None, :]
        return set_gram, point_dots, sizes


def _renyi_pass_masks(pool, slices, alpha):
    """Masks of one pass (each slice: its target, then α batches per set) and, per set, the
    rows of its α+1 batches."""
    masks, layout, row = [], [], 0
    for target, first, end in slices:
        masks.append(pool.draw(1, sampling.RENYI_TARGET_KEY, target))
        target_row, row = row, row + 1
        for key in range(first, end):
            masks.append(pool.draw(alpha, sampling.RENYI_SET_KEY, target, key))
            layout.append([target_row, *range(row, row + alpha)])
            row += alpha
    return np.concatenate(masks), np.asarray(layout)


def _renyi_by_point_slice(set_gram, point_dots, point_sq, sizes, members, in_training, direction):
    return np.concatenate([
        renyi_from_gram(set_gram, point_dots[:, :, start:start + POINT_SLICE], point_sq[start:start + POINT_SLICE],
                        sizes, members[:, :, start:start + POINT_SLICE], in_training[start:start + POINT_SLICE],
                        direction)
        for start in range(0, len(point_sq), POINT_SLICE)], axis=1)

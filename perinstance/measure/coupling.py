"""The mean rule by coupling at one checkpoint: dataset statistics and Δ_B of uniform k-subsets (accounting.md §2).

Each point's dataset statistics d*, v_X, b_X come from all-row sums (the certified bound of §3.2
needs nothing else). Its Δ_B = ||h* − m(B)||/(k+1) are drawn for uniform k-subsets B of X on a
grid of sizes k: the prefixes of one random permutation of the training rows give a batch of
every size at once, and one matrix product of the centred points with the centred batch means
gives every point × every batch. Each permutation comes from (seed, step, Monte-Carlo block,
index) alone, so a point's draws do not depend on the other points measured with it or on
resuming (its values only up to the rounding of the matrix products, whose shapes do).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from perinstance.accounting import batch_sizes
from perinstance.measure.gradient_rows import (
    HeldRows,
    PointGradients,
    RecomputedRows,
    advance,
    column_spans,
    example_chunks,
    pass_batches,
    square_norms,
)
from perinstance.measure.gram import CheckpointGram, Workload
from perinstance.measure.predictions import Predictions, predictions_of
from perinstance.persample import gradients
from perinstance.train import sampling
from perinstance.train.clipping import Transform

# The Δ_B output is (points, draws) float64 anyway, so a pass may hold 4× more (batches, points)
# products than other passes over the rows: 10,000 draws for 8,000 points in one pass, which
# centres the points once instead of three times.
COUPLING_PASS_BYTES = 1 << 30
# Panels per product: each float32 product sums over PRODUCT_PANELS panels before it is added to
# the float64 total, a quarter of the float64 additions of one product per panel.
PRODUCT_PANELS = 4


@dataclass(frozen=True)
class DatasetStatistics:
    """Per point (accounting.md §2): d* = ||h* − μ_X||, v_X = (1/n) Σ_{i∈X} ||h_i − μ_X||², and
    an upper bound on b_X = max_{i∈X} ||h_i − μ_X|| (see dataset_statistics)."""

    center_distance: np.ndarray
    spread: np.ndarray
    max_deviation: np.ndarray


def dataset_statistics(row_centred_sq: np.ndarray, point_centred_sq: np.ndarray,
                       in_training: np.ndarray) -> DatasetStatistics:
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


@dataclass(frozen=True)
class CouplingPlan:
    """The Δ_B draws of one checkpoint (accounting.md §3.2, §3.4).

    In each of `blocks` independent Monte-Carlo blocks, `permutations` random permutations of the
    N training rows. The prefix of length k of a permutation is a uniform k-subset of the rows,
    for every grid size k at once. For a training point x*, a prefix that holds x* is rejected:
    given that it does not, the prefix is a uniform k-subset of X (exact), and k = |B ∩ X|.
    """

    seed: int
    step: int
    sizes: np.ndarray  # the grid sizes, ascending; sizes[0] is k_min
    blocks: int
    permutations: int

    @property
    def k_min(self) -> int:
        return int(self.sizes[0])

    @property
    def draws(self) -> int:
        """Δ_B draws per point before rejection."""
        return self.blocks * self.permutations * len(self.sizes)

    @property
    def draw_sizes(self) -> np.ndarray:
        """k of each draw, in the order drawn: block, then permutation, then grid size."""
        return np.tile(self.sizes, self.blocks * self.permutations)

    @property
    def draw_blocks(self) -> np.ndarray:
        return np.repeat(np.arange(self.blocks), self.permutations * len(self.sizes))

    def permutation(self, block: int, index: int, num_rows: int) -> np.ndarray:
        rng = sampling.stream_rng(self.seed, sampling.SENSITIVITY_STREAM, self.step, sampling.COUPLING_KEY, block,
                                  index)
        return rng.permutation(num_rows)


def coupling_plan(seed: int, step: int, n: int, sample_rate: float, size_delta: float, num_batches: int, blocks: int,
                  max_sizes: int) -> CouplingPlan:
    """accounting.md §3.4: k_min from δ_size, the grid of sizes over [k_min, k_hi] (§3.2), and
    ceil(num_batches / (blocks·G)) permutations per block for G grid sizes, so that every point
    gets at least `num_batches` draws (before rejection)."""
    k_min = batch_sizes.size_threshold(n, sample_rate, size_delta)
    sizes = np.asarray(batch_sizes.size_grid(n, sample_rate, k_min, max_sizes), dtype=np.int64)
    return CouplingPlan(int(seed), int(step), sizes, int(blocks), math.ceil(num_batches / (blocks * len(sizes))))


def coupling_workload(num_points: int, plans: Sequence[CouplingPlan]) -> Workload:
    """What the draws of `plans` ask of a checkpoint's Gram (gram.Workload): a segment sum per grid size of
    every permutation, the segments of a permutation covering its largest size."""
    return Workload(points=num_points, batches=sum(plan.draws for plan in plans),
                    members=sum(plan.blocks * plan.permutations * int(plan.sizes[-1]) for plan in plans),
                    group=max(len(plan.sizes) for plan in plans))


@dataclass
class CouplingSamples:
    """Δ_B of every point for every draw of `plan`: values (P, draws), NaN where the draw was
    rejected because its batch held the point."""

    values: np.ndarray
    plan: CouplingPlan

    def accepted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(point position, block, sample, k, Δ_B) arrays of the accepted draws, point by point in
        the order drawn; `sample` numbers a point's accepted draws within each block from 0."""
        kept = ~np.isnan(self.values)
        samples = np.cumsum(kept.reshape(len(kept), self.plan.blocks, -1), axis=2).reshape(kept.shape) - 1
        position, column = np.nonzero(kept)
        return (position, self.plan.draw_blocks[column], samples[position, column], self.plan.draw_sizes[column],
                self.values[position, column])


# --- the dataset statistics ------------------------------------------------------------------------

def measure_statistics(rows: HeldRows | RecomputedRows, points: PointGradients, mean: torch.Tensor | None = None,
                       row_centred_sq: torch.Tensor | None = None
                       ) -> tuple[DatasetStatistics, torch.Tensor, torch.Tensor]:
    """Every point's DatasetStatistics from the rows (gradient_rows.HeldRows or RecomputedRows),
    with μ of the rows and ||h* − μ||² per point, which the Δ_B draws reuse. μ and the rows'
    ||h_i − μ||² are computed here unless given (coupling_sensitivities measures them on its way)."""
    if row_centred_sq is None:
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
    return statistics, mean, point_centred_sq


def checkpoint_statistics(model: torch.nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, point_x: torch.Tensor,
                          point_y: torch.Tensor, point_train_rows: Sequence[int] | np.ndarray, transform: Transform,
                          device: str = "cpu", progress: tqdm | None = None) -> tuple[DatasetStatistics, Predictions]:
    """The statistics-only measurement (compute_sensitivity.py --reduction mean --num-batches 0): every
    point's DatasetStatistics and Predictions at one checkpoint (arguments as gradient_rows.checkpoint_gradients),
    with no per-sample gradient held or recomputed.

    One pass gives ||g_i|| and μ = (1/N) Σ_i h_i (the trainer's clipped sum, gradients.clipped_gradient_sum);
    a second, forward-mode pass gives ⟨g_i, μ⟩ for every row (gradients.directional_derivatives), hence
    ||h_i − μ||² = ||h_i||² − 2·w_i·⟨g_i, μ⟩ + ||μ||² with h_i = w_i·g_i, and dataset_statistics turns those
    into d*, v_X, b_X. Two passes over the training set, whatever the number of parameters.
    """
    # Examples per pass: as for Δ*, this measurement holds no per-sample gradient.
    chunk = gradients.examples_per_pass(model, train_x, device)
    total, grad_norms, predictions = None, [], []
    for _, x, y in example_chunks(train_x, train_y, device, chunk):
        summed, losses, norms, logits = gradients.clipped_gradient_sum(model, x, y, transform.weights)
        summed = [part.detach().double() for part in summed]
        total = summed if total is None else [left + right for left, right in zip(total, summed)]
        grad_norms.append(norms.detach().cpu())
        predictions.append(predictions_of(losses, logits, y, norms))
        advance(progress, len(y))
    mean = [part / len(train_y) for part in total]
    row_centred_sq = _centred_square_norms_along(model, train_x, train_y, transform, mean, torch.cat(grad_norms),
                                                 device, chunk)
    point_train_rows = np.asarray(point_train_rows)
    in_training = point_train_rows >= 0
    point_centred_sq = row_centred_sq[np.maximum(point_train_rows, 0)]
    predictions = Predictions.concat(predictions).take(np.maximum(point_train_rows, 0))
    outside = np.flatnonzero(~in_training)
    if len(outside):
        outside_norms, outside_predictions = [], []
        for _, x, y in example_chunks(point_x[outside], point_y[outside], device, chunk):
            norms, losses, logits = gradients.per_sample_norms(model, x, y)
            outside_norms.append(norms.cpu())
            outside_predictions.append(predictions_of(losses, logits, y, norms))
        point_centred_sq[outside] = _centred_square_norms_along(
            model, point_x[outside], point_y[outside], transform, mean, torch.cat(outside_norms), device, chunk)
        outside_predictions = Predictions.concat(outside_predictions)
        predictions.losses[outside] = outside_predictions.losses
        predictions.correct[outside] = outside_predictions.correct
    return dataset_statistics(row_centred_sq, point_centred_sq, in_training), predictions


def _centred_square_norms_along(model, inputs, labels, transform, mean, grad_norms, device, chunk):
    """||h_i − μ||² = ||h_i||² − 2·w_i·⟨g_i, μ⟩ + ||μ||² of each example (float64), h_i = w_i·g_i, from its
    gradient norm ||g_i|| and one forward-mode pass along μ (the sum in float64 keeps its cancellation small)."""
    mean_square = sum(float((part ** 2).sum()) for part in mean)
    dots = []
    for _, x, y in example_chunks(inputs, labels, device, chunk):
        with torch.no_grad():
            dots.append(gradients.directional_derivatives(model, x, y, mean)[0].double().cpu())
    grad_norms = grad_norms.double()
    squares = transform.norms(grad_norms) ** 2 - 2 * transform.weights(grad_norms) * torch.cat(dots) + mean_square
    return squares.clamp_min(0.0).numpy()


def _centred_square_norms(matrix, mean):
    """||row − μ||² of every row of `matrix` (float64), one panel at a time."""
    return sum(square_norms(matrix[:, low:high] - mean[low:high].to(matrix.dtype))
               for low, high in column_spans(matrix.shape[1]))


# --- the Δ_B draws ---------------------------------------------------------------------------------

def measure_coupling(rows: HeldRows | RecomputedRows | CheckpointGram, points: PointGradients, plan: CouplingPlan,
                     progress: tqdm | None = None,
                     blocks: Sequence[int] | None = None) -> tuple[DatasetStatistics, CouplingSamples]:
    """The mean rule by coupling at one checkpoint (accounting.md §2): every point's
    DatasetStatistics and its CouplingSamples (of the Monte-Carlo `blocks` only, when given). `rows`: the
    gradient rows, or the checkpoint's Gram (gram.py; `points` then need no rows)."""
    if isinstance(rows, CheckpointGram):
        return gram_statistics(rows, points), gram_coupling_sensitivities(rows, points, plan, progress, blocks)
    mean = rows.mean()
    samples, row_centred_sq = coupling_sensitivities(rows, points, plan, mean, None, progress, blocks)
    statistics, _, _ = measure_statistics(rows, points, mean, row_centred_sq)
    return statistics, samples


def gram_statistics(gram: CheckpointGram, points: PointGradients) -> DatasetStatistics:
    """Every point's DatasetStatistics from the Gram's ||h_a − μ||² (float64)."""
    centred_square = gram.centred_square.cpu().numpy()
    return dataset_statistics(centred_square[:gram.num_rows], centred_square[gram.rows_of(points)],
                              points.in_training)


def gram_coupling_sensitivities(gram: CheckpointGram, points: PointGradients, plan: CouplingPlan,
                                progress: tqdm | None = None, blocks: Sequence[int] | None = None) -> CouplingSamples:
    """coupling_sensitivities from the checkpoint's centred Gram G_c (gram.py): for the prefix B of size k of a
    permutation, with c = centred at μ, ⟨h*_c, m_c⟩ = Σ_{b∈B} G_c[*, b]/k and ||m_c||² = Σ_{a,b∈B} G_c[a, b]/k².
    The prefixes are unions of the segments between grid sizes, so one batch sum per segment (gram.batch_sums:
    each segment's sums with the points, and the segments' Gram within the permutation) and cumulative sums
    over the segments give every size. k = 0: m(∅) = 0, so m_c = −μ. Float64 from the sums on; the squared
    distance is clamped at 0 before its root (_store_chunk), where rounding could take a tiny one below."""
    values = np.full((len(points.train_rows), plan.draws), np.nan)
    point_rows, grid = gram.rows_of(points), len(plan.sizes)
    index = torch.as_tensor(point_rows, device=gram.device)
    point_sq, columns = gram.centred_square[index], gram.point_columns(point_rows)
    empty_cross = gram.mean_square - gram.mean_dots[index]
    divisors = torch.as_tensor(1.0 / np.maximum(plan.sizes, 1), device=gram.device)
    empty = torch.as_tensor(plan.sizes == 0, device=gram.device)
    for chunks in _passes(plan, len(point_rows), gram.size, 8, blocks):
        draws = [draw for chunk in chunks for draw in chunk]
        ranks = np.empty((len(draws), gram.num_rows), dtype=np.int64)
        for position, (block, permutation) in enumerate(draws):
            ranks[position, plan.permutation(block, permutation, gram.num_rows)] = np.arange(gram.num_rows)
        layout = np.arange(len(draws) * grid).reshape(len(draws), grid)
        segment_grams, point_sums, _ = gram.batch_sums(_prefix_masks(ranks, plan.sizes), layout, columns)
        mean_sq = segment_grams.cumsum(dim=1).cumsum(dim=2).diagonal(dim1=1, dim2=2) * divisors ** 2
        mean_sq[:, empty] = gram.mean_square
        # In place: at 8,000 points a pass's (draws, sizes, points) float64 products are 270 MB.
        cross = point_sums.reshape(len(draws), grid, -1).cumsum_(dim=1).mul_(divisors[:, None])
        cross[:, empty] = empty_cross
        cross = cross.permute(2, 0, 1)
        first = 0
        for chunk in chunks:
            last = first + len(chunk)
            _store_chunk(values, plan, chunk, cross[:, first:last].reshape(len(point_rows), -1),
                         mean_sq[first:last].reshape(-1), point_sq, ranks[first:last], points)
            first = last
        advance(progress, len(draws))
    return CouplingSamples(values, plan)


def coupling_sensitivities(rows: HeldRows | RecomputedRows, points: PointGradients, plan: CouplingPlan,
                           mean: torch.Tensor, point_centred_sq: torch.Tensor | None, progress: tqdm | None = None,
                           blocks: Sequence[int] | None = None) -> tuple[CouplingSamples, torch.Tensor | None]:
    """Δ_B = ||h* − m(B)||/(k+1) (k ≥ 1; ||h*|| for k = 0, m(∅) = 0) of every point for every
    draw of `plan` (accounting.md §2), as CouplingSamples; with `blocks`, only the draws of those
    Monte-Carlo blocks, the others NaN (as rejected draws: CouplingSamples.accepted leaves them out).

    mean: μ of the rows (float64); point_centred_sq: ||h* − μ||². With c = centred at μ,
    ||h* − m||² = ||h*_c||² − 2⟨h*_c, m_c⟩ + ||m_c||² (see _centred_products).
    point_centred_sq None: the first pass over the rows, which a RecomputedRows makes anyway, also gives every
    row's ||h_i − μ||² (as rows.moments() would), and ||h* − μ||² follows (measure_statistics).
    Returns (CouplingSamples, the rows' ||h_i − μ||² when measured here, else None).
    """
    values = np.full((len(points.train_rows), plan.draws), np.nan)
    row_centred_sq = None
    for chunks in _passes(plan, len(points.train_rows), rows.dim, rows.dtype.itemsize, blocks):
        draws = [draw for chunk in chunks for draw in chunk]
        ranks = np.empty((len(draws), rows.num_rows), dtype=np.int64)
        for position, (block, index) in enumerate(draws):
            ranks[position, plan.permutation(block, index, rows.num_rows)] = np.arange(rows.num_rows)
        centred = None
        if point_centred_sq is None:
            row_centred_sq = torch.empty(rows.num_rows, dtype=torch.float64, device=rows.device)
            centred = (mean, row_centred_sq)
        cross, mean_sq = _centred_products(rows, points, mean, plan.sizes, ranks, [len(chunk) for chunk in chunks],
                                           centred)
        if point_centred_sq is None:
            _, _, point_centred_sq = measure_statistics(rows, points, mean, row_centred_sq)
        point_sq = point_centred_sq.to(rows.device)
        first = 0
        for chunk, chunk_cross, chunk_mean_sq in zip(chunks, cross, mean_sq):
            _store_chunk(values, plan, chunk, chunk_cross, chunk_mean_sq, point_sq, ranks[first:first + len(chunk)],
                         points)
            first += len(chunk)
        del cross, mean_sq  # freed before the next pass allocates its own
        advance(progress, len(draws))
    return CouplingSamples(values, plan), row_centred_sq


def pass_count(plan: CouplingPlan, num_points: int, dim: int, itemsize: int,
               blocks: Sequence[int] | None = None) -> int:
    """How many passes over the rows coupling_sensitivities makes for `plan` (rows of `dim` values of
    `itemsize` bytes), so that a caller can tell whether holding rows would spare any recomputation."""
    return len(_passes(plan, num_points, dim, itemsize, blocks))


def _passes(plan, num_points, dim, itemsize, blocks=None):
    """The permutations to draw, as passes of at most as many permutations as one pass holds the products
    and batch sums of (gradient_rows.pass_batches), each pass a list of chunks of consecutive permutations
    of one Monte-Carlo block ((block, index) pairs).

    A product never spans two blocks, so that a block's values do not depend on the blocks measured
    with it (the products' rounding follows their shapes): torchrun ranks share out the blocks. The
    batch sums of several blocks' chunks still come from one pass over the rows (a pass of
    RecomputedRows recomputes them)."""
    per_pass = max(1, pass_batches(num_points, dim, itemsize, COUPLING_PASS_BYTES) // len(plan.sizes))
    chunks = [[(block, index) for index in range(first, min(first + per_pass, plan.permutations))]
              for block in (range(plan.blocks) if blocks is None else blocks)
              for first in range(0, plan.permutations, per_pass)]
    passes = []
    for chunk in chunks:
        if passes and sum(map(len, passes[-1])) + len(chunk) <= per_pass:
            passes[-1].append(chunk)
        else:
            passes.append([chunk])
    return passes


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


def _centred_products(rows, points, mean, sizes, ranks, chunk_lengths, centred=None):
    """Per chunk of permutations (`chunk_lengths` consecutive rows of `ranks`): ⟨h*_c, m_c⟩ of
    every point and prefix (points, permutations·G) and ||m_c||² (permutations·G,), float64.
    centred: None or (μ, out), passed to rows.sum_panels (the rows' centred norms from this pass).

    One product of the centred points with the centred batch means per group of PRODUCT_PANELS
    panels, in the rows' dtype (as are the batch means), accumulated in float64 across the groups.
    Centring keeps the terms near the size of the result, which uncentred terms (both near ||μ||²)
    would not for a point near the mean."""
    grid, dtype, device = len(sizes), rows.dtype, rows.device
    mean = mean.to(device=device, dtype=dtype)
    divisors = torch.as_tensor(np.maximum(sizes, 1), dtype=dtype, device=device)[None, :, None]
    firsts = np.cumsum([0, *chunk_lengths])
    cross = [torch.zeros((len(points.train_rows), length * grid), dtype=torch.float64, device=device)
             for length in chunk_lengths]
    mean_sq = [torch.zeros(length * grid, dtype=torch.float64, device=device) for length in chunk_lengths]
    spans = column_spans(rows.dim)
    group, group_low = [], 0
    for number, (segment_sums, (low, high)) in enumerate(zip(rows.sum_panels(_prefix_masks(ranks, sizes), dtype,
                                                                             centred), spans)):
        prefix_means = segment_sums.reshape(len(ranks), grid, -1).cumsum_(dim=1).div_(divisors)
        centred_means = prefix_means.sub_(mean[low:high])
        parts = [centred_means[first:end].reshape((end - first) * grid, -1)
                 for first, end in zip(firsts[:-1], firsts[1:])]
        for total, part in zip(mean_sq, parts):
            total += square_norms(part)
        group.append(parts)
        if len(group) == PRODUCT_PANELS or number == len(spans) - 1:
            centred_points = points.rows[:, group_low:high] - mean[group_low:high]
            for total, grouped in zip(cross, zip(*group)):
                total.add_(centred_points @ torch.cat(grouped, dim=1).T)
            group, group_low = [], high
    return cross, mean_sq


def _store_chunk(values, plan, chunk, cross, mean_sq, point_sq, ranks, points):
    """Δ_B of one chunk's draws into their columns of `values`, NaN where the prefix holds the
    point (a training point whose rank is below k). `cross` is used up."""
    sizes, grid = plan.sizes, len(plan.sizes)
    (block, index), count = chunk[0], len(chunk)
    start = block * plan.permutations + index  # the chunk's first draw, in the order drawn
    # In place: at 8,000 points × 10,000 draws every (points, draws) float64 array is 640 MB.
    squared = cross.mul_(-2.0).add_(point_sq[:, None]).add_(mean_sq[None, :]).clamp_min_(0.0)
    chunk_values = values[:, start * grid:(start + count) * grid]
    chunk_values[:] = squared.sqrt_().cpu().numpy()
    chunk_values *= np.tile(1.0 / (sizes + 1), count)
    inside, point_rows = points.in_training, points.train_rows
    point_ranks = ranks[:, np.where(inside, point_rows, 0)].T
    rejected = inside[:, None, None] & (point_ranks[:, :, None] < sizes[None, None, :])
    chunk_values[rejected.reshape(len(point_rows), -1)] = np.nan

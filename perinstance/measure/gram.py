"""The centred Gram matrix of a checkpoint's transformed per-sample gradients, G_c[a, b] = (h_a − μ)·(h_b − μ),
and the batch sums over it from which the mean rule's Monte-Carlo statistics are quadratic forms
(accounting.md §2; docs/sensitivity.md, "The Gram route").

Every statistic of §2 that the Monte Carlo draws (Δ_B of the coupling, GLA's S) is a quadratic form in batch
sums s_D = Σ_{a∈D} h_a and the point's h*. With the Gram of the rows, 1_Dᵀ G 1_E = s_D·s_E needs a batch's
N-long rows of the Gram instead of its d-long gradients, and the Gram itself is built layer by layer from the
engine's factors (train/gram_forms.py): for LeNet-5, 3,393 multiply-adds per pair of examples instead of
61,706. So at a checkpoint whose N is below d, one Gram product serves every draw.

Numerics. The Gram is held centred at the training rows' mean μ, so that its entries, and every batch sum over
them, are of the size of the spread of the gradients, not of ||μ||²: the statistics are differences
(||h* − m||², e_j = m_j − m_0) that would otherwise cancel. The materialised layers' rows are centred in their
own dtype before their product (the rounding of μ is common to all rows and cancels in every difference); the
outer-product layers' products are formed and centred in float64, with h_a·μ from the layer's mean gradient.
The centred Gram is held in the model's dtype; ||h_a − μ||², h_a·μ and ||μ||² are float64, and the uncentred
quantities that GLA's formula takes are assembled from them in float64 (poisson_batches.py).

Memory (docs/sensitivity.md): the Gram of M rows takes M²·itemsize bytes, at most GRAM_BYTES of the device's
kind (float32: 256 MB for 8,000 rows, 10 GB for CIFAR-10's 50,000); the factors are held a group of layers at
a time within FACTOR_BYTES, each group one pass over the examples (ResNet-20's 270k materialised values per
example for 50,000 examples are 54 GB: 7 passes of 8 GiB on a GPU).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from perinstance.measure.batch_sums import Bags
from perinstance.measure.gradient_rows import (
    HELD_BYTES_CPU,
    PointGradients,
    advance,
    example_chunks,
    parameter_count,
    transformed_gradient_chunks,
)
from perinstance.measure.predictions import Predictions, predictions_of
from perinstance.train import gradients, gram_forms
from perinstance.train.clipping import Transform
from perinstance.train.gram_forms import GramFactor

# The held Gram (M² values of the model's dtype) at most, by device kind: a CPU holds 8,000 rows' in 256 MB
# (11,585 rows at most), a GPU CIFAR-10's 50,000 in 10 GB. A fixed constant, not the memory at hand, so that
# the route, hence every rounding, does not depend on what else the machine runs.
GRAM_BYTES = {"cpu": 1 << 29, "cuda": 1 << 34}
# The factors held at once while the Gram is built; more take one pass over the examples per group of layers.
FACTOR_BYTES = {"cpu": HELD_BYTES_CPU, "cuda": 1 << 33}
# Rows per block of the Gram's product, and columns per panel of the held Gram: a batch-sum call reads only its
# panel (8 MB for 8,000 rows in float32, within a CPU's cache).
GRAM_BLOCK = 2048
GRAM_PANEL = 256


def device_kind(device: str | torch.device) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def gram_route(model: torch.nn.Module, num_rows: int, device: str | torch.device) -> bool:
    """Whether the mean rule's draws at a checkpoint go through the Gram of its `num_rows` rows (training rows and
    points outside them): when the Gram fits GRAM_BYTES of the device's kind and a row of it is shorter than a
    gradient (num_rows < d; else the batch sums over the gradients themselves are cheaper)."""
    itemsize = next(model.parameters()).element_size()
    return num_rows ** 2 * itemsize <= GRAM_BYTES[device_kind(device)] and num_rows < parameter_count(model)


@dataclass
class CheckpointGram:
    """G_c of M rows (the N training rows, then the points outside the training set) held as column panels of
    GRAM_PANEL in the model's dtype, and in float64: ||h_a − μ||² (`centred_square`), h_a·μ (`mean_dots`),
    ||μ||² (`mean_square`), μ the mean of the N training rows. `predictions` of the M rows."""

    panels: list
    centred_square: torch.Tensor
    mean_dots: torch.Tensor
    mean_square: float
    num_rows: int
    predictions: Predictions

    @property
    def size(self) -> int:
        return len(self.centred_square)

    @property
    def device(self) -> torch.device:
        return self.panels[0].device

    def matrix(self) -> torch.Tensor:
        """The held Gram as one (M, M) matrix (for checks: it copies every panel)."""
        return torch.cat(self.panels, dim=1)

    def rows_of(self, points: PointGradients) -> np.ndarray:
        """Each point's row in the Gram: its training row, or for a point outside the training set (train_rows
        −1) the rows after the N training rows, in the points' order."""
        rows = np.asarray(points.train_rows).copy()
        outside = np.flatnonzero(rows < 0)
        rows[outside] = self.num_rows + np.arange(len(outside))
        return rows

    def point_squares(self, point_rows: np.ndarray) -> torch.Tensor:
        """||h*||² = ||h* − μ||² + 2 h*·μ − ||μ||² of the Gram rows `point_rows` (float64)."""
        index = torch.as_tensor(point_rows, device=self.device)
        return self.centred_square[index] + 2 * self.mean_dots[index] - self.mean_square

    def columns(self, indices: np.ndarray) -> torch.Tensor:
        """G_c[:N, indices] as one contiguous (N, len) matrix (rows `indices` of the symmetric Gram, transposed)."""
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self.device)
        return torch.cat([panel[index] for panel in self.panels], dim=1)[:, :self.num_rows].T.contiguous()

    def batch_sums(self, masks: np.ndarray, layout: np.ndarray, point_rows: np.ndarray) -> tuple:
        """For batches given as a boolean (batches, N) mask over the training rows, grouped by `layout` (groups, g)
        (each row the batches of one group): the centred sums' Gram within each group, Σ_{a∈D, b∈E} G_c[a, b]
        ((groups, g, g) float64), the sums Σ_{a∈D} G_c[a, p] for the Gram rows `point_rows` ((batches, P)
        float64), and Σ_{a∈D} (h_a − μ)·μ ((batches,) float64). Each batch's members are added in row order."""
        device = self.device
        bags = Bags.of_mask(masks, device)
        layout = torch.as_tensor(layout, device=device)
        grams = torch.zeros((*layout.shape, layout.shape[1]), dtype=torch.float64, device=device)
        dense = torch.as_tensor(masks, device=device)
        low = 0
        for panel in self.panels:
            high = min(low + panel.shape[1], self.num_rows)
            if high > low:
                sums = bags.sums(panel[:self.num_rows]).double()[layout]
                members = dense[:, low:high].to(torch.float64)[layout]
                grams.add_(torch.matmul(sums[..., :high - low], members.transpose(1, 2)))
            low += panel.shape[1]
        points = bags.sums(self.columns(point_rows)).double()
        centred_mean_dots = (self.mean_dots[:self.num_rows] - self.mean_square)[:, None]
        return grams, points, bags.sums(centred_mean_dots)[:, 0]


# --- building it ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """A part of the factors held in one group: columns `columns` of layer `layer`'s rows factor, or (columns
    None) its whole outer factor."""

    layer: int
    columns: slice | None


def checkpoint_gram(model: torch.nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, point_x: torch.Tensor,
                    point_y: torch.Tensor, point_train_rows: np.ndarray, transform: Transform, device: str = "cpu",
                    progress=None) -> tuple[CheckpointGram, PointGradients]:
    """The CheckpointGram of the training rows and of the points outside them (point_train_rows −1, in their
    order; arguments as gradient_rows.checkpoint_gradients) and the points' PointGradients (without rows).
    `progress` advances by the examples of the first pass."""
    point_train_rows = np.asarray(point_train_rows)
    outside = np.flatnonzero(point_train_rows < 0)
    inputs, labels = train_x, train_y
    if len(outside):
        inputs, labels = torch.cat([train_x, point_x[outside]]), torch.cat([train_y, point_y[outside]])
    gram = _build(model, inputs, labels, len(train_y), transform, device, progress)
    points = PointGradients(None, point_train_rows, Predictions(np.empty(0), np.empty(0, dtype=bool)))
    points.predictions = gram.predictions.take(gram.rows_of(points))
    return gram, points


def _factor_passes(model, inputs, labels, transform, device, wanted):
    """(start, the chunk's factors by layer, Predictions) of every chunk: the engine's GramFactors where
    gram_forms covers the model, else the materialised h_i as one rows factor."""
    if gram_forms.gram_covers(model):
        chunk = gradients.examples_per_pass(model, inputs, device)
        for start, x, y in example_chunks(inputs, labels, device, chunk):
            gram_pass = gram_forms.gram_factors(model, x, y, transform.weights, wanted)
            yield start, gram_pass.factors, predictions_of(gram_pass.losses, gram_pass.logits, y)
    else:
        for start, rows, predictions in transformed_gradient_chunks(model, inputs, labels, transform, device):
            yield start, [GramFactor(rows=rows)], predictions


def _groups(model, inputs, labels, transform, device, count):
    """The pieces of the factors, in groups that each fit FACTOR_BYTES for `count` rows (one pass each)."""
    _, factors, _ = next(_factor_passes(model, inputs[:2], labels[:2], transform, device, None))
    itemsize = next(model.parameters()).element_size()
    budget = FACTOR_BYTES[device_kind(device)]
    groups, current, used = [], [], 0
    for layer, factor in enumerate(factors):
        if factor.rows is None:
            pieces = [(_Piece(layer, None), count * factor.width * 8)]
        else:
            step = max(1, budget // (count * itemsize))
            pieces = [(_Piece(layer, slice(low, min(low + step, factor.width))),
                       count * (min(low + step, factor.width) - low) * itemsize)
                      for low in range(0, factor.width, step)]
        for piece, size in pieces:
            if current and used + size > budget:
                groups.append(current)
                current, used = [], 0
            current.append(piece)
            used += size
    return groups + [current] if current else groups


def _build(model, inputs, labels, num_rows, transform, device, progress):
    count, dtype = len(labels), next(model.parameters()).dtype
    panels = [torch.zeros((count, min(GRAM_PANEL, count - low)), dtype=dtype, device=device)
              for low in range(0, count, GRAM_PANEL)]
    centred_square = torch.zeros(count, dtype=torch.float64, device=device)
    mean_dots = torch.zeros(count, dtype=torch.float64, device=device)
    mean_square, predictions = 0.0, None
    for group in _groups(model, inputs, labels, transform, device, count):
        rows, outers, chunk_predictions = _hold(model, inputs, labels, transform, device, group,
                                                progress if predictions is None else None)
        if predictions is None:
            predictions = Predictions.concat(chunk_predictions)
        parts = []
        if rows is not None:
            parts.append(_centre_rows(rows, num_rows))
        parts += [_centre_outer(*outer, num_rows) for outer in outers]
        for part in parts:
            centred_square += part.centred_square
            mean_dots += part.mean_dots
            mean_square += part.mean_square
        _add_products(panels, rows, [part for part in parts if part.outer is not None])
    return CheckpointGram(panels, centred_square, mean_dots, mean_square, num_rows, predictions)


def _hold(model, inputs, labels, transform, device, group, progress):
    """One pass: the group's rows pieces as one (count, width) matrix in the model's dtype (None without any), its
    outer factors as float64 (inputs, outputs) pairs, and every chunk's Predictions."""
    count, dtype = len(labels), next(model.parameters()).dtype
    row_pieces = [piece for piece in group if piece.columns is not None]
    width = sum(piece.columns.stop - piece.columns.start for piece in row_pieces)
    rows = torch.empty((count, width), dtype=dtype, device=device) if row_pieces else None
    outers = {piece.layer: None for piece in group if piece.columns is None}
    predictions = []
    for start, factors, chunk_predictions in _factor_passes(model, inputs, labels, transform, device,
                                                            {piece.layer for piece in group}):
        end, offset = start + len(chunk_predictions.losses), 0
        for piece in row_pieces:
            part = factors[piece.layer].rows[:, piece.columns]
            rows[start:end, offset:offset + part.shape[1]] = part
            offset += part.shape[1]
        for layer in outers:
            factor = factors[layer]
            if outers[layer] is None:
                outers[layer] = tuple(torch.empty((count, part.shape[1]), dtype=torch.float64, device=device)
                                      for part in (factor.inputs, factor.outputs))
            outers[layer][0][start:end] = factor.inputs
            outers[layer][1][start:end] = factor.outputs
        predictions.append(chunk_predictions)
        advance(progress, end - start)
    return rows, list(outers.values()), predictions


@dataclass
class _Centred:
    """One part of the factors, centred: ||h_a − μ||², h_a·μ and ||μ||² of that part of the gradient (float64);
    for an outer factor also (inputs, outputs) and h_a·μ, from which _add_products forms its centred products."""

    centred_square: torch.Tensor
    mean_dots: torch.Tensor
    mean_square: float
    outer: tuple | None = None


def _centre_rows(rows, num_rows):
    """Centre the rows factor in place, in its own dtype, at the mean of its first `num_rows` rows."""
    mean = rows[:num_rows].sum(dim=0, dtype=torch.float64) / num_rows
    mean_dots = torch.cat([block.double() @ mean for block in _blocks(rows)])
    rows.sub_(mean.to(rows.dtype))
    centred_square = torch.cat([block.double().square().sum(dim=1) for block in _blocks(rows)])
    return _Centred(centred_square, mean_dots, float(mean @ mean))


def _centre_outer(inputs, outputs, num_rows):
    """g_a = b_a a_aᵀ: the mean gradient M = (1/N) Σ b aᵀ, h_a·M = b_aᵀ M a_a, ||h_a − M||² = ||a||²·||b||² − 2 h_a·M + ||M||²."""
    mean = outputs[:num_rows].T @ inputs[:num_rows] / num_rows
    mean_dots = ((outputs @ mean) * inputs).sum(dim=1)
    mean_square = float(mean.square().sum())
    squares = inputs.square().sum(dim=1) * outputs.square().sum(dim=1)
    return _Centred(squares - 2 * mean_dots + mean_square, mean_dots, mean_square, (inputs, outputs))


def _blocks(matrix: torch.Tensor) -> Iterator[torch.Tensor]:
    for start in range(0, len(matrix), GRAM_BLOCK):
        yield matrix[start:start + GRAM_BLOCK]


def _add_products(panels, rows, outers):
    """Add this group's centred products to the held Gram, block by block: R_I R_Jᵀ in the rows' dtype, and per
    outer factor (A_I A_Jᵀ)⊙(B_I B_Jᵀ) − h_I·M − h_J·M + ||M||² in float64; each block above the diagonal is
    mirrored below it, so the held Gram is exactly symmetric."""
    count = sum(panel.shape[0] for panel in panels[:1])
    for first in range(0, count, GRAM_BLOCK):
        rows_i = slice(first, min(first + GRAM_BLOCK, count))
        for second in range(first, count, GRAM_BLOCK):
            rows_j = slice(second, min(second + GRAM_BLOCK, count))
            block = None if rows is None else (rows[rows_i] @ rows[rows_j].T).double()
            for part in outers:
                (inputs, outputs), dots = part.outer, part.mean_dots
                product = (inputs[rows_i] @ inputs[rows_j].T).mul_(outputs[rows_i] @ outputs[rows_j].T)
                product.sub_(dots[rows_i, None]).sub_(dots[None, rows_j]).add_(part.mean_square)
                block = product if block is None else block.add_(product)
            if block is None:
                continue
            _add_block(panels, rows_i, rows_j, block)
            if second != first:
                _add_block(panels, rows_j, rows_i, block.T)


def _add_block(panels, rows, columns, block):
    for number in range(columns.start // GRAM_PANEL, (columns.stop - 1) // GRAM_PANEL + 1):
        low = number * GRAM_PANEL
        inside = slice(max(columns.start, low), min(columns.stop, low + GRAM_PANEL))
        panels[number][rows, inside.start - low:inside.stop - low] += block[:, inside.start - columns.start:
                                                                           inside.stop - columns.start]

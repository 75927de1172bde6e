"""The centred Gram matrix of a checkpoint's transformed per-sample gradients, G_c[a, b] = (h_a − μ)·(h_b − μ),
and the batch sums over it from which the mean rule's Monte-Carlo statistics are quadratic forms
(accounting.md §2; docs/sensitivity.md, "The Gram route").

Every statistic of §2 that the Monte Carlo draws (Δ_B of the coupling, GLA's S) is a quadratic form in batch
sums s_D = Σ_{a∈D} h_a and the point's h*. With the Gram of the rows, 1_Dᵀ G 1_E = s_D·s_E needs a batch's
N-long rows of the Gram instead of its d-long gradients, and the Gram itself is built layer by layer from the
engine's factors (persample/gram_forms.py): for LeNet-5, 3,393 multiply-adds per pair of examples instead of
61,706. So at a checkpoint whose N is below d, one Gram product serves every draw. A layer whose materialised
gradients cost less for the measurement at hand (its Workload: few points and batches against N²) stays as
centred rows instead, and every quadratic form adds the two parts.

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
from tqdm import tqdm

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
from perinstance.persample import gradients, gram_forms
from perinstance.persample.batches import LossFn
from perinstance.persample.gram_forms import GramFactor
from perinstance.train.clipping import Transform
from perinstance.train.memory import return_free_pages

# The held Gram (M² values of the model's dtype) at most, by device kind: a CPU holds 8,000 rows' in 256 MB
# (11,585 rows at most), a GPU CIFAR-10's 50,000 in 10 GB. A fixed constant, not the memory at hand, so that
# the route, hence every rounding, does not depend on what else the machine runs.
GRAM_BYTES = {"cpu": 1 << 29, "cuda": 1 << 34}
# The factors held at once while the Gram is built; more take one pass over the examples per group of layers.
FACTOR_BYTES = {"cpu": HELD_BYTES_CPU, "cuda": 1 << 33}
# Rows per block of the Gram's product, by device kind: on a CPU the float64 products of a 512-row block stay in
# cache for their elementwise products (LeNet-5's outer factors for 8,000 rows, 1 thread: 1.8 s in blocks of 512,
# 2.6 s in blocks of 2,048); a GPU takes larger blocks, fewer launches.
GRAM_BLOCK = {"cpu": 512, "cuda": 4096}
# The Gram and the kept rows are held as column panels of PANEL_BYTES of the device's kind (at least
# MIN_PANEL columns, a multiple of PANEL_STEP): a batch-sum call reads one panel, which on a CPU stays in cache
# while every batch reads it (8,000 rows: panels of 256 columns; whole rows of 2,572 values were 3.5× slower).
PANEL_BYTES = {"cpu": 8 << 20, "cuda": 256 << 20}
MIN_PANEL, PANEL_STEP = 256, 64


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
    """The centred gradients of M rows (the N training rows, then the points outside the training set) in two
    parts, each layer in one of them (`_in_gram`): the Gram G_c of some layers' parts, held as column panels,
    `panels` (panels, M, width) in the model's dtype (panel k the columns from k·width, the last one padded with
    zeros; `panel_width`; None when no layer is in it), and the other layers' centred per-sample gradients
    themselves, `rows`, column panels alike of the (M, p) matrix (None when no layer is kept so). In float64, over both parts:
    ||h_a − μ||² (`centred_square`), h_a·μ (`mean_dots`), ||μ||² (`mean_square`), μ the mean of the N training
    rows. `predictions` of the M rows."""

    panels: torch.Tensor | None
    rows: torch.Tensor | None
    centred_square: torch.Tensor
    mean_dots: torch.Tensor
    mean_square: float
    num_rows: int
    predictions: Predictions
    row_width: int = 0

    @property
    def size(self) -> int:
        return len(self.centred_square)

    @property
    def device(self) -> torch.device:
        return self.centred_square.device

    def products(self, indices: np.ndarray) -> torch.Tensor:
        """(h_a − μ)·(h_b − μ) of the rows `indices` with every row, (len, M) float64."""
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64), device=self.device)
        products = torch.zeros((len(index), self.size), dtype=torch.float64, device=self.device)
        if self.panels is not None:
            products += self.panels[:, index].transpose(0, 1).reshape(len(index), -1)[:, :self.size]
        if self.rows is not None:
            products += torch.matmul(self.rows[:, index], self.rows.transpose(1, 2)).sum(dim=0).double()
        return products

    def rows_of(self, points: PointGradients) -> np.ndarray:
        """Each point's row in the Gram: its training row, or for a point outside the training set (train_rows
        −1) the rows after the N training rows, in the points' order."""
        rows = np.asarray(points.train_rows).copy()
        outside = np.flatnonzero(rows < 0)
        rows[outside] = self.num_rows + np.arange(len(outside))
        return rows

    def point_squares(self, point_rows: np.ndarray) -> torch.Tensor:
        """||h*||² = ||h* − μ||² + 2 h*·μ − ||μ||² of the rows `point_rows` (float64)."""
        index = torch.as_tensor(point_rows, device=self.device)
        return self.centred_square[index] + 2 * self.mean_dots[index] - self.mean_square

    def point_columns(self, point_rows: np.ndarray) -> "PointColumns":
        """What batch_sums needs of the points `point_rows`, gathered once for every pass: their columns of the
        Gram over the training rows (N, P), contiguous, and their kept rows."""
        index = torch.as_tensor(np.asarray(point_rows, dtype=np.int64), device=self.device)
        gram = None if self.panels is None else \
            self.panels[:, index].transpose(0, 1).reshape(len(index), -1)[:, :self.num_rows].T.contiguous()
        rows = None if self.rows is None else self.rows[:, index].double()
        return PointColumns(gram, rows)

    def batch_sums(self, masks: np.ndarray, layout: np.ndarray, points: "PointColumns") -> tuple:
        """For batches given as a boolean (batches, N) mask over the training rows, grouped by `layout` (groups, g)
        (each row the batches of one group), with s_D = Σ_{a∈D} (h_a − μ): the Gram of the sums within each
        group, s_D·s_E ((groups, g, g) float64), s_D·(h_p − μ) for the points of `points` (point_columns;
        (batches, P) float64), and s_D·μ ((batches,) float64). Each batch's members are added in row order.

        Gram part: the sums run over its column panels (a panel of the N rows stays in a CPU's cache while every
        batch reads it); each panel's part of a group's Gram is a product of its sums with the members' 0/1
        columns in the Gram's dtype, added in float64. Rows part: each batch's sum of the rows, then float64
        products of the sums with each other within a group and with the points' rows."""
        device, count = self.device, self.num_rows
        bags = Bags.of_mask(masks, device)
        layout = torch.as_tensor(layout, device=device)
        grams = torch.zeros((*layout.shape, layout.shape[1]), dtype=torch.float64, device=device)
        products = None
        if self.panels is not None:
            members = torch.as_tensor(masks, device=device).to(self.panels.dtype)
            width = self.panels.shape[2]
            for number, low in enumerate(range(0, count, width)):
                high = min(low + width, count)
                sums = bags.sums(self.panels[number, :count, :high - low])
                grams += torch.matmul(sums[layout], members[:, low:high][layout].transpose(1, 2)).double()
            products = bags.sums(points.gram).double()
        for number, panel in enumerate([] if self.rows is None else self.rows):
            sums = bags.sums(panel[:count]).double()
            grams += torch.matmul(sums[layout], sums[layout].transpose(1, 2))
            part = sums @ points.rows[number].T
            products = part if products is None else products.add_(part)
        centred_mean_dots = (self.mean_dots[:count] - self.mean_square)[:, None]
        return grams, products, bags.sums(centred_mean_dots)[:, 0]


@dataclass
class PointColumns:
    """The points' columns of the Gram over the training rows (N, P) in its dtype, and their kept rows as float64
    panels (panels, P, width); each None when the CheckpointGram has no such part."""

    gram: torch.Tensor | None
    rows: torch.Tensor | None


# --- building it ---------------------------------------------------------------------------------------------

# The cost model that puts each layer in the Gram or keeps its materialised rows, in multiply-adds of a float32
# matrix product: a gather-and-add of one value costs GATHER_COST (embedding_bag against a matrix product on 2
# CPU cores, 1 thread: 6.5 G adds/s against 40 G multiply-adds/s), an outer factor's float64 product with its
# elementwise products FLOAT64_COST.
GATHER_COST = 6
FLOAT64_COST = 3


@dataclass(frozen=True)
class Workload:
    """What a measurement asks of a checkpoint: `points` points, `batches` batch sums of `members` batch members
    in all, Gram products within groups of `group` batches (a permutation's grid sizes, a set of α + 1)."""

    points: int
    batches: int
    members: int
    group: int


@dataclass(frozen=True)
class _Piece:
    """A part of the factors held in one group: columns `columns` of layer `layer`'s rows factor, or (columns
    None) its whole outer factor."""

    layer: int
    columns: slice | None


def checkpoint_gram(model: torch.nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, point_x: torch.Tensor,
                    point_y: torch.Tensor, point_train_rows: np.ndarray, transform: Transform, workload: Workload,
                    device: str = "cpu", progress: tqdm | None = None, loss_fn: LossFn | None = None
                    ) -> tuple[CheckpointGram, PointGradients]:
    """The CheckpointGram of the training rows and of the points outside them (point_train_rows −1, in their
    order; arguments as gradient_rows.checkpoint_gradients) for `workload`, and the points' PointGradients
    (without rows). `progress` advances by the examples of the first pass."""
    point_train_rows = np.asarray(point_train_rows)
    outside = np.flatnonzero(point_train_rows < 0)
    inputs, labels = train_x, train_y
    if len(outside):
        inputs, labels = torch.cat([train_x, point_x[outside]]), torch.cat([train_y, point_y[outside]])
    gram = _build(model, inputs, labels, len(train_y), transform, workload, device, progress, loss_fn)
    points = PointGradients(None, point_train_rows, Predictions(np.empty(0), np.empty(0, dtype=bool)))
    points.predictions = gram.predictions.take(gram.rows_of(points))
    return gram, points


def _factor_passes(model, inputs, labels, transform, device, wanted, loss_fn=None):
    """(start, the chunk's factors by layer, Predictions) of every chunk: the engine's GramFactors where
    gram_forms covers the model, else the materialised h_i as one rows factor (g_i the gradient of the example's
    loss: the cross-entropy unless `loss_fn`)."""
    if gram_forms.gram_covers(model):
        chunk = gradients.examples_per_pass(model, inputs, device)
        for start, x, y in example_chunks(inputs, labels, device, chunk):
            gram_pass = gram_forms.gram_factors(model, x, y, transform.weights, wanted, loss_fn)
            yield start, gram_pass.factors, predictions_of(gram_pass.losses, gram_pass.logits, y, gram_pass.grad_norms)
    else:
        for start, rows, predictions in transformed_gradient_chunks(model, inputs, labels, transform, device,
                                                                    loss_fn=loss_fn):
            yield start, [GramFactor(rows=rows)], predictions


def _materialised_width(factor: GramFactor) -> int:
    return factor.width if factor.rows is not None else factor.inputs.shape[1] * factor.outputs.shape[1]


def _in_gram(factor: GramFactor, count: int, workload: Workload) -> bool:
    """Whether a layer costs less in the Gram of `count` rows (its product, once) than kept as materialised rows
    (every batch gathers them, and the batch sums meet the points and each other in products of their width)."""
    gram = count * count / 2 * (factor.width if factor.rows is not None else FLOAT64_COST * factor.width)
    rows = ((workload.members * GATHER_COST + workload.batches * (workload.points + workload.group))
            * _materialised_width(factor))
    return gram < rows


def _plan(model, inputs, labels, transform, workload, device, count, loss_fn=None):
    """The layers kept as materialised rows (held together, within FACTOR_BYTES: the widest go to the Gram
    otherwise), and the pieces of the Gram's layers, in groups that each fit FACTOR_BYTES for `count` rows (one
    pass over the examples each)."""
    _, factors, _ = next(_factor_passes(model, inputs[:2], labels[:2], transform, device, None, loss_fn))
    itemsize = next(model.parameters()).element_size()
    budget = FACTOR_BYTES[device_kind(device)]
    held = [layer for layer, factor in enumerate(factors) if not _in_gram(factor, count, workload)]
    while held and count * itemsize * sum(_materialised_width(factors[layer]) for layer in held) > budget:
        held.remove(max(held, key=lambda layer: _materialised_width(factors[layer])))
    groups, current, used = [], [], 0
    for layer, factor in enumerate(factors):
        if layer in held:
            continue
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
    return held, groups + [current] if current else groups


def _build(model, inputs, labels, num_rows, transform, workload, device, progress, loss_fn):
    count, dtype = len(labels), next(model.parameters()).dtype
    held, groups = _plan(model, inputs, labels, transform, workload, device, count, loss_fn)
    width = panel_width(count, dtype.itemsize, device)
    # The Gram is allocated at its first use, after the held rows are centred (whose float64 mean takes a float64
    # copy of them): the two never stand side by side at the peak. The pass's freed memory (its chunks' factors
    # and activations, which glibc keeps for the next pass) is handed back first: the Gram, the measurement's
    # largest block, is not placed on top of it (240 MiB less at the quick preset's Δ_B draws).
    panels = None
    centred_square = torch.zeros(count, dtype=torch.float64, device=device)
    mean_dots = torch.zeros(count, dtype=torch.float64, device=device)
    mean_square, predictions, held_rows, row_width = 0.0, None, None, 0
    for group in groups or [[]]:
        rows, outers, kept, chunk_predictions = _hold(model, inputs, labels, transform, device, group,
                                                      held if predictions is None else [],
                                                      progress if predictions is None else None, loss_fn)
        parts = [_centre_rows(rows, num_rows)] if rows is not None else []
        parts += [_centre_outer(*outer, num_rows) for outer in outers]
        if predictions is None:
            predictions = Predictions.concat(chunk_predictions)
            if kept is not None:
                parts.append(_centre_rows(kept, num_rows))
                held_rows, row_width = _as_panels(kept), kept.shape[1]
                kept = None  # held as panels from here: the matrix is not kept beside them through the products
        for part in parts:
            centred_square += part.centred_square
            mean_dots += part.mean_dots
            mean_square += part.mean_square
        if group:
            if panels is None:
                return_free_pages()
                panels = torch.zeros((-(-count // width), count, width), dtype=dtype, device=device)
            _add_products(panels, rows, [part for part in parts if part.outer is not None])
    # The outer factors' ||h_a − μ||² are differences (||a||²·||b||² − 2 h_a·M + ||M||²) that can round a hair
    # below 0 where h_a is μ.
    return CheckpointGram(panels, held_rows, centred_square.clamp_min_(0.0), mean_dots, mean_square, num_rows,
                          predictions, row_width)


def panel_width(count: int, itemsize: int, device: str | torch.device) -> int:
    """Columns per panel of `count` rows: PANEL_BYTES of the device's kind, at least MIN_PANEL, a multiple of
    PANEL_STEP."""
    return max(MIN_PANEL, PANEL_BYTES[device_kind(device)] // (count * itemsize) // PANEL_STEP * PANEL_STEP)


def _as_panels(matrix):
    """A (M, p) matrix as (panels, M, width) column panels (panel_width), the last one padded with zeros."""
    width = min(matrix.shape[1], panel_width(len(matrix), matrix.element_size(), matrix.device))
    panels = matrix.new_zeros((-(-matrix.shape[1] // width), len(matrix), width))
    for number, low in enumerate(range(0, matrix.shape[1], width)):
        part = matrix[:, low:low + width]
        panels[number, :, :part.shape[1]] = part
    return panels


def _hold(model, inputs, labels, transform, device, group, held, progress, loss_fn):
    """One pass: the group's rows pieces as one (count, width) matrix in the model's dtype (None without any), its
    outer factors as float64 (inputs, outputs) pairs, the `held` layers' materialised rows as one matrix (None
    without any), and every chunk's Predictions."""
    count, dtype = len(labels), next(model.parameters()).dtype
    row_pieces = [piece for piece in group if piece.columns is not None]
    rows = _Filled(count, dtype, device) if row_pieces else None
    kept = _Filled(count, dtype, device) if held else None
    outers = {piece.layer: None for piece in group if piece.columns is None}
    predictions = []
    for start, factors, chunk_predictions in _factor_passes(model, inputs, labels, transform, device,
                                                            {piece.layer for piece in group} | set(held), loss_fn):
        end = start + len(chunk_predictions.losses)
        if rows is not None:
            rows.fill(start, [factors[piece.layer].rows[:, piece.columns] for piece in row_pieces])
        if kept is not None:
            kept.fill(start, [_materialised(factors[layer]) for layer in held])
        for layer in outers:
            factor = factors[layer]
            if outers[layer] is None:
                outers[layer] = tuple(torch.empty((count, part.shape[1]), dtype=torch.float64, device=device)
                                      for part in (factor.inputs, factor.outputs))
            outers[layer][0][start:end] = factor.inputs
            outers[layer][1][start:end] = factor.outputs
        predictions.append(chunk_predictions)
        advance(progress, end - start)
    return (None if rows is None else rows.matrix, list(outers.values()), None if kept is None else kept.matrix,
            predictions)


class _Filled:
    """A (count, width) matrix filled chunk by chunk from column parts, its width known at the first chunk."""

    def __init__(self, count, dtype, device):
        self.count, self.dtype, self.device, self.matrix = count, dtype, device, None

    def fill(self, start, parts):
        if self.matrix is None:
            width = sum(part.shape[1] for part in parts)
            self.matrix = torch.empty((self.count, width), dtype=self.dtype, device=self.device)
        offset = 0
        for part in parts:
            self.matrix[start:start + len(part), offset:offset + part.shape[1]] = part
            offset += part.shape[1]


def _materialised(factor: GramFactor) -> torch.Tensor:
    """A layer's per-sample gradients as (n, p) rows: an outer factor's b aᵀ formed."""
    if factor.rows is not None:
        return factor.rows
    return (factor.outputs[:, :, None] * factor.inputs[:, None, :]).reshape(len(factor.outputs), -1)


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
    step = GRAM_BLOCK[device_kind(matrix.device)]
    for start in range(0, len(matrix), step):
        yield matrix[start:start + step]


def _add_products(panels, rows, outers):
    """Add this group's centred products to the held Gram, block by block: R_I R_Jᵀ in the rows' dtype, and the
    outer factors' Σ (A_I A_Jᵀ)⊙(B_I B_Jᵀ) − h_I·M − h_J·M + ||M||² in float64, rounded to the Gram's dtype once
    centred; each block above the diagonal is mirrored below it, so the held Gram is exactly symmetric."""
    count, step = panels.shape[1], GRAM_BLOCK[device_kind(panels.device)]  # blocks of rows, any panel width
    mean_dots = sum(part.mean_dots for part in outers)
    mean_square = sum(part.mean_square for part in outers)
    for first in range(0, count, step):
        rows_i = slice(first, min(first + step, count))
        for second in range(first, count, step):
            rows_j = slice(second, min(second + step, count))
            block = None if rows is None else rows[rows_i] @ rows[rows_j].T
            if outers:
                products = None
                for part in outers:
                    inputs, outputs = part.outer
                    product = (inputs[rows_i] @ inputs[rows_j].T).mul_(outputs[rows_i] @ outputs[rows_j].T)
                    products = product if products is None else products.add_(product)
                products.sub_(mean_dots[rows_i, None]).sub_(mean_dots[None, rows_j]).add_(mean_square)
                # Rounded once, then added in the Gram's dtype (an in-place add across dtypes is 20× slower).
                products = products.to(panels.dtype)
                block = products if block is None else block.add_(products)
            if block is None:
                continue
            _add_block(panels, rows_i, second, block)
            if second != first:
                _add_block(panels, rows_j, first, block.T)


def _add_block(panels, rows, first_column, block):
    """Add `block` to the Gram's rows `rows` from column `first_column`, panel by panel."""
    width = panels.shape[2]
    last_column = first_column + block.shape[1]
    for number in range(first_column // width, (last_column - 1) // width + 1):
        low, high = max(first_column, number * width), min(last_column, (number + 1) * width)
        panels[number, rows, low - number * width:high - number * width] += block[:, low - first_column:
                                                                             high - first_column]

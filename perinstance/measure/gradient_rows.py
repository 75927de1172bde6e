"""The per-sample transformed gradients h_i = h(g_i) of a checkpoint, as rows (accounting.md §1, §2).

Gradients at a fixed checkpoint do not depend on which batch an example sits in (no BatchNorm),
so every quantity of §2 is assembled from these rows, computed once per checkpoint, never from a
forward/backward per batch. The rows are held as column panels (a few thousand columns each) as
far as the memory budget allows and recomputed chunk by chunk on every pass otherwise; every
result is assembled chunk by chunk in row order and panel by panel, so it is the same to the
last bit whichever rows are held.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from perinstance.measure.batch_sums import Bags
from perinstance.measure.predictions import Predictions, predictions_of
from perinstance.persample import batches, fallback_norms, gradients, layer_pass
from perinstance.train.clipping import Transform
from perinstance.train.memory import memory_budget

# Examples per per-sample pass (materialised rows); norms-only passes take gradients.examples_per_pass.
ROW_CHUNK = gradients.FALLBACK_PASS_EXAMPLES
# Columns of the held gradient matrix per panel: batch sums over narrow panels are faster than
# over whole rows of tens of thousands of floats, and the float64 copies a panel needs stay small.
COLUMN_PANEL = 2048
# A pass of the Monte Carlo over the rows holds at most PASS_OUTPUT_BYTES of (batches, points)
# float64 products and HELD_PASS_BATCHES batches per PASS_OUTPUT_BYTES.
PASS_OUTPUT_BYTES = 1 << 28
HELD_PASS_BATCHES = 4096
# Float32 batch sums (batches × d) of one pass, at most: what RecomputedRows holds while it adds
# the chunks in. Held rows' passes are cut alike, so that results do not depend on what is held.
PASS_SUM_BYTES = 1 << 28
# Recomputed rows added to the batch sums at once: at many batches the sums are far larger than a chunk, and
# each addition reads and writes them (the order of the additions, hence every bit, does not depend on it).
SUM_GROUP_ROWS = 2 * ROW_CHUNK
# Per-sample gradients held on a CPU, at most: with what torch, Opacus and pandas take, a pass's
# batch sums and a chunk's per-sample pass, a measurement of the quick preset fits in 2 GB
# (benchmarks/bench_memory.py). Further rows are recomputed on each pass, at the cost of one more
# per-sample pass over them per pass.
HELD_BYTES_CPU = 1 << 28


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
    def in_training(self) -> np.ndarray:
        """Whether each point is one of the training rows (then its h* is inside every batch sum
        that contains its row)."""
        return self.train_rows >= 0


# --- per-sample passes -------------------------------------------------------------------

@contextmanager
def training_mode(model: torch.nn.Module) -> Iterator[None]:
    """Opacus's hooks record only in training mode. The models here have no BatchNorm and no
    dropout, so training mode computes the same function as eval mode."""
    was_training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(was_training)


def advance(progress: tqdm | None, count: int) -> None:
    """Move a progress bar (or nothing) on by `count`."""
    if progress is not None:
        progress.update(count)


def example_chunks(inputs: torch.Tensor, labels: torch.Tensor, device: str,
                   size: int | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(start, inputs, labels) of each chunk of `size` examples (default ROW_CHUNK, read at call time), on `device`."""
    size = size or ROW_CHUNK
    for start in range(0, len(labels), size):
        yield start, inputs[start:start + size].to(device), labels[start:start + size].to(device)


def transformed_norms(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, transform: Transform,
                      device: str = "cpu", progress: tqdm | None = None,
                      loss_fn: batches.LossFn | None = None) -> tuple[np.ndarray, Predictions]:
    """Δ* = ||h(g_i)|| of each example (float64 array, accounting.md §2 sum rule) and its Predictions; g_i is the
    gradient of the example's loss (batches.per_example_loss: the cross-entropy unless `loss_fn`).

    Per-sample gradients are never kept (gradients.per_sample_norms).
    """
    norms, predictions = [], []
    for _, x, y in example_chunks(inputs, labels, device, gradients.examples_per_pass(model, inputs, device)):
        grad_norms, losses, logits = gradients.per_sample_norms(model, x, y, loss_fn)
        norms.append(transform.norms(grad_norms).double().cpu())
        predictions.append(predictions_of(losses, logits, y, grad_norms))
        advance(progress, len(y))
    return torch.cat(norms).numpy(), Predictions.concat(predictions)


def transformed_gradient_chunks(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                                transform: Transform, device: str = "cpu", progress: tqdm | None = None,
                                loss_fn: batches.LossFn | None = None
                                ) -> Iterator[tuple[int, torch.Tensor, Predictions]]:
    """Yield (start, rows, Predictions) per chunk of examples: rows are h_i = w(||g_i||)·g_i, flattened, g_i the
    gradient of the example's loss (the cross-entropy unless `loss_fn`)."""
    if fallback_norms.needs_fallback(model):  # layers Opacus's hooks may lack: every per-sample gradient by torch.func
        module, per_sample = None, fallback_norms.per_sample_gradients
    else:
        module = gradients.wrap_per_sample(model)
        per_sample = gradients.per_sample_gradients
    try:
        with training_mode(model):
            for start, x, y in example_chunks(inputs, labels, device):
                grad_samples, losses, logits = per_sample(module or model, x, y, loss_fn)
                grad_norms = gradients.grad_norms(grad_samples)
                chunk_predictions = predictions_of(losses, logits, y, grad_norms)
                weights = transform.weights(grad_norms)
                yield start, gradients.flatten(grad_samples).mul_(weights[:, None]), chunk_predictions
                advance(progress, len(y))
    finally:
        if module is not None:
            module.cleanup()


def parameter_count(model: torch.nn.Module) -> int:
    return sum(param.numel() for param in layer_pass.trainable_parameters(model))


def column_spans(dim: int) -> list[tuple[int, int]]:
    """(first, end) columns of each panel of COLUMN_PANEL columns."""
    return [(start, min(start + COLUMN_PANEL, dim)) for start in range(0, dim, COLUMN_PANEL)]


def square_norms(matrix: torch.Tensor) -> torch.Tensor:
    """||row||² of every row of one panel, summed in the panel's dtype and returned as float64, in
    which the callers add the panels (twice as fast as a float64 reduction)."""
    return torch.einsum("ij,ij->i", matrix, matrix).double()


def centred_square_norms(panels: Sequence[torch.Tensor], mean: torch.Tensor) -> torch.Tensor:
    """||h_i − μ||² of the rows of one chunk (its column panels): each panel centred in its own dtype, the
    panels' squares added in float64 (_Rows.moments)."""
    spans = column_spans(len(mean))
    return sum(square_norms(panel - mean[low:high].to(panel.dtype)) for panel, (low, high) in zip(panels, spans))


def panel_square_norms(panels: Sequence[torch.Tensor]) -> torch.Tensor:
    """||h_i||² of the rows of one chunk, each panel squared in float64 (_Rows.square_norms)."""
    return sum((panel.double() ** 2).sum(dim=1) for panel in panels)


def pass_batches(num_points: int, dim: int, itemsize: int, output_bytes: int = PASS_OUTPUT_BYTES) -> int:
    """Batches per Monte Carlo pass over rows of `dim` values of `itemsize` bytes: the (batches, points) float64
    products stay under `output_bytes` and the batch sums under PASS_SUM_BYTES (the products' rounding follows
    their shapes)."""
    most = HELD_PASS_BATCHES * max(1, output_bytes // PASS_OUTPUT_BYTES)
    sums = PASS_SUM_BYTES // (itemsize * dim)
    return max(1, min(most, output_bytes // (8 * num_points), sums))


class _Rows:
    """What HeldRows and RecomputedRows share: every quantity assembled chunk by chunk (ROW_CHUNK
    rows, in row order) and panel by panel, the same whichever rows are held, so that results do
    not depend on the memory budget. Subclasses provide `chunks()` and `sum_panels()`."""

    def chunks(self) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """(start, panels) of each chunk of ROW_CHUNK rows, in row order."""
        raise NotImplementedError

    def pass_batches(self, num_points: int, output_bytes: int = PASS_OUTPUT_BYTES) -> int:
        """pass_batches for these rows (the same whichever rows are held)."""
        return pass_batches(num_points, self.dim, self.dtype.itemsize, output_bytes)

    def column_sums(self) -> torch.Tensor:
        """Σ_i h_i (float64, (d,)): float64 sums of each chunk, added in row order."""
        total = None
        for _, panels in self.chunks():
            part = torch.cat([panel.sum(dim=0, dtype=torch.float64) for panel in panels])
            total = part if total is None else total.add_(part)
        return total

    def mean(self) -> torch.Tensor:
        """μ = (1/N) Σ_i h_i (float64, (d,))."""
        return self.column_sums() / self.num_rows

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """μ (`mean`) and ||h_i − μ||² of every row (float64, (N,)); the rows are centred in their own dtype,
        the sums are float64. (sum_panels can give the same norms from a pass it makes anyway.)"""
        mean = self.mean()
        return mean, torch.cat([centred_square_norms(panels, mean) for _, panels in self.chunks()])

    def square_norms(self) -> torch.Tensor:
        """||h_i||² of every row (float64, (N,)), each panel squared in float64."""
        return torch.cat([panel_square_norms(panels) for _, panels in self.chunks()])

    def products(self, matrix: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """H·matrixᵀ: h_i·m_j for every row i and row j of `matrix` (m × d), computed and summed
        over the panels in `dtype`: (rows, m)."""
        parts = [matrix[:, low:high].to(dtype) for low, high in column_spans(self.dim)]
        return torch.cat([sum(panel.to(dtype) @ part.T for panel, part in zip(panels, parts))
                          for _, panels in self.chunks()])

    def transposed_product(self, matrix: torch.Tensor) -> torch.Tensor:
        """Hᵀ·matrix for a (rows × m) `matrix`, in the rows' dtype: (d, m), the chunks added in row order."""
        product = None
        for start, panels in self.chunks():
            part = torch.cat([panel.T @ matrix[start:start + len(panel)] for panel in panels])
            product = part if product is None else product.add_(part)
        return product


class HeldRows(_Rows):
    """h_i of every training point at one checkpoint, computed once and kept as column panels."""

    def __init__(self, panels: list[torch.Tensor], predictions: Predictions) -> None:
        self.panels = panels
        self.predictions = predictions

    @classmethod
    def compute(cls, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, transform: Transform,
                device: str = "cpu", progress: tqdm | None = None,
                loss_fn: batches.LossFn | None = None) -> "HeldRows":
        dtype = next(model.parameters()).dtype
        spans = column_spans(parameter_count(model))
        panels = [torch.empty((len(labels), high - low), dtype=dtype, device=device) for low, high in spans]
        predictions = []
        for start, rows, chunk_predictions in transformed_gradient_chunks(model, inputs, labels, transform, device,
                                                                          progress, loss_fn):
            for panel, (low, high) in zip(panels, spans):
                panel[start:start + len(rows)] = rows[:, low:high]
            predictions.append(chunk_predictions)
        return cls(panels, Predictions.concat(predictions))

    @property
    def num_rows(self) -> int:
        return self.panels[0].shape[0]

    @property
    def dim(self) -> int:
        return sum(panel.shape[1] for panel in self.panels)

    @property
    def dtype(self) -> torch.dtype:
        return self.panels[0].dtype

    @property
    def device(self) -> torch.device:
        return self.panels[0].device

    def chunks(self) -> Iterator[tuple[int, list[torch.Tensor]]]:
        for start in range(0, self.num_rows, ROW_CHUNK):
            yield start, [panel[start:start + ROW_CHUNK] for panel in self.panels]

    def take(self, indices: np.ndarray) -> torch.Tensor:
        """Rows `indices` as one (len, d) matrix."""
        index = torch.as_tensor(indices, device=self.device)
        return torch.cat([panel[index] for panel in self.panels], dim=1)

    def leading(self, count: int) -> "HeldRows":
        """The first `count` rows, held."""
        return HeldRows([panel[:count] for panel in self.panels], self.predictions.take(np.arange(count)))

    def sum_panels(self, mask: np.ndarray, dtype: torch.dtype = torch.float64,
                   centred: tuple[torch.Tensor, torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
        """Panels (in `dtype`) of the batch sums s_D for a boolean (batches, rows) mask; a batch's
        members are added one after the other, in row order. centred: None, or (μ, out) to fill out (N,)
        with ||h_i − μ||² of every row, as moments() computes them."""
        if centred is not None:
            mean, out = centred
            for start, panels in self.chunks():
                out[start:start + len(panels[0])] = centred_square_norms(panels, mean)
        bags = Bags.of_mask(mask, self.device)
        for panel in self.panels:
            yield bags.sums(panel).to(dtype)


class RecomputedRows(_Rows):
    """h_i of every training point: the first `held` rows (a multiple of ROW_CHUNK) computed once and
    kept, the others recomputed chunk by chunk on each pass, never all in memory.

    For training sets whose gradient matrix does not fit (CIFAR-10 × ResNet-20 is 50k × 0.27M
    floats; on a CPU, more than HELD_BYTES_CPU). Its chunks are those of HeldRows.compute, computed
    alike, so every result equals HeldRows' bit for bit (tests/test_sensitivity.py).
    """

    def __init__(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, transform: Transform,
                 device: str = "cpu", held: int = 0, progress: tqdm | None = None, keep: Sequence[int] = (),
                 loss_fn: batches.LossFn | None = None) -> None:
        self.pass_args = (model, inputs, labels, transform, device)
        self.loss_fn = loss_fn
        self.num_rows = len(labels)
        # Whole chunks: the recomputed chunks start where HeldRows.compute's would.
        self.held = min(held // ROW_CHUNK * ROW_CHUNK, self.num_rows)
        self.dim, self.dtype, self.device = parameter_count(model), next(model.parameters()).dtype, device
        # One pass: the held rows, every row's predictions, the column sums (chunk by chunk in
        # row order, as _Rows.column_sums) and the recomputed rows listed in `keep` (for take).
        self.rows = HeldRows.compute(model, inputs[:self.held], labels[:self.held], transform, device,
                                     progress, loss_fn) if self.held else None
        self._sums = self.rows.column_sums() if self.held else None
        keep = np.unique(np.asarray(keep, dtype=np.int64))
        self._kept_index = keep[keep >= self.held]
        self._kept = torch.empty((len(self._kept_index), self.dim), dtype=self.dtype, device=device)
        # Filled in place: small arrays kept from every chunk would sit between the chunks' large blocks on the
        # heap and keep it from reusing them.
        self.predictions = Predictions(np.empty(self.num_rows), np.empty(self.num_rows))
        if self.held:
            self.predictions.losses[:self.held] = self.rows.predictions.losses
            self.predictions.correct[:self.held] = self.rows.predictions.correct
        # ||h_i||² of the recomputed rows too, which the audit asks for (square_norms): no pass of their own.
        self._recomputed_square_norms = torch.empty(self.num_rows - self.held, dtype=torch.float64, device=device)
        spans = column_spans(self.dim)
        for start, rows, chunk_predictions in self._recomputed(progress):
            panels = [rows[:, low:high].contiguous() for low, high in spans]
            part = torch.cat([panel.sum(dim=0, dtype=torch.float64) for panel in panels])
            self._sums = part if self._sums is None else self._sums.add_(part)
            self._recomputed_square_norms[start - self.held:start - self.held + len(rows)] = panel_square_norms(panels)
            wanted = np.flatnonzero((self._kept_index >= start) & (self._kept_index < start + len(rows)))
            self._kept[torch.as_tensor(wanted)] = rows[torch.as_tensor(self._kept_index[wanted] - start)]
            self.predictions.losses[start:start + len(rows)] = chunk_predictions.losses
            self.predictions.correct[start:start + len(rows)] = chunk_predictions.correct

    def column_sums(self) -> torch.Tensor:
        return self._sums.clone()

    def square_norms(self) -> torch.Tensor:
        held = [self.rows.square_norms()] if self.held else []
        return torch.cat([*held, self._recomputed_square_norms])

    def leading(self, count: int) -> HeldRows:
        """The first `count` rows, held: the held ones as they are, the others computed once more."""
        if count <= self.held:
            return self.rows.leading(count)
        model, inputs, labels, transform, device = self.pass_args
        return HeldRows.compute(model, inputs[:count], labels[:count], transform, device, loss_fn=self.loss_fn)

    def _recomputed(self, progress=None, start=None, stop=None):
        """(start, rows, predictions) of the chunks after the held rows (or of rows start..stop)."""
        model, inputs, labels, transform, device = self.pass_args
        start = self.held if start is None else start
        stop = self.num_rows if stop is None else stop
        for offset, rows, predictions in transformed_gradient_chunks(model, inputs[start:stop], labels[start:stop],
                                                                     transform, device, progress, self.loss_fn):
            yield start + offset, rows, predictions

    def chunks(self) -> Iterator[tuple[int, list[torch.Tensor]]]:
        if self.held:
            yield from self.rows.chunks()
        spans = column_spans(self.dim)
        for start, rows, _ in self._recomputed():
            # Contiguous panels, as HeldRows' (a reduction's order may follow the strides).
            yield start, [rows[:, low:high].contiguous() for low, high in spans]

    def take(self, indices: np.ndarray) -> torch.Tensor:
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

    def sum_panels(self, mask: np.ndarray, dtype: torch.dtype = torch.float64,
                   centred: tuple[torch.Tensor, torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
        """As HeldRows.sum_panels, bit for bit: each chunk's members are added onto the sums so far
        (the sums lead every bag), so a batch's members are still added one after the other. With
        `centred`, the pass that recomputes the rows also gives their centred norms (no pass of their own)."""
        sums = list(self.rows.sum_panels(mask[:, :self.held], self.dtype, centred)) if self.held else None
        spans = column_spans(self.dim)
        group, group_start = [], self.held
        for start, rows, _ in self._recomputed():
            if centred is not None:
                mean, out = centred
                out[start:start + len(rows)] = centred_square_norms(
                    [rows[:, low:high].contiguous() for low, high in spans], mean)
            group.append(rows)
            if start + len(rows) - group_start >= SUM_GROUP_ROWS or start + len(rows) == self.num_rows:
                sums = self._add_group(sums, group, mask[:, group_start:start + len(rows)], spans)
                group, group_start = [], start + len(rows)
        for panel in sums:
            yield panel.to(dtype)

    @staticmethod
    def _add_group(sums, group, group_mask, spans):
        """The batch sums with a group of recomputed chunks' rows added (each batch's members in row order)."""
        device = group[0].device
        if sums is None:
            bags = Bags.of_mask(group_mask, device)
            return [bags.sums(torch.cat([rows[:, low:high] for rows in group])) for low, high in spans]
        # Only the batches with members in the group change: at small sampling rates a group meets a few of them,
        # and the sums of all batches are far larger than the group.
        touched = np.flatnonzero(group_mask.any(axis=1))
        if not len(touched):
            return sums
        bags = Bags.of_mask(group_mask[touched], device, leading=True)
        index = torch.as_tensor(touched, device=device)
        for number, (low, high) in enumerate(spans):  # panel by panel: one panel's old sums at a time
            sums[number][index] = bags.sums(torch.cat([sums[number][index], *(rows[:, low:high] for rows in group)]))
        return sums


def held_rows(model: torch.nn.Module, num_rows: int, device: str) -> int:
    """Training rows to hold: as many whole chunks as fit in half the memory budget, and on a CPU
    in HELD_BYTES_CPU; all of them when they all fit."""
    row_bytes = parameter_count(model) * next(model.parameters()).element_size()
    fit = memory_budget(device) // 2
    if torch.device(device).type == "cpu":
        fit = min(fit, HELD_BYTES_CPU)
    if num_rows * row_bytes <= fit:
        return num_rows
    return fit // row_bytes // ROW_CHUNK * ROW_CHUNK


def checkpoint_gradients(model: torch.nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, point_x: torch.Tensor,
                         point_y: torch.Tensor, point_train_rows: Sequence[int] | np.ndarray, transform: Transform,
                         device: str = "cpu", hold: bool | None = None, progress: tqdm | None = None,
                         point_rows: bool = True, loss_fn: batches.LossFn | None = None
                         ) -> tuple[HeldRows | RecomputedRows, PointGradients]:
    """The training rows and the points, for the mean rule and the audit.

    The first rows, as many as `held_rows` allows, are held, the others recomputed on each pass
    (`hold` True or False holds all or none). A point that is a training row takes its h* and its
    predictions from its training chunk, so that neither depends on what is held.
    `point_train_rows[p]` is point p's training row, or -1 when it is not a training point (the
    --less-point point). point_rows=False keeps only the h* of the points outside the rows (the
    dataset statistics need no other). loss_fn: the per-example loss (None: the cross-entropy).
    """
    point_train_rows = np.asarray(point_train_rows)
    in_training = point_train_rows >= 0
    held = held_rows(model, len(train_y), device) if hold is None else len(train_y) if hold else 0
    if held >= len(train_y):
        rows = HeldRows.compute(model, train_x, train_y, transform, device, progress, loss_fn)
    else:
        keep = point_train_rows[in_training] if point_rows else ()
        rows = RecomputedRows(model, train_x, train_y, transform, device, held, progress, keep, loss_fn)
    inside, outside = np.flatnonzero(in_training), np.flatnonzero(~in_training)
    parts = [(inside, rows.take(point_train_rows[inside]) if point_rows else None,
              rows.predictions.take(point_train_rows[inside]))]
    outside_rows = None
    if len(outside):
        outside_rows, outside_predictions = _rows_of(model, point_x[outside], point_y[outside], transform, device,
                                                     loss_fn)
        parts.append((outside, outside_rows, outside_predictions))
    order = np.argsort(np.concatenate([positions for positions, _, _ in parts]))
    predictions = Predictions.concat([part for _, _, part in parts]).take(order)
    if not point_rows:
        return rows, PointGradients(None, point_train_rows, predictions, outside_rows)
    point_rows = torch.cat([part_rows for _, part_rows, _ in parts])[torch.as_tensor(order).to(rows.device)]
    return rows, PointGradients(point_rows, point_train_rows, predictions)


def _rows_of(model, inputs, labels, transform, device, loss_fn):
    parts = list(transformed_gradient_chunks(model, inputs, labels, transform, device, loss_fn=loss_fn))
    return torch.cat([rows for _, rows, _ in parts]), Predictions.concat([part for _, _, part in parts])

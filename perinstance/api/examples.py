"""The examples the API measures, read in chunks (docs/api.md): a pair (inputs, targets) of tensors (inputs also a
tuple or a mapping of tensors), a TensorDataset of two tensors, or any Dataset (or the dataset of a DataLoader,
with the loader's collate_fn and workers) streamed a chunk of items at a time, each item as the dataset gives
it, so that memory holds one chunk, never the dataset."""

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from perinstance.persample import batches


@dataclass
class Examples:
    """The chosen examples of `data` and how to read them: `first` is a batch (inputs, targets) of the first one
    (None when no point is chosen), and chunks(size) gives the batches of `size` examples in order."""

    data: object
    index: np.ndarray | None  # the points, None for all
    first: tuple | None
    collate: object = None
    workers: int = 0

    def point(self, position: int) -> int:
        """The index into data of the chosen example at `position`."""
        return position if self.index is None else int(self.index[position])

    def chunks(self, size: int) -> Iterator[tuple]:
        """(inputs, targets) of each chunk of `size` examples, in the order of the points."""
        if isinstance(self.data, tuple):  # tensors: slices (no copy) or indexed rows
            inputs, targets = self.data
            total = batches.count(targets) if self.index is None else len(self.index)
            for start in range(0, total, size):
                part = slice(start, start + size) if self.index is None else \
                    torch.as_tensor(self.index[start:start + size])
                yield batches.take(inputs, part), batches.take(targets, part)
            return
        sampler = None if self.index is None else self.index.tolist()
        # Its own generator: iterating a loader draws a seed, which must not come from the caller's global one.
        loader = DataLoader(self.data, batch_size=size, sampler=sampler, collate_fn=self.collate,
                            num_workers=self.workers, generator=torch.Generator())
        for batch in loader:
            yield _pair(batch)


def examples(data: object, points: Sequence[int] | None) -> Examples:
    """The Examples of `points` (None: all) of `data`; a one-line ValueError or TypeError naming what is wrong."""
    collate, workers = default_collate, 0
    if isinstance(data, DataLoader):
        # The loader's dataset read in index order, never its batches, which Poisson sampling draws at random.
        collate, workers, data = data.collate_fn, data.num_workers, data.dataset
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        data = tuple(data.tensors)
    if isinstance(data, tuple | list) and len(data) == 2 and not isinstance(data, Dataset):
        inputs, targets = (_tensor_batch(part, name) for part, name in zip(data, ("inputs", "targets")))
        counts = {batches.count(inputs), batches.count(targets)}
        if len(counts) != 1:
            raise ValueError(f"data: {batches.count(inputs)} inputs but {batches.count(targets)} targets")
        index = _index(points, counts.pop())
        first = slice(0, 1) if index is None else torch.as_tensor(index[:1])
        return Examples((inputs, targets), index, None if index is not None and not len(index) else
                        (batches.take(inputs, first), batches.take(targets, first)))
    if isinstance(data, IterableDataset):
        if points is not None:
            raise ValueError("points must be None for an IterableDataset (its items have no indices)")
        return Examples(data, None, _pair(collate([next(iter(data))])), collate, workers)
    if isinstance(data, Dataset) and hasattr(data, "__len__"):
        index = _index(points, len(data))
        if index is not None and not len(index):
            return Examples(data, index, None)
        return Examples(data, index, _pair(collate([data[0 if index is None else int(index[0])]])), collate, workers)
    raise TypeError("data must be a torch Dataset of (input, target) pairs, a DataLoader over one, or a pair "
                    f"(inputs, targets) of tensors, not {type(data).__name__}")


def _tensor_batch(part, name):
    """A tensor, a tuple or list of tensors, or a mapping of tensors (a dict)."""
    if isinstance(part, Mapping):
        part = dict(part)
    if not batches.tensors(part) or (not isinstance(part, torch.Tensor) and any(
            not isinstance(value, torch.Tensor) for value in (part.values() if isinstance(part, dict) else part))):
        raise TypeError(f"data: {name} must be a tensor, a tuple of tensors or a mapping of tensors")
    return part


def _index(points, size):
    if points is None:
        return None
    try:
        index = np.asarray(points, dtype=np.int64)
    except (TypeError, ValueError):
        raise ValueError(f"points must be a list of indices in [0, {size}), not {points!r:.60}") from None
    if index.ndim != 1 or ((index < 0) | (index >= size)).any():
        raise ValueError(f"points must be a list of indices in [0, {size})")
    return index


def _pair(batch):
    """A collated batch as (inputs, targets): the dataset's items must be (input, target) pairs."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise ValueError("data: each item of the dataset must be an (input, target) pair, not "
                         f"{type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, tuple | list) else ''}")
    inputs, targets = batch
    return (dict(inputs) if isinstance(inputs, Mapping) else inputs), targets

"""Batches whose inputs (and targets) are a tensor, a tuple of tensors or a mapping of tensors, with the examples
along the first dimension of every tensor; and the per-example loss of a batch (docs/api.md, "Any loss").

A model is applied to a batch's inputs as `model(x)` for a tensor, `model(*x)` for a tuple or list and
`model(**x)` for a mapping (a tokenizer's `input_ids`, `attention_mask`, ...). The loss of the engine is the
cross-entropy of logits against class indices unless a `loss_fn(outputs, targets)` is given, which returns one
loss per example: shape (n,), or (n, ...) summed over all but the first dimension (a sequence loss summed over its
tokens).
"""

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

# outputs, targets -> one loss per example ((n,) or (n, ...), summed per example).
LossFn = Callable[[object, object], torch.Tensor]


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], batch: object) -> object:
    """`batch` with `function` applied to each of its tensors (a tensor, a tuple or list, a mapping, nested)."""
    if isinstance(batch, torch.Tensor):
        return function(batch)
    if isinstance(batch, Mapping):
        return {key: map_tensors(function, value) for key, value in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(map_tensors(function, value) for value in batch)
    return batch


def tensors(batch: object) -> list[torch.Tensor]:
    """The tensors of `batch`, in order."""
    found = []
    map_tensors(found.append, batch)
    return found


def count(batch: object) -> int:
    """The number of examples of `batch`: the first dimension of its tensors, which must all have it."""
    sizes = {len(tensor) if tensor.dim() else None for tensor in tensors(batch)}
    if len(sizes) != 1 or None in sizes:
        shapes = ", ".join(str(tuple(tensor.shape)) for tensor in tensors(batch)) or "none"
        raise ValueError(f"a batch's tensors must share their first dimension (the examples); got shapes {shapes}")
    return sizes.pop()


def take(batch: object, index: slice | torch.Tensor) -> object:
    """The examples `index` (a slice or an index tensor) of `batch`."""
    return map_tensors(lambda tensor: tensor[index], batch)


def to_device(batch: object, device: str | torch.device) -> object:
    return map_tensors(lambda tensor: tensor.to(device), batch)


def call_arguments(inputs: object) -> tuple[tuple, dict]:
    """(positional, keyword) arguments of the model's call on `inputs`: a mapping as keywords, a tuple or list as
    positional arguments, anything else as the one argument."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


def apply_model(model: nn.Module, inputs: object) -> object:
    """model(x), model(*x) or model(**x) for a tensor, a tuple or list, or a mapping of inputs."""
    args, kwargs = call_arguments(inputs)
    return model(*args, **kwargs)


def per_example_loss(outputs: object, targets: object, loss_fn: LossFn | None = None) -> torch.Tensor:
    """One loss per example, (n,): the cross-entropy of logits `outputs` against class indices `targets`
    (loss_fn None), or loss_fn(outputs, targets) summed over all but its first dimension."""
    if loss_fn is None:
        return F.cross_entropy(outputs, targets, reduction="none")
    losses = loss_fn(outputs, targets)
    examples = count(targets)
    if not isinstance(losses, torch.Tensor) or losses.dim() == 0 or len(losses) != examples:
        shape = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(f"loss_fn must return one loss per example, shape ({examples},) or ({examples}, ...) "
                         f"(e.g. reduction='none'), not {shape}")
    return losses.reshape(examples, -1).sum(dim=1) if losses.dim() > 1 else losses


def class_indices(targets: object) -> bool:
    """Whether `targets` are one class index per example: a 1-d tensor of integers (not bool, float or complex)."""
    return isinstance(targets, torch.Tensor) and targets.dim() == 1 and not targets.is_floating_point() \
        and not targets.is_complex() and targets.dtype != torch.bool


def correct_predictions(outputs: object, targets: object) -> torch.Tensor | None:
    """1.0 where an example's largest output is its target class, 0.0 elsewhere: where outputs are logits
    (n, classes >= 2) and targets one class index per example; None for any other outputs or targets (regression
    values, even whole-numbered ones against one output, token sequences), whose correctness is not defined."""
    classes = isinstance(outputs, torch.Tensor) and outputs.dim() == 2 and outputs.shape[1] >= 2
    if not (classes and class_indices(targets) and len(outputs) == len(targets)):
        return None
    return (outputs.argmax(dim=1) == targets).float()

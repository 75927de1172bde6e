"""Per-example values that are not finite (NaN or ±inf) where a model and its loss make them: the inputs, the
outputs, the losses and the per-sample gradient norms ||g_i||.

Such a value never reaches a result: a NaN norm clips to a NaN weight (clipping.scale_weights) and from there
to NaN parameters, and a NaN Δ* would reach the accountants. The trainer, the tracked points, the measurement
and the API check the values they already hold (the norms and losses a pass returns) and refuse with the
example and the first of its values that is not finite. The kinds are in the order a pass computes them, so the
first that is not finite is where the value was made: a NaN output makes the loss and the gradient NaN too.
"""

from dataclasses import dataclass

import torch
from torch import nn

from perinstance.persample import batches

# What is not finite, in the order a pass makes them.
INPUT, OUTPUT, LOSS, GRADIENT = "input", "output", "loss", "gradient"
# Where a gradient norm that is not finite was made, when the outputs and the loss are finite (`gradient_source`).
IN_LOSS, IN_MODEL = "loss", "model"


@dataclass(frozen=True)
class NonFinite:
    """The first example, among those checked, with a value that is not finite: its position among them, the first
    of its input, output, loss and gradient norm that is not finite, and that value (of an input or output: its
    first element that is not finite)."""

    position: int
    kind: str
    value: float


class NonFiniteValues(ValueError):
    """A pass met a value that is not finite (`found`, its position among the examples of the pass's chunk). The
    callers that know which examples the pass took, and whose code made the value, say it in one line."""

    def __init__(self, found: NonFinite) -> None:
        super().__init__(f"the {found.kind} of example {found.position} is {found.value:g}")
        self.found = found


def finite_examples(batch: object, count: int) -> torch.Tensor:
    """(count,) bool on the batch's device, no value read back: whether each example's floating values in `batch`
    (a tensor, a tuple or a mapping of them: inputs or a model's outputs) are all finite. A tensor without the
    examples along its first dimension counts for every example; integer values are finite."""
    finite = None
    for tensor in batches.tensors(batch):
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        if tensor.dim() and len(tensor) == count:
            part = torch.isfinite(tensor.reshape(count, -1)).all(dim=1) if tensor.numel() else \
                torch.ones(count, dtype=torch.bool, device=tensor.device)
        else:
            part = torch.isfinite(tensor).all().expand(count)
        finite = part if finite is None else finite & part
    if finite is None:
        device = next(iter(batches.tensors(batch)), torch.zeros(0)).device
        return torch.ones(count, dtype=torch.bool, device=device)
    return finite


def first_non_finite(losses: torch.Tensor, grad_norms: torch.Tensor | None = None, outputs: object = None,
                     inputs: object = None, outputs_finite: torch.Tensor | None = None) -> NonFinite | None:
    """The first example whose inputs, outputs, loss or gradient norm (those given; `outputs_finite`: the outputs'
    finite_examples, where the outputs are not kept) is not finite, None where all are. Reads one value back from
    the device where all are finite."""
    count = len(losses)
    if outputs is not None:
        outputs_finite = finite_examples(outputs, count)
    checks = {INPUT: None if inputs is None else finite_examples(inputs, count), OUTPUT: outputs_finite,
              LOSS: torch.isfinite(losses), GRADIENT: None if grad_norms is None else torch.isfinite(grad_norms)}
    checks = {kind: finite.to(losses.device) for kind, finite in checks.items() if finite is not None}
    finite = torch.stack(list(checks.values()))
    if bool(finite.all()):
        return None
    position = int((~finite).any(dim=0).nonzero()[0, 0])
    kind = next(kind for kind, row in zip(checks, finite) if not bool(row[position]))
    if kind == INPUT:
        value = first_non_finite_element(batches.take(inputs, slice(position, position + 1)))
    elif kind == OUTPUT:  # without the outputs kept, their value is unknown
        value = float("nan") if outputs is None else \
            first_non_finite_element(batches.take(outputs, slice(position, position + 1)))
    else:
        value = float((losses if kind == LOSS else grad_norms)[position])
    return NonFinite(position, kind, value)


def first_non_finite_element(batch: object) -> float:
    """The first element of `batch` (a tensor, a tuple or a mapping of them) that is not finite; NaN if none is."""
    for tensor in batches.tensors(batch):
        if tensor.is_floating_point() or tensor.is_complex():
            values = tensor.detach().reshape(-1)
            bad = values[~torch.isfinite(values)]
            if len(bad):
                return float(bad[0].real if bad.is_complex() else bad[0])
    return float("nan")


def check_values(losses: torch.Tensor, grad_norms: torch.Tensor | None = None, outputs: object = None,
                 inputs: object = None) -> None:
    """NonFiniteValues at the first example with a value that is not finite (first_non_finite)."""
    found = first_non_finite(losses, grad_norms, outputs, inputs)
    if found is not None:
        raise NonFiniteValues(found)


def gradient_source(model: nn.Module, inputs: object, targets: object, loss_fn: batches.LossFn | None = None) -> str:
    """Where the gradient of one example's loss (inputs and targets a batch of one) stops being finite when its
    outputs and loss are finite: IN_LOSS where the loss's gradient in the outputs is not finite, else IN_MODEL
    (the backward through the model). At the model's current parameters, in its current mode."""
    with torch.no_grad():
        outputs = batches.apply_model(model, inputs)
    outputs = batches.map_tensors(lambda tensor: tensor.detach().requires_grad_(tensor.is_floating_point()), outputs)
    leaves = [tensor for tensor in batches.tensors(outputs) if tensor.requires_grad]
    with torch.enable_grad():
        loss = batches.per_example_loss(outputs, targets, loss_fn).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else []
    finite = all(bool(torch.isfinite(grad).all()) for grad in grads if grad is not None)
    return IN_MODEL if finite else IN_LOSS


def source_of(model: nn.Module, inputs: object, targets: object, loss_fn: batches.LossFn | None,
              found: NonFinite) -> str | None:
    """For a gradient that is not finite, of example `found.position` of (`inputs`, `targets`): where it stopped
    being finite (gradient_source); None for any other value."""
    if found.kind != GRADIENT:
        return None
    one = slice(found.position, found.position + 1)
    return gradient_source(model, batches.take(inputs, one), batches.take(targets, one), loss_fn)

"""`sensitivities` (docs/api.md): Δ* of each point (docs/accounting.md §2, sum rule) at a model's current
parameters, by the norms engine of compute_sensitivity.py, for any per-example loss and inputs a tensor, a tuple
or a mapping of tensors, the data streamed a chunk at a time (api/examples.py)."""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from opacus.grad_sample import AbstractGradSampleModule
from torch import nn
from torch.utils.data import DataLoader, Dataset

from perinstance.api import arguments
from perinstance.api.examples import Examples, examples
from perinstance.persample import batches, finite, gradients
from perinstance.train import user_code
from perinstance.train.clipping import CLIPPING_CHOICES, Transform


@contextmanager
def _without_opacus_hooks(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The network to measure: `model`, or the one inside an Opacus wrapper (GradSampleModule, ghost clipping's
    GradSampleModuleFastGradientClipping, ...), whose layers then run without the hooks Opacus registered on them
    until the block ends (the network's own hooks, such as weight norm's, stay). Even disabled, Opacus's full
    backward hooks stop torch.func, which takes the layers the engine lacks and checks the ones it covers, and
    ghost clipping's raise in any backward whose forward they did not see. Every hook is back after, in its
    place: the wrapper is left as it was. No copy of the network is made (a GPU model's memory twice)."""
    if not isinstance(model, AbstractGradSampleModule):
        yield model
        return
    opacus_hooks = {handle.id for handle in getattr(model, "autograd_grad_sample_hooks", [])}
    saved = []
    for module in model._module.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                      module._backward_hooks):
            if any(key in opacus_hooks for key in hooks):
                saved.append((hooks, list(hooks.items())))
                for key in [key for key in hooks if key in opacus_hooks]:
                    del hooks[key]
    try:
        yield model._module
    finally:
        for hooks, entries in saved:
            hooks.clear()
            hooks.update(entries)


def sensitivities(model: nn.Module, data: Dataset | DataLoader | tuple, clip_bound: float, clipping: str = "flat",
                  points: Sequence[int] | None = None, *, scale_r: float | None = None, scale_s: float | None = None,
                  loss_fn: batches.LossFn | None = None) -> torch.Tensor:
    """Δ* = ||h(g_i)|| of each point at the model's current parameters (docs/accounting.md §2, sum rule).

    g_i is the gradient of the point's loss: the cross-entropy of the model's logits against a class index, or
    `loss_fn(outputs, targets)`, one loss per example ((n,), or (n, ...) summed per example: a sequence loss
    summed over tokens); h the transform of `clipping` (§1): flat gives min(||g_i||, clip_bound), psac and psasc
    need `scale_r` (and psasc `scale_s`) and are bounded by Γ = clip_bound (psasc: clip_bound/scale_s). Divide by
    Γ for IndividualAccountant.step.
    data: a torch Dataset of (input, target) pairs, a DataLoader (its dataset is read in index order with its
    collate_fn, not its batches, which Poisson sampling draws at random), or a pair (inputs, targets) of tensors;
    inputs may be a tensor (model(x)), a tuple (model(*x)) or a mapping (model(**x)) of tensors. A dataset is
    streamed a chunk of items at a time. points: indices into data (None: all). The model (or the module inside
    an Opacus wrapper) is evaluated in eval mode, as compute_sensitivity.py does, by the norms engine of
    perinstance/persample/gradients.py (layers without a closed form by torch.func, fallback_norms.py), checked as a
    --model network is. Returns a float64 tensor, one Δ* per point, on the CPU. An input, output, loss or gradient
    that is not finite (NaN, ±inf) is a one-line ValueError naming data, model or loss_fn and the point.
    """
    if clipping not in CLIPPING_CHOICES:
        raise ValueError(f"clipping must be one of {', '.join(CLIPPING_CHOICES)}, not {clipping!r}")
    clip_bound = arguments.positive_finite("clip_bound", clip_bound)
    if clipping in ("psac", "psasc"):
        scale_r = arguments.positive_finite("scale_r", scale_r if scale_r is not None else math.nan)
    if clipping == "psasc":
        scale_s = arguments.positive_finite("scale_s", scale_s if scale_s is not None else math.nan)
    check_loss_fn(loss_fn)
    check_model(model)
    return measured_sensitivities(model, examples(data, points), Transform(clipping, clip_bound, scale_r, scale_s),
                                  loss_fn)


def measured_sensitivities(model: nn.Module, chosen: Examples, transform: Transform,
                           loss_fn: batches.LossFn | None, when: str = "") -> torch.Tensor:
    """`sensitivities` of the points `chosen` (api/examples.py) under `transform`, its arguments already checked
    (IndividualAccountant.attach checks them once, then measures at every due step; `when`: which step, for an
    error)."""
    if chosen.first is None:  # no point chosen
        return torch.zeros(0, dtype=torch.float64)
    norms = []
    with _without_opacus_hooks(model) as network, measured(network):
        device = next(network.parameters()).device
        first_inputs, first_targets = batches.to_device(chosen.first, device)
        if loss_fn is None:
            with torch.no_grad():
                classes = _classes(batches.apply_model(network, first_inputs))
        for inputs, targets in chosen.chunks(gradients.examples_per_pass(network, first_inputs, device)):
            inputs, targets = batches.to_device((inputs, targets), device)
            if loss_fn is None:
                targets = _class_labels(targets, classes)
            try:
                grad_norms, losses, outputs = gradients.per_sample_norms(network, inputs, targets, loss_fn)
                found = finite.first_non_finite(losses, grad_norms, outputs, (inputs, targets))
            except finite.NonFiniteValues as error:  # met by the engine's check of the network (fallback_norms.py)
                found = error.found
            if found is not None:
                raise non_finite_error(network, inputs, targets, loss_fn, found, chosen.point(sum(map(len, norms)) +
                                                                                       found.position), when)
            norms.append(transform.norms(grad_norms).double().cpu())
    return torch.cat(norms)


def non_finite_error(network: nn.Module, inputs: object, targets: object, loss_fn: batches.LossFn | None,
                     found: finite.NonFinite, point: int, when: str = "") -> ValueError:
    """The one-line ValueError for `found` (in a chunk of `inputs` and `targets`), the values of point `point`
    (an index into data) that are not finite: naming data, model or loss_fn, whichever made it."""
    where = f"for point {point}{' ' + when if when else ''}"
    if found.kind == finite.INPUT:
        return ValueError(f"data: point {point} holds a value that is not finite ({found.value:g}) in its inputs or "
                          "target")
    if found.kind == finite.OUTPUT:
        return ValueError(f"model: its output is not finite ({found.value:g}) {where}")
    if found.kind == finite.LOSS:
        name = "loss_fn" if loss_fn is not None else "model"  # the cross-entropy of finite logits is finite
        return ValueError(f"{name}: the loss is not finite ({found.value:g}; the model's outputs are finite) {where}")
    source = finite.source_of(network, inputs, targets, loss_fn, found)
    if source == finite.IN_LOSS and loss_fn is not None:
        return ValueError(f"loss_fn: its gradient in the model's outputs is not finite (||g|| = {found.value:g}; the "
                          f"outputs and the loss are finite) {where}")
    return ValueError(f"model: the gradient of the loss through it is not finite (||g|| = {found.value:g}; the "
                      f"outputs, the loss and its gradient in the outputs are finite) {where}")


def check_loss_fn(loss_fn: object) -> None:
    """A one-line TypeError where `loss_fn` is neither None nor callable."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function of (outputs, targets), not {type(loss_fn).__name__}")


def check_model(model: object) -> None:
    """A one-line TypeError or ValueError naming what the engine cannot measure in `model`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not any(param.requires_grad for param in model.parameters()):
        raise ValueError("model has no trainable parameter, so no gradient to measure (is every parameter frozen?)")
    problem = user_code.sample_mixing(model)
    if problem is not None:  # as the command line's --model refuses it
        raise ValueError(f"model: {problem}")


@contextmanager
def measured(network: nn.Module) -> Iterator[None]:
    """`network` as compute_sensitivity.py measures it, for the block: in eval mode, with gradients on (also in a
    caller's no_grad block, an optimizer's step), checked as a --model network is (a tied weight, or one used
    outside its layer); its mode is restored after."""
    was_training = network.training
    network.eval()
    try:
        with torch.enable_grad(), user_code.checked_as_user_model(network):
            yield
    finally:
        network.train(was_training)


def _classes(outputs):
    """The number of classes of logits (n, classes), for the default loss."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
        shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"model: the default loss (cross-entropy) needs logits of shape (n, classes), not {shape}; "
                         "give loss_fn for other outputs")
    return outputs.shape[1]


def _class_labels(labels, classes):
    """`labels` as int64 class indices in [0, classes), one per example, for the default loss."""
    if not batches.class_indices(labels):
        raise ValueError("data: the default loss (cross-entropy) needs one class index per example as targets; "
                         "give loss_fn for other targets (regression, sequences, ...)")
    outside = labels[(labels < 0) | (labels >= classes)]
    if len(outside):
        raise ValueError(f"data: label {int(outside[0])} is outside the model's {classes} classes (0 to {classes - 1})")
    return labels.long()

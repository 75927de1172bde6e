"""`sensitivities` (docs/api.md): Δ* of each point (docs/accounting.md §2, sum rule) at a model's current
parameters, by the norms engine of compute_sensitivity.py."""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from opacus.grad_sample import AbstractGradSampleModule
from torch.utils.data import DataLoader, Dataset, TensorDataset

from perinstance.api import arguments
from perinstance.measure.gradient_rows import transformed_norms
from perinstance.train import user_code
from perinstance.train.clipping import CLIPPING_CHOICES, Transform


def _examples(data, points):
    """(inputs, labels) tensors of `points` (None: every example) of a Dataset, a DataLoader's dataset or a
    pair of tensors."""
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, tuple | list) and len(data) == 2 and all(isinstance(part, torch.Tensor) for part in data):
        inputs, labels = data
        if len(inputs) != len(labels):
            raise ValueError(f"data: {len(inputs)} inputs but {len(labels)} labels")
    elif isinstance(data, TensorDataset) and len(data.tensors) == 2:
        inputs, labels = data.tensors
    elif isinstance(data, Dataset):
        size = len(data)
        chosen = range(size) if points is None else [int(point) for point in points]
        if any(not 0 <= point < size for point in chosen):
            raise ValueError(f"points must be indices in [0, {size})")
        return user_code.pair_tensors(data, chosen)
    else:
        raise ValueError("data must be a torch Dataset of (input, label) pairs, a DataLoader over one, or a pair "
                         f"(inputs, labels) of tensors, not {type(data).__name__}")
    if points is None:
        return inputs, labels.long()
    index = torch.as_tensor(np.asarray(points, dtype=np.int64))
    if index.ndim != 1 or ((index < 0) | (index >= len(labels))).any():
        raise ValueError(f"points must be a list of indices in [0, {len(labels)})")
    return inputs[index], labels[index].long()


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


def sensitivities(model: torch.nn.Module, data: Dataset | DataLoader | tuple[torch.Tensor, torch.Tensor],
                  clip_bound: float, clipping: str = "flat", points: Sequence[int] | None = None, *,
                  scale_r: float | None = None, scale_s: float | None = None) -> torch.Tensor:
    """Δ* = ||h(g_i)|| of each point at the model's current parameters (docs/accounting.md §2, sum rule).

    g_i is the gradient of the point's cross-entropy; h the transform of `clipping` (§1): flat gives
    min(||g_i||, clip_bound), psac and psasc need `scale_r` (and psasc `scale_s`) and are bounded by
    Γ = clip_bound (psasc: clip_bound/scale_s). Divide by Γ for IndividualAccountant.step.
    data: a torch Dataset of (input, label) pairs, a DataLoader (its dataset is read in index order, not
    its batches, which Poisson sampling draws at random), or a pair (inputs, labels) of tensors.
    points: indices into data (None: all). The model (or the module inside an Opacus wrapper) is
    evaluated in eval mode, as compute_sensitivity.py does, by the norms engine of perinstance/train/gradients.py
    (Linear, Conv2d, GroupNorm; other layers by torch.func, perinstance/train/fallback_norms.py), checked as a
    --model network is: a parameter that two layers share, or that is used outside its layer's forward, comes
    from torch.func too. Returns a float64 tensor, one Δ* per point, on the CPU.
    """
    if clipping not in CLIPPING_CHOICES:
        raise ValueError(f"clipping must be one of {', '.join(CLIPPING_CHOICES)}, not {clipping!r}")
    clip_bound = arguments.positive_finite("clip_bound", clip_bound)
    if clipping in ("psac", "psasc"):
        scale_r = arguments.positive_finite("scale_r", scale_r if scale_r is not None else math.nan)
    if clipping == "psasc":
        scale_s = arguments.positive_finite("scale_s", scale_s if scale_s is not None else math.nan)
    transform = Transform(clipping, clip_bound, scale_r, scale_s)
    inputs, labels = _examples(data, points)
    if not any(param.requires_grad for param in model.parameters()):
        raise ValueError("model has no trainable parameter, so no gradient to measure (is every parameter frozen?)")
    with _without_opacus_hooks(model) as network:
        device = next(network.parameters()).device
        was_training = network.training
        network.eval()
        try:
            with user_code.checked_as_user_model(network):  # a tied weight, or one used outside its layer
                norms, _ = transformed_norms(network, inputs, labels, transform, device)
        finally:
            network.train(was_training)
    return torch.from_numpy(norms)

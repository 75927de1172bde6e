"""A model's trainable layers, one forward with a hook on them and what it records of each layer's application,
and the per-layer work of one backward over their outputs (each layer's ||g_i||² and its part of a weighted
gradient sum, by the closed forms of layer_forms.py and sequence_forms.py): what the engine (gradients.py) and
its fallback for the layers it does not cover (fallback_norms.py) are both built from."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from perinstance.persample import batches, layer_forms, sequence_forms
from perinstance.persample.layer_forms import LayerNorms

# The layers with a closed form, and how each takes its per-sample norms from its input and output gradient.
SQUARED_NORMS = {**layer_forms.SQUARED_NORMS, **sequence_forms.SQUARED_NORMS}


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """The model in eval mode within the block (per-sample gradients are taken in eval mode, as a measurement
    loads a checkpoint), its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [param for param in module.parameters() if param.requires_grad]


def own_trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters `module` holds itself, as module.parameters(recurse=False) lists them (without
    its generator machinery: a tenth of the time, which a pass spends once per layer)."""
    own = []
    for param in module._parameters.values():
        if param is not None and param.requires_grad and not any(param is other for other in own):
            own.append(param)
    return own


def parameter_owners(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, the trainable parameters it holds that no module before it holds) of every module of `model` that
    holds a trainable parameter, in model.modules() order: the parameters, in turn, are trainable_parameters(model),
    and a module whose list is shorter than its own shares a parameter. The one walk of the model a pass of the
    engine makes (ResNet-20: 0.11 ms with needs_fallback's look at it; the three walks it replaced took 0.31)."""
    owners, seen = [], set()  # ids: hashing a tensor goes through Python, id() does not
    for module in model.modules():
        own = own_trainable_parameters(module)
        if own:
            owners.append((module, [param for param in own if id(param) not in seen]))
            seen.update(map(id, own))
    return owners


def closed_form_applies(layer: nn.Module) -> bool:
    """Whether the settings of `layer`, a type of SQUARED_NORMS, allow its closed form: a convolution with
    numeric zero padding (not reflected, not "same"), and sequence_forms.closed_form_applies."""
    if isinstance(layer, nn.Conv2d | nn.Conv1d):
        return layer.padding_mode == "zeros" and not isinstance(layer.padding, str)
    return sequence_forms.closed_form_applies(layer)


@dataclass(frozen=True)
class OutputEdge:
    """Where the gradient of a layer's output enters the autograd graph, as the layer's forward left it: the
    gradient edge of its output (torch.autograd.graph.get_gradient_edge), so that an in-place operation applied
    to the output after the layer (ReLU(inplace=True)) leaves the gradient wanted, that of the layer's own
    output, in place; with the output's shape, for a gradient of zeros where the loss does not reach it."""

    target: object  # a GradientEdge, or the tensor itself where it has no grad_fn
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, output: torch.Tensor) -> "OutputEdge":
        target = get_gradient_edge(output) if output.grad_fn is not None else output
        return cls(target, output.shape, output.dtype, output.device)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


def record_application(layer_input: object, output: object) -> tuple:
    """What a pass keeps of one application of a layer: (its input detached, the input's version, its output's
    OutputEdge); (None, None, None) for an application the closed forms cannot take (a layer input that is not a
    tensor, an attention layer applied to other keys than its queries)."""
    if not isinstance(layer_input, torch.Tensor) or not isinstance(output, torch.Tensor):
        return None, None, None
    return layer_input.detach(), layer_input._version, OutputEdge.of(output)


def modified_in_place(layer_input: torch.Tensor | None, version: int | None) -> bool:
    """Whether a recorded layer input was changed in place after the layer read it (a closed form would read the
    changed values)."""
    return layer_input is not None and layer_input._version != version


def forward_with_hook(model: nn.Module, layers: Sequence[nn.Module], hook: Callable, inputs: object) -> object:
    """batches.apply_model(model, inputs) with `hook` registered as a forward hook of each of `layers` for this
    call only (an attention layer calls it itself, within sequence_forms.attention_projections, entered here)."""
    handles = [layer.register_forward_hook(hook) for layer in layers
               if not isinstance(layer, sequence_forms.SELF_RECORDING)]
    try:
        with sequence_forms.attention_projections(model, layers, hook):
            return batches.apply_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()


def layer_norms(layers: Sequence[nn.Module], inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                losses: torch.Tensor, group_norm_rows: dict | None = None) -> tuple:
    """The gradients b_i of the summed `losses` w.r.t. the `outputs` of `layers` (each applied once to its
    `inputs`; one backward, no weight gradient), and each layer's LayerNorms, one at a time as the caller (under
    no_grad) takes them, so that a layer's materialised gradients are freed unless kept. A GroupNorm layer with
    parameter rows in `group_norm_rows` (a pass of `_forward`) takes its per-sample gradients from the same
    backward, as the gradients of its rows, and its b_i is not kept (None): the backward frees it as it goes
    (ResNet-20: 19 such layers, 2–2.5 ms of a 50 ms backward per 128 examples). Any other layer takes its norms
    from SQUARED_NORMS; once they hold the per-sample gradients of all its trainable parameters, its b_i is
    dropped from the list (None), as the clipped sum does not read it. No layers: no backward, nothing."""
    if not layers:
        return (), iter(())
    rows = [(layer, param, row) for layer, pair in (group_norm_rows or {}).items()
            for param, row in zip((layer.weight, layer.bias), pair) if row is not None and row.requires_grad]
    with_rows = {layer for layer, _, _ in rows}
    kept = [index for index, layer in enumerate(layers) if layer not in with_rows]
    edges = [outputs[index] if isinstance(outputs[index], OutputEdge) else OutputEdge.of(outputs[index])
             for index in kept]
    grads = torch.autograd.grad(losses.sum(), [*(edge.target for edge in edges), *(row for _, _, row in rows)],
                                allow_unused=True)
    # Zeros where the loss does not reach (a layer whose output is not used, a row of an unused parameter).
    grads = [edge.zeros() if grad is None else grad for edge, grad in zip(edges, grads)] + [
        torch.zeros_like(row) if grad is None else grad for (_, _, row), grad in zip(rows, grads[len(kept):])]
    grad_outputs, per_sample = [None] * len(outputs), {}
    for index, grad in zip(kept, grads):
        grad_outputs[index] = grad
    for (layer, param, _), grad in zip(rows, grads[len(kept):], strict=True):
        per_sample.setdefault(layer, {})[param] = grad

    def norms_of(index):
        layer = layers[index]
        if layer in per_sample:
            return LayerNorms.of_per_sample(per_sample[layer])
        norms = SQUARED_NORMS[type(layer)](layer, inputs[index], grad_outputs[index])
        if all(param in norms.per_sample for param in own_trainable_parameters(layer)):
            grad_outputs[index] = None  # the clipped sum takes this layer from its per-sample gradients
        return norms

    return grad_outputs, (norms_of(index) for index in range(len(layers)))


def weighted_sum(grad_samples: Sequence[torch.Tensor], weights: torch.Tensor) -> list[torch.Tensor]:
    """Σ_i w_i·g_i for each parameter: the summed transformed gradient u(B) of §1."""
    # A matrix-vector product (BLAS) is several times faster than the equivalent einsum here.
    return [(weights @ grad.reshape(grad.shape[0], -1)).reshape(grad.shape[1:]) for grad in grad_samples]


def weighted_layer_gradients(layers: Sequence[nn.Module], inputs: Sequence[torch.Tensor],
                             grad_outputs: Sequence[torch.Tensor], layer_norms: Sequence[LayerNorms],
                             weights: torch.Tensor) -> dict:
    """Σ_i w_i·g_i of every trainable parameter of `layers` (each applied once, with its input, the gradient of
    the summed loss w.r.t. its output, and its LayerNorms): a parameter whose per-sample gradients the norms
    materialised gets one matrix-vector product over them; the others (Linear layers, ghost- and single-position
    convolutions) get their layer's weight gradient for the outputs' gradients w_i·b_i, computed directly (a matrix product,
    or the convolution library's weight gradient), not by autograd."""
    summed = {}
    for layer, layer_inputs, grad_output, norms in zip(layers, inputs, grad_outputs, layer_norms, strict=True):
        for param, grads in norms.per_sample.items():
            summed[param] = (weights @ grads.reshape(len(weights), -1)).reshape(param.shape)
        rest = [param for param in own_trainable_parameters(layer) if param not in summed]
        if rest:
            weighted = grad_output * weights.reshape(-1, *[1] * (grad_output.dim() - 1))
            forms = sequence_forms if type(layer) in sequence_forms.SQUARED_NORMS else layer_forms
            summed.update(forms.weight_gradients(layer, layer_inputs, weighted, rest))
    return summed

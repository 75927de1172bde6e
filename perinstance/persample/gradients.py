"""Per-sample gradients of a model (Opacus GradSampleModule), and what is built from them; per-sample
gradient norms and the clipped gradient sum without per-sample gradients."""

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch import nn

from perinstance.persample import batches, fallback_norms, layer_forms
from perinstance.persample.layer_forms import conv2d_norm_form, group_norm_rows, linear_norm_form
from perinstance.persample.layer_pass import (
    SQUARED_NORMS,
    forward_with_hook,
    layer_norms,
    modified_in_place,
    parameter_owners,
    record_application,
    trainable_parameters,
    weighted_layer_gradients,
)

# Opacus's hooks fire on the first layer whose input needs no gradient; torch warns each
# time although per-sample gradients of the parameters are exactly what is wanted.
FULL_BACKWARD_HOOK = "Full backward hook is firing when gradients are computed"


def wrap_per_sample(model: nn.Module) -> GradSampleModule:
    """Wrap `model` so each backward stores per-sample gradients in `param.grad_sample`."""
    return GradSampleModule(model, batch_first=True, loss_reduction="sum")


def per_sample_gradients(grad_sample_module: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                         loss_fn: batches.LossFn | None = None) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-sample gradients of each example's loss (batches.per_example_loss: the cross-entropy unless `loss_fn`).

    Returns (list of grad_sample tensors, one per trainable parameter, shaped (n, *param.shape);
    per-example losses; logits). Parameters' `.grad` is left unset.
    """
    params = trainable_parameters(grad_sample_module)
    for param in params:
        param.grad_sample = None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FULL_BACKWARD_HOOK)
        logits = grad_sample_module(inputs)
        losses = batches.per_example_loss(logits, labels, loss_fn)
        losses.sum().backward()
    grad_samples = [param.grad_sample for param in params]
    for param in params:
        param.grad = None
        param.grad_sample = None
    return grad_samples, losses.detach(), logits.detach()


def grad_norms(grad_samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample L2 norms of the full (all-parameter) gradient."""
    per_parameter = [torch.linalg.vector_norm(grad.reshape(grad.shape[0], -1), dim=1) for grad in grad_samples]
    return torch.linalg.vector_norm(torch.stack(per_parameter, dim=1), dim=1)


def flatten(grad_samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample gradients as one (n, d) matrix."""
    return torch.cat([grad.reshape(grad.shape[0], -1) for grad in grad_samples], dim=1)


# Examples per pass of the engine (`examples_per_pass`), at most, by device kind, and at least; and the bytes a
# chunk's largest layer output may take. On a CPU, 10 MiB: that output and its gradient stay within the 32 MiB
# of L3 cache with room for the layer's other operands. 128 ResNet-20 examples (16×32×32 float32 outputs;
# 256 ran the norms 8% and the clipped sum 6% slower, 512 at 0.66× the speed) and 512 LeNet-5 examples
# (6×28×28; a training batch of 256 in one pass rather than two for half the Poisson draws). On a GPU, where
# each operation's launch costs as much as a small chunk's work, at most 2,048 and 64 MiB.
PASS_EXAMPLES = {"cpu": 512, "cuda": 2048}
MIN_PASS_EXAMPLES = 32
PASS_OUTPUT_BYTES = {"cpu": 10 << 20, "cuda": 64 << 20}
# Examples per pass of a model with layers that fall back to torch.func (fallback_norms.py), whose per-sample
# gradients are materialised: gradient_rows.ROW_CHUNK.
FALLBACK_PASS_EXAMPLES = 128
# A model that goes through fallback_norms.py only to be checked (a --model network, or one given to the public
# API, every trainable layer of a kind the engine covers) takes the engine's examples per pass, but no more than
# keep any one layer's per-sample gradients within these bytes, should the check send that layer to torch.func
# (and never fewer than FALLBACK_PASS_EXAMPLES). LeNet-5's largest layer, 48,120 float32 parameters: 697 examples.
CHECKED_LAYER_BYTES = 128 << 20




# --- norms only, and the clipped sum from them (no per-sample gradients kept) ---------------
#
# One forward records every parameter layer's input and output; one backward w.r.t. the outputs gives the
# gradients b_i of every layer's output, and layer_forms.py each layer's ||g_i||² and its part of the clipped sum.

@dataclass
class _Pass:
    """One forward pass with every parameter layer's input and OutputEdge (None for a GroupNorm layer with
    parameter rows), and the per-example losses."""

    layers: list
    inputs: list
    outputs: list
    logits: object
    losses: torch.Tensor
    group_norm_rows: dict  # GroupNorm layer -> its per-sample parameter rows (layer_forms.group_norm_rows)

    def layer_norms(self) -> tuple:
        """`layer_norms` of this pass; the layer outputs are let go once its backward has spent them (the
        per-layer work reads only the inputs and the gradients)."""
        grad_outputs, norms_by_layer = layer_norms(self.layers, self.inputs, self.outputs, self.losses,
                                                   self.group_norm_rows)
        self.outputs.clear()
        return grad_outputs, norms_by_layer


def _forward(model, inputs, labels, owners=None, loss_fn=None):
    layers = _parameter_layers(model, owners)
    recorded, rows = {}, {}

    def record(layer, layer_inputs, output):
        if layer in recorded:
            raise ValueError(f"{type(layer).__name__} is applied twice in one forward; its per-sample gradient "
                             "would mix both uses")
        # A GroupNorm layer with parameter rows takes its gradients from them, not from its input and output: not
        # holding its output lets the forward free it where nothing else keeps it (ResNet-20's, read by a ReLU or
        # a residual sum, neither of which saves its input: 92 MiB per 128 examples) and reuse that memory.
        if layer in rows:
            recorded[layer] = (None, None, None)
            return
        recorded[layer] = record_application(layer_inputs[0], output)
        if recorded[layer][2] is None:
            raise ValueError(f"{type(layer).__name__} is applied in a way its closed form does not take "
                             "(attention to other keys than its queries, or unbatched inputs)")

    with group_norm_rows(layers, rows):
        logits = forward_with_hook(model, layers, record, inputs)
    unapplied = [layer for layer in layers if layer not in recorded]
    if any(isinstance(layer, nn.modules.linear.NonDynamicallyQuantizableLinear) for layer in unapplied):
        raise ValueError("an attention layer applied its output projection's weight itself (attention to other keys "
                         "than its queries); the projection's closed form does not see it")
    layers = [layer for layer in layers if layer in recorded]
    count = batches.count(inputs)
    for layer in layers:
        layer_input, version, output = recorded[layer]
        if modified_in_place(layer_input, version):
            raise ValueError(f"{type(layer).__name__}: its input is changed in place after the layer read it; its "
                             "per-sample gradient would read the changed values")
        if output is not None and (len(layer_input) != count or output.shape[0] != count):
            raise ValueError(f"{type(layer).__name__}: its input or output does not have the {count} examples along "
                             f"its first dimension (shapes {tuple(layer_input.shape)}, {tuple(output.shape)})")
    return _Pass(layers, [recorded[layer][0] for layer in layers], [recorded[layer][2] for layer in layers],
                 logits, batches.per_example_loss(logits, labels, loss_fn), rows)


def layer_shapes(model: nn.Module, example: object) -> list:
    """(layer, input shape, output shape) of every parameter layer the forward of `example` (a batch of one)
    applies, in the order applied: what the per-layer choices of form and chunk are made from, before any pass.
    An attention layer's shapes are those of its input projection."""
    shapes = []
    layers = _parameter_layers(model)

    def record(layer, layer_inputs, output):
        if isinstance(layer_inputs[0], torch.Tensor) and isinstance(output, torch.Tensor):
            shapes.append((layer, layer_inputs[0].shape, output.shape))

    with torch.no_grad():
        forward_with_hook(model, layers, record, example)
    return shapes


def norm_forms(model: nn.Module, example: object) -> dict:
    """How the norms pass takes each parameter layer (by name) on examples shaped as `example`: the
    convolutions' `conv2d_norm_form`, an affine map's `linear_norm_form` (attention's input projection too),
    "rows by id" for an Embedding, "per-sample" for a normalisation layer."""
    names = {layer: name for name, layer in model.named_modules()}
    forms = {}
    for layer, input_shape, output_shape in layer_shapes(model, example):
        if isinstance(layer, nn.Conv2d):
            forms[names[layer]] = conv2d_norm_form(layer, input_shape[2:], output_shape[2:])
        elif isinstance(layer, nn.Conv1d):
            forms[names[layer]] = conv2d_norm_form(layer_forms.conv1d_as_conv2d(layer), (1, *input_shape[2:]),
                                                   (1, *output_shape[2:]))
        elif isinstance(layer, nn.Linear | nn.MultiheadAttention):
            forms[names[layer]] = linear_norm_form(math.prod(input_shape[1:-1]), input_shape[-1], output_shape[-1])
        else:
            forms[names[layer]] = "rows by id" if isinstance(layer, nn.Embedding) else "per-sample"
    return forms


def examples_per_pass(model: nn.Module, inputs: object, device: str | torch.device = "cpu") -> int:
    """Examples per pass of the norms engine (a norms-only pass, or a training step's norms and clipped sum) over
    examples shaped as `inputs`' on `device`: `pass_examples` of the model's largest layer output;
    FALLBACK_PASS_EXAMPLES where torch.func takes some of its layers; capped by CHECKED_LAYER_BYTES where the
    engine covers every layer but checks it first. A function of the model's shapes and the device's kind
    alone, so every chunk of a measurement and every step of a run is cut alike."""
    owners = parameter_owners(model)
    if not fallback_norms.engine_covers(owners):  # torch.func materialises its layers' per-sample gradients
        return FALLBACK_PASS_EXAMPLES
    element_size = next(model.parameters()).element_size()
    example = batches.to_device(batches.take(inputs, slice(0, 1)), device)
    largest = max((math.prod(output[1:]) for _, _, output in layer_shapes(model, example)), default=0)
    chunk = pass_examples(largest * element_size, torch.device(device).type)
    if owners and fallback_norms.checked(model):  # engine_covers held above: only the check sends it to torch.func
        largest_layer = max(sum(param.numel() for param in params) for _, params in owners) * element_size
        chunk = min(chunk, max(FALLBACK_PASS_EXAMPLES, CHECKED_LAYER_BYTES // largest_layer))
    return chunk


def batch_passes(count: int, per_pass: int) -> list[slice]:
    """The passes a training batch of `count` examples is cut into, for `per_pass` = examples_per_pass: as few
    as hold at most 1.5·per_pass examples each, of equal sizes (the first ones one larger where they cannot
    be). A Poisson batch a little over per_pass is then one pass, not a full one and a few examples: that
    small pass costs most of what a full one costs in per-layer overhead (ResNet-20 on 2 CPU cores: 12
    examples 24 ms against 174 ms for 128, 51 against 210 ms under OMP_WAIT_POLICY=PASSIVE, while 140 in
    one pass took 191 and 229 ms). A function of `count` and `per_pass` alone, so a step's bits do not
    depend on anything else."""
    passes = -(-count // (per_pass + per_pass // 2))
    if not passes:
        return []
    size, larger = divmod(count, passes)
    ends = [0]
    for index in range(passes):
        ends.append(ends[-1] + size + (index < larger))
    return [slice(start, end) for start, end in zip(ends, ends[1:])]


def pass_examples(output_bytes: int, kind: str) -> int:
    """PASS_EXAMPLES of the device `kind` (a GPU's for "cuda", else a CPU's), halved (to at least
    MIN_PASS_EXAMPLES) while that many examples' largest layer outputs, of `output_bytes` each, would exceed
    PASS_OUTPUT_BYTES."""
    kind = kind if kind in PASS_EXAMPLES else "cpu"
    chunk = PASS_EXAMPLES[kind]
    while chunk > MIN_PASS_EXAMPLES and chunk * output_bytes > PASS_OUTPUT_BYTES[kind]:
        chunk //= 2
    return chunk


def _parameter_layers(model, owners=None):
    """The modules that own trainable parameters (those of `owners`, parameter_owners(model), where given); each
    must be a type of SQUARED_NORMS."""
    layers = [module for module, _ in (parameter_owners(model) if owners is None else owners)]
    for layer in layers:
        if type(layer) not in SQUARED_NORMS:
            raise ValueError(f"no per-sample norms for trainable {type(layer).__name__} layers "
                             f"(supported: {', '.join(kind.__name__ for kind in SQUARED_NORMS)})")
    return layers


def per_sample_norms(model: nn.Module, inputs: object, labels: object,
                     loss_fn: batches.LossFn | None = None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """||g_i|| of the gradient of each example's loss (batches.per_example_loss: the cross-entropy unless
    `loss_fn`); also per-example losses and the model's outputs (logits)."""
    owners = parameter_owners(model)
    if fallback_norms.needs_fallback(model, owners):  # layers without a closed form here: torch.func, layer by layer
        return fallback_norms.per_sample_norms(model, inputs, labels, loss_fn)
    forward = _forward(model, inputs, labels, owners, loss_fn)
    _, norms_by_layer = forward.layer_norms()
    with torch.no_grad():
        squared = sum(norms.squared for norms in norms_by_layer)
    return squared.sqrt(), forward.losses.detach(), _detached(forward.logits)


def _detached(outputs):
    return batches.map_tensors(torch.Tensor.detach, outputs)


def weighted_pass(model: nn.Module, inputs: object, labels: object,
                  weights_of_norms: Callable[[torch.Tensor], torch.Tensor], owners: list | None = None,
                  loss_fn: batches.LossFn | None = None) -> tuple:
    """One forward and one backward to the layer outputs (the engine's closed forms; the model must need no
    fallback): (the pass, each layer's output gradient, each layer's LayerNorms, ||g_i||, w = weights_of_norms(||g_i||)),
    what the clipped sum and the Gram's factors (gram_forms.py) are built from."""
    forward = _forward(model, inputs, labels, owners, loss_fn)
    grad_outputs, norms_by_layer = forward.layer_norms()
    with torch.no_grad():
        norms_by_layer = list(norms_by_layer)
        norms = sum(norms.squared for norms in norms_by_layer).sqrt()
        return forward, grad_outputs, norms_by_layer, norms, weights_of_norms(norms)


def clipped_gradient_sum(model: nn.Module, inputs: object, labels: object,
                         weights_of_norms: Callable[[torch.Tensor], torch.Tensor],
                         loss_fn: batches.LossFn | None = None
                         ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, object]:
    """Σ_i w_i·g_i with w = weights_of_norms(||g_i||) (the clipped sum u(B) of §1), from the one backward that
    gives the norms (book-keeping, `weighted_layer_gradients`), without a second backward through the network.

    Returns (one summed gradient per trainable parameter, in model.parameters() order; per-example
    losses; ||g_i||; logits). The loss is batches.per_example_loss's (the cross-entropy unless `loss_fn`).
    """
    owners = parameter_owners(model)
    if fallback_norms.needs_fallback(model, owners):  # layers without a closed form here: torch.func, layer by layer
        return fallback_norms.clipped_gradient_sum(model, inputs, labels, weights_of_norms, loss_fn)
    forward, grad_outputs, norms_by_layer, norms, weights = weighted_pass(model, inputs, labels, weights_of_norms,
                                                                         owners, loss_fn)
    with torch.no_grad():
        summed = weighted_layer_gradients(forward.layers, forward.inputs, grad_outputs, norms_by_layer, weights)
    # A layer the forward never applied has zero gradient.
    return ([summed[param] if param in summed else torch.zeros_like(param) for _, params in owners for param in params],
            forward.losses.detach(), norms, _detached(forward.logits))


def directional_derivatives(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                            direction: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """⟨g_i, v⟩ = d/dt ℓ_i(θ + t·v) for the cross-entropy gradient g_i of every example along one direction v
    in parameter space (one tensor per trainable parameter, in model.parameters() order): a single forward-mode
    pass (torch.func.jvp) for all examples at once, never forming g_i. Also the per-example losses and logits."""
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    values = tuple(param.detach() for param in trainable_parameters(model))

    def logits_of(*params):
        return torch.func.functional_call(model, dict(zip(names, params)), (inputs,))

    with warnings.catch_warnings():
        # torch's first forward-mode pass loads its own decompositions through torch.jit.script, whose deprecation
        # warning concerns torch, not this call.
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=FutureWarning)
        logits, tangent = torch.func.jvp(logits_of, values, tuple(part.to(values[0].dtype) for part in direction))
    # d/dt of cross_entropy(logits + t·tangent) is ⟨softmax(logits) − onehot(y), tangent⟩.
    residual = torch.softmax(logits, dim=1)
    residual[torch.arange(len(labels), device=labels.device), labels] -= 1
    return (residual * tangent).sum(dim=1), F.cross_entropy(logits, labels, reduction="none"), logits

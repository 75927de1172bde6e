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

# Opacus's hooks fire on the first layer whose input needs no gradient; torch warns each
# time although per-sample gradients of the parameters are exactly what is wanted.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


def wrap_per_sample(model: nn.Module) -> GradSampleModule:
    """Wrap `model` so each backward stores per-sample gradients in `param.grad_sample`."""
    return GradSampleModule(model, batch_first=True, loss_reduction="sum")


def per_sample_gradients(grad_sample_module: nn.Module, inputs: torch.Tensor,
                         labels: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-sample gradients of the cross-entropy of each example.

    Returns (list of grad_sample tensors, one per trainable parameter, shaped (n, *param.shape);
    per-example losses; logits). Parameters' `.grad` is left unset.
    """
    params = trainable_parameters(grad_sample_module)
    for param in params:
        param.grad_sample = None
    logits = grad_sample_module(inputs)
    losses = F.cross_entropy(logits, labels, reduction="none")
    losses.sum().backward()
    grad_samples = [param.grad_sample for param in params]
    for param in params:
        param.grad = None
        param.grad_sample = None
    return grad_samples, losses.detach(), logits.detach()


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [param for param in module.parameters() if param.requires_grad]


def grad_norms(grad_samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample L2 norms of the full (all-parameter) gradient."""
    per_parameter = [torch.linalg.vector_norm(grad.reshape(grad.shape[0], -1), dim=1) for grad in grad_samples]
    return torch.linalg.vector_norm(torch.stack(per_parameter, dim=1), dim=1)


def weighted_sum(grad_samples: Sequence[torch.Tensor], weights: torch.Tensor) -> list[torch.Tensor]:
    """Σ_i w_i·g_i for each parameter: the summed transformed gradient u(B) of §1."""
    # A matrix-vector product (BLAS) is several times faster than the equivalent einsum here.
    return [(weights @ grad.reshape(grad.shape[0], -1)).reshape(grad.shape[1:]) for grad in grad_samples]


def flatten(grad_samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample gradients as one (n, d) matrix."""
    return torch.cat([grad.reshape(grad.shape[0], -1) for grad in grad_samples], dim=1)


# Values per input patch (in_channels·k_h·k_w) below which the convolution library's grouped weight-gradient
# kernel is slower than a batched product of unfolded patches. Measured on 2 CPU cores, 1 and 2 threads,
# 128-256 examples: patches 1.6-4× faster at 18, 25, 27, 36 and 75 values (LeNet-5's and ResNet-20's first
# convolutions among them), the grouped kernel 1.4-2.5× faster at 144, 150 and 200 (LeNet-5's second).
PATCH_VALUES = 128
# Examples per pass of the engine (`examples_per_pass`), at most, by device kind, and at least; and the bytes a
# chunk's largest layer output may take. On a CPU, 10 MiB: that output and its gradient stay within the 32 MiB
# of L3 cache with room for the layer's other operands. 128 ResNet-20 examples (16×32×32 float32 outputs;
# 256 ran the norms 8% and the clipped sum 6% slower, 512 at 0.66× the speed) and 512 LeNet-5 examples
# (6×28×28; a training batch of 256 in one pass rather than two for half the Poisson draws). On a GPU, where
# each operation's launch costs as much as a small chunk's work, at most 2,048 and 64 MiB.
PASS_EXAMPLES = {"cpu": 512, "cuda": 2048}
MIN_PASS_EXAMPLES = 32
PASS_OUTPUT_BYTES = {"cpu": 10 << 20, "cuda": 64 << 20}
# Examples per pass of a model that falls back to torch.func (fallback_norms.py), whose per-sample gradients
# are materialised: gradient_rows.ROW_CHUNK.
FALLBACK_PASS_EXAMPLES = 128
# Examples whose unfolded patches are formed at once on a CPU (conv2d_squared_norms, "patches"; a GPU takes the
# whole chunk, as each launch costs more than the work of a few examples): the patches are p/c times the input,
# and a few examples' stay in cache (LeNet-5's first convolution: 3.9× faster than 512 examples' at once;
# ResNet-20's, as fast as 128 examples'). The grouped kernel takes a whole chunk: in blocks of 2 MiB of
# operands it ran 1.15× slower on ResNet-20, no faster on LeNet-5.
PATCH_CHUNK = 32


# --- norms only, and the clipped sum from them (no per-sample gradients kept) ---------------
#
# Each layer's per-sample gradient is a function of its input a_i and of the gradient b_i of
# the summed loss w.r.t. its output (no layer here mixes samples). One backward pass w.r.t. the
# layer outputs gives every b_i and skips all weight gradients; each layer's ||g_i||² then
# comes from (a_i, b_i) by a closed form or from g_i formed per sample, whichever the layer's
# shapes make cheaper. With weights w_i, the gradient of Σ w_i·loss_i is Σ_i w_i·g_i where g_i
# was formed, and elsewhere each layer's ordinary weight gradient for outputs' gradients w_i·b_i:
# the clipped sum u(B) of §1 (accounting.md) without a second backward through the network.

@dataclass
class LayerNorms:
    """||g_i||² of one layer's trainable parameters (n,), and the per-sample gradients (n, *param.shape) that
    its form materialised on the way, by parameter: the clipped sum takes those as Σ_i w_i·g_i (book-keeping)
    instead of a weight gradient of its own."""

    squared: torch.Tensor
    per_sample: dict


def linear_squared_norms(layer: nn.Linear, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of a Linear layer on (n, features) inputs: g_W = b aᵀ, so ||g_W||² = ||a||²·||b||². Nothing is
    materialised (the clipped sum is the layer's weight gradient for the weighted b)."""
    if inputs.dim() != 2:
        raise ValueError(f"per-sample norms need (n, features) inputs to Linear, got shape {tuple(inputs.shape)}")
    output_squares = grad_outputs.square().sum(dim=1)
    squared = inputs.square().sum(dim=1) * output_squares if layer.weight.requires_grad else 0
    if layer.bias is not None and layer.bias.requires_grad:
        squared = squared + output_squares
    return LayerNorms(squared, {})


def conv2d_squared_norms(layer: nn.Conv2d, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of a Conv2d layer, by the form `conv2d_norm_form` picks from its shapes.

    With input patches a_t and output gradients b_t at the T output positions, g = Σ_t b_t a_tᵀ.
    Materialised ("grouped"): one grouped convolution-weight gradient (groups = samples) in the convolution
    library, or ("patches"), for patches of fewer than PATCH_VALUES values, where that library's grouped
    kernel is slow, a batched product of unfolded patches; the per-sample gradients are returned with the
    norms. Ghost: ||g||² = Σ_{t,t'} (a_t·a_t')(b_t·b_t'), with the patch products a_t·a_t' summed from the
    products of input pixels (`_patch_gram`). At one output position ("single", T = 1: LeNet-5's third
    convolution) the layer is a Linear one on its only patch, ||g||² = ||a||²·||b||². The bias gradient
    Σ_t b_t is always returned per sample.
    """
    if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
        raise ValueError("per-sample norms of Conv2d need numeric zero padding")
    count, outputs = grad_outputs.shape[:2]
    output_rows = grad_outputs.reshape(count, outputs, -1)
    squared, per_sample = 0, {}
    if layer.weight.requires_grad:
        form = conv2d_norm_form(layer, inputs.shape[2:], grad_outputs.shape[2:])
        if form == "single":
            squared = _patches(layer, inputs).square().sum(dim=(1, 2)) * output_rows.square().sum(dim=(1, 2))
        elif form == "ghost":
            output_gram = torch.bmm(output_rows.transpose(1, 2), output_rows)
            squared = (_patch_gram(layer, inputs) * output_gram).sum(dim=(1, 2))
        else:
            if form == "patches" and inputs.device.type == "cpu":
                weight_grads = torch.cat([_materialised(layer, form, inputs[first:first + PATCH_CHUNK],
                                                        grad_outputs[first:first + PATCH_CHUNK])
                                          for first in range(0, count, PATCH_CHUNK)])
            else:
                weight_grads = _materialised(layer, form, inputs, grad_outputs)
            per_sample[layer.weight] = weight_grads.reshape(count, *layer.weight.shape)
            squared = weight_grads.reshape(count, -1).square().sum(dim=1)
    if layer.bias is not None and layer.bias.requires_grad:
        per_sample[layer.bias] = output_rows.sum(dim=2)
        squared = squared + per_sample[layer.bias].square().sum(dim=1)
    return LayerNorms(squared, per_sample)


def _materialised(layer, form, inputs, grad_outputs):
    """(n, out_channels, in_channels/groups · k_h · k_w) per-sample weight gradients of a Conv2d, in `form`."""
    count, outputs = grad_outputs.shape[:2]
    if form == "patches":
        return torch.bmm(grad_outputs.reshape(count, outputs, -1), _patches(layer, inputs).transpose(1, 2))
    return torch.nn.grad.conv2d_weight(
        inputs.reshape(1, -1, *inputs.shape[2:]), (count * outputs, *layer.weight.shape[1:]),
        grad_outputs.reshape(1, -1, *grad_outputs.shape[2:]), layer.stride, layer.padding, layer.dilation,
        count * layer.groups).reshape(count, outputs, -1)


def conv2d_norm_form(layer: nn.Conv2d, input_size: tuple, output_size: tuple) -> str:
    """How conv2d_squared_norms takes ||g_i||² of `layer` on inputs of spatial `input_size` (outputs of
    `output_size`): "single" at one output position, "ghost" where `conv2d_norm_costs` finds it cheaper than
    materialising, else "patches" (patches of fewer than PATCH_VALUES values) or "grouped". A function of the
    shapes alone, so every pass (Δ*, the mean-rule statistics, training) takes each layer the same way
    (docs/sensitivity.md)."""
    if layer.groups == 1 and tuple(output_size) == (1, 1):
        return "single"
    costs = conv2d_norm_costs(layer.in_channels // layer.groups, layer.out_channels, layer.kernel_size,
                              input_size, output_size, layer.padding)
    if layer.groups == 1 and costs["ghost"] < costs["materialised"]:
        return "ghost"
    if layer.groups == 1 and layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1] < PATCH_VALUES:
        return "patches"
    return "grouped"


def conv2d_norm_costs(in_channels: int, out_channels: int, kernel_size: tuple[int, int], input_size: tuple[int, int],
                      output_size: tuple[int, int], padding: tuple[int, int]) -> dict[str, int]:
    """Multiply-adds per sample of the two forms of `conv2d_squared_norms`.

    Materialised: T·o·p. Ghost: the products of the input's P pixels (P²·c), their shifted sums
    over the kernel columns then rows on the padded grid (`_patch_gram`), and the products of output
    gradients (T²·o). ResNet-20's 8×8 convolutions are cheaper as ghosts, every other convolution of
    nets.py is not (LeNet-5's third has one output position: "single", cheaper still).
    """
    (kernel_h, kernel_w), (output_h, output_w) = kernel_size, output_size
    padded_h = input_size[0] + 2 * padding[0]
    positions, pixels = output_h * output_w, input_size[0] * input_size[1]
    materialised = positions * out_channels * in_channels * kernel_h * kernel_w
    ghost = (pixels ** 2 * in_channels + kernel_w * (padded_h * output_w) ** 2 + kernel_h * positions ** 2
             + positions ** 2 * out_channels)
    return {"materialised": materialised, "ghost": ghost}


def _patch_gram(layer, inputs):
    """(n, T, T) products a_t·a_t' of the input patches of a Conv2d layer (groups = 1).

    A patch is k_h·k_w pixels, so a_t·a_t' = Σ_δ x_{t+δ}·x_{t'+δ} over the kernel offsets δ: the
    (P, P) products of padded input pixels, shifted and summed over kernel columns, then rows.
    Cheaper than unfolding the patches (p = c·k_h·k_w values each) when T is small. The products of the
    input's own pixels are formed, then padded with the zeros a padding pixel's products are (ResNet-20's
    8×8 maps: 64² products over the channels instead of 100²).
    """
    (pad_h, pad_w), (kernel_h, kernel_w) = layer.padding, layer.kernel_size
    (stride_h, stride_w), (dilation_h, dilation_w) = layer.stride, layer.dilation
    count, _, height, width = inputs.shape
    pixels = inputs.flatten(2)
    pixel_gram = F.pad(torch.bmm(pixels.transpose(1, 2), pixels).reshape(count, height, width, height, width),
                       (pad_w, pad_w, pad_h, pad_h) * 2)
    padded_h, padded_w = height + 2 * pad_h, width + 2 * pad_w
    output_h = (padded_h - dilation_h * (kernel_h - 1) - 1) // stride_h + 1
    output_w = (padded_w - dilation_w * (kernel_w - 1) - 1) // stride_w + 1

    def columns(offset):
        return slice(offset * dilation_w, offset * dilation_w + stride_w * (output_w - 1) + 1, stride_w)

    def rows(offset):
        return slice(offset * dilation_h, offset * dilation_h + stride_h * (output_h - 1) + 1, stride_h)

    column_sums = _sum_in_place(pixel_gram[:, :, columns(j), :, columns(j)] for j in range(kernel_w))
    gram = _sum_in_place(column_sums[:, rows(i), :, rows(i)] for i in range(kernel_h))
    return gram.reshape(count, output_h * output_w, output_h * output_w)


def _sum_in_place(terms):
    """The sum of a non-empty iterable of tensors, into a copy of the first (one buffer, no temporaries)."""
    terms = iter(terms)
    total = next(terms).clone()
    for term in terms:
        total += term
    return total


def _patches(layer, inputs):
    """The (n, p, T) input patches of a Conv2d layer, one column per output position.

    Copied once from a strided view of the padded input: several times faster on CPU than
    F.unfold, which loops over the samples.
    """
    (pad_h, pad_w), (kernel_h, kernel_w) = layer.padding, layer.kernel_size
    (stride_h, stride_w), (dilation_h, dilation_w) = layer.stride, layer.dilation
    padded = F.pad(inputs, (pad_w, pad_w, pad_h, pad_h))
    windows = padded.unfold(2, dilation_h * (kernel_h - 1) + 1, stride_h).unfold(3, dilation_w * (kernel_w - 1) + 1,
                                                                                  stride_w)
    windows = windows[..., ::dilation_h, ::dilation_w]  # (n, c, T_h, T_w, kernel_h, kernel_w)
    return windows.permute(0, 1, 4, 5, 2, 3).reshape(len(inputs), -1, windows.shape[2] * windows.shape[3])


def group_norm_squared_norms(layer: nn.GroupNorm, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of a GroupNorm layer: per channel g_γ = Σ_positions b·x̂ and g_β = Σ_positions b, both
    returned per sample ((n, channels) each)."""
    per_sample = {}
    if layer.weight is not None and layer.weight.requires_grad:
        # In place: on CPU a second buffer of this size costs about as much again in fresh pages.
        products = F.group_norm(inputs, layer.num_groups, eps=layer.eps).mul_(grad_outputs)
        per_sample[layer.weight] = products.flatten(2).sum(dim=2)
    if layer.bias is not None and layer.bias.requires_grad:
        per_sample[layer.bias] = grad_outputs.flatten(2).sum(dim=2)
    return LayerNorms(sum(grad.square().sum(dim=1) for grad in per_sample.values()), per_sample)


SQUARED_NORMS = {nn.Linear: linear_squared_norms, nn.Conv2d: conv2d_squared_norms,
                 nn.GroupNorm: group_norm_squared_norms}


@dataclass
class _Pass:
    """One forward pass with every parameter layer's input and output, and the per-example losses."""

    layers: list
    inputs: list
    outputs: list
    logits: torch.Tensor
    losses: torch.Tensor


def _forward(model, inputs, labels):
    layers = _parameter_layers(model)
    recorded = {}

    def record(layer, layer_inputs, output):
        if layer in recorded:
            raise ValueError(f"{type(layer).__name__} is applied twice in one forward; its per-sample gradient "
                             "would mix both uses")
        recorded[layer] = (layer_inputs[0].detach(), output)

    logits = forward_with_hook(model, layers, record, inputs)
    layers = [layer for layer in layers if layer in recorded]
    return _Pass(layers, [recorded[layer][0] for layer in layers], [recorded[layer][1] for layer in layers],
                 logits, F.cross_entropy(logits, labels, reduction="none"))


def forward_with_hook(model: nn.Module, layers: Sequence[nn.Module], hook: Callable, inputs: torch.Tensor) -> torch.Tensor:
    """model(inputs) with `hook` registered as a forward hook of each of `layers` for this call only."""
    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        return model(inputs)
    finally:
        for handle in handles:
            handle.remove()


def layer_shapes(model: nn.Module, example: torch.Tensor) -> list:
    """(layer, input shape, output shape) of every parameter layer the forward of `example` (a batch of one)
    applies, in the order applied: what the per-layer choices of form and chunk are made from, before any pass."""
    shapes = []

    def record(layer, layer_inputs, output):
        shapes.append((layer, layer_inputs[0].shape, output.shape))

    with torch.no_grad():
        forward_with_hook(model, _parameter_layers(model), record, example)
    return shapes


def norm_forms(model: nn.Module, example: torch.Tensor) -> dict:
    """How the norms pass takes each parameter layer (by name) on examples shaped as `example`: the
    convolutions' `conv2d_norm_form`, "ghost" for a Linear layer, "per-sample" for a GroupNorm layer."""
    names = {layer: name for name, layer in model.named_modules()}
    forms = {}
    for layer, input_shape, output_shape in layer_shapes(model, example):
        if isinstance(layer, nn.Conv2d):
            forms[names[layer]] = conv2d_norm_form(layer, input_shape[2:], output_shape[2:])
        else:
            forms[names[layer]] = "ghost" if isinstance(layer, nn.Linear) else "per-sample"
    return forms


def examples_per_pass(model: nn.Module, inputs: torch.Tensor, device: str | torch.device = "cpu") -> int:
    """Examples per pass of the norms engine (a norms-only pass, or a training step's norms and clipped sum) over
    examples shaped as `inputs`' on `device`: `pass_examples` of the model's largest layer output. A function of
    the model's shapes and the device's kind alone, so every chunk of a measurement and every step of a run is
    cut alike."""
    from perinstance.train import fallback_norms

    if fallback_norms.needs_fallback(model):  # torch.func materialises its layers' per-sample gradients
        return FALLBACK_PASS_EXAMPLES
    largest = max((math.prod(output[1:]) for _, _, output in layer_shapes(model, inputs[:1].to(device))), default=0)
    return pass_examples(largest * next(model.parameters()).element_size(), torch.device(device).type)


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


def _parameter_layers(model):
    """The modules that own trainable parameters; each must be a type of SQUARED_NORMS."""
    layers = [module for module in model.modules()
              if any(param.requires_grad for param in module.parameters(recurse=False))]
    for layer in layers:
        if type(layer) not in SQUARED_NORMS:
            raise ValueError(f"no per-sample norms for trainable {type(layer).__name__} layers "
                             f"(supported: {', '.join(kind.__name__ for kind in SQUARED_NORMS)})")
    return layers


def layer_norms(layers: Sequence[nn.Module], inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                losses: torch.Tensor) -> tuple:
    """The gradients b_i of the summed `losses` w.r.t. the `outputs` of `layers` (each applied once to its
    `inputs`; one backward, no weight gradient), and each layer's LayerNorms, one at a time as the caller (under
    no_grad) takes them, so that a layer's materialised gradients are freed unless kept. No layers: no backward,
    nothing."""
    if not layers:
        return (), iter(())
    grad_outputs = torch.autograd.grad(losses.sum(), outputs, materialize_grads=True)
    return grad_outputs, (SQUARED_NORMS[type(layer)](layer, layer_inputs, grad_output)
                          for layer, layer_inputs, grad_output in zip(layers, inputs, grad_outputs))


def per_sample_norms(model: nn.Module, inputs: torch.Tensor,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """||g_i|| of the cross-entropy gradient of each example; also per-example losses and logits."""
    from perinstance.train import fallback_norms

    if fallback_norms.needs_fallback(model):  # layers without a closed form here: torch.func, layer by layer
        return fallback_norms.per_sample_norms(model, inputs, labels)
    forward = _forward(model, inputs, labels)
    _, norms_by_layer = layer_norms(forward.layers, forward.inputs, forward.outputs, forward.losses)
    with torch.no_grad():
        squared = sum(norms.squared for norms in norms_by_layer)
    return squared.sqrt(), forward.losses.detach(), forward.logits.detach()


def clipped_gradient_sum(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                         weights_of_norms: Callable[[torch.Tensor], torch.Tensor]
                         ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_i w_i·g_i with w = weights_of_norms(||g_i||) (the clipped sum u(B) of §1), from the one backward that
    gives the norms (book-keeping, `weighted_layer_gradients`), without a second backward through the network.

    Returns (one summed gradient per trainable parameter, in model.parameters() order; per-example
    losses; ||g_i||; logits).
    """
    from perinstance.train import fallback_norms

    if fallback_norms.needs_fallback(model):  # layers without a closed form here: torch.func, layer by layer
        return fallback_norms.clipped_gradient_sum(model, inputs, labels, weights_of_norms)
    forward = _forward(model, inputs, labels)
    grad_outputs, norms_by_layer = layer_norms(forward.layers, forward.inputs, forward.outputs, forward.losses)
    with torch.no_grad():
        norms_by_layer = list(norms_by_layer)
        norms = sum(norms.squared for norms in norms_by_layer).sqrt()
        summed = weighted_layer_gradients(forward.layers, forward.inputs, grad_outputs, norms_by_layer,
                                          weights_of_norms(norms))
    # A layer the forward never applied has zero gradient.
    return ([summed.get(param, torch.zeros_like(param)) for param in trainable_parameters(model)],
            forward.losses.detach(), norms, forward.logits.detach())


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
        rest = [param for param in layer.parameters(recurse=False) if param.requires_grad and param not in summed]
        if rest:
            weighted = grad_output * weights.reshape(-1, *[1] * (grad_output.dim() - 1))
            summed.update(_weight_gradients(layer, layer_inputs, weighted, rest))
    return summed


def _weight_gradients(layer, inputs, grad_outputs, params):
    """The gradients of `params` (some of `layer`'s own) for the gradient `grad_outputs` of its output."""
    if isinstance(layer, nn.Conv2d):  # a ghost or single-position form: its bias (as GroupNorm's) is materialised
        if conv2d_norm_form(layer, inputs.shape[2:], grad_outputs.shape[2:]) == "single":
            # A matrix product: several times faster than the convolution library's weight gradient here.
            patches = _patches(layer, inputs).reshape(len(inputs), -1)
            return {layer.weight: (grad_outputs.reshape(len(inputs), -1).T @ patches).reshape(layer.weight.shape)}
        return {layer.weight: torch.nn.grad.conv2d_weight(inputs, layer.weight.shape, grad_outputs, layer.stride,
                                                          layer.padding, layer.dilation, layer.groups)}
    return {param: grad_outputs.T @ inputs if param is layer.weight else grad_outputs.sum(dim=0) for param in params}


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

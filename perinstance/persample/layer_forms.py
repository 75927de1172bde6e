"""Each layer type's per-sample gradient norms from the layer's input and the gradient of its output (closed
forms, or per-sample gradients formed where a layer's shapes make that cheaper), the form chosen for each
convolution, and a layer's weight gradient for weighted output gradients: what gradients.py's norms pass and
clipped sum are built from (docs/sensitivity.md)."""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Values per input patch (in_channels·k_h·k_w) below which the convolution library's grouped weight-gradient
# kernel is slower than a batched product of unfolded patches. Measured on 2 CPU cores, 1 and 2 threads,
# 128-256 examples: patches 1.6-4× faster at 18, 25, 27, 36 and 75 values (LeNet-5's and ResNet-20's first
# convolutions among them), the grouped kernel 1.4-2.5× faster at 144, 150 and 200 (LeNet-5's second).
PATCH_VALUES = 128
# Examples whose unfolded patches are formed at once on a CPU (`_materialised`, "patches"; a GPU takes the
# whole chunk, as each launch costs more than the work of a few examples): the patches are p/c times the input,
# and a few examples' stay in cache (LeNet-5's first convolution: 3.9× faster than 512 examples' at once;
# ResNet-20's, as fast as 128 examples'). The grouped kernel takes a whole chunk: in blocks of 2 MiB of
# operands it ran 1.15× slower on ResNet-20, no faster on LeNet-5.
PATCH_CHUNK = 32


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

    @classmethod
    def of_per_sample(cls, per_sample: dict) -> "LayerNorms":
        """The LayerNorms of a layer whose trainable parameters' per-sample gradients are all in `per_sample`."""
        return cls(sum(grad.reshape(len(grad), -1).square().sum(dim=1) for grad in per_sample.values()), per_sample)


def linear_squared_norms(layer: nn.Linear, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of a Linear layer on (n, ..., features) inputs (linear_parts)."""
    return linear_parts(layer.weight, layer.bias, inputs, grad_outputs)


def linear_parts(weight: torch.Tensor, bias: torch.Tensor | None, inputs: torch.Tensor,
                 grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of the trainable ones of `weight` and `bias` of an affine map x -> W x + b applied to inputs
    (n, ..., features) with gradients `grad_outputs` of its outputs. With the inputs a_t and output gradients b_t of
    the T positions of an example (tokens, or T = 1), g_W = Σ_t b_t a_tᵀ and g_b = Σ_t b_t. At T = 1,
    ||g_W||² = ||a||²·||b||². Otherwise, by `linear_norm_form`: ghost, ||g_W||² = Σ_{t,t'} (a_t·a_t')(b_t·b_t')
    from the two (T, T) Gram matrices, or materialised, ||Σ_t b_t a_tᵀ||², examples a few at a time
    (`_example_blocks`). Nothing is kept: the clipped sum is the weight gradient for the weighted b."""
    if inputs.dim() == 2:
        output_squares = grad_outputs.square().sum(dim=1)
        squared = inputs.square().sum(dim=1) * output_squares if weight.requires_grad else 0
        if bias is not None and bias.requires_grad:
            squared = squared + output_squares
        return LayerNorms(squared, {})
    count = len(inputs)
    a, b = inputs.reshape(count, -1, inputs.shape[-1]), grad_outputs.reshape(count, -1, grad_outputs.shape[-1])
    squared = grad_outputs.new_zeros(count)
    if weight.requires_grad:
        form = linear_norm_form(a.shape[1], a.shape[2], b.shape[2])
        per_example = (a.shape[1] ** 2 if form == "ghost" else a.shape[2] * b.shape[2]) * b.element_size()
        for block in _example_blocks(count, per_example, b.device):
            if form == "ghost":
                squared[block] = (torch.bmm(a[block], a[block].transpose(1, 2))
                                  * torch.bmm(b[block], b[block].transpose(1, 2))).sum(dim=(1, 2))
            else:
                squared[block] = torch.bmm(b[block].transpose(1, 2), a[block]).square().sum(dim=(1, 2))
    if bias is not None and bias.requires_grad:
        squared = squared + b.sum(dim=1).square().sum(dim=1)
    return LayerNorms(squared, {})


def linear_norm_form(positions: int, in_features: int, out_features: int) -> str:
    """How linear_parts takes ||g_W||² of an affine map applied at `positions` positions per example: "ghost"
    (two (T, T) Gram matrices, T²·(in + out) multiply-adds) where that is cheaper than "materialised"
    (T·in·out), as conv2d_norm_form chooses for a convolution. A function of the shapes alone."""
    ghost = positions ** 2 * (in_features + out_features)
    return "ghost" if positions == 1 or ghost < positions * in_features * out_features else "materialised"


# On a CPU, the per-example Gram matrices or weight gradients that linear_parts forms at once stay within these
# bytes (in cache); a GPU takes a whole chunk at once, as each launch costs more than a few examples' work.
BLOCK_BYTES = 4 << 20


def _example_blocks(count: int, per_example: int, device: torch.device) -> list[slice]:
    """Consecutive slices of `count` examples, each holding at most BLOCK_BYTES of `per_example` bytes on a CPU."""
    size = count if device.type != "cpu" else max(1, BLOCK_BYTES // max(per_example, 1))
    return [slice(start, start + size) for start in range(0, count, size)]


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
            squared = (_patch_gram(layer, inputs, grad_outputs.shape[2:]) * output_gram).sum(dim=(1, 2))
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
        # Each chunk's products go straight into their rows of the result: no copy of the chunks into one.
        chunk = PATCH_CHUNK if inputs.device.type == "cpu" else max(count, 1)
        output_rows = grad_outputs.reshape(count, outputs, -1)
        weight_grads = output_rows.new_empty(count, outputs, layer.in_channels * math.prod(layer.kernel_size))
        for first in range(0, count, chunk):
            torch.bmm(output_rows[first:first + chunk], _patches(layer, inputs[first:first + chunk]).transpose(1, 2),
                      out=weight_grads[first:first + chunk])
        return weight_grads
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
                              input_size, output_size)
    if layer.groups == 1 and costs["ghost"] < costs["materialised"]:
        return "ghost"
    return materialised_form(layer)


def materialised_form(layer: nn.Conv2d) -> str:
    """How a convolution's per-sample weight gradients are materialised: "patches" (one group, patches of fewer than
    PATCH_VALUES values) or "grouped"."""
    if layer.groups == 1 and layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1] < PATCH_VALUES:
        return "patches"
    return "grouped"


def conv2d_norm_costs(in_channels: int, out_channels: int, kernel_size: tuple[int, int], input_size: tuple[int, int],
                      output_size: tuple[int, int]) -> dict[str, int]:
    """Multiply-adds per sample of the two forms of `conv2d_squared_norms`.

    Materialised: T·o·p. Ghost: the products of the input's P pixels (P²·c), their shifted sums
    over the kernel columns then rows (`_patch_gram`), and the products of output
    gradients (T²·o). ResNet-20's 8×8 convolutions are cheaper as ghosts, every other convolution of
    nets.py is not (LeNet-5's third has one output position: "single", cheaper still).
    """
    (kernel_h, kernel_w), (output_h, output_w) = kernel_size, output_size
    positions, pixels = output_h * output_w, input_size[0] * input_size[1]
    materialised = positions * out_channels * in_channels * kernel_h * kernel_w
    ghost = (pixels ** 2 * in_channels + kernel_w * (input_size[0] * output_w) ** 2 + kernel_h * positions ** 2
             + positions ** 2 * out_channels)
    return {"materialised": materialised, "ghost": ghost}


def _patch_gram(layer, inputs, output_size):
    """(n, T, T) products a_t·a_t' of the input patches of a Conv2d layer (groups = 1) whose output maps are of
    `output_size` (T = its product).

    A patch is k_h·k_w pixels, so a_t·a_t' = Σ_δ x_{t+δ}·x_{t'+δ} over the kernel offsets δ: the (P, P)
    products of the input's own pixels, shifted and summed over kernel columns, then rows. Cheaper than
    unfolding the patches (p = c·k_h·k_w values each) when T is small. A padding pixel is zero, and so are
    its products: each offset adds only the positions whose pixel lies in the input, a slice of the
    products, so that no padded copy is formed (ResNet-20's 8×8 maps: sums over 64² products instead of
    100²). The offsets are added in kernel order onto zeros: the same sums as over the padded products.
    """
    (pad_h, pad_w), (kernel_h, kernel_w) = layer.padding, layer.kernel_size
    (stride_h, stride_w), (dilation_h, dilation_w) = layer.stride, layer.dilation
    count, _, height, width = inputs.shape
    output_h, output_w = output_size
    pixels = inputs.flatten(2)
    pixel_gram = torch.bmm(pixels.transpose(1, 2), pixels).reshape(count, height, width, height, width)
    column_sums = pixel_gram.new_zeros(count, height, output_w, height, output_w)
    for outputs, columns in _offset_slices(width, output_w, kernel_w, stride_w, pad_w, dilation_w):
        column_sums[:, :, outputs, :, outputs] += pixel_gram[:, :, columns, :, columns]
    gram = pixel_gram.new_zeros(count, output_h, output_w, output_h, output_w)
    for outputs, rows in _offset_slices(height, output_h, kernel_h, stride_h, pad_h, dilation_h):
        gram[:, outputs, :, outputs] += column_sums[:, rows, :, rows]
    return gram.reshape(count, output_h * output_w, output_h * output_w)


def _offset_slices(size: int, outputs: int, kernel: int, stride: int, padding: int,
                   dilation: int) -> list[tuple[slice, slice]]:
    """For each kernel offset along one axis, in order: (the output positions t whose input position
    stride·t + dilation·offset − padding lies in the input's `size`, those input positions), as slices; an
    offset that reaches no input position is left out."""
    pairs = []
    for offset in range(kernel):
        shift = dilation * offset - padding
        first = max(0, -(shift // stride))  # the least t with stride·t + shift ≥ 0
        stop = min(outputs, (size - 1 - shift) // stride + 1)
        if stop > first:
            pairs.append((slice(first, stop), slice(stride * first + shift, stride * (stop - 1) + shift + 1, stride)))
    return pairs


def _patches(layer, inputs):
    """The (n, p, T) input patches of a Conv2d layer, one column per output position.

    Copied once from a strided view of the padded input: several times faster on CPU than
    F.unfold, which loops over the samples.
    """
    (pad_h, pad_w), (kernel_h, kernel_w) = layer.padding, layer.kernel_size
    (stride_h, stride_w), (dilation_h, dilation_w) = layer.stride, layer.dilation
    # F.pad copies its input even where every pad is zero.
    padded = F.pad(inputs, (pad_w, pad_w, pad_h, pad_h)) if pad_h or pad_w else inputs
    windows = padded.unfold(2, dilation_h * (kernel_h - 1) + 1, stride_h).unfold(3, dilation_w * (kernel_w - 1) + 1,
                                                                                  stride_w)
    if dilation_h != 1 or dilation_w != 1:
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
    return LayerNorms.of_per_sample(per_sample)


class _GroupNormRows(torch.autograd.Function):
    """GroupNorm whose affine parameters enter as per-sample rows (n, channels), all equal to the layer's own:
    the gradient of a row is that sample's γ or β gradient. Its backward is torch's fused GroupNorm backward
    on the batch viewed as one sample of n·channels channels in n·groups groups (the same groups, so the same
    input gradient, bit for bit): the per-channel γ and β gradients that kernel forms on the way to the input
    gradient are then per sample, at almost no cost beyond that input gradient."""

    @staticmethod
    def forward(ctx, inputs, weight_rows, bias_rows, num_groups, eps):
        count, channels = inputs.shape[:2]
        positions = math.prod(inputs.shape[2:])
        weight = None if weight_rows is None else weight_rows[0]
        bias = None if bias_rows is None else bias_rows[0]
        output, mean, rstd = torch.native_group_norm(inputs, weight, bias, count, channels, positions, num_groups, eps)
        ctx.save_for_backward(inputs, mean, rstd, weight_rows)
        ctx.num_groups = num_groups
        return output

    @staticmethod
    def backward(ctx, grad_output):
        inputs, mean, rstd, weight_rows = ctx.saved_tensors
        count, channels = inputs.shape[:2]
        positions = math.prod(inputs.shape[2:])
        sample = (1, count * channels, positions)
        weights = None if weight_rows is None else weight_rows.reshape(-1)
        grad_input, grad_weight, grad_bias = torch.ops.aten.native_group_norm_backward(
            grad_output.reshape(sample), inputs.reshape(sample), mean.reshape(1, -1), rstd.reshape(1, -1), weights, 1,
            count * channels, positions, count * ctx.num_groups, list(ctx.needs_input_grad[:3]))
        return (None if grad_input is None else grad_input.reshape(inputs.shape),
                None if grad_weight is None else grad_weight.reshape(count, channels),
                None if grad_bias is None else grad_bias.reshape(count, channels), None, None)


@contextmanager
def group_norm_rows(layers: Sequence[nn.Module], rows: dict) -> Iterator[None]:
    """Within the block, each GroupNorm layer of `layers` runs as _GroupNormRows; `rows` gets, per layer
    applied, its (weight rows, bias rows): leaves whose gradients are the per-sample ones of its trainable
    parameters (None for an absent or frozen one)."""

    def forward_of(layer):
        def forward(inputs):
            weight_rows, bias_rows = (None if param is None else
                                      param.detach().expand(len(inputs), -1).requires_grad_(param.requires_grad)
                                      for param in (layer.weight, layer.bias))
            rows[layer] = (weight_rows, bias_rows)
            return _GroupNormRows.apply(inputs, weight_rows, bias_rows, layer.num_groups, layer.eps)
        return forward

    norms = [layer for layer in layers if type(layer) is nn.GroupNorm]
    for layer in norms:
        layer.forward = forward_of(layer)
    try:
        yield
    finally:
        for layer in norms:
            del layer.forward


@dataclass
class _Conv2dView:
    """The attributes of a Conv2d that conv2d_squared_norms reads, for a Conv1d applied as a Conv2d of height 1:
    its weight viewed as (out, in/groups, 1, k), every size with a leading 1 (0 for the padding)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    in_channels: int
    out_channels: int
    kernel_size: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    groups: int
    padding_mode: str


def conv1d_as_conv2d(layer: nn.Conv1d) -> _Conv2dView:
    """`layer` as a Conv2d of height 1 (inputs and output gradients unsqueezed at dimension 2)."""
    padding = layer.padding if isinstance(layer.padding, str) else (0, *layer.padding)
    # Detached: the view carries the weight's shape and requires_grad, also where it is made under no_grad.
    weight = layer.weight.detach().unsqueeze(2).requires_grad_(layer.weight.requires_grad)
    return _Conv2dView(weight, layer.bias, layer.in_channels, layer.out_channels,
                       (1, *layer.kernel_size), (1, *layer.stride), padding, (1, *layer.dilation), layer.groups,
                       layer.padding_mode)


def conv1d_squared_norms(layer: nn.Conv1d, inputs: torch.Tensor, grad_outputs: torch.Tensor) -> LayerNorms:
    """||g_i||² of a Conv1d layer on (n, channels, length) inputs: conv2d_squared_norms of the layer as a Conv2d of
    height 1, its materialised weight gradients viewed back in the layer's shape."""
    view = conv1d_as_conv2d(layer)
    norms = conv2d_squared_norms(view, inputs.unsqueeze(2), grad_outputs.unsqueeze(2))
    per_sample = {}
    for param, grads in norms.per_sample.items():
        if param is view.weight:
            per_sample[layer.weight] = grads.reshape(len(grads), *layer.weight.shape)
        else:
            per_sample[param] = grads
    return LayerNorms(norms.squared, per_sample)


SQUARED_NORMS = {nn.Linear: linear_squared_norms, nn.Conv2d: conv2d_squared_norms,
                 nn.GroupNorm: group_norm_squared_norms, nn.Conv1d: conv1d_squared_norms,
                 # attention's output projection: a Linear layer by another name
                 nn.modules.linear.NonDynamicallyQuantizableLinear: linear_squared_norms}


def weight_gradients(layer: nn.Module, inputs: torch.Tensor, grad_outputs: torch.Tensor,
                     params: Sequence[nn.Parameter]) -> dict:
    """The gradients of `params` (some of `layer`'s own) for the gradient `grad_outputs` of its output."""
    if isinstance(layer, nn.Conv2d | _Conv2dView):  # ghost or single-position: its bias (as GroupNorm's) is materialised
        if conv2d_norm_form(layer, inputs.shape[2:], grad_outputs.shape[2:]) == "single":
            # A matrix product: several times faster than the convolution library's weight gradient here.
            patches = _patches(layer, inputs).reshape(len(inputs), -1)
            return {layer.weight: (grad_outputs.reshape(len(inputs), -1).T @ patches).reshape(layer.weight.shape)}
        return {layer.weight: torch.nn.grad.conv2d_weight(inputs, layer.weight.shape, grad_outputs, layer.stride,
                                                          layer.padding, layer.dilation, layer.groups)}
    if isinstance(layer, nn.Conv1d):
        view = conv1d_as_conv2d(layer)
        grads = weight_gradients(view, inputs.unsqueeze(2), grad_outputs.unsqueeze(2), [view.weight])
        return {layer.weight: grads[view.weight].reshape(layer.weight.shape)}
    return affine_gradients(layer.weight, inputs, grad_outputs, params)


def affine_gradients(weight: torch.Tensor, inputs: torch.Tensor, grad_outputs: torch.Tensor,
                     params: Sequence[nn.Parameter]) -> dict:
    """The summed gradients of `params` (`weight` and a bias) of an affine map applied to every row (token) of
    `inputs`, for the gradient `grad_outputs` of its outputs: Σ_rows grad·inputᵀ for the weight, Σ_rows grad for
    the bias."""
    grad_rows = grad_outputs.reshape(-1, grad_outputs.shape[-1])
    return {param: grad_rows.T @ inputs.reshape(-1, inputs.shape[-1]) if param is weight else grad_rows.sum(dim=0)
            for param in params}

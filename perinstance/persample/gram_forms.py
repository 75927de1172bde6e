"""Per-sample gradients in the form whose cross products give a Gram matrix cheapest, layer by layer, from the
engine's one pass (gradients.py, layer_forms.py): what the mean rule's Gram of a checkpoint is built from
(perinstance/measure/gram.py, docs/sensitivity.md "The Gram route").

A layer's part of g_i·g_j comes from one of two factors of its per-sample gradients:
- "outer": a layer whose gradient is one outer product b_i a_iᵀ (a Linear layer on (n, features) inputs, a
  convolution with one output position on its only patch; a bias is a column of ones in a_i) has
  g_i·g_j = (a_i·a_j)(b_i·b_j): a + b multiply-adds per pair instead of a·b (LeNet-5's 48,120-weight third
  convolution: 521 instead of 48,120).
- "rows": every other layer's per-sample gradients, materialised and flattened (g_i·g_j their dot product):
  the convolutions with many positions, whose ghost form costs T²·(p + o) per pair against p·o (the engine
  already forms most of them for the norms), and GroupNorm's per-sample γ and β.
"""

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from perinstance.persample import batches, fallback_norms, gradients, layer_forms
from perinstance.persample.layer_pass import own_trainable_parameters, parameter_owners

# The layer types with a Gram factor here; a model with another trainable layer type takes its materialised
# per-sample gradients as one rows factor instead (perinstance/measure/gram.py).
GRAM_LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm)


@dataclass
class GramFactor:
    """One layer's per-sample gradients of n examples, as `rows` (n, p), or as the `inputs` (n, a) and output
    gradients `outputs` (n, b) of g_i = b_i a_iᵀ; the other fields None."""

    rows: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    outputs: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """Multiply-adds per pair of examples in a Gram product (p, or a + b)."""
        if self.rows is not None:
            return self.rows.shape[1]
        return self.inputs.shape[1] + self.outputs.shape[1]


@dataclass
class GramPass:
    """One pass over a chunk: each parameter layer's GramFactor of h_i = w_i·g_i (None for a layer not asked
    for), and the examples' losses, logits and gradient norms ||g_i||."""

    factors: list
    losses: torch.Tensor
    logits: torch.Tensor
    grad_norms: torch.Tensor


def gram_covers(model: nn.Module) -> bool:
    """Whether gram_factors takes `model`: the engine covers it without falling back, and every trainable layer
    is of a GRAM_LAYERS type."""
    owners = parameter_owners(model)
    return (not fallback_norms.needs_fallback(model, owners)
            and all(isinstance(module, GRAM_LAYERS) for module, _ in owners))


def gram_factors(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                 weights_of_norms: Callable[[torch.Tensor], torch.Tensor],
                 wanted: Collection[int] | None = None, loss_fn: batches.LossFn | None = None) -> GramPass:
    """The GramFactor of h_i = w_i·g_i, w = weights_of_norms(||g_i||), of every parameter layer (in the order the
    forward applies them; only the layers at positions `wanted`, when given, the others None): one forward and
    one backward to the layer outputs (gradients.weighted_pass), the norms from the engine's forms.
    The model must be one gram_covers takes."""
    forward, grad_outputs, norms_by_layer, grad_norms, weights = gradients.weighted_pass(model, inputs, labels,
                                                                               weights_of_norms, loss_fn=loss_fn)
    with torch.no_grad():
        factors = [None if wanted is not None and index not in wanted else
                   _weighted(_layer_factor(layer, layer_inputs, grad_output, norms), weights)
                   for index, (layer, layer_inputs, grad_output, norms)
                   in enumerate(zip(forward.layers, forward.inputs, grad_outputs, norms_by_layer, strict=True))]
    return GramPass(factors, forward.losses.detach(), forward.logits.detach(), grad_norms)


def _weighted(factor, weights):
    if factor.rows is not None:
        return GramFactor(rows=factor.rows.mul_(weights[:, None]))
    return GramFactor(inputs=factor.inputs, outputs=factor.outputs * weights[:, None])


def _layer_factor(layer, inputs, grad_output, norms):
    """The GramFactor of one layer's g_i (unweighted), from its input, its output gradient and its LayerNorms."""
    own = own_trainable_parameters(layer)
    if all(param in norms.per_sample for param in own):  # materialised by the norms' form: GroupNorm, convolutions
        count = len(norms.per_sample[own[0]])
        return GramFactor(rows=torch.cat([norms.per_sample[param].reshape(count, -1) for param in own], dim=1))
    count = len(inputs)
    bias = layer.bias is not None and layer.bias.requires_grad
    if isinstance(layer, nn.Linear):
        return _outer(inputs, grad_output, bias) if layer.weight.requires_grad else GramFactor(rows=grad_output)
    # A convolution whose weight gradient the norms did not form: one output position, or the ghost form.
    if layer_forms.conv2d_norm_form(layer, inputs.shape[2:], grad_output.shape[2:]) == "single":
        return _outer(layer_forms._patches(layer, inputs).reshape(count, -1), grad_output.reshape(count, -1), bias)
    parts = [layer_forms._materialised(layer, layer_forms.materialised_form(layer), inputs, grad_output)
             .reshape(count, -1)]
    if bias:
        parts.append(norms.per_sample[layer.bias])
    return GramFactor(rows=torch.cat(parts, dim=1))


def _outer(inputs, grad_output, bias):
    """g = b aᵀ (and the bias gradient b, as a column of ones appended to a)."""
    if bias:
        inputs = torch.cat([inputs, inputs.new_ones(len(inputs), 1)], dim=1)
    return GramFactor(inputs=inputs, outputs=grad_output)

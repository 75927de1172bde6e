"""Per-sample gradients of a model (Opacus GradSampleModule), and what is built from them."""

import warnings

import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.conv import compute_conv_grad_sample
from opacus.utils.tensor_utils import unfold2d
from torch import nn

# Opacus's hooks fire on the first layer whose input needs no gradient; torch warns each
# time although per-sample gradients of the parameters are exactly what is wanted.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


def wrap_per_sample(model):
    """Wrap `model` so each backward stores per-sample gradients in `param.grad_sample`."""
    return GradSampleModule(model, batch_first=True, loss_reduction="sum")


def per_sample_gradients(grad_sample_module, inputs, labels):
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


def trainable_parameters(module):
    return [param for param in module.parameters() if param.requires_grad]


def grad_norms(grad_samples):
    """Per-sample L2 norms of the full (all-parameter) gradient."""
    per_parameter = [torch.linalg.vector_norm(grad.reshape(grad.shape[0], -1), dim=1) for grad in grad_samples]
    return torch.linalg.vector_norm(torch.stack(per_parameter, dim=1), dim=1)


def weighted_sum(grad_samples, weights):
    """Σ_i w_i·g_i for each parameter: the summed transformed gradient u(B) of §1."""
    # A matrix-vector product (BLAS) is several times faster than the equivalent einsum here.
    return [(weights @ grad.reshape(grad.shape[0], -1)).reshape(grad.shape[1:]) for grad in grad_samples]


def flatten(grad_samples):
    """Per-sample gradients as one (n, d) matrix."""
    return torch.cat([grad.reshape(grad.shape[0], -1) for grad in grad_samples], dim=1)


# --- norms only (the sum-rule sensitivity needs nothing else) ------------------------------

def conv2d_norm_sample(layer, activations, backprops):
    """Per-sample gradient norms of a Conv2d layer, by whichever of two exact forms is cheaper.

    With unfolded inputs a_t (p values) and output gradients b_t (o values) at the T output
    positions, g = Σ_t b_t a_tᵀ. Materialising g costs T·o·p per sample; the ghost form
    ||g||² = Σ_{t,t'} (a_t·a_t')(b_t·b_t') costs T²·(o + p). LeNet-5's third convolution
    (T = 1, 48k of its 62k weights) is far cheaper in the ghost form, its first two are not.
    """
    inputs = unfold2d(activations[0].to(backprops.dtype), kernel_size=layer.kernel_size, padding=layer.padding,
                      stride=layer.stride, dilation=layer.dilation)
    count, patch, positions = inputs.shape
    outputs = backprops.reshape(count, -1, positions)
    norms = {}
    if layer.weight.requires_grad:
        if layer.groups == 1 and positions * (patch + outputs.shape[1]) < patch * outputs.shape[1]:
            input_gram = torch.bmm(inputs.transpose(1, 2), inputs)
            output_gram = torch.bmm(outputs.transpose(1, 2), outputs)
            norms[layer.weight] = (input_gram * output_gram).sum(dim=(1, 2)).clamp(min=0).sqrt()
        else:
            grad_sample = compute_conv_grad_sample(layer, activations, backprops)[layer.weight]
            norms[layer.weight] = grad_sample.reshape(count, -1).norm(dim=1)
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = outputs.sum(dim=2).norm(dim=1)
    return norms


class NormSampleModule(GradSampleModuleFastGradientClipping):
    """Opacus's ghost-clipping hooks (per-sample norms, no per-sample gradients kept), with
    Conv2d norms from `conv2d_norm_sample`. Hooks record only in training mode."""

    NORM_SAMPLERS = {**GradSampleModuleFastGradientClipping.NORM_SAMPLERS, nn.Conv2d: conv2d_norm_sample}


def wrap_norms_only(model):
    """Wrap `model` so each backward computes per-sample gradient norms only."""
    return NormSampleModule(model, batch_first=True, loss_reduction="sum", use_ghost_clipping=True)


def per_sample_norms(norm_module, inputs, labels):
    """||g_i|| of the cross-entropy gradient of each example; also per-example losses and logits."""
    logits = norm_module(inputs)
    losses = F.cross_entropy(logits, labels, reduction="none")
    losses.sum().backward()
    norms = norm_module.get_norm_sample().detach()
    for param in trainable_parameters(norm_module):
        param.grad = None
    return norms, losses.detach(), logits.detach()

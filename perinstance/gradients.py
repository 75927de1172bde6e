"""Per-sample gradients of a model (Opacus GradSampleModule), and what is built from them."""

import warnings

import torch
import torch.nn.functional as F
from opacus import GradSampleModule

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
    squared = sum(grad.reshape(grad.shape[0], -1).pow(2).sum(dim=1) for grad in grad_samples)
    return squared.sqrt()


def weighted_sum(grad_samples, weights):
    """Σ_i w_i·g_i for each parameter: the summed transformed gradient u(B) of §1."""
    return [torch.einsum("n,n...->...", weights, grad) for grad in grad_samples]


def flatten(grad_samples):
    """Per-sample gradients as one (n, d) matrix."""
    return torch.cat([grad.reshape(grad.shape[0], -1) for grad in grad_samples], dim=1)

"""Test oracles: the quantities of accounting.md §2 by one forward/backward per batch, as the paper
repository computed them, against which the engine (perinstance/measure/gradient_rows.py and the modules
built on it) is checked; benchmarks/bench_sensitivity.py times them as the obvious alternative."""

import numpy as np
import torch

from perinstance.measure.gradient_rows import parameter_count, training_mode
from perinstance.persample import batches as batch_structures
from perinstance.persample import gradients, layer_pass


def one_backward_per_example(model, inputs, targets, loss_fn=None):
    """Every example's gradient of its loss (batches.per_example_loss) by one plain autograd backward each,
    inputs and targets a tensor, a tuple or a mapping: (count, trainable parameters) float64."""
    params = [param for param in model.parameters() if param.requires_grad]
    rows = []
    for index in range(batch_structures.count(targets)):
        one = slice(index, index + 1)
        loss = batch_structures.per_example_loss(batch_structures.apply_model(model, batch_structures.take(inputs, one)),
                                                 batch_structures.take(targets, one), loss_fn).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(param) if grad is None else grad.to_dense()).flatten()
                               for param, grad in zip(params, grads)]))
    return torch.stack(rows).double()


def reference_batch_means(model, inputs, labels, transform, batches, device="cpu"):
    """m(B) = (1/|B|) Σ_{i∈B} h(g_i) for each index list B (m(∅) = 0): (len(batches), d) float64."""
    module = gradients.wrap_per_sample(model)
    means = []
    try:
        with training_mode(model):
            for batch in batches:
                batch = torch.as_tensor(np.asarray(batch, dtype=np.int64))
                if len(batch) == 0:
                    means.append(torch.zeros(parameter_count(model), dtype=torch.float64))
                    continue
                grad_samples, _, _ = gradients.per_sample_gradients(module, inputs[batch].to(device),
                                                                    labels[batch].to(device))
                weights = transform.weights(gradients.grad_norms(grad_samples))
                summed = torch.cat([part.reshape(-1) for part in layer_pass.weighted_sum(grad_samples, weights)])
                means.append(summed.double().cpu() / len(batch))
    finally:
        module.cleanup()
    return torch.stack(means).numpy()


def reference_batch_sensitivities(model, inputs, labels, transform, point, batches, device="cpu"):
    """Δ_B = ||m(B ∪ {x*}) − m(B)|| for each index list B (not containing `point`)."""
    with_point = [list(batch) + [point] for batch in batches]
    means = reference_batch_means(model, inputs, labels, transform, list(batches) + with_point, device)
    return np.linalg.norm(means[len(batches):] - means[:len(batches)], axis=1)


def reference_renyi_statistics(model, inputs, labels, transform, target_batch, set_batches, device="cpu"):
    """S of accounting.md §2, by its defining formula, for one target batch B_0 and each set
    [B_1..B_α] of index lists."""
    target_mean = reference_batch_means(model, inputs, labels, transform, [target_batch], device)[0]
    statistics = []
    for batches in set_batches:
        means = reference_batch_means(model, inputs, labels, transform, batches, device)
        alpha = len(batches)
        statistics.append((means ** 2).sum() - (alpha - 1) * (target_mean ** 2).sum()
                          - ((means.sum(axis=0) - (alpha - 1) * target_mean) ** 2).sum())
    return np.asarray(statistics)

"""Input canaries (`--input-canaries M`, docs/audit.md §1b): crafted examples that pass through the run's Poisson
sampler, its per-sample gradients and its clipping like real points, so that a sampling or clipping fault shows in
the one-run audit (the gradient canaries of canaries.py skip the last two).

Canary j is in the run with probability 1/2; an included canary is one more training example (its index after the
real points'). Its input is a balanced random ±A pattern on the input features that are constant over the
training set (all features when fewer than MIN_CONSTANT_FEATURES are), 0 elsewhere, with a random label: on those
features the pattern sums to 0, so under a fully connected first layer its gradient there is orthogonal to every
real point's, and two canaries' patterns overlap by about 1/√k of k features. A = INPUT_SCALE × the root mean square of the training inputs.

At every step the audit's projection of canary j is x_t = ⟨ũ_t, g_j⟩/(Γ·||g_j||), g_j its loss gradient at θ_{t−1}
(what step t clips): the privatised sum seen along the direction the canary moves it, in units of Γ. It costs the
canaries' gradient norms and one forward-mode pass over them per step. Its bound is the worst case at Γ: the
accounting of a point whose clipped gradient has norm Γ at every step, whatever the trajectory.
"""

import math

import numpy as np
import torch

from perinstance.persample import gradients
from perinstance.train import sampling
from perinstance.train.canaries import SETUP_KEY, canary_inclusions, sum_units
from perinstance.train.runs import RunConfig

MIN_CONSTANT_FEATURES = 16
INPUT_SCALE = 4.0
INCLUSION_KEY, DESIGN_KEY = 2, 3
ROWS_PER_PASS = 4096


def crafted_inputs(seed: int, count: int, train_x: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs shaped like the training inputs, labels): the canaries' crafted examples, from the run's seed alone."""
    rng = sampling.stream_rng(seed, sampling.CANARY_STREAM, SETUP_KEY, DESIGN_KEY)
    flat = train_x.reshape(len(train_x), -1)
    constant, squares = torch.ones(flat.shape[1], dtype=torch.bool), 0.0
    for start in range(0, len(flat), ROWS_PER_PASS):  # in row blocks: a large training set is never copied whole
        rows = flat[start:start + ROWS_PER_PASS]
        constant &= (rows == flat[0]).all(dim=0)
        squares += float(rows.double().square().sum())
    constant = torch.nonzero(constant).ravel().numpy()
    support = constant if constant.size >= MIN_CONSTANT_FEATURES else np.arange(flat.shape[1])
    amplitude = INPUT_SCALE * math.sqrt(squares / flat.numel())
    balanced = np.resize([1.0, -1.0], support.size)
    if support.size % 2:
        balanced[-1] = 0.0
    patterns = np.zeros((count, flat.shape[1]))
    patterns[:, support] = amplitude * rng.permuted(np.tile(balanced, (count, 1)), axis=1)
    labels = rng.integers(num_classes, size=count)
    return (torch.as_tensor(patterns, dtype=train_x.dtype).reshape(count, *train_x.shape[1:]),
            torch.as_tensor(labels, dtype=torch.int64))


class InputCanaries:
    """The input canaries of one run: their examples (appended to the training set) and their projections."""

    def __init__(self, run: RunConfig, train_x: torch.Tensor, device: torch.device) -> None:
        self.run = run
        self.included = canary_inclusions(run.seed, run.input_canaries, INCLUSION_KEY)
        inputs, labels = crafted_inputs(run.seed, run.input_canaries, train_x.cpu(), run.num_classes)
        self.inputs, self.labels = inputs.to(device), labels.to(device)

    def members(self, drawn: np.ndarray) -> np.ndarray:
        """The included canaries among those the sampler drew (indices 0..M−1)."""
        return drawn[self.included[drawn]]

    def project(self, model: torch.nn.Module, update: list, per_pass: int) -> torch.Tensor:
        """x of every canary at the model's current parameters θ_{t−1}, from step t's update (average units)."""
        tangent = [part * sum_units(self.run) for part in update]
        rows = []
        for span in gradients.batch_passes(len(self.labels), per_pass):
            inputs, labels = self.inputs[span], self.labels[span]
            norms = gradients.per_sample_norms(model, inputs, labels)[0]
            dots = gradients.directional_derivatives(model, inputs, labels, tangent)[0]
            rows.append(torch.where(norms > 0, dots / norms.clamp_min(torch.finfo(norms.dtype).tiny), 0.0))
        return torch.cat(rows)

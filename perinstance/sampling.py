"""Randomness of a run, reproducible per step from (seed, step) alone.

Deriving every step's batch and noise from (seed, stream, step) rather than from a
running generator means a resumed run needs no generator state to continue bitwise
identically, and any step's batch can be re-drawn later.
"""

import numpy as np
import torch

BATCH_STREAM = 0
NOISE_STREAM = 1
SENSITIVITY_STREAM = 2
INIT_STREAM = 3


def step_rng(seed, stream, step):
    """A numpy Generator for one (seed, stream, step)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), int(step)]))


def torch_generator(seed, stream, step, device="cpu"):
    """A torch Generator for one (seed, stream, step), on `device`."""
    state = np.random.SeedSequence([int(seed), int(stream), int(step)]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state[0]) << 32 | int(state[1]))
    return generator


def poisson_batch(seed, step, dataset_size, sample_rate):
    """Indices of the Poisson batch of `step`: each point in independently with prob q."""
    rng = step_rng(seed, BATCH_STREAM, step)
    return np.flatnonzero(rng.random(dataset_size) < sample_rate)

"""Every random draw of the project, reproducible from (seed, stream, key) alone, and its Poisson sampler.

Deriving each draw from (seed, stream, step or key) rather than from a running generator means
a resumed run needs no generator state to continue bitwise identically, any step's batch can be
re-drawn later, and a point's Monte-Carlo draws do not depend on the points measured with it.
Each consumer has its own stream, so that no draw replays another's.
"""

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# Training: each step's batch and noise, and the initial weights.
BATCH_STREAM = 0
NOISE_STREAM = 1
INIT_STREAM = 3
# The measurement's Monte Carlo (keys below), the audit's trials and the membership attack's draws.
SENSITIVITY_STREAM = 2
AUDIT_STREAM = 17
MEMBERSHIP_STREAM = 18
# The canaries of the one-run audit: their inclusions, directions and each step's sampling.
CANARY_STREAM = 19
# --points random:N.
POINTS_STREAM = 0x9017

# Keys within SENSITIVITY_STREAM, after the checkpoint's step: GLA's statistic's target batches
# and its sets of α batches, and the coupling's permutations.
RENYI_TARGET_KEY, RENYI_SET_KEY, COUPLING_KEY = 2, 3, 4
# Keys within AUDIT_STREAM, after the step: the simulated trials, the batches of the mean rule's
# upper bound, the random start of the whitening.
TRIAL_KEY, UPPER_KEY, WHITENING_KEY = 0, 1, 2


def stream_rng(seed: int, stream: int, *key: int) -> np.random.Generator:
    """A numpy Generator for one (seed, stream, key...)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), *map(int, key)]))


def init_seed(seed: int) -> int:
    """The seed of a run's initial weights (torch.manual_seed), from the run's seed alone."""
    return int(np.random.SeedSequence([int(seed), INIT_STREAM]).generate_state(1)[0])


def torch_generator(seed: int, stream: int, step: int, device: str = "cpu") -> "torch.Generator":
    """A torch Generator for one (seed, stream, step), on `device`."""
    import torch  # only training draws with torch; the accountants read the stream names without it

    state = np.random.SeedSequence([int(seed), int(stream), int(step)]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state[0]) << 32 | int(state[1]))
    return generator


def poisson_masks(rng: np.random.Generator, count: int, size: int, sample_rate: float) -> np.ndarray:
    """`count` independent Poisson_q subsets of range(size) as a boolean (count, size) mask: one
    uniform per index, in row-major order."""
    return rng.random((count, size)) < sample_rate


def poisson_batch(seed: int, step: int, dataset_size: int, sample_rate: float) -> np.ndarray:
    """Indices of the Poisson batch of training step `step`: each point in independently with prob q."""
    return np.flatnonzero(poisson_masks(stream_rng(seed, BATCH_STREAM, step), 1, dataset_size, sample_rate)[0])


def poisson_members(rng: np.random.Generator, count: int, size: int, sample_rate: float,
                    width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`count` independent Poisson_q subsets of range(size) as their members, for many batches at a
    small q (the audit's millions of trials), where one uniform per index would cost `size` draws
    per batch: the gaps between consecutive members of a Bernoulli(q) sequence are i.i.d.
    Geometric(q), so a batch costs about q·size + 1 draws. Gaps by inversion, ⌈log(1 − U)/log(1 − q)⌉
    with U uniform on [0, 1), `width` per batch and round (default: enough for all but a 1e-8
    fraction of batches), rounds until every batch has passed the end. Returns (members, sizes):
    the members of every batch in order, concatenated, and each batch's size."""
    if sample_rate <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(count, dtype=np.int64)
    mean = size * sample_rate
    width = width or max(8, int(mean + 6 * np.sqrt(mean) + 8))
    scale = 1 / np.log1p(-sample_rate) if sample_rate < 1 else 0.0

    def gaps():
        uniform = rng.random((count, width))
        np.log1p(-uniform, out=uniform)
        uniform *= scale
        return np.maximum(np.ceil(uniform), 1).astype(np.int64)

    positions = np.cumsum(gaps(), axis=1) - 1
    while np.any(positions[:, -1] < size):
        positions = np.concatenate([positions, np.cumsum(gaps(), axis=1) + positions[:, -1:]], axis=1)
    inside = positions < size
    return positions[inside], inside.sum(axis=1)


def members_mask(members: np.ndarray, sizes: np.ndarray, size: int) -> np.ndarray:
    """The boolean (batches, size) mask of batches given as (members, sizes)."""
    mask = np.zeros((len(sizes), size), dtype=bool)
    mask[np.repeat(np.arange(len(sizes)), sizes), members] = True
    return mask

"""White-box gradient canaries in a DP-SGD run, and their scores (docs/audit.md §1b).

`--canaries M --canary-norms 0.1,0.3,1`: M canaries in equal groups, one per norm c. Canary j has
a fixed random unit direction u_j in parameter space and is included in the run with probability
1/2 (its own seeded draw). An included canary is one more example for Poisson sampling: at every
step it is in the batch with probability q, independently of the real points, and then c·Γ·u_j is
added to the clipped-gradient sum as its transformed gradient (a point of sensitivity c·Γ, §1).
The score of canary j is Σ_t ⟨update_t, u_j⟩, the projection of every step's privatised update
on its direction, accumulated as training goes (white-box, all iterates).

u_j is supported on CANARY_SUPPORT random coordinates with random signs, 1/√k each: a random
unit direction that costs M·k numbers instead of M·d, whose overlap with another canary's or
with a gradient is as small as a dense one's on average.
"""

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from perinstance.errors import UsageError
from perinstance.files import fileio
from perinstance.train import sampling
from perinstance.train.runs import RunConfig

CANARY_SUPPORT = 64
CANARY_FILE = "canaries.csv"
# Keys within CANARY_STREAM: (SETUP_KEY, 0) the inclusions, (SETUP_KEY, 1) the directions,
# (SAMPLING_KEY, step) the canaries in each step's batch.
SETUP_KEY, SAMPLING_KEY = 0, 1


def parse_canary_norms(text: str | None) -> tuple[float, ...] | None:
    """--canary-norms: comma-separated c in (0, 1], the canary norms as multiples of Γ."""
    if text is None:
        return None
    try:
        norms = tuple(float(token) for token in text.split(","))
    except ValueError:
        raise UsageError("--canary-norms", f"expected numbers in (0, 1] separated by commas, got {text!r}") from None
    if not norms or not all(0 < norm <= 1 for norm in norms):
        raise UsageError("--canary-norms", f"every norm must be in (0, 1] (a multiple of the bound Γ), got {text!r}")
    return norms


def check_canary_flags(canaries: int | None, norms: tuple[float, ...] | None, private: bool) -> None:
    """--canaries M needs DP and M a positive multiple of the number of --canary-norms groups."""
    if canaries is None:
        if norms is not None:
            raise UsageError("--canary-norms", "needs --canaries")
        return
    if not private:
        raise UsageError("--canaries", "canaries audit a private run: drop --no-dp / --dp 0")
    groups = len(norms or (1.0,))
    if canaries <= 0 or canaries % groups:
        raise UsageError("--canaries", f"must be a positive multiple of the {groups} norm group(s), got {canaries}")


def canary_norms(count: int, norms: tuple[float, ...]) -> np.ndarray:
    """Each canary's norm c (a multiple of Γ): equal consecutive groups, one per norm."""
    return np.repeat(np.asarray(norms, dtype=float), count // len(norms))


def canary_inclusions(seed: int, count: int) -> np.ndarray:
    """Which canaries are in the run: each with probability 1/2, from the run's seed alone."""
    return sampling.stream_rng(seed, sampling.CANARY_STREAM, SETUP_KEY, 0).random(count) < 0.5


def canary_directions(seed: int, count: int, dimension: int) -> tuple[np.ndarray, np.ndarray]:
    """(coordinates, weights), each (count, k): u_j = Σ_i weights[j, i]·e_{coordinates[j, i]}, unit norm."""
    rng = sampling.stream_rng(seed, sampling.CANARY_STREAM, SETUP_KEY, 1)
    support = min(CANARY_SUPPORT, dimension)
    coordinates = np.stack([rng.choice(dimension, support, replace=False) for _ in range(count)])
    weights = rng.choice([-1.0, 1.0], size=(count, support)) / np.sqrt(support)
    return coordinates, weights


class Canaries:
    """The canaries of one run on its trainable parameters: their additions to the gradient sum and their scores."""

    def __init__(self, run: RunConfig, params: list, device: torch.device) -> None:
        self.run = run
        self.norms = canary_norms(run.canaries, run.canary_norms)
        self.included = canary_inclusions(run.seed, run.canaries)
        dimension = sum(param.numel() for param in params)
        coordinates, weights = canary_directions(run.seed, run.canaries, dimension)
        self.coordinates = torch.as_tensor(coordinates, device=device)
        self.weights = torch.as_tensor(weights, dtype=torch.float32, device=device)
        # On the device: read back only with a checkpoint, not at every step (see training.LOSS_READ_STEPS).
        self.scores = torch.zeros(run.canaries, dtype=torch.float64, device=device)

    def sampled(self, step: int) -> np.ndarray:
        """The included canaries in step `step`'s batch: Poisson with the run's q, their own stream."""
        drawn = sampling.stream_rng(self.run.seed, sampling.CANARY_STREAM, SAMPLING_KEY, step).random(self.run.canaries)
        return np.flatnonzero(self.included & (drawn < self.run.sample_rate))

    def add_to(self, summed: list, members: np.ndarray) -> None:
        """Add c_j·Γ·u_j of every canary in `members` to the transformed-gradient sum (in place)."""
        if not len(members):
            return
        flat = torch.cat([total.reshape(-1) for total in summed])
        scale = torch.as_tensor(self.norms[members] * self.run.clip_bound, dtype=flat.dtype, device=flat.device)
        chosen = torch.as_tensor(members, device=flat.device)
        flat.index_add_(0, self.coordinates[chosen].reshape(-1), (self.weights[chosen] * scale[:, None]).reshape(-1))
        for total, part in zip(summed, torch.split(flat, [total.numel() for total in summed])):
            total.copy_(part.reshape(total.shape))

    def score(self, update: list) -> None:
        """Add each canary's projection of this step's privatised update."""
        flat = torch.cat([part.reshape(-1) for part in update])
        self.scores += (flat[self.coordinates] * self.weights).sum(dim=1).double()

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"canary": np.arange(self.run.canaries), "norm": self.norms,
                             "included": self.included.astype(int), "score": self.scores.cpu().numpy()})


def write_canaries(run_dir: str, canaries: Canaries) -> None:
    """canaries.csv in the run folder: each canary's norm (×Γ), whether it was in, and its score."""
    fileio.write_csv(os.path.join(run_dir, CANARY_FILE), canaries.frame())


@dataclass(frozen=True)
class CanaryScores:
    """A run's canaries as read back: norm (×Γ), inclusion and score of each."""

    norms: np.ndarray
    included: np.ndarray
    scores: np.ndarray


def read_canaries(run_dir: str) -> CanaryScores:
    path = os.path.join(run_dir, CANARY_FILE)
    if not os.path.exists(path):
        raise UsageError("--run", f"{run_dir} has no {CANARY_FILE}: train it with --canaries M")
    frame = pd.read_csv(path)
    return CanaryScores(norms=frame["norm"].to_numpy(float), included=frame["included"].to_numpy().astype(bool),
                        scores=frame["score"].to_numpy(float))

"""Canaries of the one-run audit in a DP-SGD run, and what the run records of them (docs/audit.md §1b).

Two kinds, both drawn into the batches by the run's own Poisson sampler, as examples of the training set are:

- gradient canaries (`--canaries M --canary-norms 0.1,0.3,1`): M insertions into the noisy gradient sum, in equal
  groups, one per norm c. Canary j has a fixed random unit direction u_j and is in the run with probability 1/2;
  when the sampler draws it, c·Γ·u_j is added to the clipped-gradient sum, as the transformed gradient of a point
  of sensitivity c·Γ (§1). They skip the per-sample gradients and the clipping: they test the noise, the sampler
  and the accounting.
- input canaries (`--input-canaries M`, perinstance/train/input_canaries.py): crafted examples that go through the
  sampler, the per-sample gradients and the clipping like real points.

At every step t the run records, for every canary (in or out), x_t: the projection of the privatised sum ũ_t
(before the optimizer: momentum and Adam are post-processing) on the canary's unit direction, in units of Γ. The
projections of the steps since the last checkpoint are saved with it, so a resumed run ends with the same ones;
at the end they are written to canary_projections.npy (canaries × steps) and the per-canary scores to
canaries.csv.

u_j is supported on k <= CANARY_SUPPORT coordinates, ±1/√k each (canary_directions: orthogonal directions, Hadamard
rows on disjoint blocks of random coordinates, whenever M <= d): a random unit direction that costs M·k numbers
instead of M·d, whose overlap with a gradient is as small as a dense one's on average.
"""

import io
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy.linalg import hadamard

from perinstance.accounting.one_run_ideal import likelihood_ratio_scores, summed_scores
from perinstance.errors import UsageError
from perinstance.files import checkpoints, fileio
from perinstance.train import sampling
from perinstance.train.runs import RunConfig

CANARY_SUPPORT = 64
CANARY_FILE = "canaries.csv"
PROJECTION_FILE = "canary_projections.npy"
GRADIENT, INPUT = "gradient", "input"
# Keys within CANARY_STREAM: (SETUP_KEY, 0) the gradient canaries' inclusions, (SETUP_KEY, 1) their directions,
# (SETUP_KEY, 2) the input canaries' inclusions, (SETUP_KEY, 3) their inputs and labels.
SETUP_KEY = 0
# Checkpoint payload keys: the projections of the steps since the previous checkpoint (steps × canaries), and the
# first of those steps.
PROJECTIONS_KEY, FIRST_STEP_KEY = "canary_projections", "canary_first_step"


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


def check_canary_flags(canaries: int | None, norms: tuple[float, ...] | None, private: bool,
                       input_canaries: int | None = None) -> None:
    """--canaries M needs DP and M a positive multiple of the number of --canary-norms groups; --input-canaries M
    needs DP and M >= 2."""
    if input_canaries is not None:
        if not private:
            raise UsageError("--input-canaries", "canaries audit a private run: drop --no-dp / --dp 0")
        if input_canaries < 2:
            raise UsageError("--input-canaries", f"must be at least 2 (some in, some out), got {input_canaries}")
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


def canary_inclusions(seed: int, count: int, key: int = 0) -> np.ndarray:
    """Which canaries are in the run: each with probability 1/2, from the run's seed alone."""
    return sampling.stream_rng(seed, sampling.CANARY_STREAM, SETUP_KEY, key).random(count) < 0.5


@dataclass(frozen=True)
class CanaryBlocks:
    """Orthogonal canary directions (canary_directions, count <= dimension): disjoint blocks of k coordinates
    (coordinates (B, k)), a random sign per coordinate (signs (B, k)), and canary j the row row[j] of the k×k
    Hadamard matrix on block block[j]: u_j = Σ_i H[row_j, i]·signs[block_j, i]·e_{coordinates[block_j, i]}/√k."""

    coordinates: np.ndarray
    signs: np.ndarray
    block: np.ndarray
    row: np.ndarray

    @property
    def support(self) -> int:
        return self.coordinates.shape[1]


def canary_blocks(seed: int, count: int, dimension: int) -> CanaryBlocks | None:
    """The blocks of canary_directions, or None when there are more canaries than coordinates."""
    if count > dimension:
        return None
    rng = sampling.stream_rng(seed, sampling.CANARY_STREAM, SETUP_KEY, 1)
    support = CANARY_SUPPORT
    while -(-count // support) * support > dimension:
        support //= 2
    blocks = -(-count // support)
    coordinates = rng.permutation(dimension)[:blocks * support].reshape(blocks, support)
    signs = rng.choice([-1.0, 1.0], size=(blocks, support))
    slot = rng.permutation(blocks * support)[:count]  # (block, Hadamard row) of each canary
    return CanaryBlocks(coordinates=coordinates, signs=signs, block=slot // support, row=slot % support)


def canary_directions(seed: int, count: int, dimension: int) -> tuple[np.ndarray, np.ndarray]:
    """(coordinates, weights), each (count, k): u_j = Σ_i weights[j, i]·e_{coordinates[j, i]}, unit norm.

    With count <= dimension the directions are orthogonal, so that a canary's projection holds nothing of the
    others (which, each in the run at about q of the steps, would add a persistent offset to it): disjoint blocks
    of k random coordinates (k = CANARY_SUPPORT, or the largest power of two for which the blocks fit), each
    carrying k canaries as the rows of a k×k Hadamard matrix with a random sign per coordinate, 1/√k each. Each
    canary then spreads over k coordinates, so what the other points' gradients put on its direction is nearly the
    same for every canary. With more canaries than coordinates, each takes CANARY_SUPPORT random coordinates."""
    return directions_of(seed, count, dimension, canary_blocks(seed, count, dimension))


def directions_of(seed: int, count: int, dimension: int, blocks: CanaryBlocks | None) -> tuple[np.ndarray, np.ndarray]:
    """canary_directions from the run's canary_blocks (None: more canaries than coordinates)."""
    if blocks is None:
        rng = sampling.stream_rng(seed, sampling.CANARY_STREAM, SETUP_KEY, 1)
        support = min(CANARY_SUPPORT, dimension)
        coordinates = np.stack([rng.choice(dimension, support, replace=False) for _ in range(count)])
        return coordinates, rng.choice([-1.0, 1.0], size=(count, support)) / np.sqrt(support)
    rows = hadamard(blocks.support).astype(float)[blocks.row]
    return blocks.coordinates[blocks.block], rows * blocks.signs[blocks.block] / np.sqrt(blocks.support)


def sum_units(run: RunConfig) -> float:
    """The factor from the privatised update in average-gradient units (what the trainer hands the optimizer) to
    the privatised sum ũ in units of Γ: B_exp/Γ (for the mean rule, the same noise in those units, §1)."""
    return run.batch_size / run.clip_bound


class Canaries:
    """The gradient canaries of one run on its trainable parameters: their additions to the sum and projections."""

    def __init__(self, run: RunConfig, params: list, device: torch.device) -> None:
        self.run = run
        self.norms = canary_norms(run.canaries, run.canary_norms)
        # What a drawn canary adds, in units of Γ: its norm c, or 1/c under the planted fault inverted_norm
        # (runs.PLANTED_FAULTS, audit.py --self-test only).
        self.added_norms = 1 / self.norms if run.planted_fault == "inverted_norm" else self.norms
        self.included = canary_inclusions(run.seed, run.canaries)
        dimension = sum(param.numel() for param in params)
        blocks = canary_blocks(run.seed, run.canaries, dimension)
        coordinates, weights = directions_of(run.seed, run.canaries, dimension, blocks)
        self.coordinates = torch.as_tensor(coordinates, device=device)
        self.weights = torch.as_tensor(weights, dtype=torch.float32, device=device)
        # With orthogonal directions the projections are a Hadamard transform of each block's coordinates: k times
        # fewer values gathered than one gather per canary and coordinate.
        self.blocks = None if blocks is None else (
            torch.as_tensor(blocks.coordinates, device=device),
            torch.as_tensor(blocks.signs, dtype=torch.float32, device=device),
            torch.as_tensor(hadamard(blocks.support) / np.sqrt(blocks.support), dtype=torch.float32, device=device),
            torch.as_tensor(blocks.block, device=device), torch.as_tensor(blocks.row, device=device))

    def members(self, drawn: np.ndarray) -> np.ndarray:
        """The included canaries among those the sampler drew (indices 0..M−1)."""
        return drawn[self.included[drawn]]

    def add_to(self, summed: list, members: np.ndarray) -> None:
        """Add c_j·Γ·u_j of every canary in `members` to the transformed-gradient sum (in place)."""
        if not len(members):
            return
        flat = torch.cat([total.reshape(-1) for total in summed])
        scale = torch.as_tensor(self.added_norms[members] * self.run.clip_bound, dtype=flat.dtype, device=flat.device)
        chosen = torch.as_tensor(members, device=flat.device)
        flat.index_add_(0, self.coordinates[chosen].reshape(-1), (self.weights[chosen] * scale[:, None]).reshape(-1))
        for total, part in zip(summed, torch.split(flat, [total.numel() for total in summed])):
            total.copy_(part.reshape(total.shape))

    def project(self, update: list) -> torch.Tensor:
        """x of every canary at this step: ⟨ũ, u_j⟩/Γ from the update in average-gradient units."""
        flat = torch.cat([part.reshape(-1) for part in update])
        if self.blocks is None:
            return (flat[self.coordinates] * self.weights).sum(dim=1) * sum_units(self.run)
        coordinates, signs, transform, block, row = self.blocks
        return ((flat[coordinates] * signs) @ transform)[block, row] * sum_units(self.run)


class ProjectionLog:
    """Every canary's projection at every step since the last checkpoint (on the device: read back only with a
    checkpoint, see training.LOSS_READ_STEPS)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.first_step = 1

    def append(self, row: torch.Tensor) -> None:
        self.rows.append(row.float())

    def payload(self, step: int, count: int) -> dict:
        """The checkpoint's share: the rows of steps first_step..step; the log then starts at step + 1."""
        rows = torch.stack(self.rows).cpu() if self.rows else torch.zeros(0, count)
        saved = {PROJECTIONS_KEY: rows, FIRST_STEP_KEY: self.first_step}
        self.rows, self.first_step = [], step + 1
        return saved

    def restart(self, step: int) -> None:
        """Resumed from checkpoint `step`: the rows before it are in the checkpoints."""
        self.rows, self.first_step = [], step + 1


def gather_projections(run_dir: str, run: RunConfig, count: int) -> np.ndarray:
    """canaries × steps: the checkpoints' shares of the projections, in order; a one-line error unless they cover
    steps 1..T exactly once."""
    shares = []
    for step in checkpoints.saved_steps(run_dir):
        if step not in run.checkpoint_steps:
            continue
        payload = checkpoints.load_checkpoint(run_dir, step)
        if PROJECTIONS_KEY not in payload:
            raise UsageError("--save-name", f"{run_dir}: checkpoint {step} holds no canary projections (trained by "
                                            "an earlier version); delete the run folder and train it again")
        shares.append((int(payload[FIRST_STEP_KEY]), payload[PROJECTIONS_KEY].numpy()))
    shares.sort(key=lambda share: share[0])
    expected = 1
    for first, rows in shares:
        if first != expected or rows.shape[1:] != (count,):
            raise UsageError("--save-name", f"{run_dir}: the checkpoints' canary projections do not cover steps 1.."
                                            f"{run.total_steps} once; delete the run folder and train it again")
        expected += len(rows)
    if expected != run.total_steps + 1:
        raise UsageError("--save-name", f"{run_dir}: canary projections end at step {expected - 1}, not "
                                        f"{run.total_steps}; finish training the run")
    return np.concatenate([rows for _, rows in shares]).T


@dataclass(frozen=True)
class CanaryRecord:
    """A run's canaries as read back: kind (GRADIENT or INPUT), norm (×Γ; an input canary's bound is Γ),
    inclusion, and the projections (canaries × steps, units of Γ)."""

    kinds: np.ndarray
    norms: np.ndarray
    included: np.ndarray
    projections: np.ndarray

    def scores(self, run: RunConfig) -> pd.DataFrame:
        """canaries.csv: per canary, `score` Σ_t x_t (last-iterate) and `lr_score` the likelihood ratio (§11.10)."""
        ratio = np.empty(len(self.norms))
        for norm in np.unique(self.norms):
            group = self.norms == norm
            ratio[group] = likelihood_ratio_scores(self.projections[group], norm=norm,
                                                   noise_multiplier=run.noise_multiplier, sample_rate=run.sample_rate)
        return pd.DataFrame({"canary": np.arange(len(self.kinds)), "kind": self.kinds, "norm": self.norms,
                             "included": self.included.astype(int), "score": summed_scores(self.projections),
                             "lr_score": ratio})


def write_canaries(run_dir: str, run: RunConfig, record: CanaryRecord) -> None:
    """canary_projections.npy and canaries.csv in the run folder."""
    buffer = io.BytesIO()
    np.save(buffer, record.projections.astype(np.float32), allow_pickle=False)
    fileio.write_bytes(os.path.join(run_dir, PROJECTION_FILE), buffer.getvalue())
    fileio.write_csv(os.path.join(run_dir, CANARY_FILE), record.scores(run))


def read_canaries(run_dir: str) -> CanaryRecord:
    """The canaries of a trained run: canaries.csv and canary_projections.npy (a one-line error without them)."""
    table, projections = (os.path.join(run_dir, name) for name in (CANARY_FILE, PROJECTION_FILE))
    if not os.path.exists(table):
        raise UsageError("--run", f"{run_dir} has no {CANARY_FILE}: train it with --canaries M or --input-canaries M")
    frame = pd.read_csv(table)
    if "kind" not in frame or not os.path.exists(projections):
        raise UsageError("--run", f"{run_dir} was trained by an earlier version (no per-step canary projections); "
                                  "delete the run folder and train it again")
    with open(projections, "rb") as handle:
        steps = np.load(handle, allow_pickle=False)
    return CanaryRecord(kinds=frame["kind"].to_numpy(str), norms=frame["norm"].to_numpy(float),
                        included=frame["included"].to_numpy().astype(bool), projections=steps.astype(float))

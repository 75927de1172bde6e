"""Discretised privacy loss distributions and their composition on a circular grid (docs/accounting.md §8.1,
§8.3): the per-level PMFs of the Poisson-subsampled Gaussian, the Chernoff windows, the FFT composition
and the reading of ε off a composed PMF.

Pure: numpy, scipy and Google's dp_accounting; no torch and no I/O. dp_accounting builds the
discretised PLD of the Poisson-subsampled Gaussian (pessimistic connect-the-dots) once per
sensitivity level; this module composes them for every point at once:

- the per-level PMFs are folded onto one circular grid per chunk of points and transformed by a
  real FFT; composing is multiplying spectra, so a point's T steps are one product of
  (level spectrum)^(steps charged at that level);
- the window of the circular grid comes from a Chernoff bound on each point's composed PLD, and
  what may lie above it is added to the mass at +∞ (§8.3); mass below it folds upward;
- ε is read off the composed PMF as dp_accounting's get_epsilon_for_delta does.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_mechanism
from numpy.typing import ArrayLike
from scipy import fft, signal
from scipy.special import logsumexp

from perinstance.accounting import exact_eps_delta, numerics

# Length of one discretisation step of the privacy loss (dp_accounting's
# value_discretization_interval): the cost grows as 1/interval, the pessimism of the
# discretisation about linearly with it (docs/performance.md: its effect on ε at the quick run's mechanism).
DEFAULT_INTERVAL = 1e-3
DIRECTIONS = ("remove", "add")
# Mass, as a fraction of δ, that a Chernoff bound allows above (added to +∞) and below (folded
# upward) the window.
TAIL_SHARE = 1e-7
# Orders t of the Chernoff bounds P(L ≥ x) ≤ E[e^{tL}]·e^{−tx}, in units of 1/loss, both signs.
CHERNOFF_ORDERS = np.concatenate([-(2.0 ** np.arange(6, -6.1, -0.25)), 2.0 ** np.arange(-6, 6.1, 0.25)])
# Complex spectrum entries held at once (points × frequencies); 2^22 is 64 MiB per array.
CHUNK_ENTRIES = 2**22
# Rows of a chunk's composed spectrum exponentiated at once (_exp_spectrum).
EXP_ROWS = 32
# The FFT's rounding, allowed for by ROUNDING·sqrt(length)·steps at +∞ (§8.3: well above the
# measured Σ_bins |error|, which bounds the error of every δ(ε)).
ROUNDING = 2.0**-50
# Losses per block when ε is read off a composed PMF (epsilon_for_delta).
READ_BLOCK = 256
# A spectrum entry below this modulus is a zero (its logarithm would be −inf, and 0·(−inf) NaN).
SPECTRUM_FLOOR = 1e-300


@dataclass(frozen=True)
class LossPmf:
    """One direction of a discretised PLD: probs[i] is the mass at loss (lower + i)·interval, and
    infinity_mass the mass at +∞ (§8.1)."""

    lower: int
    probs: np.ndarray
    infinity_mass: float

    @property
    def upper(self) -> int:
        return self.lower + len(self.probs) - 1

    def log_mgf(self, orders: ArrayLike, interval: float) -> np.ndarray:
        """log E[e^{tL}; L finite] at each order t (Chernoff bounds of §8.3).

        Blocked: with i = b·a + r, Σ_i p_i e^{tℓ_i} = Σ_a e^{t(ℓ_0 + b·a·h)}·Σ_r p_{ba+r} e^{t·r·h}, the
        inner sums one matrix product (b small enough that e^{|t|·b·h} stays moderate)."""
        orders = np.asarray(orders, dtype=float)
        block = int(max(1, min(64, 8 / (np.max(np.abs(orders)) * interval))))
        blocks = -(-len(self.probs) // block)
        masses = np.zeros(blocks * block)
        masses[:len(self.probs)] = self.probs
        inner = masses.reshape(blocks, block) @ np.exp(np.outer(np.arange(block) * interval, orders))
        starts = (self.lower + block * np.arange(blocks)) * interval
        with np.errstate(divide="ignore"):
            return logsumexp(np.log(inner) + starts[:, None] * orders[None, :], axis=0)

    def folded(self, length: int) -> np.ndarray:
        """The masses on a circle of `length` bins: loss index i at i mod length."""
        positions = (self.lower + np.arange(len(self.probs))) % length
        return np.bincount(positions, weights=self.probs, minlength=length)


@dataclass(frozen=True)
class DirectionalEps:
    """Per point ε of each direction (§8.1): remove bounds D(P||Q), add D(Q||P)."""

    remove: np.ndarray
    add: np.ndarray

    @property
    def max(self) -> np.ndarray:
        return np.maximum(self.remove, self.add)


def _hockey_stick(eps, mu, sample_rate, direction):
    """δ(ε) of one direction of the subsampled Gaussian pair at every real ε (§3.3's formulas; at
    q = 1 both directions are the Gaussian's, and ε ≤ log(1−q) gives 1 − e^ε in the remove one)."""
    if direction == "add" and sample_rate < 1:
        return exact_eps_delta.delta_add(eps, mu, sample_rate)
    floor = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf
    with np.errstate(invalid="ignore"):
        delta = exact_eps_delta.delta_remove(np.maximum(eps, floor + 1e-12), mu, sample_rate)
    return np.where(eps <= floor, -np.expm1(eps), delta)


def _connect_the_dots(noise_multiplier, sample_rate, interval, direction):
    """dp_accounting's pessimistic connect-the-dots PMF of one direction, as its
    from_gaussian_mechanism builds it (same losses, same discretiser), with the δ(ε) at the grid
    losses from §3.3's vectorised formulas instead of its per-loss Python loop."""
    adjacency = {"remove": privacy_loss_mechanism.AdjacencyType.REMOVE,
                 "add": privacy_loss_mechanism.AdjacencyType.ADD}[direction]
    bounds = privacy_loss_mechanism.GaussianPrivacyLoss(
        noise_multiplier, sensitivity=1.0, pessimistic_estimate=True, sampling_prob=sample_rate,
        adjacency_type=adjacency).connect_dots_bounds()
    lower = math.floor(bounds.epsilon_lower / interval)
    upper = math.ceil(bounds.epsilon_upper / interval)
    deltas = np.clip(_hockey_stick(np.arange(lower, upper + 1) * interval, 1.0 / noise_multiplier, sample_rate,
                                   direction), 0.0, 1.0)
    dense = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(interval, lower, upper, deltas).to_dense_pmf()
    # dp_accounting's public API gives no access to the masses.
    return LossPmf(lower=int(dense._lower_loss), probs=np.asarray(dense._probs, dtype=float),
                   infinity_mass=float(dense._infinity_mass))


def subsampled_gaussian_pmfs(noise_multipliers: ArrayLike, sample_rate: float,
                             interval: float = DEFAULT_INTERVAL) -> dict[str, list[LossPmf]]:
    """§8.1: {direction: [LossPmf per level]}, the pessimistic PLD of one step of the subsampled
    Gaussian with sensitivity 1 and noise std z (as dp_accounting.from_gaussian_mechanism builds
    it). z = inf (sensitivity 0) and q = 0 cost nothing: the PLD is a point mass at loss 0."""
    numerics.check_sample_rate(sample_rate)
    _check_interval(interval)
    pmfs = {direction: [] for direction in DIRECTIONS}
    for noise_multiplier in np.asarray(noise_multipliers, dtype=float):
        if not noise_multiplier > 0:
            raise ValueError(f"noise multiplier must be > 0, not {noise_multiplier!r}")
        for direction in DIRECTIONS:
            pmfs[direction].append(LossPmf(lower=0, probs=np.ones(1), infinity_mass=0.0)
                                   if np.isinf(noise_multiplier) or sample_rate == 0
                                   else _connect_the_dots(noise_multiplier, sample_rate, interval, direction))
    return pmfs


def epsilon_for_delta(probs: ArrayLike, first: ArrayLike, interval: float, infinity_mass: ArrayLike,
                      delta: float) -> np.ndarray:
    """The smallest ε ≥ 0 with δ(ε) = m_∞ + Σ_i p_i·(1 − e^{ε − ℓ_i})_+ ≤ δ, row by row (§8.1).

    probs (n, m): masses at the losses ℓ_i = (first + i)·interval, first ≥ 0 (masses below loss 0
    never count for ε ≥ 0); infinity_mass (n,). Negative masses (FFT rounding) count as 0.
    Returns (n,): ε, inf where m_∞ > δ.

    δ(ℓ_i) = m_∞ + A_i − e^{ℓ_i}·W_i with A_i = Σ_{j>i} p_j and W_i = Σ_{j>i} p_j·e^{−ℓ_j} is
    nonincreasing in i. It is first evaluated at the starts of blocks of READ_BLOCK losses, then
    in full inside the one block where it crosses δ; between ℓ_{i−1} and ℓ_i it is linear in e^ε.
    """
    probs = np.asarray(probs, dtype=float)
    rows, columns = probs.shape
    blocks = -(-(first + columns) // READ_BLOCK)
    masses = np.zeros((rows, blocks * READ_BLOCK))
    np.maximum(probs, 0.0, out=masses[:, first:first + columns])  # in place: no second copy of a chunk's PMFs
    masses = masses.reshape(rows, blocks, READ_BLOCK)
    infinity_mass = np.asarray(infinity_mass, dtype=float)
    # Within a block: e^{−(ℓ_j − ℓ_start)}; across blocks: e^{−READ_BLOCK·interval}.
    within = np.exp(-interval * np.arange(READ_BLOCK))
    across = math.exp(-interval * READ_BLOCK)
    block_mass = masses.sum(axis=2)
    block_discounted = masses @ within
    # Tails from the next block's start on: mass, and discounted to that start.
    mass_after = (np.cumsum(block_mass[:, ::-1], axis=1) - block_mass[:, ::-1])[:, ::-1]
    discounted_after = signal.lfilter([0.0, 1.0], [1.0, -across], block_discounted[:, ::-1], axis=1)[:, ::-1]
    at_starts = (infinity_mass[:, None] + mass_after + block_mass - masses[:, :, 0]
                 - (block_discounted - masses[:, :, 0] + across * discounted_after))
    crossing = np.maximum((at_starts > delta).sum(axis=1) - 1, 0)  # the last block starting above δ
    index = np.arange(rows)
    inside = masses[index, crossing]
    # Inside that block, for each loss: the masses above it in the block, then the block's tail.
    inside_above = np.cumsum(inside[:, ::-1], axis=1)[:, ::-1] - inside
    inside_discounted = signal.lfilter([0.0, math.exp(-interval)], [1.0, -math.exp(-interval)], inside[:, ::-1],
                                       axis=1)[:, ::-1]
    above = infinity_mass[:, None] + mass_after[index, crossing][:, None] + inside_above
    discounted = inside_discounted + (np.exp(-interval * (READ_BLOCK - np.arange(READ_BLOCK)))[None, :]
                                      * discounted_after[index, crossing][:, None])
    met = above - discounted <= delta
    offset = np.where(met.any(axis=1), np.argmax(met, axis=1), READ_BLOCK)
    grid_index = crossing * READ_BLOCK + offset  # the smallest grid loss with δ(ℓ) ≤ δ
    previous = np.maximum(offset - 1, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        between = (crossing * READ_BLOCK + previous) * interval + np.log(
            (above[index, previous] - delta) / np.maximum(discounted[index, previous], 1e-300))
    eps = np.clip(between, (grid_index - 1) * interval, grid_index * interval)
    eps = np.where((grid_index == 0) | (at_starts[:, 0] <= delta), 0.0, eps)
    return np.where(infinity_mass <= delta, eps, np.inf)


def window_bounds(log_mgf: ArrayLike, hard_lower: ArrayLike, hard_upper: ArrayLike, interval: float,
                  tail_mass: float) -> tuple[np.ndarray, np.ndarray]:
    """Per point, loss indices [lower, upper] outside which the composed finite mass is at most
    tail_mass on each side, from log E[e^{tS}] at CHERNOFF_ORDERS (n, orders), within the hard
    support [hard_lower, hard_upper]."""
    with np.errstate(over="ignore", invalid="ignore"):
        bound = (log_mgf + math.log(1 / tail_mass)) / CHERNOFF_ORDERS / interval
    positive = CHERNOFF_ORDERS > 0
    upper = np.min(np.where(np.isfinite(bound[:, positive]), bound[:, positive], np.inf), axis=1)
    lower = np.max(np.where(np.isfinite(bound[:, ~positive]), bound[:, ~positive], -np.inf), axis=1)
    upper = np.minimum(np.ceil(upper), hard_upper)
    lower = np.maximum(np.floor(lower), hard_lower)
    return lower.astype(np.int64), upper.astype(np.int64)


def mass_above(log_mgf: ArrayLike, hard_upper: ArrayLike, window_upper: ArrayLike, interval: float) -> np.ndarray:
    """Chernoff bound on the composed finite mass above loss index window_upper (0 when the
    support ends there)."""
    positive = CHERNOFF_ORDERS > 0
    exponent = log_mgf[:, positive] - CHERNOFF_ORDERS[positive] * (window_upper + 1) * interval
    bound = np.exp(np.min(exponent, axis=1))
    return np.where(hard_upper <= window_upper, 0.0, np.minimum(bound, 1.0))


def chunks(lower: ArrayLike, upper: ArrayLike) -> Iterator[tuple[np.ndarray, int, int]]:
    """Points ordered by window width, in runs that fit CHUNK_ENTRIES; each with its window."""
    order = np.argsort(upper - lower, kind="stable")
    start = 0
    while start < len(order):
        stop = start + 1
        window_lower, window_upper = lower[order[start]], upper[order[start]]
        while stop < len(order):
            new_lower = min(window_lower, lower[order[stop]])
            new_upper = max(window_upper, upper[order[stop]])
            if (stop + 1 - start) * (new_upper - new_lower + 1) // 2 > CHUNK_ENTRIES:
                break
            window_lower, window_upper = new_lower, new_upper
            stop += 1
        yield order[start:stop], int(window_lower), int(window_upper)
        start = stop


def read_window(composed: ArrayLike, window_lower: ArrayLike, interval: float, infinity_mass: ArrayLike,
                delta: float) -> np.ndarray:
    """ε per row of circular composed PMFs (loss index s at s mod length), whose window starts at
    loss index window_lower."""
    length = composed.shape[1]
    first = max(window_lower, 0)
    start = first % length
    stop = start + window_lower + length - first  # the window's top, one circle later at most
    window = composed[:, start:stop] if stop <= length else np.concatenate(
        [composed[:, start:], composed[:, :stop - length]], axis=1)
    return epsilon_for_delta(window, first, interval, infinity_mass, delta)


def level_spectra(pmfs: list[LossPmf], used: ArrayLike, length: int) -> np.ndarray:
    """rfft of each used level's PMF folded on a circle of `length` bins."""
    folded = np.stack([pmfs[level].folded(length) for level in used])
    return fft.rfft(folded, axis=1)


def _log_spectra(spectra):
    """log of spectra as (real, imaginary) parts; moduli below SPECTRUM_FLOOR count as the floor."""
    return np.log(np.maximum(np.abs(spectra), SPECTRUM_FLOOR)), np.angle(spectra)


def _exp_spectrum(log_modulus, phase):
    """exp(log_modulus + i·phase), 0 where the modulus is below e^{−700} (0 for every purpose; much
    of a composed spectrum is, and exp is slow on the way to underflow). Elementwise, EXP_ROWS rows at a
    time: the same values, with the temporaries of a few rows rather than of the whole chunk (six times its
    size)."""
    spectrum = np.zeros(log_modulus.shape, dtype=complex)
    for start in range(0, len(log_modulus), EXP_ROWS):
        rows = slice(start, start + EXP_ROWS)
        alive = log_modulus[rows] > -700.0
        modulus = np.exp(log_modulus[rows][alive])
        angle = phase[rows][alive]
        spectrum[rows][alive] = modulus * np.cos(angle) + 1j * (modulus * np.sin(angle))
    return spectrum


def compose_counts(pmfs: list[LossPmf], counts: ArrayLike, interval: float, delta: float) -> np.ndarray:
    """ε of one direction for points whose composition charges counts[p, ℓ] steps to level ℓ
    (§8.3): S = Σ_ℓ counts·L_ℓ, spectrum exp(counts @ log F_ℓ)."""
    orders_mgf = np.stack([pmf.log_mgf(CHERNOFF_ORDERS, interval) for pmf in pmfs])
    log_finite = np.log1p(-np.array([pmf.infinity_mass for pmf in pmfs]))
    lowers = np.array([pmf.lower for pmf in pmfs])
    uppers = np.array([pmf.upper for pmf in pmfs])
    counts = np.asarray(counts, dtype=float)
    log_mgf = counts @ orders_mgf
    hard_lower, hard_upper = counts @ lowers, counts @ uppers
    lower, upper = window_bounds(log_mgf, hard_lower, hard_upper, interval, TAIL_SHARE * delta)
    eps = np.empty(len(counts))
    for members, window_lower, window_upper in chunks(lower, upper):
        length = fft.next_fast_len(int(window_upper - window_lower + 1), real=True)
        used = np.flatnonzero(counts[members].any(axis=0))
        modulus, phase = _log_spectra(level_spectra(pmfs, used, length))
        chunk_counts = counts[members][:, used]
        infinity_mass = (-np.expm1(chunk_counts @ log_finite[used])
                         + ROUNDING * math.sqrt(length) * counts[members].sum(axis=1)
                         + mass_above(log_mgf[members], hard_upper[members], window_upper, interval))
        # The composed PMFs are read at once, not kept into the next chunk's spectra.
        eps[members] = read_window(fft.irfft(_exp_spectrum(chunk_counts @ modulus, chunk_counts @ phase), n=length,
                                             axis=1), window_lower, interval, infinity_mass, delta)
    return eps


def _check_interval(interval):
    if not (interval > 0 and math.isfinite(interval)):
        raise ValueError(f"interval must be finite and > 0, not {interval!r}")

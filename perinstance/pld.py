"""Per-instance ε of a training run by privacy loss distributions (docs/accounting.md §8).

Pure: numpy, scipy and Google's dp_accounting; no torch and no I/O. dp_accounting builds the
discretised PLD of the Poisson-subsampled Gaussian (pessimistic connect-the-dots) once per
sensitivity level; this module composes them for every point at once:

- the per-level PMFs are folded onto one circular grid per chunk of points and transformed by a
  real FFT; composing is multiplying spectra, so a point's T steps are one product of
  (level spectrum)^(steps charged at that level) (sum rule: a matrix product of the step counts
  with the log-spectra) or of (mixture spectrum)^(steps of the segment) (mean rule);
- the window of the circular grid comes from a Chernoff bound on each point's composed PLD, and
  what may lie above it is added to the mass at +∞ (§8.3); mass below it folds upward;
- ε is read off the composed PMF as dp_accounting's get_epsilon_for_delta does.
"""

import math
from dataclasses import dataclass

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_mechanism
from scipy import fft, signal
from scipy.special import logsumexp

from perinstance import accounting

# Length of one discretisation step of the privacy loss (dp_accounting's
# value_discretization_interval): the cost grows as 1/interval, the pessimism of the
# discretisation about linearly with it (README: its effect on ε at the quick run's mechanism).
DEFAULT_INTERVAL = 1e-3
DIRECTIONS = ("remove", "add")
# Mass, as a fraction of δ, that a Chernoff bound allows above (added to +∞) and below (folded
# upward) the window.
TAIL_SHARE = 1e-7
# Orders t of the Chernoff bounds P(L ≥ x) ≤ E[e^{tL}]·e^{−tx}, in units of 1/loss, both signs.
CHERNOFF_ORDERS = np.concatenate([-(2.0 ** np.arange(6, -6.1, -0.25)), 2.0 ** np.arange(-6, 6.1, 0.25)])
# Complex spectrum entries held at once (points × frequencies); 2^22 is 64 MiB per array.
CHUNK_ENTRIES = 2**22
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
    def upper(self):
        return self.lower + len(self.probs) - 1

    def log_mgf(self, orders, interval):
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

    def folded(self, length):
        """The masses on a circle of `length` bins: loss index i at i mod length."""
        positions = (self.lower + np.arange(len(self.probs))) % length
        return np.bincount(positions, weights=self.probs, minlength=length)


@dataclass(frozen=True)
class DirectionalEps:
    """Per point ε of each direction (§8.1): remove bounds D(P||Q), add D(Q||P)."""

    remove: np.ndarray
    add: np.ndarray

    @property
    def max(self):
        return np.maximum(self.remove, self.add)


def _hockey_stick(eps, mu, sample_rate, direction):
    """δ(ε) of one direction of the subsampled Gaussian pair at every real ε (§3.3's formulas; at
    q = 1 both directions are the Gaussian's, and ε ≤ log(1−q) gives 1 − e^ε in the remove one)."""
    if direction == "add" and sample_rate < 1:
        return accounting.delta_add(eps, mu, sample_rate)
    floor = math.log1p(-sample_rate) if sample_rate < 1 else -math.inf
    with np.errstate(invalid="ignore"):
        delta = accounting.delta_remove(np.maximum(eps, floor + 1e-12), mu, sample_rate)
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


def subsampled_gaussian_pmfs(noise_multipliers, sample_rate, interval=DEFAULT_INTERVAL):
    """§8.1: {direction: [LossPmf per level]}, the pessimistic PLD of one step of the subsampled
    Gaussian with sensitivity 1 and noise std z (as dp_accounting.from_gaussian_mechanism builds
    it). z = inf (sensitivity 0) and q = 0 cost nothing: the PLD is a point mass at loss 0."""
    accounting._check_sample_rate(sample_rate)
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


# --- reading ε off a composed PMF ------------------------------------------------------------

def epsilon_for_delta(probs, first, interval, infinity_mass, delta):
    """The smallest ε ≥ 0 with δ(ε) = m_∞ + Σ_i p_i·(1 − e^{ε − ℓ_i})_+ ≤ δ, row by row (§8.1).

    probs (n, m): masses at the losses ℓ_i = (first + i)·interval, first ≥ 0 (masses below loss 0
    never count for ε ≥ 0); infinity_mass (n,). Negative masses (FFT rounding) count as 0.
    Returns (n,): ε, inf where m_∞ > δ.

    δ(ℓ_i) = m_∞ + A_i − e^{ℓ_i}·W_i with A_i = Σ_{j>i} p_j and W_i = Σ_{j>i} p_j·e^{−ℓ_j} is
    nonincreasing in i. It is first evaluated at the starts of blocks of READ_BLOCK losses, then
    in full inside the one block where it crosses δ; between ℓ_{i−1} and ℓ_i it is linear in e^ε.
    """
    probs = np.maximum(np.asarray(probs, dtype=float), 0.0)
    rows, columns = probs.shape
    blocks = -(-(first + columns) // READ_BLOCK)
    masses = np.zeros((rows, blocks * READ_BLOCK))
    masses[:, first:first + columns] = probs
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


# --- windows (§8.3) ----------------------------------------------------------------------------

def _window_bounds(log_mgf, hard_lower, hard_upper, interval, tail_mass):
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


def _mass_above(log_mgf, hard_upper, window_upper, interval):
    """Chernoff bound on the composed finite mass above loss index window_upper (0 when the
    support ends there)."""
    positive = CHERNOFF_ORDERS > 0
    exponent = log_mgf[:, positive] - CHERNOFF_ORDERS[positive] * (window_upper + 1) * interval
    bound = np.exp(np.min(exponent, axis=1))
    return np.where(hard_upper <= window_upper, 0.0, np.minimum(bound, 1.0))


def _chunks(lower, upper):
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


def _read_window(composed, window_lower, interval, infinity_mass, delta):
    """ε per row of circular composed PMFs (loss index s at s mod length), whose window starts at
    loss index window_lower."""
    length = composed.shape[1]
    first = max(window_lower, 0)
    start = first % length
    stop = start + window_lower + length - first  # the window's top, one circle later at most
    window = composed[:, start:stop] if stop <= length else np.concatenate(
        [composed[:, start:], composed[:, :stop - length]], axis=1)
    return epsilon_for_delta(window, first, interval, infinity_mass, delta)


def _level_spectra(pmfs, used, length):
    """rfft of each used level's PMF folded on a circle of `length` bins."""
    folded = np.stack([pmfs[level].folded(length) for level in used])
    return fft.rfft(folded, axis=1)


def _log_spectra(spectra):
    """log of spectra as (real, imaginary) parts; moduli below SPECTRUM_FLOOR count as the floor."""
    return np.log(np.maximum(np.abs(spectra), SPECTRUM_FLOOR)), np.angle(spectra)


def _exp_spectrum(log_modulus, phase):
    """exp(log_modulus + i·phase), 0 where the modulus is below e^{−700} (0 for every purpose; most
    of a composed spectrum is, and exp is slow on the way to underflow)."""
    spectrum = np.zeros(log_modulus.shape, dtype=complex)
    alive = log_modulus > -700.0
    modulus = np.exp(log_modulus[alive])
    angle = phase[alive]
    spectrum[alive] = modulus * np.cos(angle) + 1j * (modulus * np.sin(angle))
    return spectrum


def _compose_counts(pmfs, counts, interval, delta):
    """ε of one direction for points whose composition charges counts[p, ℓ] steps to level ℓ
    (§8.3): S = Σ_ℓ counts·L_ℓ, spectrum exp(counts @ log F_ℓ)."""
    orders_mgf = np.stack([pmf.log_mgf(CHERNOFF_ORDERS, interval) for pmf in pmfs])
    log_finite = np.log1p(-np.array([pmf.infinity_mass for pmf in pmfs]))
    lowers = np.array([pmf.lower for pmf in pmfs])
    uppers = np.array([pmf.upper for pmf in pmfs])
    counts = np.asarray(counts, dtype=float)
    log_mgf = counts @ orders_mgf
    hard_lower, hard_upper = counts @ lowers, counts @ uppers
    lower, upper = _window_bounds(log_mgf, hard_lower, hard_upper, interval, TAIL_SHARE * delta)
    eps = np.empty(len(counts))
    for members, window_lower, window_upper in _chunks(lower, upper):
        length = fft.next_fast_len(int(window_upper - window_lower + 1), real=True)
        used = np.flatnonzero(counts[members].any(axis=0))
        modulus, phase = _log_spectra(_level_spectra(pmfs, used, length))
        chunk_counts = counts[members][:, used]
        composed = fft.irfft(_exp_spectrum(chunk_counts @ modulus, chunk_counts @ phase), n=length, axis=1)
        infinity_mass = (-np.expm1(chunk_counts @ log_finite[used])
                         + ROUNDING * math.sqrt(length) * counts[members].sum(axis=1)
                         + _mass_above(log_mgf[members], hard_upper[members], window_upper, interval))
        eps[members] = _read_window(composed, window_lower, interval, infinity_mass, delta)
    return eps


def _check_interval(interval):
    if not (interval > 0 and math.isfinite(interval)):
        raise ValueError(f"interval must be finite and > 0, not {interval!r}")


# --- §8.2: the sum rule ------------------------------------------------------------------------

def segment_counts(checkpoint_steps, total_steps):
    """§4: the number of steps charged to each checkpoint (the latest one ≤ t−1 for step t), and to
    the worst case before the first one: (counts per checkpoint (C,), steps before the first)."""
    counts = np.zeros(len(checkpoint_steps), dtype=np.int64)
    before_first = 0
    for first, last, checkpoint in accounting.step_segments(checkpoint_steps, total_steps):
        if checkpoint is None:
            before_first += last - first + 1
        else:
            counts[checkpoint] += last - first + 1
    return counts, before_first


def sum_rule_eps(sensitivity_ratio, checkpoint_steps, total_steps, *, sample_rate, noise_multiplier, delta,
                 rounding=0.01, interval=DEFAULT_INTERVAL):
    """§8.2: per point ε at δ of the T steps of the sum rule, composed by PLD, both directions.

    sensitivity_ratio (P, C): Δ*/Γ per point at each checkpoint (checkpoint_steps, sorted); step t
    uses the latest checkpoint ≤ t−1 and the steps before the first use Γ. Each Δ*/Γ is rounded up
    to a multiple of `rounding` (accounting.sensitivity_levels); the point's PLD is
    ⊗_c PLD(q, σ·Γ/Δ_c)^{⊗ n_c} at dp_accounting's discretisation `interval`.
    """
    accounting._check_probability("delta", delta)
    accounting._check_noise(noise_multiplier)
    ratio = np.asarray(sensitivity_ratio, dtype=float)
    if ratio.ndim != 2 or ratio.shape[1] != len(checkpoint_steps):
        raise ValueError(f"sensitivity_ratio must be (points, {len(checkpoint_steps)} checkpoints), "
                         f"not {ratio.shape}")
    if np.any(~(ratio >= 0)):
        raise ValueError("sensitivity_ratio must be >= 0 (and not NaN)")
    ratio = np.minimum(ratio, 1.0)
    steps, before_first = segment_counts(checkpoint_steps, total_steps)
    levels = accounting.sensitivity_levels(rounding, ratio)
    level = np.searchsorted(levels, ratio, side="left")
    counts = np.zeros((len(ratio), len(levels)))
    np.add.at(counts, (np.repeat(np.arange(len(ratio)), ratio.shape[1]), level.ravel()),
              np.tile(steps, len(ratio)))
    counts[:, -1] += before_first
    # Points with the same steps at every level have the same PLD: compose each once.
    distinct, position = np.unique(counts, axis=0, return_inverse=True)
    with np.errstate(divide="ignore"):
        pmfs = subsampled_gaussian_pmfs(noise_multiplier / levels, sample_rate, interval)
    eps = {direction: _compose_counts(pmfs[direction], distinct, interval, delta)[position.reshape(-1)]
           for direction in DIRECTIONS}
    return DirectionalEps(**eps)


# --- §8.4: the mean rule -----------------------------------------------------------------------

def step_law(sensitivities, log_weights, log_mass, *, dominate):
    """§8.4: the per-step mixture over components (sizes or Δ_B samples) as a probability law.

    w_j = exp(log_weights_j − log_mass) over the present components (NaN sensitivity: absent).
    dominate=False (estimate, baseline): the w_j are the conditional law itself; they must sum to 1.
    dominate=True (certified): the w_j are upper bounds u_j on the true conditional probabilities
    (Σ u_j ≥ 1); the law takes u_j from the largest sensitivity down until the mass reaches 1,
    which stochastically dominates every law below the u_j. Rows whose log-weights are NaN (a
    component without data) give NaN. Returns weights of the same shape.
    """
    sensitivities = np.asarray(sensitivities, dtype=float)
    weights = np.exp(np.broadcast_to(np.asarray(log_weights, dtype=float), sensitivities.shape) - log_mass)
    weights = np.where(np.isnan(sensitivities), 0.0, weights)
    missing = np.isnan(weights).any(axis=-1, keepdims=True)
    weights = np.nan_to_num(weights)
    if dominate:
        order = np.argsort(-np.nan_to_num(sensitivities, nan=-np.inf), axis=-1, kind="stable")
        ordered = np.take_along_axis(weights, order, axis=-1)
        before = np.cumsum(ordered, axis=-1) - ordered
        law = np.empty_like(weights)
        np.put_along_axis(law, order, np.clip(1.0 - before, 0.0, ordered), axis=-1)
        short = ~missing[..., 0] & (weights.sum(axis=-1) < 1 - 1e-9)
        if short.any():
            raise ValueError(f"weight bounds sum to {weights.sum(axis=-1)[short].min():.6g} < 1; they cannot bound a "
                             "probability law")
    else:
        law = weights
        total = weights.sum(axis=-1)
        wrong = ~missing[..., 0] & ~np.isclose(total, 1.0, rtol=0, atol=1e-9)
        if wrong.any():
            raise ValueError(f"weights sum to {total[wrong][0]:.12g}, not 1 (log_mass must be the log of their sum)")
    return np.where(missing, np.nan, law)


def estimate_log_weights(sample_sizes, grid_sizes, grid_log_weights):
    """§3.2 stratified estimate as a mixture: each sample of size k weighs π_k/n_k, with n_k the
    samples of its row at that size (sample_sizes (..., S), NaN: absent). Rows with a grid size
    without samples give NaN (their estimate is undefined, as in the RDP path)."""
    sample_sizes = np.asarray(sample_sizes, dtype=float)
    grid_sizes = np.asarray(grid_sizes)
    column = np.searchsorted(grid_sizes, np.nan_to_num(sample_sizes, nan=-1))
    present = ~np.isnan(sample_sizes)
    on_grid = present & (column < len(grid_sizes))
    on_grid[on_grid] &= grid_sizes[column[on_grid]] == sample_sizes[on_grid]
    if np.any(present & ~on_grid):
        raise ValueError("sample sizes must be grid sizes")
    safe_column = np.where(on_grid, column, 0)
    flat = safe_column.reshape(-1, sample_sizes.shape[-1])
    counts = np.stack([np.bincount(row[mask], minlength=len(grid_sizes))
                       for row, mask in zip(flat, on_grid.reshape(flat.shape))]).reshape(
        *sample_sizes.shape[:-1], len(grid_sizes))
    with np.errstate(divide="ignore"):
        per_sample = np.asarray(grid_log_weights, dtype=float)[safe_column] - np.log(
            np.take_along_axis(counts, safe_column, axis=-1))
    log_weights = np.where(on_grid, per_sample, -np.inf)
    return np.where((counts == 0).any(axis=-1, keepdims=True), np.nan, log_weights)


def mean_rule_eps(sensitivities, weights, checkpoint_steps, total_steps, *, sample_rate, noise_std, delta,
                  delta_fail, before_first=None, relative_step=1e-2, interval=DEFAULT_INTERVAL):
    """§8.4: per point ε at δ of the T steps of the mean rule, composed by PLD, both directions.

    sensitivities (P, C, S): per point, checkpoint and mixture component (size k or Δ_B sample;
    NaN: absent) the sensitivity in the update's units; weights (P, C, S): the per-step law of
    the components (step_law). Step t uses the latest checkpoint ≤ t−1; the steps before the first
    checkpoint use before_first = (sensitivities (S',), weights (S',)) (the baseline). The point's
    per-step PLD is Σ_j w_j·PLD(q, s/Δ_j) (the PLD of the revealed-component pair), Δ rounded up
    onto a geometric grid of ratio 1 + relative_step; the composed PLD is converted at
    δ − T·delta_fail. Points whose weights are NaN give NaN.
    """
    accounting._check_probability("delta", delta)
    accounting._check_positive("noise_std", noise_std)
    if not 0 <= delta_fail < 1:
        raise ValueError(f"delta_fail must be in [0, 1), not {delta_fail!r}")
    sensitivities = np.asarray(sensitivities, dtype=float)
    weights = np.broadcast_to(np.asarray(weights, dtype=float), sensitivities.shape)
    if sensitivities.ndim != 3 or sensitivities.shape[1] != len(checkpoint_steps):
        raise ValueError(f"sensitivities must be (points, {len(checkpoint_steps)} checkpoints, components), "
                         f"not {sensitivities.shape}")
    if np.any(sensitivities < 0):
        raise ValueError("sensitivities must be >= 0")
    steps, before = segment_counts(checkpoint_steps, total_steps)
    points = len(sensitivities)
    if before:
        if before_first is None:
            raise ValueError(f"the steps before the first checkpoint ({checkpoint_steps[0]}) need before_first")
        first_sensitivities, first_weights = (np.asarray(value, dtype=float)[None, None, :] for value in before_first)
        width = max(sensitivities.shape[2], first_sensitivities.shape[2])
        sensitivities = np.concatenate([_pad(sensitivities, width, np.nan), np.broadcast_to(
            _pad(first_sensitivities, width, np.nan), (points, 1, width))], axis=1)
        weights = np.concatenate([_pad(weights, width, 0.0), np.broadcast_to(
            _pad(first_weights, width, 0.0), (points, 1, width))], axis=1)
        steps = np.append(steps, before)
    charged = steps > 0
    sensitivities, weights, steps = sensitivities[:, charged], weights[:, charged], steps[charged]
    budget = delta - total_steps * delta_fail
    eps = DirectionalEps(remove=np.full(points, np.nan), add=np.full(points, np.nan))
    defined = ~np.isnan(weights).any(axis=(1, 2))
    if budget <= 0:
        eps.remove[defined] = np.inf
        eps.add[defined] = np.inf
        return eps
    mu = np.where(weights > 0, sensitivities / noise_std, np.nan)[defined]
    levels = accounting.geometric_levels(mu, relative_step)
    level = np.searchsorted(levels, np.nan_to_num(mu), side="left")
    mixture = np.where(np.isnan(mu), 0.0, weights[defined])
    with np.errstate(divide="ignore"):
        pmfs = subsampled_gaussian_pmfs(1.0 / levels, sample_rate, interval)
    for direction in DIRECTIONS:
        getattr(eps, direction)[defined] = _compose_mixtures(pmfs[direction], level, mixture, steps, interval,
                                                             budget)
    return eps


def _pad(array, width, value):
    """The last axis padded to `width` with `value` (absent components: NaN sensitivity, weight 0)."""
    missing = width - array.shape[-1]
    return np.concatenate([array, np.full((*array.shape[:-1], missing), value)], axis=-1) if missing else array


def _integer_power(spectrum, exponent):
    """spectrum**exponent for an integer exponent ≥ 1 by repeated squaring: a few complex products,
    no logarithm."""
    result = None
    square = spectrum
    while exponent:
        if exponent & 1:
            result = square.copy() if result is None else result * square
        exponent >>= 1
        if exponent:
            square = square * square
    return result


def _compose_mixtures(pmfs, level, mixture, steps, interval, delta):
    """ε of one direction for points whose step in segment g has the PLD Σ_j mixture[p, g, j]·PLD of
    level[p, g, j], for steps[g] steps (§8.4): spectrum Π_g (Σ_j w_j F_ℓj)^{n_g}."""
    orders_mgf = np.stack([pmf.log_mgf(CHERNOFF_ORDERS, interval) for pmf in pmfs])
    infinity = np.array([pmf.infinity_mass for pmf in pmfs])
    lowers = np.array([pmf.lower for pmf in pmfs])
    uppers = np.array([pmf.upper for pmf in pmfs])
    used_component = mixture > 0
    points = len(level)
    log_mgf = np.empty((points, len(CHERNOFF_ORDERS)))
    chunk_points = max(1, CHUNK_ENTRIES // (level.shape[1] * level.shape[2] * len(CHERNOFF_ORDERS)))
    for start in range(0, points, chunk_points):
        part = slice(start, start + chunk_points)
        with np.errstate(divide="ignore"):
            terms = np.log(mixture[part])[..., None] + orders_mgf[level[part]]
        log_mgf[part] = (steps[None, :, None] * logsumexp(terms, axis=2)).sum(axis=1)
    hard_upper = (steps * np.where(used_component, uppers[level], np.iinfo(np.int64).min).max(axis=2)).sum(axis=1)
    hard_lower = (steps * np.where(used_component, lowers[level], np.iinfo(np.int64).max).min(axis=2)).sum(axis=1)
    log_finite = (steps * np.log1p(-(mixture * infinity[level]).sum(axis=2))).sum(axis=1)
    lower, upper = _window_bounds(log_mgf, hard_lower, hard_upper, interval, TAIL_SHARE * delta)
    eps = np.empty(points)
    for members, window_lower, window_upper in _chunks(lower, upper):
        length = fft.next_fast_len(int(window_upper - window_lower + 1), real=True)
        used, position = np.unique(level[members], return_inverse=True)
        position = position.reshape(level[members].shape)
        spectra = _level_spectra(pmfs, used, length)
        spectrum = None
        for segment, count in enumerate(steps):
            weights = np.zeros((len(members), len(used)))
            np.add.at(weights, (np.repeat(np.arange(len(members)), level.shape[2]),
                                position[:, segment].ravel()), mixture[members, segment].ravel())
            step = _integer_power(weights @ spectra.real + 1j * (weights @ spectra.imag), int(count))
            spectrum = step if spectrum is None else spectrum * step
        composed = fft.irfft(spectrum, n=length, axis=1)
        infinity_mass = (-np.expm1(log_finite[members]) + ROUNDING * math.sqrt(length) * steps.sum()
                         + _mass_above(log_mgf[members], hard_upper[members], window_upper, interval))
        eps[members] = _read_window(composed, window_lower, interval, infinity_mass, delta)
    return eps

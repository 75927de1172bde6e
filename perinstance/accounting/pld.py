"""Per-instance ε of a training run by privacy loss distributions (docs/accounting.md §8.2, §8.4): the sum
rule (a matrix product of the step counts with the log-spectra of pld_grid) and the mean rule (the
mixture spectrum of each segment raised to the segment's steps).

Pure: numpy, scipy and Google's dp_accounting; no torch and no I/O.
"""

import math

import numpy as np
from numpy.typing import ArrayLike
from scipy import fft
from scipy.special import logsumexp

from perinstance.accounting import certified_radius, numerics, rdp_composition
from perinstance.accounting.pld_grid import (
    CHERNOFF_ORDERS,
    CHUNK_ENTRIES,
    DEFAULT_INTERVAL,
    DIRECTIONS,
    ROUNDING,
    TAIL_SHARE,
    DirectionalEps,
    chunks,
    compose_counts,
    level_spectra,
    mass_above,
    read_window,
    subsampled_gaussian_pmfs,
    window_bounds,
)


def segment_counts(checkpoint_steps: ArrayLike, total_steps: int) -> tuple[np.ndarray, int]:
    """§4: the number of steps charged to each checkpoint (the latest one ≤ t−1 for step t), and to
    the worst case before the first one: (counts per checkpoint (C,), steps before the first)."""
    counts = np.zeros(len(checkpoint_steps), dtype=np.int64)
    before_first = 0
    for first, last, checkpoint in rdp_composition.step_segments(checkpoint_steps, total_steps):
        if checkpoint is None:
            before_first += last - first + 1
        else:
            counts[checkpoint] += last - first + 1
    return counts, before_first


def sum_rule_eps(sensitivity_ratio: ArrayLike, checkpoint_steps: ArrayLike, total_steps: int, *, sample_rate: float,
                 noise_multiplier: float, delta: float,
                 rounding: float = 0.01, interval: float = DEFAULT_INTERVAL) -> DirectionalEps:
    """§8.2: per point ε at δ of the T steps of the sum rule, composed by PLD, both directions.

    sensitivity_ratio (P, C): Δ*/Γ per point at each checkpoint (checkpoint_steps, sorted); step t
    uses the latest checkpoint ≤ t−1 and the steps before the first use Γ. Each Δ*/Γ is rounded up
    to a multiple of `rounding` (rdp_composition.sensitivity_levels); the point's PLD is
    ⊗_c PLD(q, σ·Γ/Δ_c)^{⊗ n_c} at dp_accounting's discretisation `interval`.
    """
    numerics.check_probability("delta", delta)
    numerics.check_noise(noise_multiplier)
    ratio = np.asarray(sensitivity_ratio, dtype=float)
    if ratio.ndim != 2 or ratio.shape[1] != len(checkpoint_steps):
        raise ValueError(f"sensitivity_ratio must be (points, {len(checkpoint_steps)} checkpoints), "
                         f"not {ratio.shape}")
    if np.any(~(ratio >= 0)):
        raise ValueError("sensitivity_ratio must be >= 0 (and not NaN)")
    ratio = np.minimum(ratio, 1.0)
    steps, before_first = segment_counts(checkpoint_steps, total_steps)
    levels = rdp_composition.sensitivity_levels(rounding, ratio)
    level = np.searchsorted(levels, ratio, side="left")
    counts = np.zeros((len(ratio), len(levels)))
    np.add.at(counts, (np.repeat(np.arange(len(ratio)), ratio.shape[1]), level.ravel()),
              np.tile(steps, len(ratio)))
    counts[:, -1] += before_first
    # Points with the same steps at every level have the same PLD: compose each once.
    distinct, position = np.unique(counts, axis=0, return_inverse=True)
    with np.errstate(divide="ignore"):
        pmfs = subsampled_gaussian_pmfs(noise_multiplier / levels, sample_rate, interval)
    eps = {direction: compose_counts(pmfs[direction], distinct, interval, delta)[position.reshape(-1)]
           for direction in DIRECTIONS}
    return DirectionalEps(**eps)


def step_law(sensitivities: ArrayLike, log_weights: ArrayLike, log_mass: ArrayLike, *, dominate: bool) -> np.ndarray:
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


def estimate_log_weights(sample_sizes: ArrayLike, grid_sizes: ArrayLike, grid_log_weights: ArrayLike) -> np.ndarray:
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


def mean_rule_eps(sensitivities: ArrayLike, weights: ArrayLike, checkpoint_steps: ArrayLike, total_steps: int, *,
                  sample_rate: float, noise_std: float, delta: float, delta_fail: float,
                  before_first: tuple[ArrayLike, ArrayLike] | None = None, relative_step: float = 1e-2,
                  interval: float = DEFAULT_INTERVAL) -> DirectionalEps:
    """§8.4: per point ε at δ of the T steps of the mean rule, composed by PLD, both directions.

    sensitivities (P, C, S): per point, checkpoint and mixture component (size k or Δ_B sample;
    NaN: absent) the sensitivity in the update's units; weights (P, C, S): the per-step law of
    the components (step_law). Step t uses the latest checkpoint ≤ t−1; the steps before the first
    checkpoint use before_first = (sensitivities (S',), weights (S',)) (the baseline). The point's
    per-step PLD is Σ_j w_j·PLD(q, s/Δ_j) (the PLD of the revealed-component pair), Δ rounded up
    onto a geometric grid of ratio 1 + relative_step; the composed PLD is converted at
    δ − T·delta_fail. Points whose weights are NaN give NaN.
    """
    numerics.check_probability("delta", delta)
    numerics.check_positive("noise_std", noise_std)
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
    levels = certified_radius.geometric_levels(mu, relative_step)
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
    lower, upper = window_bounds(log_mgf, hard_lower, hard_upper, interval, TAIL_SHARE * delta)
    eps = np.empty(points)
    for members, window_lower, window_upper in chunks(lower, upper):
        length = fft.next_fast_len(int(window_upper - window_lower + 1), real=True)
        used, position = np.unique(level[members], return_inverse=True)
        position = position.reshape(level[members].shape)
        spectra = level_spectra(pmfs, used, length)
        spectrum = None
        for segment, count in enumerate(steps):
            weights = np.zeros((len(members), len(used)))
            np.add.at(weights, (np.repeat(np.arange(len(members)), level.shape[2]),
                                position[:, segment].ravel()), mixture[members, segment].ravel())
            step = _integer_power(weights @ spectra.real + 1j * (weights @ spectra.imag), int(count))
            spectrum = step if spectrum is None else spectrum * step
        composed = fft.irfft(spectrum, n=length, axis=1)
        infinity_mass = (-np.expm1(log_finite[members]) + ROUNDING * math.sqrt(length) * steps.sum()
                         + mass_above(log_mgf[members], hard_upper[members], window_upper, interval))
        eps[members] = read_window(composed, window_lower, interval, infinity_mass, delta)
    return eps

"""§7 of docs/accounting.md: the concentration radius of a uniform k-subset's mean, its failure allocation
over sizes and the certified mixture, held against closed forms (Bernstein, Bennett, McDiarmid), a direct
evaluation of the tail bound with mpmath, and Monte Carlo over adversarial populations."""

import math

import mpmath
import numpy as np
import pytest
from scipy import optimize, stats

from perinstance.accounting import batch_sizes, certified_radius, exact_eps_delta


def bernstein_radius(spread, deviation, size, failure):
    """§7.2 closed form: sqrt(2v·log(2/β)/k) + 2b·log(2/β)/(3k)."""
    log_term = math.log(2 / failure)
    return math.sqrt(2 * spread * log_term / size) + 2 * deviation * log_term / (3 * size)


def bennett_radius(spread, deviation, size, failure):
    """§7.2: t/k with 2·exp(−(kv/b²)·h(tb/(kv))) = β, h(u) = (1+u)·log(1+u) − u, by brentq."""
    target = math.log(2 / failure) * deviation**2 / (size * spread)
    ratio = optimize.brentq(lambda u: (1 + u) * math.log1p(u) - u - target, 0.0, 1e12, xtol=1e-14, rtol=1e-14)
    return ratio * spread / deviation


def mcdiarmid_radius(spread, deviation, size, failure):
    return math.sqrt(spread / size) + deviation * math.sqrt(2 * math.log(1 / failure) / size)


def pinelis_tail(spread, deviation, size, radius):
    """§7.2 at 40 digits: min over λ of (1 + (v/b²)·(e^{λb} − 1 − λb))^k / cosh(λ·k·r), λ by golden section."""
    mpmath.mp.dps = 40
    ratio, size, length = mpmath.mpf(spread) / deviation**2, mpmath.mpf(size), mpmath.mpf(size * radius) / deviation

    def log_bound(log_lambda):
        scaled = mpmath.exp(log_lambda)
        return size * mpmath.log1p(ratio * (mpmath.expm1(scaled) - scaled)) - mpmath.log(mpmath.cosh(scaled * length))

    low, high = mpmath.mpf(-12), mpmath.mpf(6)
    golden = (mpmath.sqrt(5) - 1) / 2
    for _ in range(200):
        left, right = high - golden * (high - low), low + golden * (high - low)
        if log_bound(left) <= log_bound(right):
            high = right
        else:
            low = left
    return float(mpmath.exp(log_bound((low + high) / 2)))


CASES = [(spread, deviation, size, failure) for spread, deviation in ((0.967, 1.02), (0.3, 1.0), (1e-3, 1.0),
                                                                       (1e-6, 2.0), (1.0, 1.0))
         for size in (1, 7, 64, 3000) for failure in (0.5, 1e-3, 1e-9)]


@pytest.mark.parametrize("spread, deviation, size, failure", CASES)
def test_radius_never_above_the_closed_forms(spread, deviation, size, failure):
    radius = float(certified_radius.concentration_radius([spread], [deviation], size, failure)[0])
    assert 0 < radius <= deviation
    assert radius <= mcdiarmid_radius(spread, deviation, size, failure) * (1 + 1e-12)
    assert radius <= bennett_radius(spread, deviation, size, failure) * (1 + 1e-9)
    assert radius <= bernstein_radius(spread, deviation, size, failure) * (1 + 1e-12)


@pytest.mark.parametrize("spread, deviation, size, failure", CASES)
def test_radius_is_where_the_tail_bound_reaches_the_failure(spread, deviation, size, failure):
    """Where Pinelis's radius is the smaller one, the tail bound evaluated at it is β (the smallest such radius,
    up to the rounding of v/b² by 1e-4); otherwise the radius is McDiarmid's or b."""
    radius = float(certified_radius.concentration_radius([spread], [deviation], size, failure)[0])
    others = min(mcdiarmid_radius(spread, deviation, size, failure), deviation)
    if radius < others * (1 - 1e-9):
        assert pinelis_tail(spread, deviation, size, radius) <= failure * (1 + 1e-9)
        assert pinelis_tail(spread, deviation, size, radius * (1 - 1e-3)) > failure
    else:
        assert radius == pytest.approx(others, rel=1e-12)


def test_radius_is_monotone():
    sizes = np.arange(1, 400)
    for failure in (0.3, 1e-4, 1e-12):
        radius = certified_radius.concentration_radius([0.4], [1.0], sizes, failure)[0]
        assert np.all(np.diff(radius) <= 1e-15)
    levels = np.geomspace(0.99, 1e-15, 60)
    for size in (1, 30, 1000):
        radius = certified_radius.concentration_radius([0.4], [1.0], size, levels)[0]
        assert np.all(np.diff(radius) >= -1e-15)
    spreads = np.linspace(1e-4, 1.0, 50)
    radius = certified_radius.concentration_radius(spreads, np.ones(50), 40, 1e-6)
    assert np.all(np.diff(radius) >= -1e-15)
    # An upper bound on b_X (what compute_sensitivity.py records) gives a larger radius: still a bound.
    deviations = np.linspace(0.6, 3.0, 50)
    for size, failure in ((1, 0.5), (40, 1e-6), (2000, 1e-12)):
        radius = certified_radius.concentration_radius(np.full(50, 0.3), deviations, size, failure)
        assert np.all(np.diff(radius) >= -1e-15)
    assert float(certified_radius.concentration_radius([0.0], [0.0], 10, 1e-6)[0]) == 0


# --- Monte Carlo: identity 6 on adversarial populations ---------------------------------------

def far_point(rng):
    """Every point at 0 but one at distance 10: a subset that holds the far point is far from the mean."""
    points = np.zeros((200, 3))
    points[0] = [10.0, 0.0, 0.0]
    return points


def heavy_spread(rng):
    """Points at ±1 on one axis: the variance is as large as the bound allows (v = b²)."""
    return np.sign(rng.uniform(-1, 1, 300))[:, None] * np.array([[1.0, 0.0]])


def high_dimension(rng):
    """Random directions in 2,000 dimensions, a few of them long."""
    points = rng.normal(size=(400, 2000))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    points[:5] *= 6
    return points


def two_clusters(rng):
    """A big tight cluster and a small one far away, both with some spread."""
    return np.concatenate([rng.normal(0, 0.05, (270, 5)), 3 + rng.normal(0, 0.05, (30, 5))])


@pytest.mark.parametrize("population", [far_point, heavy_spread, high_dimension, two_clusters])
def test_radius_fails_at_most_at_its_rate_on_adversarial_populations(population):
    """||m(B) − μ|| > r_k(β) over uniform k-subsets happens at a rate <= β (binomial margin), at the tail levels
    of the certified mixture; and the radius is no wider than the population allows by more than the tail
    bound's slack (a radius at half its value is exceeded more often than β somewhere)."""
    rng = np.random.default_rng(population.__name__.__len__())
    points = population(rng)
    center = points.mean(axis=0)
    deviations = np.linalg.norm(points - center, axis=1)
    spread, largest = np.mean(deviations**2), deviations.max()
    trials = 4000
    levels = np.array([0.5, 0.2, 0.05, 0.01])
    exceeded_at_half = False
    for size in (1, 5, 20, 60):
        means = np.stack([points[rng.choice(len(points), size, replace=False)].mean(axis=0) for _ in range(trials)])
        distances = np.linalg.norm(means - center, axis=1)
        radius = certified_radius.concentration_radius([spread], [largest], size, levels)[0]
        counts = np.sum(distances[:, None] > radius[None, :], axis=0)
        assert np.all(counts <= stats.binom.ppf(0.999, trials, levels)), (size, counts / trials, levels)
        exceeded_at_half |= bool(np.any(np.mean(distances[:, None] > 0.5 * radius[None, :], axis=0) > levels))
    assert exceeded_at_half


# --- §7.3, §7.4: failure allocation and the certified mixture ----------------------------------

def test_size_failures_spend_the_budget_front_loaded():
    n, rate = 511, 0.125
    k_min = batch_sizes.size_threshold(n, rate, 1e-7)
    grid = batch_sizes.size_grid(n, rate, k_min, 64)
    log_weights = batch_sizes.lumped_size_log_weights(grid, n, rate)
    mass = np.exp(log_weights)
    for failure in (1e-9, 1e-7, 1e-3):
        failures = certified_radius.size_failures(log_weights, failure)
        assert np.all(failures > 0) and np.all(failures <= certified_radius.SIZE_FAILURE_CAP)
        spent = mass * failures
        assert np.sum(spent) <= failure and np.sum(spent) == pytest.approx(failure, rel=1e-6)
        uncapped = failures < certified_radius.SIZE_FAILURE_CAP
        # Shares ∝ 1/(j+1) among the sizes that are not capped.
        index = np.flatnonzero(uncapped)
        np.testing.assert_allclose(spent[index] * (index + 1), spent[index[0]] * (index[0] + 1), rtol=1e-9)
    # A budget no size can use up: every size at the cap, within the budget.
    failures = certified_radius.size_failures(np.log([1e-3, 1e-3]), 0.5)
    np.testing.assert_array_equal(failures, certified_radius.SIZE_FAILURE_CAP)


def test_certified_mixture_weights_and_levels():
    """Per size, the levels' weights sum to the size's probability; each component is certified_sensitivity at
    its tail β_j^{(l/L)²}; one level is the single radius at β_j; size 0 gets Γ and no failure mass."""
    n, rate = 99, 0.05
    sizes = np.arange(0, 15)
    log_weights = batch_sizes.lumped_size_log_weights(sizes, n, rate)
    statistics = ([0.3, 1.2], [0.2, 0.5], [0.9, 1.1])
    bound, component_log_weights, component_sizes = certified_radius.certified_mixture(*statistics, 1.0, sizes, log_weights,
                                                                                1e-4, levels=5)
    assert bound.shape == (2, 15 * 5) and list(component_sizes) == list(np.repeat(sizes, 5))
    per_size = np.exp(component_log_weights).reshape(15, 5).sum(axis=1)
    np.testing.assert_allclose(per_size, np.exp(log_weights), rtol=1e-12)
    failures = certified_radius.size_failures(np.where(sizes > 0, log_weights, -np.inf), 1e-4)
    assert failures[0] == certified_radius.SIZE_FAILURE_CAP  # size 0 spends nothing: Π_0·β_0 is not charged
    assert np.sum(np.exp(log_weights[1:]) * failures[1:]) <= 1e-4
    tails = failures[:, None] ** ((np.arange(1, 6) / 5) ** 2)[None, :]
    expected = certified_radius.certified_sensitivity(*statistics, 1.0, sizes[:, None], tails)
    np.testing.assert_allclose(bound, expected.reshape(2, -1), rtol=1e-12)
    np.testing.assert_array_equal(bound[:, :5], 1.0)
    single, single_log_weights, _ = certified_radius.certified_mixture(*statistics, 1.0, sizes, log_weights, 1e-4, levels=1)
    np.testing.assert_allclose(single, certified_radius.certified_sensitivity(*statistics, 1.0, sizes, failures), rtol=1e-12)
    np.testing.assert_allclose(single_log_weights, log_weights)


def test_dominant_size_sums_the_levels():
    log_terms = np.log([[0.3, 0.3, 0.5, 1e-300], [0.1, 0.1, 0.05, 0.6]])
    assert list(certified_radius.dominant_size(log_terms, np.array([4, 4, 7, 7]))) == [4, 7]


def test_more_levels_never_loosen_the_bound_much_and_beat_one():
    """The mixture's (ε, δ) with 16 levels is far below the single-radius version on a population with v ≈ b²
    (the synthetic MLP's first checkpoint) and within a few percent of 64 levels."""
    n, rate, noise_std = 511, 0.125, 1 / 64
    k_min = batch_sizes.size_threshold(n, rate, 1e-7)
    delta_size = batch_sizes.size_failure(n, rate, k_min)
    grid = batch_sizes.size_grid(n, rate, k_min, 64)
    log_weights = batch_sizes.lumped_size_log_weights(grid, n, rate)
    statistics = ([0.985], [0.967], [1.02])

    def eps(levels):
        bound, weights, _ = certified_radius.certified_mixture(*statistics, 1.0, grid, log_weights, delta_size,
                                                               levels=levels)
        return float(exact_eps_delta.per_step_eps(bound / noise_std, 1e-5, rate, np.exp(weights), 2 * delta_size)[0])

    baseline = float(exact_eps_delta.per_step_eps(certified_radius.baseline_mean_sensitivity(1.0, grid)[None, :] / noise_std,
                                                  1e-5, rate, np.exp(log_weights), delta_size)[0])
    one, sixteen, many = eps(1), eps(16), eps(64)
    assert many <= sixteen <= one < baseline
    assert sixteen < 0.6 * baseline and sixteen <= 1.05 * many

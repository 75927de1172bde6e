"""The accountants' mathematics (perinstance/accounting/) against docs/accounting.md §6 and
against independent computations: numerical integration, mpmath, Google's dp-accounting."""

import itertools
import math

import dp_accounting
import mpmath
import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy.optimize import brentq
from scipy.special import logsumexp

from perinstance.accounting import batch_sizes, certified_radius, exact_eps_delta, rdp_composition, renyi_step

ORDERS = np.array([1.5, 2, 2.5, 3, 4.5, 8, 16, 32, 64])


# --- independent references -----------------------------------------------------------------

def quadrature_rdp(sample_rate, noise_multiplier, order):
    """RDP_SGM by direct numerical integration of E_Q[(P/Q)^λ], P = (1−q)N(0,z²) + qN(1,z²),
    Q = N(0,z²) (Mironov et al. 2019, Thm 4: this direction dominates)."""
    z = noise_multiplier
    grid = np.linspace(-30 * z - 3, order + 30 * z + 3, 200_001)
    log_q = -grid**2 / (2 * z * z) - 0.5 * math.log(2 * math.pi * z * z)
    log_ratio = np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + (2 * grid - 1) / (2 * z * z))
    return (logsumexp(log_q + order * log_ratio) + math.log(grid[1] - grid[0])) / (order - 1)


def mpmath_gaussian_eps(ratio, delta):
    """Analytic Gaussian ε (Balle & Wang 2018) by bisection at 40 digits."""
    mpmath.mp.dps = 40
    ratio = mpmath.mpf(ratio)

    def excess(eps):
        return (mpmath.ncdf(ratio / 2 - eps / ratio) - mpmath.exp(eps) * mpmath.ncdf(-ratio / 2 - eps / ratio)
                - delta)

    low, high = mpmath.mpf(0), ratio**2 / 2 + ratio * 12 + 1
    if excess(low) <= 0:
        return 0.0
    for _ in range(120):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return float(high)


def dp_accounting_rdp(sample_rate, noise_multiplier, orders, steps=1):
    accountant = dp_accounting.rdp.RdpAccountant(list(orders))
    event = dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    accountant.compose(event, steps)
    return np.asarray(accountant._rdp)  # the RDP curve; dp-accounting has no public getter


# --- §3.1 sum rule: identities 1 and 2 ------------------------------------------------------

@pytest.mark.parametrize("sample_rate, noise_multiplier", [(0.01, 1.0), (0.1, 2.0), (1.0, 0.8)])
def test_sum_rule_at_clip_bound_is_opacus(sample_rate, noise_multiplier):
    # Identity 1 (the rows are per point; Γ = 3 must cancel).
    rdp = renyi_step.rdp_sum_rule([3.0, 3.0], 3.0, noise_multiplier, sample_rate, ORDERS)
    opacus = renyi_step.opacus_rdp.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                               orders=list(ORDERS))
    # Opacus sums the same terms one at a time: equal to the rounding of a different summation order.
    np.testing.assert_allclose(rdp, [opacus, opacus], rtol=1e-9)


@pytest.mark.parametrize("sample_rate, noise_multiplier", [(0.004, 0.7), (0.05, 1.3), (0.5, 4.0)])
def test_sum_rule_zero_monotone_and_below_baseline(sample_rate, noise_multiplier):
    # Identity 2.
    clip_bound = 2.0
    norms = np.linspace(0, clip_bound, 21)
    orders = np.array([1.1, 1.5, 2, 2.5, 3.7, 8, 12.5, 32, 100.5, 256])
    rdp = renyi_step.rdp_sum_rule(norms, clip_bound, noise_multiplier, sample_rate, orders)
    baseline = renyi_step.rdp_sgm(sample_rate, noise_multiplier, orders)
    assert np.all(rdp[0] == 0)
    slack = 1e-9 * np.abs(rdp) + 1e-15
    assert np.all(np.diff(rdp, axis=0) >= -slack[1:]), "not nondecreasing in the norm"
    assert np.all(np.diff(rdp, axis=1) >= -slack[:, 1:]), "not nondecreasing in the order"
    assert np.all(rdp <= baseline * (1 + 1e-12))
    np.testing.assert_allclose(rdp[-1], baseline, rtol=1e-12)


@pytest.mark.parametrize("sample_rate, noise_multiplier", [(0.01, 1.0), (0.1, 0.8), (0.05, 5.0)])
def test_sum_rule_matches_dp_accounting(sample_rate, noise_multiplier):
    # Second library: Δ* = Γ/2 is the subsampled Gaussian with noise multiplier 2σ. Integer
    # orders only: at fractional ones dp-accounting's series stops early (1% high at q=0.1,
    # z=1.6, λ=2.5, where Opacus matches quadrature; the range test below covers them).
    orders = [2, 3, 5, 8, 16, 32, 64, 128, 256]
    rdp = renyi_step.rdp_sum_rule([0.5], 1.0, noise_multiplier, sample_rate, orders)[0]
    np.testing.assert_allclose(rdp, dp_accounting_rdp(sample_rate, 2 * noise_multiplier, orders), rtol=1e-9)


# --- numerical range ------------------------------------------------------------------------

@pytest.mark.parametrize("sample_rate", [1e-4, 1e-3, 0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("noise_multiplier", [0.3, 1.0, 5.0, 20.0])
def test_rdp_sgm_range_valid_and_close(sample_rate, noise_multiplier):
    orders = np.array([1.1, 1.5, 2, 2.5, 7.3, 32.5, 49.13, 64, 100.7, 255.5, 256])
    with np.errstate(all="raise"):
        rdp = renyi_step.rdp_sgm(sample_rate, noise_multiplier, orders)
    assert np.all(np.isfinite(rdp)) and np.all(rdp >= 0)
    assert np.all(np.diff(rdp) >= -1e-9 * rdp[1:] - 1e-15)
    reference = np.array([quadrature_rdp(sample_rate, noise_multiplier, order) if sample_rate < 1
                          else order / (2 * noise_multiplier**2) for order in orders])
    # Never below the exact value (a bound may only be rounded up), and close to it; both sides
    # carry ~1e-11 of rounding in log A = (λ−1)·ρ, which matters only for tiny ρ.
    rounding = 1e-10 / (orders - 1)
    assert np.all(rdp >= reference * (1 - 1e-6) - rounding)
    assert np.all(rdp <= reference * 1.01 + rounding)


def test_opacus_fractional_failure_is_replaced_by_a_bound():
    # Opacus's own series gives a negative value here; the guard must not pass it on.
    raw = renyi_step.opacus_rdp.compute_rdp(q=0.5, noise_multiplier=20.0, steps=1, orders=49.13)
    assert raw < 0
    guarded = renyi_step.rdp_sgm(0.5, 20.0, [49.13])[0]
    exact = quadrature_rdp(0.5, 20.0, 49.13)
    assert exact <= guarded <= exact * 1.001


# --- §3.3 (ε, δ): identity 3 ----------------------------------------------------------------

@pytest.mark.parametrize("ratio, delta", [(1.0, 1e-5), (0.1, 1e-5), (5.0, 1e-3), (30.0, 1e-8), (1e-3, 0.3),
                                          (0.7, 1e-12)])
def test_analytic_gaussian_matches_mpmath(ratio, delta):
    eps = exact_eps_delta.gaussian_eps(np.array([2 * ratio]), 2.0, delta)[0]
    reference = mpmath_gaussian_eps(ratio, delta)
    assert eps == pytest.approx(reference, rel=1e-9, abs=1e-12)
    assert eps >= reference - 1e-12, "bisection must return the safe end"


def test_gaussian_eps_edges_and_classic():
    assert np.all(exact_eps_delta.gaussian_eps(np.array([0.0, 0.0]), 1.0, 1e-5) == 0)
    # δ above the mechanism's δ(0) = 2Φ(r/2) − 1 needs no ε.
    assert exact_eps_delta.gaussian_eps(np.array([0.01]), 1.0, 0.1)[0] == 0
    assert np.isnan(exact_eps_delta.gaussian_eps(np.array([np.nan]), 1.0, 1e-5)[0])
    ratios = np.linspace(0.01, 0.2, 20)
    classic = exact_eps_delta.gaussian_eps(ratios, 1.0, 1e-5, "classic")
    analytic = exact_eps_delta.gaussian_eps(ratios, 1.0, 1e-5)
    np.testing.assert_allclose(classic, ratios * math.sqrt(2 * math.log(1.25e5)))
    # The classic bound is valid below 1, so it is never below the exact ε there.
    assert np.all(analytic[classic < 1] <= classic[classic < 1])
    with np.errstate(all="raise"):
        extreme = exact_eps_delta.gaussian_eps(np.array([1e-8, 1e-3, 50.0, 1e3]), 1.0, 1e-12)
    assert np.all(np.isfinite(extreme)) and np.all(np.diff(extreme) > 0)


@pytest.mark.parametrize("sample_rate, noise_multiplier", [(0.01, 1.0), (0.2, 3.0), (1.0, 2.0)])
def test_holder_infinity_at_clip_bound(sample_rate, noise_multiplier):
    # Identity 3: (ε, δ) with p = ∞, Δ = Γ is log(1 + q(e^{ε_G(Γ)} − 1)), ε_G at δ/q.
    delta, clip_bound = 1e-5, 1.5
    eps = exact_eps_delta.eps_delta_holder([clip_bound], noise_multiplier * clip_bound, sample_rate, delta, math.inf)
    eps_gaussian = mpmath_gaussian_eps(1 / noise_multiplier, delta / sample_rate)
    assert eps == pytest.approx(math.log1p(sample_rate * math.expm1(eps_gaussian)), rel=1e-9)
    assert exact_eps_delta.baseline_eps_delta(noise_multiplier, sample_rate, delta) == pytest.approx(eps, rel=1e-12)


def test_baseline_not_below_dp_accounting_pld():
    # Independent validity check: the amplified Gaussian bound is never below the PLD
    # accountant's (near exact) ε by more than its discretisation.
    for sample_rate, noise_multiplier in [(0.01, 1.0), (0.1, 2.0), (0.3, 0.9)]:
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
        accountant.compose(dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian))
        exact = accountant.get_epsilon(1e-5)
        bound = exact_eps_delta.baseline_eps_delta(noise_multiplier, sample_rate, 1e-5)
        assert bound >= exact - 1e-4
        assert bound <= exact * 1.5


def test_holder_finite_formula_and_ragged_samples():
    sample_rate, delta, noise_std, holder_p = 0.05, 1e-5, 2.0, 3.0
    samples = np.array([0.3, 1.1, 0.05, 2.0])
    eps_gaussian = np.array([mpmath_gaussian_eps(s / noise_std, delta / (2 * sample_rate)) for s in samples])
    log_mean = math.log(np.mean(np.exp(holder_p * eps_gaussian)))
    expected = math.log(1 - sample_rate + math.exp(log_mean / (holder_p - 1) + holder_p / (holder_p - 1)
                                                   * math.log(sample_rate) - math.log(delta / 2) / (holder_p - 1)))
    eps = exact_eps_delta.eps_delta_holder(samples, noise_std, sample_rate, delta, holder_p)
    assert eps == pytest.approx(expected, rel=1e-9)
    # Rows of a 2-D input are points; NaN pads a point with fewer samples.
    padded = np.array([samples, [0.3, 1.1, np.nan, np.nan]])
    both = exact_eps_delta.eps_delta_holder(padded, noise_std, sample_rate, delta, holder_p)
    assert both[0] == pytest.approx(eps, rel=1e-12)
    assert both[1] == pytest.approx(exact_eps_delta.eps_delta_holder(samples[:2], noise_std, sample_rate, delta, holder_p))
    # The paper's large p: nearly the p = ∞ value at δ/2 for a single sample.
    with np.errstate(all="raise"):
        large = exact_eps_delta.eps_delta_holder([[1.0], [0.0]], 1.0, 1e-4, 1e-5, 1e4)
    assert np.all(np.isfinite(large)) and large[1] < large[0]


# --- §2 / §3.2 mean rule: identity 4 --------------------------------------------------------

def test_statistic_of_equal_means_is_gaussian():
    # Identity 4, and the Gaussian RDP α·||m'−m_0||²/(2s²) it gives.
    rng = np.random.default_rng(4)
    for alpha in [2, 3, 8]:
        target, common = rng.normal(size=5), rng.normal(size=5)
        statistic = renyi_step.renyi_statistic(np.tile(common, (alpha, 1)), target)
        distance = np.sum((common - target) ** 2)
        assert statistic == pytest.approx(-alpha * (alpha - 1) * distance, rel=1e-12)
        rdp = renyi_step.rdp_mean_rule([statistic] * 3, 0.7, alpha)
        assert rdp == pytest.approx(alpha * distance / (2 * 0.7**2), rel=1e-12)


def test_statistic_is_the_gaussian_integral():
    # §2: ∫ Π_j N(y; m_j, s²) · N(y; m_0, s²)^{1−α} dy = exp(−S/(2s²)), here in one dimension.
    rng = np.random.default_rng(5)
    noise_std, grid = 0.6, np.linspace(-15, 15, 60_001)
    for alpha in [2, 3, 5]:
        means, target = rng.normal(size=(alpha, 1)), rng.normal(size=1)

        def log_density(mean):
            return -(grid - mean) ** 2 / (2 * noise_std**2) - 0.5 * math.log(2 * math.pi * noise_std**2)

        log_integrand = sum(log_density(mean[0]) for mean in means) + (1 - alpha) * log_density(target[0])
        log_integral = logsumexp(log_integrand) + math.log(grid[1] - grid[0])
        statistic = renyi_step.renyi_statistic(means, target)
        assert -statistic / (2 * noise_std**2) == pytest.approx(log_integral, rel=1e-8, abs=1e-8)


def test_per_target_aggregate_is_below_joint():
    rng = np.random.default_rng(6)
    statistics = rng.normal(-0.5, 1.0, size=60)
    target = np.repeat(np.arange(6), 10)
    joint = renyi_step.rdp_mean_rule(statistics, 0.5, 3)
    per_target = renyi_step.rdp_mean_rule(statistics, 0.5, 3, "per-target", target)
    assert per_target < joint
    by_hand = np.mean([logsumexp(-statistics[target == t] / 0.5) - math.log(10) for t in range(6)]) / 2
    assert per_target == pytest.approx(by_hand, rel=1e-12)


# --- identity 5: exact divergences on an enumerable toy problem -----------------------------

TOY_NORMS = np.array([0.9, 0.3, -0.5, 0.8, -1.0, 0.1])  # x* first, then X; Γ = 1, one dimension
TOY_RATE, TOY_SIGMA = 0.4, 0.8
# The mean rule's noise σΓ/B_exp is B_exp = 2.4 times smaller; more σ keeps its Monte-Carlo
# estimate light-tailed enough to converge in a test.
TOY_MEAN_SIGMA = 3.0
TOY_GRID = np.linspace(-12, 12, 48_001)


def subsets(count):
    """Every subset of `count` points as a 0/1 mask, with its Poisson probability."""
    masks = np.array(list(itertools.product([0, 1], repeat=count)), dtype=float)
    log_weight = masks.sum(1) * math.log(TOY_RATE) + (count - masks.sum(1)) * math.log1p(-TOY_RATE)
    return masks, log_weight


def batch_mean(masks, values):
    size = masks.sum(axis=-1)
    return np.where(size > 0, (masks * values).sum(axis=-1) / np.maximum(size, 1), 0.0)


def log_mixture(centres, log_weight, noise_std):
    """log density on TOY_GRID of Σ_B w(B)·N(centre(B), s²)."""
    log_normal = (-(TOY_GRID[None] - centres[:, None]) ** 2 / (2 * noise_std**2)
                  - 0.5 * math.log(2 * math.pi * noise_std**2))
    return logsumexp(log_normal + log_weight[:, None], axis=0)


def renyi(log_p, log_q, order):
    return (logsumexp(order * log_p + (1 - order) * log_q) + math.log(TOY_GRID[1] - TOY_GRID[0])) / (order - 1)


def toy_mixtures(update):
    """log densities of the released update from X' (P) and X (Q), and the batches' updates."""
    with_point, log_w_with = subsets(6)
    without, log_w_without = subsets(5)
    centres_with = update(with_point, TOY_NORMS)
    centres_without = update(without, TOY_NORMS[1:])
    return centres_with, log_w_with, centres_without, log_w_without


@pytest.mark.parametrize("order", [2, 3.5, 8])
def test_toy_sum_rule_exact_divergence_below_bound(order):
    noise_std = TOY_SIGMA * 1.0

    def batch_sum(masks, values):
        return (masks * values).sum(axis=-1)

    centres_with, log_w_with, centres_without, log_w_without = toy_mixtures(batch_sum)
    log_p = log_mixture(centres_with, log_w_with, noise_std)
    log_q = log_mixture(centres_without, log_w_without, noise_std)
    bound = renyi_step.rdp_sum_rule([abs(TOY_NORMS[0])], 1.0, TOY_SIGMA, TOY_RATE, [order])[0, 0]
    assert renyi(log_p, log_q, order) <= bound
    assert renyi(log_q, log_p, order) <= bound
    # With the other points' updates all zero the mixture is the SGM pair itself: equality.
    pair_p = np.logaddexp(math.log1p(-TOY_RATE) + log_mixture(np.zeros(1), np.zeros(1), noise_std),
                          math.log(TOY_RATE) + log_mixture(np.array([TOY_NORMS[0]]), np.zeros(1), noise_std))
    pair_q = log_mixture(np.zeros(1), np.zeros(1), noise_std)
    assert renyi(pair_p, pair_q, order) == pytest.approx(bound, rel=1e-6)


def mean_rule_setup():
    noise_std = TOY_MEAN_SIGMA * 1.0 / (TOY_RATE * 6)  # s_m = σΓ/B_exp, B_exp = qN
    centres_with, log_w_with, centres_without, log_w_without = toy_mixtures(batch_mean)
    log_p = log_mixture(centres_with, log_w_with, noise_std)
    log_q = log_mixture(centres_without, log_w_without, noise_std)
    return noise_std, centres_with, log_w_with, centres_without, log_w_without, log_p, log_q


def exact_mean_bound(log_mixture_samples, target_centres, target_log_w, noise_std, order):
    """(1/(α−1)) log E_{B_0}[∫ P(y)^α N(y; m(B_0), s²)^{1−α} dy], the §2 bound with exact expectations."""
    log_normal = (-(TOY_GRID[None] - target_centres[:, None]) ** 2 / (2 * noise_std**2)
                  - 0.5 * math.log(2 * math.pi * noise_std**2))
    log_terms = logsumexp(order * log_mixture_samples[None] + (1 - order) * log_normal, axis=1)
    return (logsumexp(log_terms + target_log_w) + math.log(TOY_GRID[1] - TOY_GRID[0])) / (order - 1)


@pytest.mark.parametrize("order", [2, 3])
def test_toy_mean_rule_exact_divergence_below_bound(order):
    noise_std, centres_with, log_w_with, centres_without, log_w_without, log_p, log_q = mean_rule_setup()
    remove = exact_mean_bound(log_p, centres_without, log_w_without, noise_std, order)
    add = exact_mean_bound(log_q, centres_with, log_w_with, noise_std, order)
    assert renyi(log_p, log_q, order) <= remove
    assert renyi(log_q, log_p, order) <= add


def test_toy_mean_rule_statistic_expectation_and_monte_carlo():
    order = 2
    noise_std, centres_with, log_w_with, centres_without, log_w_without, log_p, _ = mean_rule_setup()
    exact = exact_mean_bound(log_p, centres_without, log_w_without, noise_std, order)
    # Enumerating every (B_0, B_1, B_2) and averaging exp(−S/(2s²)) is the same number (§2).
    b0, b1, b2 = np.meshgrid(np.arange(32), np.arange(64), np.arange(64), indexing="ij")
    means = np.stack([centres_with[b1.ravel()], centres_with[b2.ravel()]], axis=1)[:, :, None]
    statistic = renyi_step.renyi_statistic(means, centres_without[b0.ravel()][:, None])
    log_weight = log_w_without[b0.ravel()] + log_w_with[b1.ravel()] + log_w_with[b2.ravel()]
    enumerated = logsumexp(-statistic / (2 * noise_std**2) + log_weight) / (order - 1)
    assert enumerated == pytest.approx(exact, rel=1e-6)
    # Monte Carlo with the script's estimator converges to it.
    rng = np.random.default_rng(7)
    for count in [1_000, 10_000, 100_000]:
        target = batch_mean((rng.random((count, 5)) < TOY_RATE).astype(float), TOY_NORMS[1:])
        samples = batch_mean((rng.random((count, order, 6)) < TOY_RATE).astype(float), TOY_NORMS)
        statistic = renyi_step.renyi_statistic(samples[:, :, None], target[:, None])
        estimate = renyi_step.rdp_mean_rule(statistic, noise_std, order)
        terms = np.exp(-statistic / (2 * noise_std**2) - (order - 1) * exact)
        standard_error = np.std(terms) / math.sqrt(count) / (order - 1)  # delta method around exp((α−1)·exact)
        assert abs(estimate - exact) <= 4 * standard_error
    assert standard_error < 0.02 * exact


def test_rdp_tables_remember_levels_and_give_the_same_numbers():
    """RdpTable computes each level once per (q, σ, orders) while remembered; every table, whatever was asked
    before it, holds exactly what rdp_sgm_levels gives for its own levels."""
    rng = np.random.default_rng(3)
    orders = np.array(rdp_composition.COMPOSITION_ORDERS)
    rdp_composition._remembered.clear()
    for sample_rate, noise_multiplier, power in [(0.03, 0.8, 3), (0.03, 0.8, 5), (0.2, 1.3, 3), (0.03, 0.8, 2),
                                                 (0.03, 0.8, 3)]:
        levels = certified_radius.geometric_levels(rng.random(3000) ** power, 1e-2)
        table = rdp_composition.RdpTable(sample_rate, noise_multiplier, orders, levels)
        direct = np.zeros((len(levels), len(orders)))
        direct[1:] = renyi_step.rdp_sgm_levels(sample_rate, noise_multiplier / levels[1:], orders)
        assert levels[0] == 0 and np.array_equal(table.rdp, direct)
    assert len(rdp_composition._remembered) == 2


# --- §4 composition: identity 6 -------------------------------------------------------------

def composed(sample_rate, noise_multiplier, ratios, steps, total_steps, orders, holder_b, rounding=0.01):
    levels = rdp_composition.sensitivity_levels(rounding, ratios)
    table = rdp_composition.RdpTable(sample_rate, noise_multiplier,
                                     rdp_composition.composition_orders(orders, total_steps, holder_b), levels)
    return rdp_composition.compose_rdp(table, np.asarray(ratios, dtype=float), steps, total_steps, orders, holder_b)


def test_composition_worst_case_is_opacus_and_dp_accounting():
    # Identity 6 with b = ∞, and the composed ε against the second library.
    sample_rate, noise_multiplier, total_steps, delta = 0.02, 1.1, 300, 1e-5
    orders = np.array([2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
    rdp = composed(sample_rate, noise_multiplier, np.ones((1, 3, 2)), [0, 100, 200], total_steps, orders, math.inf)
    opacus = total_steps * np.asarray(renyi_step.opacus_rdp.compute_rdp(
        q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(orders)))
    np.testing.assert_allclose(rdp, [opacus, opacus], rtol=1e-12)
    eps, best = rdp_composition.rdp_to_eps(orders, rdp, delta)
    accountant = dp_accounting.rdp.RdpAccountant(list(orders))
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(sample_rate, gaussian), total_steps)
    reference_eps, reference_order = accountant.get_epsilon_and_optimal_order(delta)
    np.testing.assert_allclose(eps, reference_eps, rtol=1e-6)
    assert np.all(best == reference_order)


def test_composition_half_norm_matches_dp_accounting():
    # Δ* = Γ/2 at every step is the subsampled Gaussian with noise 2σ, for T steps.
    orders = np.array([2, 4, 8, 16, 32, 64, 128])
    rdp = composed(0.01, 0.9, np.full((1, 1, 1), 0.5), [0], 500, orders, math.inf)[0]
    np.testing.assert_allclose(rdp, dp_accounting_rdp(0.01, 1.8, orders, 500), rtol=1e-5)


def test_composition_finite_holder_within_order_inflation():
    # Identity 6, finite b: ≥ the b = ∞ value and ≤ T·ρ at the largest order 1 + (λ−1)e^{T/(b−1)}.
    sample_rate, noise_multiplier, total_steps = 0.01, 1.5, 200
    orders = np.array([1.5, 2, 3, 5, 8, 13, 21, 34, 55])
    for holder_b in [3 * total_steps, 50.0]:
        rdp = composed(sample_rate, noise_multiplier, np.ones((1, 1, 1)), [0], total_steps, orders, holder_b)[0]
        plain = total_steps * renyi_step.rdp_sgm(sample_rate, noise_multiplier, orders)
        largest = 1 + (orders - 1) * math.exp(total_steps / (holder_b - 1))
        inflated = total_steps * renyi_step.rdp_sgm(sample_rate, noise_multiplier, largest)
        assert np.all(rdp >= plain * (1 - 1e-12))
        assert np.all(rdp <= inflated * (1 + 1e-9))


def test_composition_matches_step_by_step_formula():
    # Several runs, checkpoints that differ, finite b: the §4 sum evaluated step by step with
    # Opacus at the exact orders λ_{T−t} and exact Δ must lie just below the table's result.
    sample_rate, noise_multiplier, total_steps, holder_b = 0.05, 1.2, 40, 120.0
    orders = np.array([2, 4.5, 9])
    rng = np.random.default_rng(8)
    steps = np.array([0, 10, 25])
    ratios = rng.uniform(0.05, 1.0, size=(2, 3, 2))
    ratios[1, 1] = np.nan  # the second run has no checkpoint at step 10
    ratios = rdp_composition.carry_forward(ratios)
    rdp = composed(sample_rate, noise_multiplier, ratios, steps, total_steps, orders, holder_b, rounding=0.0)
    growth = holder_b / (holder_b - 1)
    for point in range(2):
        for column, alpha in enumerate(orders):
            total = 0.0
            for step in range(1, total_steps + 1):
                order = 1 + (alpha - 1) * growth ** (total_steps - step)
                checkpoint = np.searchsorted(steps, step - 1, side="right") - 1
                noise = noise_multiplier / ratios[:, checkpoint, point]
                per_run = [renyi_step.rdp_sgm(sample_rate, noise[run], [order])[0] for run in range(2)]
                log_mean = logsumexp(holder_b * (order - 1) * np.array(per_run)) - math.log(2)
                total += growth ** -(total_steps - step) * log_mean / holder_b
            exact = total / (alpha - 1)
            assert exact * (1 - 1e-9) <= rdp[point, column] <= exact * 1.01


def test_running_composition_is_the_composition_of_every_horizon():
    # b = ∞, two runs whose checkpoints differ, steps before the first checkpoint at Γ: the running sum after h steps
    # is compose_rdp's for T = h, and Opacus's RDP of the steps so far, charged step by step.
    sample_rate, noise_multiplier, total_steps = 0.04, 1.1, 30
    orders = np.array([2.0, 4.0, 16.0])
    steps = np.array([3, 10, 22])
    ratios = np.random.default_rng(9).uniform(0.05, 1.0, size=(2, 3, 4))
    ratios[0, 1] = np.nan
    ratios = rdp_composition.carry_forward(ratios)
    table = rdp_composition.RdpTable(sample_rate, noise_multiplier, orders,
                                     rdp_composition.sensitivity_levels(0.0, ratios))
    running = rdp_composition.running_composition(table, ratios, steps, total_steps, orders)
    assert running.shape == (total_steps, 4, 3)
    for horizon in (1, 4, 11, 23, total_steps):
        np.testing.assert_allclose(running[horizon - 1],
                                   rdp_composition.compose_rdp(table, ratios, steps, horizon, orders, math.inf),
                                   rtol=1e-12)
    point, step_rdp = 2, []
    for step in range(1, total_steps + 1):
        checkpoint = np.searchsorted(steps, step - 1, side="right") - 1
        ratio = 1.0 if checkpoint < 0 else ratios[:, checkpoint, point].max()
        step_rdp.append(opacus_rdp.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier / ratio, steps=1,
                                               orders=orders))
    np.testing.assert_allclose(running[:, point], np.cumsum(step_rdp, axis=0), rtol=1e-6)
    with pytest.raises(ValueError):
        rdp_composition.running_composition(table, ratios, steps, total_steps, [3.0])


def test_composition_leading_worst_case_and_zero_norm():
    # Steps before the first checkpoint use Γ; a zero norm costs nothing afterwards.
    orders = np.array([2.0, 8.0])
    rdp = composed(0.05, 1.0, np.zeros((1, 1, 1)), [30], 100, orders, math.inf)[0]
    np.testing.assert_allclose(rdp, 30 * renyi_step.rdp_sgm(0.05, 1.0, orders), rtol=1e-12)


def test_rounding_rounds_the_norm_up():
    ratios = np.array([[[0.031, 0.5, 0.0, 1.0 + 1e-9]]])
    levels = rdp_composition.sensitivity_levels(0.01, ratios)
    table = rdp_composition.RdpTable(0.1, 1.0, [2.0], levels)
    looked_up = table.levels[table.level_index(ratios[0, 0])]
    np.testing.assert_allclose(looked_up, [0.04, 0.5, 0.0, 1.0])
    assert np.all(looked_up >= np.minimum(ratios[0, 0], 1.0))


def test_step_segments():
    assert rdp_composition.step_segments([0, 10, 25], 40) == [(1, 10, 0), (11, 25, 1), (26, 40, 2)]
    assert rdp_composition.step_segments([5, 40], 40) == [(1, 5, None), (6, 40, 0)]
    # Per-step norms: T checkpoints, one step each.
    assert rdp_composition.step_segments(range(4), 4) == [(1, 1, 0), (2, 2, 1), (3, 3, 2), (4, 4, 3)]


def test_composition_numerical_range():
    orders = np.array([1.25, 2, 16, 64, 256])
    ratios = np.linspace(0, 1, 7)[None, None, :]
    with np.errstate(over="raise", invalid="raise"):
        for sample_rate, noise_multiplier in [(1e-4, 0.3), (1.0, 20.0), (0.5, 0.3), (0.01, 20.0)]:
            rdp = composed(sample_rate, noise_multiplier, ratios, [0], 50, orders, 150.0)
            eps, _ = rdp_composition.rdp_to_eps(orders, rdp, 1e-5)
            assert np.all(np.isfinite(rdp)) and np.all(np.isfinite(eps))
            assert np.all(np.diff(rdp, axis=0) >= -1e-9 * rdp[1:])


# --- §3.3 edges: huge ε and q = 1 -------------------------------------------------------------

def mpmath_delta_remove(eps, mu, sample_rate):
    """δ_rem of §3.3 at 50 digits: q·Φ̄(x₀ − μ) − (e^ε − 1 + q)·Φ̄(x₀), x₀ = log((e^ε − 1 + q)/q)/μ + μ/2."""
    mpmath.mp.dps = 50
    eps, mu, sample_rate = mpmath.mpf(eps), mpmath.mpf(mu), mpmath.mpf(sample_rate)
    factor = mpmath.expm1(eps) + sample_rate
    threshold = mpmath.log(factor / sample_rate) / mu + mu / 2
    return sample_rate * mpmath.ncdf(mu - threshold) - factor * mpmath.ncdf(-threshold)


@pytest.mark.parametrize("eps, mu", [(700.0, 40.0), (750.0, 40.0), (3000.0, 80.0), (5.0, 3.0)])
def test_delta_remove_in_log_space_beyond_exp_overflow(eps, mu):
    """e^ε overflows above ε ≈ 709.78; δ_rem stays finite and right there (it was NaN, read as 'below δ')."""
    value = float(exact_eps_delta.delta_remove(eps, mu, 0.008))
    assert math.isfinite(value)
    assert value == pytest.approx(float(mpmath_delta_remove(eps, mu, 0.008)), rel=1e-6, abs=1e-300)


def test_mean_rule_baseline_beyond_exp_overflow_is_a_bound():
    """N = 1,000, B_exp = 8, σ = 0.2, δ = 1e-7: the mean rule's baseline needs ε far above 709.78 (at
    k = 0 the update moves by Γ against noise σΓ/8, μ = 40); the returned ε has δ(ε) ≤ δ at 50 digits and a
    slightly smaller ε does not."""
    n, sample_rate, sigma, delta = 999, 0.008, 0.2, 1e-7
    k_min = batch_sizes.size_threshold(n, sample_rate, delta / 10)
    grid = batch_sizes.size_grid(n, sample_rate, k_min, 64)
    weights = np.exp(batch_sizes.lumped_size_log_weights(grid, n, sample_rate))
    mu = certified_radius.baseline_mean_sensitivity(1.0, grid) / (sigma / 8)
    fail = batch_sizes.size_failure(n, sample_rate, k_min)
    eps = float(exact_eps_delta.per_step_eps(mu[None, :], delta, sample_rate, weights[None, :], fail)[0])
    assert 800 < eps < math.inf

    def delta_at(value):
        return fail + sum(weight * mpmath_delta_remove(value, component, sample_rate)
                          for weight, component in zip(weights, mu, strict=True) if weight > 0)
    assert delta_at(eps) <= delta < delta_at(eps * (1 - 1e-6))


def test_per_step_eps_never_returns_an_unverified_eps(monkeypatch):
    """A δ that cannot be evaluated is not 'below the target': ε = inf, not a finite number."""
    monkeypatch.setitem(exact_eps_delta.DIRECTION_DELTAS, "remove", lambda eps, mu, rate: np.full(np.shape(mu), np.nan))
    assert exact_eps_delta.per_step_eps([[1.0]], 1e-5, 0.1, direction="remove")[0] == math.inf


@pytest.mark.parametrize("eps, mu", [(0.0, 0.5), (0.5, 1.0), (1.0, 1.0), (3.0, 2.0), (10.0, 6.0)])
def test_add_direction_at_full_sampling_is_the_gaussian_mechanism(eps, mu):
    """q = 1: both directions are H_{e^ε}(N(0,1) || N(μ,1)) = Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ) (Balle & Wang
    2018, Thm 8), evaluated here at 50 digits; the add direction was 0."""
    mpmath.mp.dps = 50
    gaussian = float(mpmath.ncdf(mpmath.mpf(mu) / 2 - eps / mpmath.mpf(mu))
                     - mpmath.exp(eps) * mpmath.ncdf(-mpmath.mpf(mu) / 2 - eps / mpmath.mpf(mu)))
    assert float(exact_eps_delta.delta_add(eps, mu, 1.0)) == pytest.approx(gaussian, rel=1e-9, abs=1e-300)
    assert float(exact_eps_delta.delta_remove(eps, mu, 1.0)) == pytest.approx(gaussian, rel=1e-9, abs=1e-300)
    assert gaussian > 0
    add = exact_eps_delta.per_step_eps([[mu]], 1e-6, 1.0, direction="add")[0]
    assert add == pytest.approx(exact_eps_delta.gaussian_eps(mu, 1.0, 1e-6)[()], rel=1e-6)


def test_per_step_eps_in_blocks_is_the_same(monkeypatch):
    """Rows are solved in blocks of EPS_CHUNK_ELEMENTS values: any block size gives the same ε, and each ε is
    within 1e-9 of the root of δ(ε) = δ (brentq on the same δ)."""
    rng = np.random.default_rng(4)
    mu = rng.uniform(0, 4, (7, 3, 40))
    weights = rng.dirichlet(np.ones(40), (7, 3)) * 0.999
    whole = exact_eps_delta.per_step_eps(mu, 1e-5, 0.05, weights, 1e-7)
    monkeypatch.setattr(exact_eps_delta, "EPS_CHUNK_ELEMENTS", 50)
    np.testing.assert_array_equal(exact_eps_delta.per_step_eps(mu, 1e-5, 0.05, weights, 1e-7), whole)

    def excess(eps, row, column):
        return max(float(exact_eps_delta.mixture_delta(eps, mu[row, column], weights[row, column], 0.05, name))
                   for name in ("remove", "add")) + 1e-7 - 1e-5
    for row, column in ((0, 0), (3, 2), (6, 1)):
        root = brentq(excess, 0.0, 200.0, args=(row, column), xtol=1e-14, rtol=1e-13)
        assert root <= whole[row, column] <= root * (1 + 1e-9) + 1e-12


def opacus_rdp_repaired(sample_rate, noise, order):
    """RDP_SGM from Opacus itself, one (z, λ) at a time, with §3's repair of its fractional-order series: a value
    outside [log A at ⌊λ⌋, the chord to ⌈λ⌉] (or a failed series) is replaced by the chord."""
    from opacus.accountants.analysis import rdp as opacus

    def moment(alpha):
        try:
            return (alpha - 1) * float(opacus.compute_rdp(q=sample_rate, noise_multiplier=noise, steps=1,
                                                          orders=float(alpha)))
        except (ValueError, OverflowError):
            return math.nan

    if order > renyi_step.LARGEST_OPACUS_ORDER:
        return order / (2 * noise ** 2)
    low, high = math.floor(order), math.ceil(order)
    if low == high:
        return moment(order) / (order - 1)
    floor_moment = 0.0 if low == 1 else moment(low)
    chord = floor_moment + (order - low) * (moment(high) - floor_moment)
    value = moment(order)
    inside = floor_moment - 1e-12 * abs(floor_moment) <= value <= chord * (1 + 1e-9) + 1e-300
    return (min(value, chord) if inside else chord) / (order - 1)


@pytest.mark.parametrize("sample_rate", [0.001, 0.032, 0.128, 0.5, 0.9, 1.0])
def test_rdp_of_many_noise_multipliers_is_opacus_at_each(sample_rate):
    """rdp_sgm_levels (every noise multiplier of a table at once) against Opacus (one z and λ at a time), at
    integer, fractional and large orders, from very little noise to very much: equal to float rounding."""
    orders = np.asarray([*rdp_composition.COMPOSITION_ORDERS, 300.0, 700.0])
    noise = np.geomspace(0.3, 500, 17)
    many = renyi_step.rdp_sgm_levels(sample_rate, noise, orders)
    each = np.array([[opacus_rdp_repaired(sample_rate, z, order) for order in orders] for z in noise])
    np.testing.assert_allclose(many, each, rtol=1e-6, atol=1e-14)
    assert np.array_equal(renyi_step.rdp_sgm_levels(sample_rate, [np.inf], orders), np.zeros((1, len(orders))))
    assert np.array_equal(renyi_step.rdp_sgm(sample_rate, noise[3], orders), many[3])

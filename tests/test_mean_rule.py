"""The mean update rule by coupling (accounting.md §3.2-§3.4, §6 identities 3, 5, 6 and 8).

Exact enumeration of every batch on one-dimensional toys is the independent computation that
the coupling, certified and baseline bounds are held against.
"""

import dataclasses
import itertools
import math
import os

import dp_accounting
import numpy as np
import pandas as pd
import pytest
from conftest import leave_one_out_statistics
from dp_accounting.pld import pld_privacy_accountant
from scipy import integrate, stats
from scipy.special import logsumexp

from perinstance.accounting import batch_sizes, certified_radius, exact_eps_delta, rdp_composition, renyi_step
from perinstance.accounting.mechanism import Mechanism
from perinstance.files.results import COLUMNS

# --- exact enumeration (identity 5) ---------------------------------------------------------


def enumerate_batches(others, sample_rate):
    """Every batch B ⊆ X with its Poisson probability: (members, probability) pairs."""
    for mask in itertools.product([0, 1], repeat=len(others)):
        chosen = np.asarray(mask, dtype=bool)
        yield others[chosen], sample_rate ** chosen.sum() * (1 - sample_rate) ** (~chosen).sum()


def mean_of(values):
    return float(np.mean(values)) if len(values) else 0.0


def mixtures(target, others, sample_rate, noise_std, keep=None):
    """Components (location, weight) of P (x* in the training set) and Q (without) in one dimension;
    with `keep`, the laws conditioned on the event {keep(B)} about the other points' batch B."""
    with_point, without = [], []
    batches = [(batch, probability) for batch, probability in enumerate_batches(others, sample_rate)
               if keep is None or keep(batch)]
    mass = sum(probability for _, probability in batches)
    for batch, probability in batches:
        probability /= mass
        without.append((mean_of(batch), probability))
        with_point.append((mean_of(batch), probability * (1 - sample_rate)))
        with_point.append((mean_of(np.append(batch, target)), probability * sample_rate))
    return with_point, without


def log_densities(components, noise_std, grid):
    """log of the mixture density on a grid of points (vectorised over the grid)."""
    locations = np.array([location for location, _ in components])
    log_weights = np.log([weight for _, weight in components])
    return logsumexp(log_weights[:, None] + stats.norm.logpdf(grid[None, :], locations[:, None], noise_std), axis=0)


def integration_grid(noise_std):
    """Fine enough that the trapezoid rule is exact to ~1e-10 on these Gaussian mixtures."""
    span = 2 + 12 * noise_std
    return np.linspace(-span, span, 40_001)


class Pair:
    """The two laws P (x* in the training set) and Q (without) of one toy, on an integration grid."""

    def __init__(self, target, others, sample_rate, noise_std, keep=None):
        with_point, without = mixtures(target, others, sample_rate, noise_std, keep)
        self.grid = integration_grid(noise_std)
        self.log_p = log_densities(with_point, noise_std, self.grid)
        self.log_q = log_densities(without, noise_std, self.grid)

    def laws(self, direction):
        return (self.log_p, self.log_q) if direction == "remove" else (self.log_q, self.log_p)

    def renyi(self, alpha, direction):
        first, second = self.laws(direction)
        return math.log(integrate.trapezoid(np.exp(alpha * first + (1 - alpha) * second), self.grid)) / (alpha - 1)

    def hockey_stick(self, eps, direction):
        first, second = self.laws(direction)
        return integrate.trapezoid(np.maximum(np.exp(first) - math.exp(eps) * np.exp(second), 0.0), self.grid)


def batch_sensitivities(target, others, sample_rate):
    """Δ_B, |B|, and probability for every B ⊆ X (§2)."""
    return [(abs(target - mean_of(batch)) / (len(batch) + 1) if len(batch) else abs(target), len(batch), probability)
            for batch, probability in enumerate_batches(others, sample_rate)]


def coupling_rdp_exact(target, others, sample_rate, noise_std, alpha):
    """§3.2 coupling bound with the exact expectation over every batch (k_min = 0)."""
    terms = [math.log(probability) + (alpha - 1) * float(renyi_step.rdp_sgm(sample_rate, noise_std / delta, [alpha])[0])
             if delta > 0 else math.log(probability)
             for delta, _, probability in batch_sensitivities(target, others, sample_rate)]
    return logsumexp(terms) / (alpha - 1)


def population_statistics(target, others):
    """d*, v_X, b_X of a one-dimensional toy (§2)."""
    center = np.mean(others)
    deviations = np.abs(others - center)
    return abs(target - center), np.mean(deviations ** 2), np.max(deviations)


def certified_components(target, others, clip_bound, sample_rate, failure):
    """§7's certified mixture with k_min = 0 and every size evaluated: (Δ̄, weight) per component, and the
    certified event's test keep(B): ||m(B) − μ_X|| within the radius at its size's failure β_k."""
    center_distance, spread, deviation = population_statistics(target, others)
    sizes = np.arange(len(others) + 1)
    log_weights = batch_sizes.size_log_pmf(sizes, len(others), sample_rate)
    bound, component_log_weights, _ = certified_radius.certified_mixture([center_distance], [spread], [deviation],
                                                                         clip_bound, sizes, log_weights, failure)
    size_failures = certified_radius.size_failures(np.where(sizes > 0, log_weights, -np.inf), failure)
    radius = certified_radius.concentration_radius([spread], [deviation], np.maximum(sizes, 1), size_failures)[0]

    def keep(batch):
        return len(batch) == 0 or abs(np.mean(batch) - np.mean(others)) <= radius[len(batch)]
    return bound[0], np.exp(component_log_weights), keep


def certified_rdp(target, others, clip_bound, sample_rate, noise_std, alpha, failure):
    """§3.2 certified bound (§7's mixture) with k_min = 0 and every size evaluated."""
    bound, weights, _ = certified_components(target, others, clip_bound, sample_rate, failure)
    moments = np.array([(alpha - 1) * float(renyi_step.rdp_sgm(sample_rate, noise_std / value, [alpha])[0])
                        for value in bound])
    return float(certified_radius.mixture_rdp(moments, np.log(weights), math.log(1 - failure), alpha))


def baseline_rdp(clip_bound, n, sample_rate, noise_std, alpha):
    sizes = np.arange(n + 1)
    return mixture_bound(certified_radius.baseline_mean_sensitivity(clip_bound, sizes), sizes, n, sample_rate, noise_std,
                         alpha, 0.0)


def mixture_bound(bound, sizes, n, sample_rate, noise_std, alpha, log_mass):
    moments = np.array([(alpha - 1) * float(renyi_step.rdp_sgm(sample_rate, noise_std / value, [alpha])[0])
                        for value in bound])
    return float(certified_radius.mixture_rdp(moments, batch_sizes.size_log_pmf(sizes, n, sample_rate), log_mass, alpha))


def toys(count, seed=0):
    """One-dimensional populations: N − 1 ≤ 5 other points, h in [−Γ, Γ], varied q and σ."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 6))
        clip_bound = 1.0
        others = rng.uniform(-1, 1, n) * rng.choice([0.1, 0.5, 1.0])
        target = float(rng.uniform(-1, 1))
        sample_rate = float(rng.choice([0.1, 0.3, 0.5, 0.8]))
        batch_size = max(sample_rate * (n + 1), 0.5)
        sigma = float(rng.choice([0.7, 1.0, 2.0]))
        yield target, others, clip_bound, sample_rate, sigma * clip_bound / batch_size, sigma


@pytest.mark.parametrize("alpha", [2.0, 4.0])
def test_exact_renyi_below_coupling_certified_and_baseline(alpha):
    """The certified value bounds the laws conditioned on its event E (the failure goes to δ_fail, §3.4, §7.5):
    it is held against the exact divergence of P_E and Q_E."""
    for target, others, clip_bound, sample_rate, noise_std, _ in toys(12, seed=int(alpha)):
        pair = Pair(target, others, sample_rate, noise_std)
        remove, add = pair.renyi(alpha, "remove"), pair.renyi(alpha, "add")
        coupling = coupling_rdp_exact(target, others, sample_rate, noise_std, alpha)
        baseline = baseline_rdp(clip_bound, len(others), sample_rate, noise_std, alpha)
        for exact in (remove, add):
            assert exact <= coupling * (1 + 1e-7) + 1e-9
            assert exact <= baseline * (1 + 1e-7) + 1e-9
        for failure in (0.05, 0.3):
            certified = certified_rdp(target, others, clip_bound, sample_rate, noise_std, alpha, failure)
            keep = certified_components(target, others, clip_bound, sample_rate, failure)[2]
            conditioned = Pair(target, others, sample_rate, noise_std, keep)
            for direction in ("remove", "add"):
                assert conditioned.renyi(alpha, direction) <= certified * (1 + 1e-7) + 1e-9
            # The step that §7 adds, without the slack of joint convexity: the exact expectation over the
            # batches in E of exp((α−1)·RDP_SGM(q, s/Δ_B, α)), normalised by 1 − β.
            kept = [(delta, probability) for (delta, _, probability), (batch, _) in
                    zip(batch_sensitivities(target, others, sample_rate), enumerate_batches(others, sample_rate),
                        strict=True) if keep(batch)]
            terms = [math.log(probability) + (alpha - 1) * float(renyi_step.rdp_sgm(sample_rate, noise_std / delta,
                                                                                     [alpha])[0])
                     if delta > 0 else math.log(probability) for delta, probability in kept]
            assert (logsumexp(terms) - math.log(1 - failure)) / (alpha - 1) <= certified * (1 + 1e-7) + 1e-9
        assert min(add, certified_radius.add_direction_cap(sample_rate)) >= add - 1e-12
        assert add <= certified_radius.add_direction_cap(sample_rate) + 1e-9


def test_certified_event_fails_at_most_its_share_on_every_toy():
    """Identity 6 exactly: over every k-subset of each toy, P(|m(B) − μ_X| > r) <= β at every tail level of §7's
    mixture and at each size's failure β_k, and Σ_k π_k·β_k <= β."""
    for target, others, _, sample_rate, _, _ in toys(40, seed=11):
        _, spread, deviation = population_statistics(target, others)
        sizes = np.arange(1, len(others) + 1)
        log_weights = batch_sizes.size_log_pmf(sizes, len(others), sample_rate)
        for failure in (1e-3, 0.05, 0.3):
            size_failures = certified_radius.size_failures(log_weights, failure)
            assert np.sum(np.exp(log_weights) * size_failures) <= failure
            tails = np.concatenate([size_failures[:, None] ** ((np.arange(1, 17) / 16) ** 2)[None, :],
                                    np.geomspace(0.9, 1e-6, 12)[None, :].repeat(len(sizes), axis=0)], axis=1)
            radius = certified_radius.concentration_radius([spread], [deviation], sizes[:, None], tails)[0]
            for row, size in enumerate(sizes):
                distances = np.array([abs(np.mean(others[list(subset)]) - np.mean(others))
                                      for subset in itertools.combinations(range(len(others)), size)])
                rates = np.mean(distances[:, None] > radius[row][None, :] * (1 + 1e-12), axis=0)
                assert np.all(rates <= tails[row]), (size, rates, tails[row])


@pytest.mark.parametrize("alpha", [2.0, 8.0])
def test_the_sum_rule_baseline_is_not_a_bound_for_the_mean_rule(alpha):
    """§3.2: RDP_SGM(q, σ, α) is exceeded by the exact mean-rule divergence (an empty batch moves the
    realised-size mean by |h*| = Γ against noise σΓ/B_exp < σΓ)."""
    others, target, sample_rate, sigma = np.array([-1.0, -1.0]), 1.0, 0.5, 1.0
    noise_std = sigma / (sample_rate * 3)
    remove = Pair(target, others, sample_rate, noise_std).renyi(alpha, "remove")
    assert remove > float(renyi_step.rdp_sgm(sample_rate, sigma, [alpha])[0])
    assert remove <= baseline_rdp(1.0, 2, sample_rate, noise_std, alpha) * (1 + 1e-7)


def test_exact_hockey_stick_below_the_coupling_delta():
    for target, others, _, sample_rate, noise_std, _ in toys(10, seed=7):
        pair = Pair(target, others, sample_rate, noise_std)
        table = batch_sensitivities(target, others, sample_rate)
        mu = np.array([[delta / noise_std for delta, _, _ in table]])
        weights = np.array([[probability for _, _, probability in table]])
        for eps in (0.1, 0.5, 1.5):
            for direction in ("remove", "add"):
                exact = pair.hockey_stick(eps, direction)
                bound = float(exact_eps_delta.mixture_delta(eps, mu, weights, sample_rate, direction)[0])
                assert exact <= bound + 1e-9, (direction, eps, exact, bound)
        # ε from the bound is at least the ε at which the exact δ drops below the target.
        eps_bound = float(exact_eps_delta.per_step_eps(mu, 1e-3, sample_rate, weights)[0])
        exact_at_bound = max(pair.hockey_stick(eps_bound, "remove"), pair.hockey_stick(eps_bound, "add"))
        assert exact_at_bound <= 1e-3 + 1e-9


class SizePair(Pair):
    """P and Q when the n other points all have the value `others_value`: a batch is then known by
    its size k ~ Bin(n, q) alone, so a training set of N = 64 is enumerated exactly."""

    def __init__(self, target, others_value, n, sample_rate, noise_std):
        sizes = np.arange(n + 1)
        weights = stats.binom.pmf(sizes, n, sample_rate)
        without = [(others_value if size else 0.0, weight) for size, weight in zip(sizes, weights)]
        with_point = [(location, weight * (1 - sample_rate)) for location, weight in without] + [
            ((size * others_value + target) / (size + 1), weight * sample_rate) for size, weight in zip(sizes, weights)]
        self.grid = integration_grid(noise_std)
        self.log_p = log_densities(with_point, noise_std, self.grid)
        self.log_q = log_densities(without, noise_std, self.grid)


def exact_eps(pair, delta):
    """The smallest ε whose hockey-stick is <= δ in both directions (bisection; it is nonincreasing)."""
    low, high = 0.0, 64.0
    for _ in range(60):
        middle = (low + high) / 2
        if max(pair.hockey_stick(middle, direction) for direction in ("remove", "add")) > delta:
            low = middle
        else:
            high = middle
    return high


@pytest.mark.parametrize("others_value", [0.0, -1.0])
def test_at_n_64_the_mean_rule_leaks_far_more_than_the_sum_rules_accounting(others_value):
    """docs/audit.md §1: N = 64, B_exp = 4, σ = 1, δ = 1e-5, x* at Γ = 1, the 63 others at one value.
    The exact one-step ε of the realised-size mean rule is several times the per-step ε of the sum
    rule's accounting at the same σ and q (x* alone in its batch releases Γ against noise σΓ/B_exp;
    others opposite to x* move the mean by up to 2Γ/(k+1)), and at most the coupling bound and the
    mean rule's own baseline."""
    size, batch_size, sigma, delta = 64, 4, 1.0, 1e-5
    sample_rate = batch_size / size
    mechanism = Mechanism(noise_multiplier=sigma, clip_bound=1.0, sample_rate=sample_rate, batch_size=batch_size,
                          dataset_size=size, total_steps=1, rule="mean")
    exact = exact_eps(SizePair(1.0, others_value, size - 1, sample_rate, mechanism.noise_std), delta)
    sum_rule, _, _ = dataclasses.replace(mechanism, rule="sum").per_step_baseline_eps(delta)
    baseline, _, _ = mechanism.per_step_baseline_eps(delta)
    sizes = np.arange(size)
    sensitivities = np.where(sizes > 0, abs(1.0 - others_value) / (sizes + 1), 1.0)
    coupling = exact_eps_delta.per_step_eps(sensitivities[None, :] / mechanism.noise_std, delta, sample_rate,
                                            stats.binom.pmf(sizes, size - 1, sample_rate)[None, :])[0]
    assert exact > 5 * sum_rule
    assert exact <= coupling * (1 + 1e-6) and coupling <= baseline * (1 + 1e-9)


def test_exact_hockey_stick_below_the_certified_delta():
    """§3.3 with §7's mixture: δ_exact(ε) <= Σ_c w_c·δ(ε; Δ̄_c/s) + β in both directions (the certified event
    fails with probability at most β), and the certified ε at δ is one where the exact δ is below δ."""
    for target, others, clip_bound, sample_rate, noise_std, _ in toys(10, seed=8):
        pair = Pair(target, others, sample_rate, noise_std)
        for failure in (1e-3, 0.05):
            bound, weights, _ = certified_components(target, others, clip_bound, sample_rate, failure)
            mu = bound[None, :] / noise_std
            for eps in (0.1, 0.5, 1.5):
                for direction in ("remove", "add"):
                    certified = float(exact_eps_delta.mixture_delta(eps, mu, weights, sample_rate, direction)[0]) + failure
                    assert pair.hockey_stick(eps, direction) <= certified + 1e-9, (direction, eps)
            eps_bound = float(exact_eps_delta.per_step_eps(mu, 0.1, sample_rate, weights, failure)[0])
            assert max(pair.hockey_stick(eps_bound, "remove"), pair.hockey_stick(eps_bound, "add")) <= 0.1 + 1e-9
            # Without the slack of joint convexity: the exact expectation of δ(ε; Δ_B/s) over every batch.
            table = batch_sensitivities(target, others, sample_rate)
            exact_mu = np.array([[delta / noise_std for delta, _, _ in table]])
            exact_weights = np.array([[probability for _, _, probability in table]])
            for direction in ("remove", "add"):
                expected = float(exact_eps_delta.mixture_delta(1.0, exact_mu, exact_weights, sample_rate, direction)[0])
                certified = float(exact_eps_delta.mixture_delta(1.0, mu, weights, sample_rate, direction)[0]) + failure
                assert expected <= certified + 1e-12


# --- identity 3: the exact per-step (ε, δ) ---------------------------------------------------

@pytest.mark.parametrize("sample_rate, sigma, delta", [(0.01, 1.0, 1e-5), (0.1, 0.8, 1e-5), (0.5, 2.0, 1e-3),
                                                       (0.032, 0.6, 1e-5), (1.0, 1.5, 1e-6)])
def test_exact_eps_at_the_clip_bound_is_the_pld_accountant(sample_rate, sigma, delta):
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)))
    exact = float(exact_eps_delta.per_step_eps([[1 / sigma]], delta, sample_rate)[0])
    assert exact == pytest.approx(accountant.get_epsilon(delta), rel=2e-3, abs=1e-4)
    for holder_p in (2.0, 10.0, 1e4, math.inf):
        holder = float(exact_eps_delta.eps_delta_holder([1.0], sigma, sample_rate, delta, holder_p))
        assert exact <= holder * (1 + 1e-8)


def test_exact_eps_directions_and_edges():
    # Δ = 0 costs nothing; the add direction is never above log(1/(1−q)) nor the remove one here.
    assert exact_eps_delta.per_step_eps([[0.0]], 1e-5, 0.1)[0] == 0
    add = exact_eps_delta.per_step_eps([[2.0]], 1e-5, 0.1, direction="add")[0]
    remove = exact_eps_delta.per_step_eps([[2.0]], 1e-5, 0.1, direction="remove")[0]
    assert add <= -math.log(0.9) + 1e-9 and add < remove
    assert exact_eps_delta.per_step_eps([[2.0]], 1e-5, 0.1, delta_fail=2e-5)[0] == math.inf
    # Nondecreasing in the sensitivity.
    eps = exact_eps_delta.per_step_eps(np.linspace(0, 3, 30)[:, None], 1e-5, 0.05)
    assert np.all(np.diff(eps) >= -1e-12)
    # A mixture of components is at most its worst component.
    mixture = exact_eps_delta.per_step_eps([[0.1, 0.5, 2.0]], 1e-5, 0.05)[0]
    assert mixture <= exact_eps_delta.per_step_eps([[2.0]], 1e-5, 0.05)[0]


def test_math_refuses_nonsense():
    with pytest.raises(ValueError, match="noise_multiplier"):
        renyi_step.rdp_sgm(0.1, -1.0, [2])
    with pytest.raises(ValueError, match="holder_p"):
        exact_eps_delta.eps_delta_holder([1.0], 1.0, 0.1, 1e-5, 0.5)
    with pytest.raises(ValueError, match="sample_rate"):
        exact_eps_delta.per_step_eps([[1.0]], 1e-5, 1.5)
    with pytest.raises(ValueError, match="delta"):
        exact_eps_delta.per_step_eps([[1.0]], 0.0, 0.1)
    with pytest.raises(ValueError, match="orders"):
        renyi_step.rdp_sgm(0.1, 1.0, [1.0])
    with pytest.raises(ValueError, match="mu"):
        exact_eps_delta.per_step_eps([[-1.0]], 1e-5, 0.1)


# --- §3.4 batch sizes -------------------------------------------------------------------------

def test_size_threshold_and_lumping():
    n, rate = 7999, 0.032
    k_min = batch_sizes.size_threshold(n, rate, 1e-9)
    assert stats.binom.cdf(k_min - 1, n, rate) <= 1e-9 < stats.binom.cdf(k_min, n, rate)
    assert batch_sizes.size_failure(n, rate, k_min) == pytest.approx(stats.binom.cdf(k_min - 1, n, rate))
    grid = batch_sizes.size_grid(n, rate, k_min, 32)
    assert grid[0] == k_min and len(grid) <= 34 and np.all(np.diff(grid) > 0)
    lumped = np.exp(batch_sizes.lumped_size_log_weights(grid, n, rate))
    assert lumped.sum() == pytest.approx(1 - stats.binom.cdf(k_min - 1, n, rate), rel=1e-9)
    every = batch_sizes.size_grid(20, 0.3, 0, 64)
    assert list(every) == list(range(0, batch_sizes.size_upper(20, 0.3) + 1))
    assert batch_sizes.size_threshold(10, 0.1, 1e-6) == 0


# --- identity 8: null population, and a point at the mean ------------------------------------

SIGMA, CLIP, N, BATCH = 1.0, 1.0, 400, 32


def coupling_rows(gradients, points, batch_size, sigma, clip_bound, size_delta, permutations, blocks=2, seed=0,
                  max_sizes=8):
    """Result rows of the mean rule computed directly in numpy (float64), as compute_sensitivity.py
    would write them: statistics and stratified Δ_B samples with their size k."""
    count = len(gradients)
    n = count - 1
    rate = batch_size / count
    k_min = batch_sizes.size_threshold(n, rate, size_delta)
    grid = batch_sizes.size_grid(n, rate, k_min, max_sizes)
    rng = np.random.default_rng(seed)
    base = dict(run="toy", seed=0, step=0, stage=0.0, total_steps=100, label=0, correct=1, loss=0.1, exp="coupling",
                reduction="mean", direction="none", target_batch=0, alpha=np.nan, sigma=sigma,
                clip_bound=clip_bound, sample_rate=rate, batch_size=batch_size, dataset_size=count,
                noise_std=sigma * clip_bound / batch_size, dataset="synthetic", model="mlp", clipping="flat",
                update_rule="mean", target_eps=np.nan, delta=1e-5, accuracy=0.9, mc_seed=0, k_min=k_min)
    rows = []
    for point in points:
        for quantity, value in leave_one_out_statistics(gradients, point):
            rows.append(dict(base, point=point, quantity=quantity, value=value, sample=0, block=0, k=np.nan))
    for block in range(blocks):
        for index in range(permutations):
            order = rng.permutation(count)
            for k in grid:
                prefix = order[:k]
                batch_mean = gradients[prefix].mean(axis=0) if k else 0.0
                for point in points:
                    if point in prefix:
                        continue
                    value = np.linalg.norm(gradients[point] - batch_mean) / (k + 1) if k else \
                        np.linalg.norm(gradients[point])
                    rows.append(dict(base, point=point, quantity="batch_sensitivity", value=value,
                                     sample=index * len(grid) + int(np.searchsorted(grid, k)), block=block, k=k))
    return pd.DataFrame(rows, columns=COLUMNS)


def scaled_rows(n_points, seed):
    """Gradients with a shared component (as at a real checkpoint), norms at most 1."""
    rng = np.random.default_rng(seed)
    rows = np.full((n_points, 20), 0.1) + rng.normal(scale=0.1, size=(n_points, 20))
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1.0)


def accountant_output(tmp_path, run, script, rows, *flags):
    os.makedirs(tmp_path / "res", exist_ok=True)
    rows.to_csv(tmp_path / "res" / "toy.csv", index=False)
    result = run(script, "--res-name", "toy", *flags)
    assert result.returncode == 0, result.stderr
    name = os.path.splitext(script)[0]
    return pd.read_csv(tmp_path / "res" / f"toy_{name}.csv"), result


def test_null_population_costs_nothing(tmp_path, run):
    gradients = np.tile(scaled_rows(1, 0), (N, 1))
    rows = coupling_rows(gradients, [0, 1], BATCH, SIGMA, CLIP, 1e-8, permutations=5)
    output, _ = accountant_output(tmp_path, run, "renyi_per_instance_mean.py", rows, "--alpha", "2", "8")
    # ~0: Opacus's log-space sums leave an absolute floor of about 1e-8 on (α−1)·RDP.
    for kind in ("estimate", "certified"):
        assert np.all(output.loc[output["kind"] == kind, "rdp"].abs() < 1e-7)
    assert np.all(output.loc[output["kind"] == "baseline", "rdp"] > 0)
    assert set(output["kind"]) == {"estimate", "certified", "baseline"}
    assert {"k_min", "delta_fail", "direction", "alpha"} <= set(output.columns)
    eps, _ = accountant_output(tmp_path, run, "eps_delta.py", rows)
    assert np.all(eps.loc[eps["kind"] != "baseline", "eps"] < 1e-6)


def test_point_at_the_mean_is_far_below_the_sum_rule(tmp_path, run):
    gradients = scaled_rows(N, 1)
    gradients[0] = np.delete(gradients, 0, axis=0).mean(axis=0)
    rows = coupling_rows(gradients, [0, 1], BATCH, SIGMA, CLIP, 1e-8, permutations=20)
    output, _ = accountant_output(tmp_path, run, "renyi_per_instance_mean.py", rows, "--alpha", "8")
    estimate = output.query("kind == 'estimate' and direction == 'max'").set_index("point")["rdp"]
    certified = output.query("kind == 'certified' and direction == 'max'").set_index("point")["rdp"]
    sum_rule = renyi_step.rdp_sum_rule(np.linalg.norm(gradients[[0, 1]], axis=1), CLIP, SIGMA, BATCH / N, [8.0])[:, 0]
    assert estimate[0] < 0.1 * sum_rule[0]
    assert estimate[0] <= certified[0] and estimate[0] < estimate[1]
    row = output.query("kind == 'estimate' and direction == 'max' and point == 0").iloc[0]
    assert row["rdp_min"] <= row["rdp"] * (1 + 1e-9) and row["rdp"] <= row["rdp_max"] * (1 + 1e-9)


def test_estimate_matches_exact_stratified_expectation(tmp_path, run):
    """With every size sampled many times the estimate approaches the exact coupling expectation
    conditioned on k ≥ k_min, computed here from fresh subsets."""
    gradients = scaled_rows(60, 3)
    batch = 8
    rows = coupling_rows(gradients, [0], batch, SIGMA, CLIP, 1e-2, permutations=300, blocks=1, seed=5, max_sizes=100)
    output, _ = accountant_output(tmp_path, run, "renyi_per_instance_mean.py", rows, "--alpha", "2")
    estimate = output.query("kind == 'estimate' and direction == 'remove'")["rdp"].iloc[0]
    n, rate = 59, batch / 60
    k_min = batch_sizes.size_threshold(n, rate, 1e-2)
    rng = np.random.default_rng(11)
    others = gradients[1:]
    terms = []
    for k in range(k_min, n + 1):
        subsets = [rng.choice(n, k, replace=False) for _ in range(400)]
        deltas = [np.linalg.norm(gradients[0] - others[subset].mean(axis=0)) / (k + 1) for subset in subsets]
        moments = [float(renyi_step.rdp_sgm(rate, SIGMA * CLIP / batch / delta, [2.0])[0]) for delta in deltas]
        terms.append(stats.binom.logpmf(k, n, rate) + logsumexp(moments) - math.log(len(moments)))
    exact = (logsumexp(terms) - math.log(stats.binom.sf(k_min - 1, n, rate)))
    assert estimate == pytest.approx(exact, rel=0.05)


# --- §4: composition of the mean rule -----------------------------------------------------------

def test_composition_of_the_mean_rule(tmp_path, run):
    """Certified and estimated ε over the run: below the mean rule's own composed baseline, which equals
    a direct composition of the per-step baseline; T·delta_fail is taken out of δ."""
    # Large enough batches that the bulk of sizes, not the rarest ones, decides the bound (§3.4).
    count, batch = 1000, 200
    gradients = scaled_rows(count, 4)
    rows = pd.concat([coupling_rows(gradients, [0, 1, 2], batch, SIGMA, CLIP, 1e-8, permutations=3,
                                    max_sizes=64).assign(step=step) for step in (0, 50)], ignore_index=True)
    output, result = accountant_output(tmp_path, run, "renyi_per_instance_sum_compo.py", rows, "--alpha", "2", "4", "8",
                                       "16", "32")
    # Certified per step at two checkpoints, held between them: a held estimate (accounting.md §4); the Monte Carlo
    # per-step values below compose to an estimate.
    assert set(output["kind"]) == {"held_estimate", "baseline"}
    certified = output[output["kind"] == "held_estimate"].set_index("point")["eps"]
    baseline = output[output["kind"] == "baseline"]
    assert np.all(certified < baseline["eps"].to_numpy()) and np.all(certified > 0)
    others, rate = count - 1, batch / count
    k_min = batch_sizes.size_threshold(others, rate, 1e-8)
    fail = batch_sizes.size_failure(others, rate, k_min)
    grid = batch_sizes.size_grid(others, rate, k_min, 64)
    weights = batch_sizes.lumped_size_log_weights(grid, others, rate)
    orders = [2.0, 4.0, 8.0, 16.0, 32.0]
    noise = SIGMA * CLIP / batch
    step_rdp = [float(certified_radius.mixture_rdp(
        np.array([(alpha - 1) * float(renyi_step.rdp_sgm(rate, noise / value, [alpha])[0])
                  for value in certified_radius.baseline_mean_sensitivity(CLIP, grid)]), weights, math.log(1 - fail), alpha))
        for alpha in orders]
    expected, _ = rdp_composition.rdp_to_eps(orders, 100 * np.array(step_rdp), 1e-5 - 100 * fail)
    # The script rounds Δ up by at most 1%: its baseline is at most a few percent above the exact one.
    assert float(expected) <= baseline["eps"].iloc[0] <= float(expected) * 1.03
    assert baseline["delta_fail"].iloc[0] == pytest.approx(fail)
    estimate, _ = accountant_output(tmp_path, run, "renyi_per_instance_sum_compo.py", rows, "--kind", "estimate",
                                    "--alpha", "2", "4", "8", "16", "32")
    assert set(estimate["kind"]) == {"estimate", "baseline"}
    assert np.all(estimate.loc[estimate["kind"] == "estimate", "eps"].to_numpy() <= certified.to_numpy() * 1.001)


def test_composition_refuses_a_rule_it_was_not_trained_with(tmp_path, run):
    rows = coupling_rows(scaled_rows(50, 2), [0], 8, SIGMA, CLIP, 1e-3, permutations=2).assign(update_rule="sum")
    os.makedirs(tmp_path / "res", exist_ok=True)
    rows.to_csv(tmp_path / "res" / "toy.csv", index=False)
    result = run("renyi_per_instance_sum_compo.py", "--res-name", "toy")
    assert result.returncode == 2 and "trained with the sum rule" in result.stderr


# --- identity 6: the certified event on a real checkpoint ---------------------------------------

def test_certified_event_holds_on_a_real_checkpoint(tmp_path):
    """||m(B) − μ_X|| > r_k for uniform k-subsets of a trained model's transformed gradients happens
    at a rate ≤ β (binomial margin), for §3.2's radius and §7.2's; a radius without the concentration
    term is exceeded often, so the check has the power to see a wrong r_k."""
    from perinstance.cli import options
    from perinstance.measure.gradient_rows import HeldRows
    from perinstance.train import training
    from perinstance.train.clipping import Transform
    from perinstance.train.data import load_dataset

    args = options.parse_training_flags(["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5",
                                     "--epochs", "1", "--models-dir", str(tmp_path)])
    outcome = training.train(args, quiet=True)
    metadata = outcome.run
    model, _ = training.load_model(metadata, outcome.run_dir, metadata.total_steps)
    dataset = load_dataset("synthetic")
    held = HeldRows.compute(model, dataset.train_x, dataset.train_y, Transform.of_run(metadata))
    gradients = held.take(np.arange(len(dataset.train_y))).double().numpy()
    others = gradients[1:]
    center = others.mean(axis=0)
    deviations = np.linalg.norm(others - center, axis=1)
    spread, largest = np.mean(deviations ** 2), deviations.max()
    rng = np.random.default_rng(3)
    failure, trials = 0.05, 3000
    for k in (4, 16, 64):
        distances = np.array([np.linalg.norm(others[rng.choice(len(others), k, replace=False)].mean(axis=0) - center)
                              for _ in range(trials)])
        radius = math.sqrt(spread / k) + largest * math.sqrt(2 * math.log(1 / failure) / k)
        assert np.sum(distances > radius) <= stats.binom.ppf(0.999, trials, failure)
        assert np.mean(distances > 0.5 * math.sqrt(spread / k)) > 0.5
        # §7.2's radius (the smaller of McDiarmid's and Pinelis's), at the tail levels the certified mixture uses.
        for level in (0.5, 0.2, 0.05, 0.01):
            radius = float(certified_radius.concentration_radius([spread], [largest], k, level)[0])
            assert np.sum(distances > radius) <= stats.binom.ppf(0.999, trials, level)


def test_composition_of_a_point_that_changes_nothing(tmp_path, run):
    """Identical gradients and k_min > 0: every Δ_B is 0, the estimate's per-step ρ is exactly 0 (not a
    rounding below it) and the composition finishes with the ε of a zero RDP curve."""
    gradients = np.tile(scaled_rows(1, 0), (N, 1))
    rows = pd.concat([coupling_rows(gradients, [0, 1], BATCH, SIGMA, CLIP, 1e-8, permutations=3).assign(step=step)
                      for step in (0, 50)], ignore_index=True)
    assert rows["k_min"].iloc[0] > 0
    output, result = accountant_output(tmp_path, run, "renyi_per_instance_sum_compo.py", rows, "--kind", "estimate",
                                       "--alpha", "2", "8")
    assert "Traceback" not in result.stderr
    estimate = output[output["kind"] == "estimate"]
    budget = 1e-5 - estimate["steps"].iloc[0] * estimate["delta_fail"].iloc[0]
    nothing, _ = rdp_composition.rdp_to_eps([2.0, 8.0], np.zeros(2), budget)
    assert len(estimate) == 2 and np.allclose(estimate["eps"], float(nothing), rtol=1e-9)

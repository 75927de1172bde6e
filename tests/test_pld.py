"""Composition by privacy loss distributions (docs/accounting.md §8).

Independent computations: dp_accounting's PLD accountant and its own compose/self_compose of the
same levels, the RDP accountant of §4, and the exact enumeration of tests/test_mean_rule.py's
one-dimensional toys.
"""

import math
import os

import dp_accounting
import numpy as np
import pandas as pd
import pytest
from conftest import assert_usage_error
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution
from scipy.special import logsumexp
from test_accountant_scripts import RATE, SIGMA, STEPS, grad_norm_rows
from test_mean_rule import Pair, accountant_output, batch_sensitivities, coupling_rows, scaled_rows, toys

from perinstance.accounting import batch_sizes, certified_radius, pld, pld_grid, rdp_composition

# The quick run's mechanism: q = 256/8000, σ for ε = 10 at δ = 1e-5 over T = 125 steps (Opacus RDP).
QUICK = dict(sample_rate=256 / 8000, noise_multiplier=0.608062744140625)
QUICK_STEPS = 125
QUICK_CHECKPOINTS = np.append(np.arange(0, QUICK_STEPS, 10), QUICK_STEPS)


def realistic_ratios(points, checkpoints, seed):
    """Δ*/Γ per point and checkpoint: at Γ early, most points well below it later, ~8% at Γ throughout."""
    rng = np.random.default_rng(seed)
    late = rng.beta(2, 5, size=points)
    decay = np.exp(-np.arange(checkpoints) / 3.0)
    ratio = np.minimum(1.0, late[:, None] * (1 - decay) + decay * rng.uniform(0.5, 1.0, size=(points, 1)))
    ratio[rng.random(points) < 0.08] = 1.0
    return ratio


def direct_pld(levels_and_steps, sample_rate, interval, noise_std=1.0):
    """dp_accounting's own composition: a list of (mixture [(Δ, weight)], steps) per segment."""
    composed = None
    for components, steps in levels_and_steps:
        mixture, mass = None, 0.0
        for sensitivity, weight in components:
            one = privacy_loss_distribution.from_gaussian_mechanism(
                noise_std / sensitivity, sampling_prob=sample_rate, value_discretization_interval=interval)
            mixture = one if mixture is None else mixture.compute_mixture(one, mass / (mass + weight))
            mass += weight
        block = mixture.self_compose(int(steps))
        composed = block if composed is None else composed.compose(block)
    return composed


def direct_eps(distribution, delta):
    return (distribution._pmf_remove.get_epsilon_for_delta(delta), distribution._pmf_add.get_epsilon_for_delta(delta))


# --- (a) at Γ throughout: dp_accounting's PLD accountant -----------------------------------------

@pytest.mark.parametrize("sample_rate, sigma, steps, checkpoints, interval", [
    (256 / 8000, 0.608062744140625, 125, QUICK_CHECKPOINTS, 1e-3),
    (0.01, 1.0, 60, [0, 7, 30], 1e-4),
    (0.5, 2.0, 20, [5, 10], 1e-3),  # steps 1..5 before the first checkpoint use Γ
    (1.0, 1.5, 10, [0], 1e-3),
])
def test_at_the_clip_bound_equals_the_pld_accountant(sample_rate, sigma, steps, checkpoints, interval):
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(sigma)), steps)
    for delta in (1e-5, 1e-3):
        eps = pld.sum_rule_eps(np.ones((1, len(checkpoints))), checkpoints, steps, sample_rate=sample_rate,
                               noise_multiplier=sigma, delta=delta, interval=interval)
        assert eps.max[0] == pytest.approx(accountant.get_epsilon(delta), rel=1e-6, abs=1e-8)
        assert eps.max[0] >= accountant.get_epsilon(delta) - 1e-9
        assert eps.add[0] <= eps.remove[0] + 1e-12


# --- (b) never above the RDP accountant ------------------------------------------------------

def test_sum_rule_below_rdp_on_realistic_inputs():
    ratios = realistic_ratios(60, len(QUICK_CHECKPOINTS), seed=0)
    orders = np.array(rdp_composition.COMPOSITION_ORDERS)
    levels = rdp_composition.sensitivity_levels(0.01, ratios)
    table = rdp_composition.RdpTable(QUICK["sample_rate"], QUICK["noise_multiplier"], orders, levels)
    rdp = rdp_composition.compose_rdp(table, ratios.T[None], QUICK_CHECKPOINTS, QUICK_STEPS, orders, math.inf)
    rdp_eps, _ = rdp_composition.rdp_to_eps(orders, rdp, 1e-5)
    eps = pld.sum_rule_eps(ratios, QUICK_CHECKPOINTS, QUICK_STEPS, delta=1e-5, rounding=0.01, **QUICK)
    assert np.all(eps.max <= rdp_eps)
    assert np.median(eps.max / rdp_eps) < 0.95  # PLD is tighter, not merely equal


def certified_inputs(distances, checkpoints, n=7999, batch=256, size_delta=8e-10):
    """Per point (its d* in `distances`, v_X = 0.3, b_X = 1.5) and checkpoint the certified Δ̄_k on
    the size grid of §3.2, with its log-weights."""
    rate = batch / (n + 1)
    k_min = batch_sizes.size_threshold(n, rate, size_delta)
    delta_size = batch_sizes.size_failure(n, rate, k_min)
    grid = batch_sizes.size_grid(n, rate, k_min, 64)
    log_weights = batch_sizes.lumped_size_log_weights(grid, n, rate)
    distance = np.repeat(distances, checkpoints)
    bound = certified_radius.certified_sensitivity(distance, np.full(distance.shape, 0.3), np.full(distance.shape, 1.5),
                                                   1.0, grid, delta_size)
    return bound.reshape(len(distances), checkpoints, -1), log_weights, delta_size, rate


def test_mean_rule_certified_below_rdp():
    steps, checkpoints = 40, np.array([0, 10, 20, 30])
    bound, log_weights, delta_size, rate = certified_inputs([0.1, 0.6, 1.4], len(checkpoints))
    fail = 2 * delta_size  # β = δ_size
    noise_std = QUICK["noise_multiplier"] / 256
    law = pld.step_law(bound, log_weights, math.log(1 - fail), dominate=True)
    eps = pld.mean_rule_eps(bound, law, checkpoints, steps, sample_rate=rate, noise_std=noise_std, delta=1e-5,
                            delta_fail=fail)
    orders = np.array(rdp_composition.COMPOSITION_ORDERS)
    table = rdp_composition.RdpTable(rate, noise_std, orders, certified_radius.geometric_levels(bound, 1e-2))
    # §3.2 per point, checkpoint and order: (λ−1)ρ = log Σ_k π_k·exp((λ−1)·RDP_SGM) − log(P(k ≥ k_min) − β).
    per_step = logsumexp(table.log_moments(bound) + log_weights[:, None], axis=2) - math.log(1 - fail)
    counts, _ = pld.segment_counts(checkpoints, steps)
    rdp = np.einsum("c,pco->po", counts, per_step) / (orders - 1)
    rdp_eps, _ = rdp_composition.rdp_to_eps(orders, rdp, 1e-5 - steps * fail)
    assert np.all(eps.max <= rdp_eps)
    assert np.all(eps.max > 0)


# --- (c) one step of the mean rule against the exact enumeration ------------------------------

def one_step(sensitivities, law, sample_rate, noise_std, delta, delta_fail=0.0):
    return pld.mean_rule_eps(np.asarray(sensitivities, dtype=float)[None, None], np.asarray(law)[None, None], [0], 1,
                             sample_rate=sample_rate, noise_std=noise_std, delta=delta, delta_fail=delta_fail)


def assert_exact_below(pair, eps, delta):
    """The exact hockey-stick at the ε a method gives is at most δ, in each direction."""
    for direction in pld_grid.DIRECTIONS:
        assert pair.hockey_stick(float(getattr(eps, direction)[0]), direction) <= delta + 1e-9, direction


@pytest.mark.parametrize("seed", [0, 7])
def test_one_step_of_the_mean_rule_bounds_the_exact_mixture(seed):
    for target, others, clip_bound, sample_rate, noise_std, _ in toys(8, seed=seed):
        pair = Pair(target, others, sample_rate, noise_std)
        table = batch_sensitivities(target, others, sample_rate)
        sensitivities = [value for value, _, _ in table]
        probabilities = [probability for _, _, probability in table]
        # The estimate with the exact expectation: every batch is a component.
        for delta in (1e-3, 1e-2):
            assert_exact_below(pair, one_step(sensitivities, probabilities, sample_rate, noise_std, delta), delta)
        # The certified bound with k_min = 0: Δ̄_k per size, weights π_k/(1 − β), δ_fail = β.
        failure = 1e-3
        center = np.mean(others)
        sizes = np.arange(len(others) + 1)
        bound = certified_radius.certified_sensitivity([abs(target - center)], [np.mean((others - center) ** 2)],
                                                       [np.max(np.abs(others - center))], clip_bound, sizes, failure)[0]
        law = pld.step_law(bound, batch_sizes.size_log_pmf(sizes, len(others), sample_rate), math.log(1 - failure),
                           dominate=True)
        for delta in (1e-2, 5e-2):
            assert_exact_below(pair, one_step(bound, law, sample_rate, noise_std, delta, failure), delta)


# --- (d) the aligned mixture is not a bound ---------------------------------------------------

def test_the_aligned_mixture_fails_where_the_revealed_batch_holds():
    target, others, sample_rate, noise_std, delta = 0.649, np.array([-0.318]), 0.3, 0.5, 2.6e-3
    pair = Pair(target, others, sample_rate, noise_std)
    table = batch_sensitivities(target, others, sample_rate)
    aligned = privacy_loss_distribution.from_mixture_gaussian_mechanism(
        noise_std, [0.0] + [value for value, _, _ in table],
        [1 - sample_rate] + [sample_rate * probability for _, _, probability in table],
        value_discretization_interval=pld_grid.DEFAULT_INTERVAL)
    assert aligned._pmf_remove.get_delta_for_epsilon(2.0) < 0.9 * pair.hockey_stick(2.0, "remove")
    assert pair.hockey_stick(aligned.get_epsilon_for_delta(delta), "remove") > delta
    revealed = one_step([value for value, _, _ in table], [probability for _, _, probability in table], sample_rate,
                        noise_std, delta)
    assert_exact_below(pair, revealed, delta)


# --- (e) the fast path against dp_accounting's own composition --------------------------------

def test_sum_rule_fast_path_bounds_direct_composition():
    steps, checkpoints, rounding = 40, np.array([0, 10, 25]), 0.05
    ratios = realistic_ratios(3, len(checkpoints), seed=3)
    eps = pld.sum_rule_eps(ratios, checkpoints, steps, delta=1e-5, rounding=rounding, **QUICK)
    counts, _ = pld.segment_counts(checkpoints, steps)
    for point in range(3):
        levels = np.ceil(ratios[point] / rounding - 1e-9) * rounding
        direct = direct_pld([([(level, 1.0)], count) for level, count in zip(levels, counts)],
                            QUICK["sample_rate"], pld_grid.DEFAULT_INTERVAL, QUICK["noise_multiplier"])
        for mine, theirs in zip((eps.remove[point], eps.add[point]), direct_eps(direct, 1e-5)):
            assert theirs - 1e-9 <= mine <= theirs + 1e-6


def test_mean_rule_fast_path_bounds_direct_composition():
    rng = np.random.default_rng(4)
    sample_rate, noise_std, steps, checkpoints = 0.05, 0.02, 30, np.array([0, 10, 20])
    sensitivities = rng.uniform(0.001, 0.03, size=(2, 3, 4))
    law = pld.step_law(sensitivities, np.log(rng.dirichlet(np.ones(4), size=(2, 3))), 0.0, dominate=False)
    eps = pld.mean_rule_eps(sensitivities, law, checkpoints, steps, sample_rate=sample_rate, noise_std=noise_std,
                            delta=1e-5, delta_fail=0.0, relative_step=1e-2)
    levels = certified_radius.geometric_levels(sensitivities / noise_std, 1e-2)
    for point in range(2):
        rounded = levels[np.searchsorted(levels, sensitivities[point] / noise_std)]
        direct = direct_pld([(list(zip(rounded[c], law[point, c])), 10) for c in range(3)], sample_rate,
                            pld_grid.DEFAULT_INTERVAL)
        for mine, theirs in zip((eps.remove[point], eps.add[point]), direct_eps(direct, 1e-5)):
            assert theirs - 1e-9 <= mine <= theirs + 1e-6


@pytest.mark.parametrize("length, first", [(1, 0), (5, 3), (255, 0), (256, 0), (257, 300), (3000, 0), (3000, 7)])
def test_epsilon_for_delta_is_dp_accountings(length, first):
    rng = np.random.default_rng(length + first)
    interval = 1e-2
    for delta in (0.3, 1e-3, 1e-6):
        infinity = np.array([0.0, 1e-7, 1e-4])
        probs = rng.dirichlet(np.full(length, 0.3), size=3) * (1 - infinity[:, None]) * rng.uniform(0.2, 1)
        eps = pld_grid.epsilon_for_delta(probs, first, interval, infinity, delta)
        for row in range(3):
            theirs = privacy_loss_distribution.pld_pmf.DensePLDPmf(interval, first, probs[row], infinity[row], True)
            expected = theirs.get_epsilon_for_delta(delta)
            if math.isinf(expected):
                assert math.isinf(eps[row])
            else:
                assert eps[row] == pytest.approx(expected, rel=1e-9, abs=1e-12), (row, delta)


# --- rounding, monotonicity, edges -----------------------------------------------------------

def test_rounding_up_and_monotone():
    ratios = realistic_ratios(8, 3, seed=6)
    checkpoints, steps = np.array([0, 10, 20]), 30
    exact = pld.sum_rule_eps(ratios, checkpoints, steps, delta=1e-5, rounding=0.0, **QUICK).max
    rounded = pld.sum_rule_eps(ratios, checkpoints, steps, delta=1e-5, rounding=0.05, **QUICK).max
    assert np.all(rounded >= exact) and np.any(rounded > exact)
    grid = np.linspace(0, 1, 6)[:, None] * np.ones((1, 3))
    eps = pld.sum_rule_eps(grid, checkpoints, steps, delta=1e-5, **QUICK)
    assert eps.max[0] == 0 and np.all(np.diff(eps.max) > 0)


def test_step_law_takes_the_largest_sensitivities_first():
    law = pld.step_law([1.0, 3.0, 2.0], np.log([0.3, 0.5, 0.4]), 0.0, dominate=True)
    assert law == pytest.approx([0.1, 0.5, 0.4])
    with pytest.raises(ValueError, match="cannot bound"):
        pld.step_law([1.0, 3.0], np.log([0.3, 0.5]), 0.0, dominate=True)
    with pytest.raises(ValueError, match="not 1"):
        pld.step_law([1.0, 3.0], np.log([0.3, 0.5]), 0.0, dominate=False)
    assert np.isnan(pld.step_law([[1.0, 2.0]], [[np.nan, 0.0]], 0.0, dominate=False)).all()


def test_estimate_weights_and_undefined_points():
    log_weights = pld.estimate_log_weights([[3, 5, 5, np.nan], [3, 3, 3, 3]], [3, 5], np.log([0.25, 0.75]))
    assert np.exp(log_weights[0]) == pytest.approx([0.25, 0.375, 0.375, 0.0])
    assert np.isnan(log_weights[1]).all()  # no sample of size 5
    sensitivities = np.array([[[0.01, 0.02, 0.03, np.nan]], [[0.01, 0.01, 0.01, 0.01]]])
    law = pld.step_law(sensitivities, log_weights[:, None, :], 0.0, dominate=False)
    eps = pld.mean_rule_eps(sensitivities, law, [0], 10, sample_rate=0.1, noise_std=0.05, delta=1e-5, delta_fail=0.0)
    assert eps.max[0] > 0 and np.isnan(eps.max[1])
    spent = pld.mean_rule_eps(sensitivities[:1], law[:1], [0], 10, sample_rate=0.1, noise_std=0.05, delta=1e-5,
                              delta_fail=1e-6)
    assert spent.max[0] == math.inf


def test_mean_rule_before_the_first_checkpoint_uses_the_given_law():
    sensitivities = np.full((1, 1, 2), 0.01)
    law = np.full((1, 1, 2), 0.5)
    with pytest.raises(ValueError, match="before_first"):
        pld.mean_rule_eps(sensitivities, law, [5], 10, sample_rate=0.1, noise_std=0.05, delta=1e-5, delta_fail=0.0)
    later = pld.mean_rule_eps(sensitivities, law, [5], 10, sample_rate=0.1, noise_std=0.05, delta=1e-5,
                              delta_fail=0.0, before_first=([0.05, 0.02, 0.01], [0.2, 0.3, 0.5]))
    throughout = pld.mean_rule_eps(sensitivities, law, [0], 10, sample_rate=0.1, noise_std=0.05, delta=1e-5,
                                   delta_fail=0.0)
    assert later.max[0] > throughout.max[0]


@pytest.mark.parametrize("noise_multiplier, sample_rate, interval", [
    (0.608, 0.032, 1e-3), (12.16, 0.032, 1e-3), (0.2, 0.3, 1e-3), (1.5, 1.0, 1e-3), (0.9, 0.01, 1e-4)])
def test_level_pmfs_are_dp_accountings(noise_multiplier, sample_rate, interval):
    mine = pld_grid.subsampled_gaussian_pmfs([noise_multiplier], sample_rate, interval)
    theirs = privacy_loss_distribution.from_gaussian_mechanism(noise_multiplier, sampling_prob=sample_rate,
                                                               value_discretization_interval=interval)
    for direction, pmf in (("remove", theirs._pmf_remove), ("add", theirs._pmf_add)):
        dense, own = pmf.to_dense_pmf(), mine[direction][0]
        assert (own.lower, len(own.probs)) == (dense._lower_loss, len(dense._probs))
        assert np.abs(own.probs - dense._probs).max() < 1e-10
        assert own.infinity_mass == pytest.approx(dense._infinity_mass, rel=1e-9, abs=1e-300)


# --- renyi_per_instance_sum_compo.py --accountant pld ------------------------------------------

def test_script_sum_rule(tmp_path, run):
    pld_out, result = accountant_output(tmp_path, run, "renyi_per_instance_sum_compo.py", pd.DataFrame(grad_norm_rows()),
                                        "--accountant", "pld")
    assert "discretisation 0.001" in result.stdout
    assert set(pld_out["accountant"]) == {"pld"} and set(pld_out["discretization"]) == {pld_grid.DEFAULT_INTERVAL}
    assert pld_out["alpha"].isna().all()
    np.testing.assert_array_equal(pld_out["eps"], np.maximum(pld_out["eps_remove"], pld_out["eps_add"]))
    rdp_out, _ = accountant_output(tmp_path, run, "renyi_per_instance_sum_compo.py", pd.DataFrame(grad_norm_rows()),
                                   "--holder-b", "inf")
    assert set(rdp_out["accountant"]) == {"rdp"} and rdp_out["eps_remove"].isna().all()
    # Δ* at three checkpoints, held between them: a held-Δ* estimate by either accountant (accounting.md §4).
    assert set(pld_out["kind"]) == set(rdp_out["kind"]) == {"held_estimate", "baseline"}
    certified = pld_out[pld_out["kind"] == "held_estimate"].set_index("point")["eps"]
    assert np.all(certified < rdp_out[rdp_out["kind"] == "held_estimate"].set_index("point")["eps"])
    # Point 0 is at Γ throughout: the baseline, dp_accounting's accountant for T steps; point 1 is at 0.
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=pld_grid.DEFAULT_INTERVAL)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(RATE, dp_accounting.GaussianDpEvent(SIGMA)), STEPS)
    assert certified[0] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
    assert set(pld_out.loc[pld_out["kind"] == "baseline", "eps"]) == {certified[0]}
    assert certified[1] == 0


def test_script_sum_rule_takes_the_largest_sensitivity_of_several_runs(tmp_path, run):
    two = pd.DataFrame(grad_norm_rows(run="a") + grad_norm_rows(run="bb"))
    largest = two.assign(value=two.groupby(["step", "point"])["value"].transform("max"))
    several, _ = accountant_output(tmp_path, run, "renyi_per_instance_sum_compo.py", two, "--accountant", "pld")
    one, _ = accountant_output(tmp_path, run, "renyi_per_instance_sum_compo.py", largest[largest["run"] == "a"],
                               "--accountant", "pld")
    pd.testing.assert_frame_equal(several, one)


@pytest.mark.parametrize("flags, flag", [(["--holder-b", "3T"], "--holder-b"), (["--pld-interval", "0"], "--pld-interval"),
                                         (["--accountant", "prv"], "--accountant")])
def test_script_refuses(tmp_path, run, flags, flag):
    os.makedirs(tmp_path / "res")
    pd.DataFrame(grad_norm_rows()).to_csv(tmp_path / "res" / "toy.csv", index=False)
    assert_usage_error(run("renyi_per_instance_sum_compo.py", "--res-name", "toy", "--accountant", "pld", *flags), flag)


def test_script_mean_rule(tmp_path, run):
    rows = pd.concat([coupling_rows(scaled_rows(1000, 4), [0, 1, 2], 200, 1.0, 1.0, 1e-8, permutations=3,
                                    max_sizes=64).assign(step=step) for step in (0, 50)], ignore_index=True)
    script = "renyi_per_instance_sum_compo.py"
    by_kind = {}
    for kind in ("certified", "estimate"):
        for accountant in ("rdp", "pld"):
            frame, _ = accountant_output(tmp_path, run, script, rows, "--kind", kind, "--accountant", accountant)
            by_kind[kind, accountant] = frame.set_index(["kind", "point"])
    # Two checkpoints, held between them: the certified values compose to a held-Δ* estimate, the Monte Carlo ones
    # to an estimate (accounting.md §4; §3.5's project note).
    composed = {"certified": "held_estimate", "estimate": "estimate"}
    for kind in ("certified", "estimate"):
        pld_out, rdp_out = by_kind[kind, "pld"], by_kind[kind, "rdp"]
        assert set(pld_out.index.get_level_values("kind")) == {composed[kind], "baseline"}
        assert np.all(pld_out["eps"] < rdp_out["eps"])  # the kind's rows and the baseline's
        np.testing.assert_array_equal(pld_out["delta_fail"], rdp_out["delta_fail"])
        assert np.all(pld_out.loc[composed[kind], "eps"] < pld_out.loc["baseline", "eps"])
    assert np.all(by_kind["estimate", "pld"].loc["estimate", "eps"]
                  <= by_kind["certified", "pld"].loc["held_estimate", "eps"])


def test_blocked_moment_generating_function():
    for interval in (1e-3, 1e-2):
        pmfs = pld_grid.subsampled_gaussian_pmfs([0.3, 5.0], 0.05, interval)
        for pmf in pmfs["remove"] + pmfs["add"]:
            losses = (pmf.lower + np.arange(len(pmf.probs))) * interval
            with np.errstate(divide="ignore"):
                direct = logsumexp(pld_grid.CHERNOFF_ORDERS[:, None] * losses + np.log(pmf.probs), axis=1)
            np.testing.assert_allclose(pmf.log_mgf(pld_grid.CHERNOFF_ORDERS, interval), direct, rtol=1e-12, atol=1e-12)

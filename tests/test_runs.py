"""The typed run (runs.RunConfig, run.json) and the mechanism the accountants see (mechanism.py)."""

import dataclasses
import json

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp
from scipy.optimize import brentq
from scipy.stats import binom

from perinstance.accounting import exact_eps_delta, rdp_composition
from perinstance.accounting.mechanism import Mechanism, rule_noise_std
from perinstance.cli import options
from perinstance.errors import UsageError
from perinstance.train import run_plan, runs
from perinstance.train.data import load_dataset

SYNTHETIC = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5"]


def planned(*argv):
    args = run_plan.resolve_training_args(options.parse_training_flags([*SYNTHETIC, *map(str, argv)]))
    return run_plan.plan_run(args, load_dataset("synthetic"))


def test_run_json_round_trip_and_frozen(tmp_path):
    run = planned("--sigma", "0.9", "--dec-lr", "2", "--momentum", "0.5", "--track-points", "0-3")
    runs.save_run(tmp_path, run)
    assert runs.load_run(tmp_path) == run
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.total_steps = 1
    assert run.tracked_points == (0, 1, 2, 3) and run.dec_lr == (2.0,) and run.momentum == 0.5


def test_format_1_run_json_reads_as_the_same_run(tmp_path):
    """A run.json written before format 2 (flags under "args", no optimizer fields) is the same run."""
    run = planned("--eps", "5", "--optimizer", "adam", "--gamma", "0.5", "--dec-lr", "1", "3")
    old = run.to_json()
    old["format"] = 1
    old["args"] = old.pop("flags")
    for name in ("lr", "optimizer", "momentum", "gamma", "dec_lr"):
        del old[name]
    (tmp_path / "run.json").write_text(json.dumps(old))
    assert runs.load_run(tmp_path) == run


@pytest.mark.parametrize("change, message", [
    (lambda data: {**data, "format": 3}, "has format 3, newer"),
    (lambda data: {**data, "momentum": 1.5}, "momentum is 1.5, expected a number in [0, 1)"),
    (lambda data: {key: value for key, value in data.items() if key != "lr"}, "lacks the key lr"),
    (lambda data: [1, 2], "holds a JSON array"),
])
def test_a_damaged_run_json_is_one_line_naming_the_file(tmp_path, change, message):
    (tmp_path / "run.json").write_text(json.dumps(change(planned("--sigma", "1").to_json())))
    with pytest.raises(UsageError) as error:
        runs.load_run(tmp_path)
    assert message in str(error.value) and "run.json" in str(error.value)


@pytest.mark.parametrize("rule", ["sum", "mean"])
def test_mechanism_of_a_run_by_hand(rule):
    run = planned("--sigma", "1.3", "--cn", "2", "--reduction", rule)
    mechanism = Mechanism.of_run(run)
    assert mechanism.rule == rule and mechanism.sample_rate == 32 / len(load_dataset("synthetic").train_y)
    expected = 1.3 * 2 / (32 if rule == "mean" else 1)  # σΓ, or σΓ/B_exp (accounting.md §1)
    assert mechanism.noise_std == pytest.approx(expected, rel=1e-15)
    assert Mechanism.of_run(run, "sum").noise_std == pytest.approx(2.6, rel=1e-15)
    assert rule_noise_std(np.array([1.3, 1.3]), 2.0, 32, np.array(["sum", "mean"])) == pytest.approx([2.6, 2.6 / 32])


def test_baseline_eps_is_opacus_rdp_accountant():
    """The worst-case baseline is what Opacus's own accountant reports for the same run."""
    mechanism = Mechanism(noise_multiplier=1.1, clip_bound=1.0, sample_rate=0.01, batch_size=100,
                          dataset_size=10_000, total_steps=1_000, rule="sum")
    accountant = RDPAccountant()
    accountant.history = [(1.1, 0.01, 1_000)]
    orders = rdp_composition.COMPOSITION_ORDERS
    eps, order = mechanism.baseline_eps(1e-5)
    assert eps == pytest.approx(accountant.get_epsilon(1e-5, alphas=orders), rel=1e-12)
    assert mechanism.baseline_eps(1e-5, steps=10)[0] < eps
    np.testing.assert_allclose(mechanism.baseline_rdp([2.0, 8.0], steps=3),
                               compute_rdp(q=0.01, noise_multiplier=1.1, steps=3, orders=[2.0, 8.0]), rtol=1e-12)


def test_per_step_baseline_of_the_sum_rule_is_one_step_of_the_pld_accountant():
    mechanism = Mechanism(noise_multiplier=1.0, clip_bound=3.0, sample_rate=0.0625, batch_size=4, dataset_size=64,
                          total_steps=32, rule="sum")
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(0.0625, dp_accounting.GaussianDpEvent(1.0)))
    eps, k_min, delta_size = mechanism.per_step_baseline_eps(1e-5)
    assert eps == pytest.approx(accountant.get_epsilon(1e-5), rel=2e-3) and (k_min, delta_size) == (0, 0.0)


@pytest.mark.parametrize("size_delta, k_min", [(None, 0), (0.04, 1)])
def test_per_step_baseline_of_the_mean_rule_by_hand(size_delta, k_min):
    """accounting.md §3.2-§3.4 assembled by hand on N = 6, q = 1/2 (P(k = 0) = 1/32): the smallest ε with
    Σ_{k ≥ k_min} π_k·δ(ε; Δ̄_k/s) + P(k < k_min) <= δ in both directions, Δ̄_0 = Γ, Δ̄_k = 2Γ/(k+1)."""
    clip_bound, sigma, batch_size, delta = 0.5, 2.0, 3, 0.05
    mechanism = Mechanism(noise_multiplier=sigma, clip_bound=clip_bound, sample_rate=0.5, batch_size=batch_size,
                          dataset_size=6, total_steps=1, rule="mean")
    sizes = np.arange(k_min, 6)
    weights = binom.pmf(sizes, 5, 0.5)
    mu = np.array([clip_bound if size == 0 else 2 * clip_bound / (size + 1) for size in sizes]) / (
        sigma * clip_bound / batch_size)
    fail = 1 / 32 if k_min else 0.0

    def excess(eps):
        return max(np.sum(weights * exact_eps_delta.delta_remove(eps, mu, 0.5)),
                   np.sum(weights * exact_eps_delta.delta_add(eps, mu, 0.5))) + fail - delta

    eps, found_k_min, delta_size = mechanism.per_step_baseline_eps(delta, size_delta)
    assert (found_k_min, delta_size) == (k_min, pytest.approx(fail, rel=1e-12))
    assert eps == pytest.approx(brentq(excess, 0.0, 50.0, xtol=1e-12), rel=1e-7)

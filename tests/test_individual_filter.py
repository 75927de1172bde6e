"""The filter's mathematics (docs/accounting.md §12.1-§12.2, §12.5 identity 3) against Opacus and exact sums."""

import math
import warnings

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from perinstance.accounting import individual_filter


@pytest.mark.parametrize("order", [1.5, 2.7, 8.0, 32.0])
@pytest.mark.parametrize("target", [4.0, 10.0])
def test_budget_converts_back_through_opacus(order, target):
    """§12.1: Opacus's get_privacy_spent at the one order λ_f turns the budget back into the target ε."""
    delta = 1e-5
    try:
        budget = individual_filter.budget_rdp([target], delta, order)[0]
    except ValueError:
        assert target + individual_filter.conversion_gap(delta, order) <= 0
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps, _ = get_privacy_spent(orders=[order], rdp=[budget], delta=delta)
    assert eps == pytest.approx(target, rel=1e-12)
    assert individual_filter.guarantee_eps(budget, delta, order) == pytest.approx(target, rel=1e-12)


def test_a_target_without_a_budget_is_refused():
    """§12.1's example: λ_f = 2 at δ = 1e-5 refuses every ε <= 10.1."""
    with pytest.raises(ValueError, match="no Rényi budget"):
        individual_filter.budget_rdp([10.0], 1e-5, 2.0)
    assert individual_filter.budget_rdp([10.2], 1e-5, 2.0)[0] > 0
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            individual_filter.budget_rdp([bad], 1e-5, 8.0)


@pytest.mark.parametrize("order", [2.0, 3.5, 8.0])
def test_charges_are_opacus_rdp_of_the_scaled_noise(order):
    """§12.2: ρ = RDP_SGM(q, σ/r; λ_f), 0 at r = 0, by Opacus's compute_rdp (at least it: fractional orders may be
    rounded up)."""
    sample_rate, noise = 0.032, 0.9
    ratios = np.array([0.0, 1e-4, 0.05, 0.3, 0.999, 1.0, 0.3])
    charges = individual_filter.step_charges(sample_rate, noise, ratios, order)
    assert charges[0] == 0
    for ratio, charge in zip(ratios[1:], charges[1:]):
        expected = compute_rdp(q=sample_rate, noise_multiplier=noise / ratio, steps=1, orders=[order])[0]
        # Charges below 1e-9 lose digits to cancellation in both codes; they weigh nothing in a budget.
        assert charge == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert charges[3] == charges[6]
    with pytest.raises(ValueError):
        individual_filter.step_charges(sample_rate, noise, [1.5], order)


def test_full_charges_last_exactly_the_uniform_runs_steps():
    """§12.5 identity 3: with every r = 1 and the budget the uniform run's RDP after T steps (Opacus: T times one
    step's, here of the suite's one-step RDP), every point is active for exactly T steps, at T ≈ 6·10⁴, where a plain
    float sum stops one step early."""
    sample_rate, noise, order = 0.01, 1.0, 8.0
    charge = individual_filter.uniform_charge(sample_rate, noise, order)
    for steps in (60_000, 61_234):
        budget = steps * charge
        assert budget == pytest.approx(compute_rdp(q=sample_rate, noise_multiplier=noise, steps=steps,
                                                   orders=[order])[0], rel=1e-12)
        state = individual_filter.FilterState(np.full(2, budget))
        plain, plain_steps = 0.0, 0
        for step in range(1, steps + 3):
            state.step(step, np.full(2, charge))
            if plain + charge <= budget:
                plain, plain_steps = plain + charge, plain_steps + 1
        assert list(state.left_at) == [steps + 1, steps + 1]
        assert individual_filter.uniform_steps(sample_rate, noise, budget, order) == steps
        assert state.spent[0] == math.fsum([charge] * steps)
        assert plain_steps == steps - 1  # the counter-example the exact sum avoids


def test_rule_charges_active_points_only_and_never_readmits():
    """§12.2: a point whose next charge would pass its budget leaves for good and is charged nothing more."""
    state = individual_filter.FilterState([1.0, 1.0, 0.5])
    assert list(state.step(1, [0.4, 0.2, 0.6])) == [True, True, False]
    assert list(state.step(2, [0.4, 0.9, 0.0])) == [True, False, False]
    assert list(state.step(3, [0.0, 0.0, 0.0])) == [True, False, False]
    assert list(state.left_at) == [0, 2, 1]
    np.testing.assert_allclose(state.spent, [0.8, 0.2, 0.0])
    restored = individual_filter.FilterState.from_state_dict(state.state_dict())
    assert list(restored.step(4, [0.3, 0.0, 0.0])) == [False, False, False]
    assert list(restored.left_at) == [4, 2, 1]
    with pytest.raises(ValueError):
        state.step(5, [math.nan, 0.0, 0.0])
    with pytest.raises(ValueError):
        individual_filter.FilterState([1.0, -1.0])


def test_default_order_maximises_the_uniform_runs_steps():
    """The default λ_f: no order of the grid lets uniform DP-SGD at (σ, q) take more steps within the budget."""
    sample_rate, noise, target, delta = 0.032, 0.9, 8.0, 1e-5
    chosen = individual_filter.default_order(sample_rate, noise, target, delta)

    def steps_at(order):
        budget = target + individual_filter.conversion_gap(delta, order)
        return -1 if budget <= 0 else individual_filter.uniform_steps(sample_rate, noise, budget, order)

    best = max(steps_at(order) for order in individual_filter.DEFAULT_ORDER_GRID)
    assert steps_at(chosen) == best > 0

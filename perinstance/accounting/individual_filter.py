"""The individual Rényi filter of docs/accounting.md §12 (Feldman & Zrnic, "Individual Privacy Accounting via a
Rényi Filter", NeurIPS 2021): budgets at one Rényi order, per-step charges, and the rule that takes a point out of
training for good once its next charge would pass its budget. Pure functions on numbers and arrays: no torch, no I/O.
"""

import math

import numpy as np
from numpy.typing import ArrayLike

from perinstance.accounting.numerics import check_noise, check_probability, check_sample_rate
from perinstance.accounting.rdp_composition import COMPOSITION_ORDERS
from perinstance.accounting.renyi_step import rdp_sgm_levels

# The orders the default of --filter-order is chosen from (default_order): the composition's grid up to 64. Larger
# orders only pay off for budgets far above the ε that DP-SGD is trained to.
DEFAULT_ORDER_GRID = tuple(order for order in COMPOSITION_ORDERS if order <= 64)


def check_order(order: float) -> float:
    """λ_f as a float, refused (ValueError) unless finite and > 1."""
    order = float(order)
    if not (order > 1 and math.isfinite(order)):
        raise ValueError(f"order must be a finite Rényi order > 1, not {order!r}")
    return order


def conversion_gap(delta: float, order: float) -> float:
    """What §12.1's conversion subtracts from a Rényi budget to give ε: B − ε = (log δ + log λ)/(λ − 1) −
    log((λ − 1)/λ) (Opacus's get_privacy_spent at one order; negative for every δ < 1/λ)."""
    check_probability("delta", delta)
    order = check_order(order)
    return (math.log(delta) + math.log(order)) / (order - 1) - math.log((order - 1) / order)


def budget_rdp(target_eps: ArrayLike, delta: float, order: float) -> np.ndarray:
    """§12.1: the Rényi budget B_i at order λ_f of each target ε_i at δ. A target that gives B_i <= 0 at this order
    is refused (ValueError naming the smallest target the order allows)."""
    target_eps = np.asarray(target_eps, dtype=float)
    if not np.all(np.isfinite(target_eps) & (target_eps > 0)):
        raise ValueError("target ε must be finite and > 0")
    gap = conversion_gap(delta, order)
    budget = target_eps + gap
    if np.any(budget <= 0):
        raise ValueError(f"a target ε of {float(target_eps[budget <= 0].min()):g} gives no Rényi budget at order "
                         f"{order:g} and δ={delta:g}: targets must exceed {-gap:.4g} at this order (a larger order "
                         "allows smaller targets)")
    return budget


def guarantee_eps(budget: ArrayLike, delta: float, order: float) -> np.ndarray:
    """The (ε, δ) guarantee of a point whose Rényi divergences at λ_f are at most `budget` (§12.3, §12.1's
    conversion): B − gap, floored at 0."""
    return np.maximum(np.asarray(budget, dtype=float) - conversion_gap(delta, order), 0.0)


def step_charges(sample_rate: float, noise_multiplier: float, sensitivity_ratio: ArrayLike,
                 order: float) -> np.ndarray:
    """§12.2: ρ_{i,t} = RDP_SGM(q, σ/r_{i,t}; λ_f) of each point's r = Δ*/Γ in [0, 1] (0 where r = 0), by the
    suite's RDP_SGM (renyi_step.rdp_sgm_levels: Opacus's values, an upper bound where a fractional order's series
    cancels)."""
    check_sample_rate(sample_rate)
    check_noise(noise_multiplier)
    order = check_order(order)
    ratio = np.asarray(sensitivity_ratio, dtype=float)
    if not np.all((ratio >= 0) & (ratio <= 1)):
        raise ValueError("sensitivity ratios Δ*/Γ must be in [0, 1]")
    charges = np.zeros(ratio.shape)
    moving = ratio > 0
    if moving.any():
        # One RDP_SGM per distinct ratio: points clipped at Γ, the common case early in training, share one.
        levels, where = np.unique(ratio[moving], return_inverse=True)
        charges[moving] = rdp_sgm_levels(sample_rate, noise_multiplier / levels, [order])[:, 0][where]
    return charges


def uniform_charge(sample_rate: float, noise_multiplier: float, order: float) -> float:
    """The charge of a point at the worst case Γ (r = 1): what uniform DP-SGD spends per step at λ_f."""
    return float(step_charges(sample_rate, noise_multiplier, [1.0], order)[0])


def uniform_steps(sample_rate: float, noise_multiplier: float, budget: float, order: float) -> int:
    """The steps uniform DP-SGD takes within a Rényi budget at λ_f: the largest t with t·ρ(1) <= B, in the
    filter's own arithmetic (FilterState: the exactly rounded running sum), so that a point charged ρ(1) at every
    step leaves the filter after exactly this many steps."""
    charge = uniform_charge(sample_rate, noise_multiplier, order)
    if charge == 0:
        raise ValueError("a step of zero charge never uses the budget")
    steps = int(budget // charge)
    # Floor division can be one off either way at a rounding boundary: settle it on the exact sums.
    while steps > 0 and math.fsum([charge] * steps) > budget:
        steps -= 1
    while math.fsum([charge] * (steps + 1)) <= budget:
        steps += 1
    return steps


def default_order(sample_rate: float, noise_multiplier: float, target_eps: float, delta: float,
                  orders: ArrayLike = DEFAULT_ORDER_GRID) -> float:
    """--filter-order's default: of `orders`, the one at which uniform DP-SGD at (σ, q) takes the most steps
    within the budget of `target_eps` at δ (ties: the smallest order). A point charged at Γ at every step then
    leaves the filter exactly where uniform DP-SGD at the same (ε, δ) would stop, and points charged less stay
    longer."""
    check_sample_rate(sample_rate)
    check_noise(noise_multiplier)
    best, best_steps = None, -1
    for order in orders:
        gap = conversion_gap(delta, order)
        if target_eps + gap <= 0:
            continue
        charge = uniform_charge(sample_rate, noise_multiplier, order)
        steps = math.inf if charge == 0 else (target_eps + gap) // charge
        if steps > best_steps:
            best, best_steps = float(order), steps
    if best is None:
        raise ValueError(f"no order of the grid gives a positive Rényi budget for ε = {target_eps:g} at "
                         f"δ = {delta:g}; give a larger budget or --filter-order")
    return best


class FilterState:
    """The filter's state over the points (§12.2): each point's charges so far as an exactly rounded running sum,
    whether it is still active, and the step it left at (0: still active).

    The running sums are double-double (hi + lo, error-free TwoSum): `spent` is the correctly rounded value of the
    exact sum of a point's charges, as math.fsum of all of them would give it, so that a point charged the same ρ
    at every step with budget fl(T·ρ) is active for exactly T steps (§12.5, identity 3), where a plain float sum
    can stop it a step early."""

    def __init__(self, budget: ArrayLike) -> None:
        budget = np.asarray(budget, dtype=float)
        if budget.ndim != 1 or not np.all(np.isfinite(budget) & (budget > 0)):
            raise ValueError("budgets must be a 1-D array of finite Rényi budgets > 0")
        self.budget = budget
        self.spent_hi = np.zeros(len(budget))
        self.spent_lo = np.zeros(len(budget))
        self.left_at = np.zeros(len(budget), dtype=np.int64)

    @property
    def active(self) -> np.ndarray:
        """Whether each point is still in the training set."""
        return self.left_at == 0

    @property
    def spent(self) -> np.ndarray:
        """Each point's charges so far, summed (the correctly rounded exact sum)."""
        return self.spent_hi + self.spent_lo

    def step(self, step: int, charges: ArrayLike) -> np.ndarray:
        """Apply the rule of step `step` (>= 1) with every point's charge of that step (§12.2; the charges of points
        no longer active are ignored). A point stays active iff its spent + charge <= its budget; it is charged
        then. Returns the boolean mask of the points active at this step (the only ones that may be drawn)."""
        charges = np.asarray(charges, dtype=float)
        if charges.shape != self.budget.shape or not np.all(np.isfinite(charges) & (charges >= 0)):
            raise ValueError("charges must be finite, >= 0, one per point")
        if not (isinstance(step, int | np.integer) and step >= 1):
            raise ValueError(f"step must be an integer >= 1, not {step!r}")
        hi, lo = _two_sum(self.spent_hi, charges)
        lo = lo + self.spent_lo
        hi, lo = _fast_two_sum(hi, lo)
        active = self.active & (hi <= self.budget)
        self.spent_hi = np.where(active, hi, self.spent_hi)
        self.spent_lo = np.where(active, lo, self.spent_lo)
        self.left_at = np.where(self.active & ~active, step, self.left_at)
        return active

    def state_dict(self) -> dict[str, np.ndarray]:
        """Arrays that restore the state exactly (load_state_dict)."""
        return {"budget": self.budget.copy(), "spent_hi": self.spent_hi.copy(), "spent_lo": self.spent_lo.copy(),
                "left_at": self.left_at.copy()}

    @classmethod
    def from_state_dict(cls, state: dict) -> "FilterState":
        filter_state = cls(state["budget"])
        for name in ("spent_hi", "spent_lo", "left_at"):
            value = np.asarray(state[name], dtype=getattr(filter_state, name).dtype)
            if value.shape != filter_state.budget.shape:
                raise ValueError(f"filter state {name} has shape {value.shape}, not {filter_state.budget.shape}")
            setattr(filter_state, name, value.copy())
        return filter_state


def _two_sum(first, second):
    """Knuth's TwoSum: (s, e) with s = fl(a + b) and s + e = a + b exactly."""
    total = first + second
    second_part = total - first
    error = (first - (total - second_part)) + (second - second_part)
    return total, error


def _fast_two_sum(large, small):
    """Dekker's FastTwoSum (|large| >= |small|): the renormalised pair, hi the correctly rounded sum."""
    total = large + small
    return total, small - (total - large)

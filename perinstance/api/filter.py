"""`IndividualFilter` (docs/api.md): the individual Rényi filter of docs/accounting.md §12 (Feldman & Zrnic) on
the API, shaped like Opacus's accountants. Each point has a budget, a target ε at δ turned into a Rényi budget at
one order λ_f (§12.1); every step charges each active point RDP_SGM(q, σ/r; λ_f) of its Δ*/Γ at the parameters the
step starts from, and a point whose next charge would pass its budget leaves training for good (§12.2). Then
`get_epsilon` is each point's guarantee (§12.3), over every trajectory; `composed_epsilon` is §4's composition
along the observed run, never above it. The mathematics is perinstance/accounting/individual_filter.py; `attach`
(api/opacus_filter.py) runs it on an Opacus loop.
"""

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike
from torch import nn
from torch.utils.data import DataLoader

from perinstance.accounting import individual_filter
from perinstance.accounting.guarantees import Kind
from perinstance.analysis import composition
from perinstance.api import arguments, opacus_filter
from perinstance.api.accountant import DEFAULT_ORDERS, RATIO_TOLERANCE, IndividualAccountant, checked_ratios


class IndividualFilter:
    """Per-point budgets for DP-SGD's sum rule (Opacus's update), kept by an individual Rényi filter.

    num_points: the training points, every one of the training set, in the dataset's order. target_epsilon: each
    point's target ε at target_delta (one number for all, or one per point), turned into a Rényi budget at the one
    order `order` (§12.1); None chooses it when the order is first needed (at `attach`, or at the first `step`)
    by individual_filter.default_order from that step's σ and q and the smallest target: the order at which
    uniform DP-SGD at (σ, q) runs the most steps within that target, so that a point charged at Γ at every step
    leaves where uniform DP-SGD at the same (ε, δ) would stop. Every bad argument is a one-line ValueError.
    """

    def __init__(self, num_points: int, target_epsilon: float | ArrayLike, target_delta: float, *,
                 order: float | None = None) -> None:
        self._accountant = IndividualAccountant(num_points)  # checks num_points
        self.num_points = self._accountant.num_points
        self.target_epsilon = _targets(target_epsilon, self.num_points)
        self.target_delta = arguments.probability("target_delta", target_delta)
        self._order = None
        self._state = None
        self._attached = False
        if order is not None:
            self._fix_order(_order(order))

    def _fix_order(self, order):
        try:
            budget = individual_filter.budget_rdp(self.target_epsilon, self.target_delta, order)
        except ValueError as error:
            raise ValueError(f"target_epsilon: {error}") from None
        self._order, self._state = order, individual_filter.FilterState(budget)

    def choose_order(self, noise_multiplier: float, sample_rate: float) -> float:
        """The filter's order λ_f: the one given, or else, the first time, individual_filter.default_order for the
        smallest target at (σ, q), fixed from then on. attach and the first step call it."""
        if self._order is None:
            noise_multiplier = arguments.positive_finite("noise_multiplier", noise_multiplier)
            sample_rate = arguments.sample_rate(sample_rate)
            smallest = float(self.target_epsilon.min())
            try:
                order = individual_filter.default_order(sample_rate, noise_multiplier, smallest, self.target_delta)
            except ValueError:
                raise ValueError(f"target_epsilon: no order up to {individual_filter.DEFAULT_ORDER_GRID[-1]} gives "
                                 f"ε = {smallest:g} a Rényi budget at δ = {self.target_delta:g}; give a larger "
                                 "target or an order") from None
            self._fix_order(order)
        return self._order

    @property
    def order(self) -> float | None:
        """λ_f, the one Rényi order of the budgets and charges (None until chosen)."""
        return self._order

    def _filter_state(self, what):
        if self._state is None:
            raise ValueError(f"{what}: the filter's order is chosen at attach or at the first step; give order= "
                             "to fix it at construction")
        return self._state

    @property
    def budget(self) -> np.ndarray:
        """Each point's Rényi budget B_i at λ_f (§12.1)."""
        return self._filter_state("budget").budget.copy()

    @property
    def spent(self) -> np.ndarray:
        """Each point's charges so far at λ_f, summed exactly (§12.2; zeros before the order is chosen). Data
        dependent: publishing them is a release about the points (§12.6)."""
        return np.zeros(self.num_points) if self._state is None else self._state.spent

    @property
    def active(self) -> np.ndarray:
        """Whether each point is still in the training set (the points the next step may draw)."""
        return np.ones(self.num_points, dtype=bool) if self._state is None else self._state.active

    @property
    def left_at(self) -> np.ndarray:
        """The step at which each point left the training set (int64; 0: still active). A point that left at step
        t was in the batches of steps < t only."""
        return np.zeros(self.num_points, dtype=np.int64) if self._state is None else self._state.left_at.copy()

    @property
    def num_steps(self) -> int:
        """The steps taken so far."""
        return self._accountant.num_steps

    @property
    def accountant(self) -> IndividualAccountant:
        """The steps as an IndividualAccountant: per step (σ, q) and each point's Δ*/Γ, 0 from the step it left."""
        return self._accountant

    @property
    def kind(self) -> str:
        """What get_epsilon gives: "guarantee" (§12.3, over every trajectory)."""
        return Kind.GUARANTEE.value

    @property
    def composed_kind(self) -> str:
        """What composed_epsilon gives: "certified", a bound along the observed run (§4; Δ* measured at every
        step, as the filter's charges need)."""
        return Kind.CERTIFIED.value

    @classmethod
    def mechanism(cls) -> str:
        """The accounting mechanism's name, as Opacus's accountants give theirs (state_dict records it)."""
        return "individual_filter"

    def __len__(self) -> int:
        return len(self._accountant)

    def step(self, *, noise_multiplier: float, sample_rate: float,
             sensitivity_ratios: ArrayLike | torch.Tensor) -> np.ndarray:
        """The rule of step t = num_steps + 1 (§12.2), before its batch is drawn: each active point is charged
        RDP_SGM(q, σ/r; λ_f) of its r = Δ*/Γ at the parameters the step starts from, θ_{t−1}, and stays active iff
        its charges, this one included, are at most its budget. Returns the boolean mask of the points the step
        may draw: draw the Poisson batch over all points as usual and drop the others (attach does it).

        sensitivity_ratios: num_points values; the active points' in [0, 1] (within 1e-6 of 1, a float32 clipped
        norm over C, counts as 1), the others' are ignored (they are not measured). They must be measured at θ_{t−1}:
        a value held from an earlier step is not a bound, and the guarantee needs bounds (§12.4)."""
        noise_multiplier = arguments.positive_finite("noise_multiplier", noise_multiplier)
        sample_rate = arguments.sample_rate(sample_rate)
        ratio = checked_ratios(sensitivity_ratios, self.num_points, active=self.active)
        order = self.choose_order(noise_multiplier, sample_rate)
        # A clipped norm min(||g||, C) in float32 over C lands within a few ulps of 1, on either side: it counts as
        # Γ (rounding up keeps a charge a bound, §5), so that points clipped at every step leave where uniform
        # DP-SGD stops (§12.5 identity 3).
        ratio = np.where(ratio >= 1 - RATIO_TOLERANCE, 1.0, ratio)
        charges = self._charges(sample_rate, noise_multiplier, ratio, order)
        active = self._state.step(self.num_steps + 1, charges)
        self._accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                              sensitivity_ratios=np.where(active, ratio, 0.0), measured=True)
        return active.copy()

    def _charges(self, sample_rate, noise_multiplier, sensitivity_ratio, order):
        """ρ_{i,t} of every point (§12.2): the inactive ones' ratios are 0, so they cost nothing."""
        return individual_filter.step_charges(sample_rate, noise_multiplier, sensitivity_ratio, order)

    def get_epsilon(self, delta: float | None = None) -> np.ndarray:
        """Each point's guarantee (kind "guarantee", §12.3): ε_i such that the whole run, however long, is
        (ε_i, delta)-DP for point i, both directions, whatever trajectory is released. At target_delta (None) it is
        the target; at another δ it is the Rényi budget converted at λ_f (§12.1's conversion with that δ; the
        budget holds at λ_f only, so other orders cannot improve it). Not a report on this run: composed_epsilon
        is that."""
        if delta is None or delta == self.target_delta:
            if self._order is None:
                return self.target_epsilon.copy()
            delta = self.target_delta
        delta = arguments.probability("delta", delta)
        budget = self._filter_state("delta other than target_delta").budget
        return individual_filter.guarantee_eps(budget, delta, self._order)

    def composed_epsilon(self, delta: float | None = None, *, rounding: float = composition.SUM_RULE_ROUNDING,
                         orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
        """Each point's ε at `delta` (None: target_delta) along the observed run (kind "certified", §4): the steps'
        RDP_SGM of the Δ*/Γ recorded (0 from the step a point left) composed, converted at the best of `orders`
        (each Δ*/Γ rounded up to a multiple of `rounding`, as IndividualAccountant.get_epsilon) and at λ_f with the
        exact charges: never above get_epsilon(delta), since the charges at λ_f sum to at most the budget. A bound
        conditional on the trajectory released, and itself a release about the points (§4)."""
        delta = self.target_delta if delta is None else arguments.probability("delta", delta)
        eps = self._accountant.get_epsilon(delta, orders=orders, rounding=rounding)
        if self._order is None:
            return eps
        return np.minimum(eps, individual_filter.guarantee_eps(self._state.spent, delta, self._order))

    def attach(self, optimizer: object, model: nn.Module, data: DataLoader, *, every: int = 1,
               loss_fn: Callable | None = None) -> DataLoader:
        """Run the filter on an Opacus loop (api/opacus_filter.py, docs/api.md): returns the DataLoader to train
        on, which draws exactly as `data` does and drops the points that left, charging each step before its
        batch is drawn. Opacus's own accountant keeps running unchanged. every: 1 (a filter measures Δ* at every
        step)."""
        if self._attached:
            raise ValueError("optimizer: this filter is attached already (one filter follows one run)")
        loader = opacus_filter.attach(self, optimizer, model, data, every=every, loss_fn=loss_fn)
        self._attached = True
        return loader

    def state_dict(self, destination: dict | None = None) -> dict:
        """The filter's state: `mechanism`, `num_points`, `target_epsilon` (float64 tensor), `target_delta`,
        `order` (None until chosen), `filter` (the exact running sums: budget, spent_hi, spent_lo, left_at as
        tensors; None until the order is chosen) and `accountant` (IndividualAccountant.state_dict of the steps).
        Saves with torch.save, loads with torch.load(weights_only=True). `destination`: a mapping to fill."""
        destination = {} if destination is None else destination
        destination["mechanism"] = self.mechanism()
        destination["num_points"] = self.num_points
        destination["target_epsilon"] = torch.from_numpy(self.target_epsilon.copy())
        destination["target_delta"] = self.target_delta
        destination["order"] = self._order
        destination["filter"] = None if self._state is None else {
            name: torch.from_numpy(value) for name, value in self._state.state_dict().items()}
        destination["accountant"] = self._accountant.state_dict()
        return destination

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the state of state_dict() of a filter of the same points, targets and δ (its order, where this
        one was given an order, the same too), exactly: a run resumes where it stopped."""
        keys = {"mechanism", "num_points", "target_epsilon", "target_delta", "order", "filter", "accountant"}
        if not isinstance(state_dict, Mapping) or not keys <= set(state_dict):
            raise ValueError(f"state_dict must be a mapping with keys {', '.join(sorted(keys))} (from state_dict())")
        if state_dict["mechanism"] != self.mechanism():
            raise ValueError(f"state_dict is of mechanism {state_dict['mechanism']!r}, not {self.mechanism()!r}")
        if state_dict["num_points"] != self.num_points:
            raise ValueError(f"state_dict has num_points={state_dict['num_points']!r}; this filter follows "
                             f"{self.num_points} points")
        if not (np.array_equal(np.asarray(state_dict["target_epsilon"], dtype=float), self.target_epsilon)
                and state_dict["target_delta"] == self.target_delta):
            raise ValueError("state_dict has other target_epsilon or target_delta than this filter")
        order = state_dict["order"]
        if (order is None) != (state_dict["filter"] is None) or (self._order is not None and order != self._order):
            raise ValueError(f"state_dict has order {order!r} and this filter {self._order!r}")
        accountant = IndividualAccountant(self.num_points)
        accountant.load_state_dict(state_dict["accountant"])
        state = None
        if order is not None:
            state = individual_filter.FilterState.from_state_dict(
                {name: np.asarray(value) for name, value in state_dict["filter"].items()})
            expected = individual_filter.budget_rdp(self.target_epsilon, self.target_delta, _order(order))
            if not np.array_equal(state.budget, expected):
                raise ValueError("state_dict's budgets are not those of its target_epsilon at its order")
            if state.left_at.max(initial=0) > accountant.num_steps:
                raise ValueError("state_dict has a point leaving after the last step it records")
        elif accountant.num_steps:
            raise ValueError("state_dict records steps but no order")
        self._order, self._state, self._accountant = (None if order is None else float(order)), state, accountant


def _targets(target_epsilon, num_points):
    """target_epsilon as num_points float64 values, each finite and > 0."""
    if isinstance(target_epsilon, torch.Tensor):
        target_epsilon = target_epsilon.detach().cpu().numpy()
    try:
        targets = np.array(target_epsilon, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"target_epsilon must be a number or one per point, not {target_epsilon!r:.60}") from None
    if targets.ndim == 0:
        targets = np.full(num_points, float(targets))
    if targets.shape != (num_points,):
        raise ValueError(f"target_epsilon must be one number or {num_points} (one per point), not shape "
                         f"{targets.shape}")
    bad = targets[~(np.isfinite(targets) & (targets > 0))]
    if bad.size:
        raise ValueError(f"target_epsilon must be finite and > 0, not {bad[0]!r}")
    return targets


def _order(order):
    return individual_filter.check_order(arguments.number("order", order))

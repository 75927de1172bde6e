"""`IndividualAccountant` (docs/api.md), shaped like Opacus's accountants: one `step` per optimizer step, with
each point's sensitivity Δ*/Γ of that step, and `get_epsilon(delta)` gives one ε per point. It composes the sum
rule exactly as renyi_per_instance_sum_compo.py does (docs/accounting.md §4 by Rényi DP, §8.2 by privacy loss
distributions): a run of steps with the same Δ* is a checkpoint of the scripts.
"""

import math
from collections.abc import Mapping, Sequence

import dp_accounting
import numpy as np
import torch
from numpy.typing import ArrayLike
from opacus.accountants import RDPAccountant

from perinstance.accounting import dp_events, pld, pld_grid, rdp_composition
from perinstance.accounting.guarantees import Kind
from perinstance.analysis import composition
from perinstance.api import arguments, opacus_hook

ACCOUNTANTS = ("rdp", "pld")
# The scripts' orders and Opacus's RDPAccountant's: ε at every sensitivity 1 is then never above Opacus's own,
# and never above the scripts' at their default --alpha.
DEFAULT_ORDERS = tuple(np.unique(np.concatenate([rdp_composition.COMPOSITION_ORDERS, RDPAccountant.DEFAULT_ALPHAS])))
# A clipped norm Δ* = min(||g||, C) divided by C can land a few float32 ulps above 1; such ratios count as 1.
RATIO_TOLERANCE = 1e-6


class IndividualAccountant:
    """Per-point privacy of DP-SGD's sum rule (Opacus's update) over the steps taken so far.

    num_points: the training points followed (any subset of the training set, in the order that
    `sensitivities` arrays use). Each `step` records one DP-SGD step: its noise multiplier σ,
    Poisson sample rate q and each point's Δ*/Γ (docs/accounting.md §2, at the parameters the step
    starts from), measured at that step or held from an earlier measurement (§4: then the composition is a
    held-Δ* estimate, `kind`). `history` holds (noise_multiplier, sample_rate, num_steps, sensitivity_ratios) with
    consecutive equal steps merged, as Opacus's RDPAccountant merges (σ, q); len() is its length.
    `attach` records the steps of an Opacus DPOptimizer by itself (api/opacus_hook.py).
    """

    def __init__(self, num_points: int) -> None:
        if isinstance(num_points, bool) or not isinstance(num_points, int | np.integer) or num_points < 1:
            raise ValueError(f"num_points must be an integer >= 1, not {num_points!r}")
        self.num_points = int(num_points)
        # (σ, q, steps, Δ*/Γ or None, how many of the steps measured their Δ*/Γ rather than held it)
        self._history: list[tuple[float, float, int, np.ndarray | None, int]] = []

    def _checked_ratios(self, sensitivity_ratios, name="sensitivity_ratios") -> np.ndarray | None:
        if sensitivity_ratios is None:
            return None
        sensitivity_ratio = np.minimum(checked_ratios(sensitivity_ratios, self.num_points, name), 1.0)
        sensitivity_ratio.flags.writeable = False
        return sensitivity_ratio

    def step(self, *, noise_multiplier: float, sample_rate: float,
             sensitivity_ratios: ArrayLike | torch.Tensor | None = None, measured: bool | None = None) -> None:
        """Record one step of Poisson rate `sample_rate` and noise multiplier `noise_multiplier`.

        sensitivity_ratios: Δ*/Γ of every point at this step (array-like or tensor of num_points values in
        [0, 1]); None: every point at the worst case 1. measured: whether they were measured at this step's
        parameters (True) or held from an earlier measurement (False: the composition is then a held-Δ*
        estimate, §4); None: measured unless they equal the previous step's values (held, as a loop that measures every k
        steps passes the same values k times).
        """
        noise_multiplier = arguments.positive_finite("noise_multiplier", noise_multiplier)
        sample_rate = arguments.sample_rate(sample_rate)
        sensitivity_ratio = self._checked_ratios(sensitivity_ratios)
        if measured is None:
            previous = self._history[-1][3] if self._history else None
            measured = (sensitivity_ratio is None or previous is None
                        or not np.array_equal(previous, sensitivity_ratio))
        elif not isinstance(measured, bool | np.bool_):
            raise ValueError(f"measured must be True, False or None, not {measured!r}")
        self._append(noise_multiplier, sample_rate, 1, sensitivity_ratio,
                     int(bool(measured) or sensitivity_ratio is None))

    def _append(self, noise_multiplier, sample_rate, num_steps, sensitivity_ratio, measured_steps):
        if self._history:
            last_noise, last_rate, last_steps, last_ratio, last_measured = self._history[-1]
            same_ratio = (last_ratio is None and sensitivity_ratio is None) or (last_ratio is not None and (
                sensitivity_ratio is not None and np.array_equal(last_ratio, sensitivity_ratio)))
            if last_noise == noise_multiplier and last_rate == sample_rate and same_ratio:
                self._history[-1] = (last_noise, last_rate, last_steps + num_steps, last_ratio,
                                     last_measured + measured_steps)
                return
        self._history.append((noise_multiplier, sample_rate, num_steps, sensitivity_ratio, measured_steps))

    @property
    def history(self) -> list[tuple[float, float, int, np.ndarray | None]]:
        """(noise_multiplier, sample_rate, num_steps, sensitivity_ratios or None) per run of equal steps."""
        return [entry[:4] for entry in self._history]

    @property
    def num_steps(self) -> int:
        """The number of steps recorded."""
        return sum(entry[2] for entry in self._history)

    @property
    def held_steps(self) -> int:
        """The steps whose Δ*/Γ were held from an earlier measurement, not measured at the step (§4)."""
        return sum(entry[2] - entry[4] for entry in self._history)

    @property
    def certified(self) -> np.ndarray:
        """Per point, whether its ε from get_epsilon is a bound along the observed run (docs/accounting.md §4):
        every step's Δ*/Γ of the point measured at that step, or held at the worst case 1 (Δ* <= Γ always).
        Otherwise its ε is a held-Δ* estimate ("Δ* held between measurements", not a bound)."""
        bound = np.ones(self.num_points, dtype=bool)
        for _, _, num_steps, sensitivity_ratio, measured_steps in self._history:
            if sensitivity_ratio is not None and measured_steps < num_steps:
                bound &= sensitivity_ratio == 1.0
        return bound

    @property
    def kind(self) -> str:
        """"certified" when every point's ε is a bound along the observed run (`certified`), else "held_estimate"
        (some step held Δ* between measurements, §4: not a bound). The words are Kind's, as the scripts' `kind`
        column has them."""
        return Kind.CERTIFIED.value if self.certified.all() else Kind.HELD_ESTIMATE.value

    def __len__(self) -> int:
        return len(self._history)

    @classmethod
    def mechanism(cls) -> str:
        """The accounting mechanism's name, as Opacus's accountants give theirs (state_dict records it)."""
        return "individual"

    def attach(self, optimizer: object, model: torch.nn.Module, data: object, *, every: int = 1,
               points: Sequence[int] | None = None, loss_fn: object = None) -> opacus_hook.Attached:
        """Record every real step of an Opacus DPOptimizer, with Δ* of the points measured every `every` steps
        (api/opacus_hook.py, docs/api.md): returns a handle whose detach() stops it."""
        return opacus_hook.attach(self, optimizer, model, data, every=every, points=points, loss_fn=loss_fn)

    def dp_event(self, point: int, *, rounding: float = composition.SUM_RULE_ROUNDING) -> dp_accounting.DpEvent:
        """Point `point`'s run as a dp_accounting event (§3.1, §8.2): per step, the Poisson-subsampled Gaussian of
        noise multiplier σ·Γ/Δ* (Δ*/Γ rounded up to a multiple of `rounding`, as get_epsilon rounds it; a step at
        Δ* = 0 adds nothing), composed. dp_accounting's PLDAccountant gives get_epsilon(accountant="pld")'s ε on
        it (at the same discretisation), and it composes with the events of other mechanisms."""
        if isinstance(point, bool) or not isinstance(point, int | np.integer) or not 0 <= point < self.num_points:
            raise ValueError(f"point must be an index in [0, {self.num_points}), not {point!r}")
        rounding = _rounding(rounding)
        return dp_events.sum_rule_event([(noise_multiplier, sample_rate, num_steps,
                                          1.0 if sensitivity_ratio is None else float(sensitivity_ratio[point]))
                                         for noise_multiplier, sample_rate, num_steps, sensitivity_ratio, _ in self._history],
                                        rounding)

    def _mechanisms(self) -> list[tuple[float, float, list[int], np.ndarray, int]]:
        """The steps grouped by (σ, q), each group as the scripts' input (§4): (σ, q, checkpoint steps,
        Δ*/Γ as (checkpoints, points), T). Under b = ∞ the composed RDP is a sum over steps, so a group's
        steps may be taken together whatever steps of other groups lie between them."""
        groups = {}
        for noise_multiplier, sample_rate, num_steps, sensitivity_ratio, _ in self._history:
            group = groups.setdefault((noise_multiplier, sample_rate), ([], [], [0]))
            checkpoints, rows, total = group
            checkpoints.append(total[0])
            rows.append(np.ones(self.num_points) if sensitivity_ratio is None else sensitivity_ratio)
            total[0] += num_steps
        return [(noise_multiplier, sample_rate, checkpoints, np.array(rows), total[0])
                for (noise_multiplier, sample_rate), (checkpoints, rows, total) in groups.items()]

    def get_epsilon(self, delta: float, alphas: Sequence[float] | None = None, *, accountant: str = "rdp",
                    holder_b: float = math.inf, rounding: float = composition.SUM_RULE_ROUNDING,
                    orders: Sequence[float] = DEFAULT_ORDERS,
                    pld_interval: float = pld_grid.DEFAULT_INTERVAL) -> np.ndarray:
        """ε of every point at `delta` after the steps so far (float64 array of num_points values).

        accountant "rdp": §4, Rényi DP of each step composed with Hölder exponent `holder_b` (math.inf:
        along this one observed trajectory, Yu et al.'s individual accounting; a finite b needs one (σ, q)
        for all steps), converted at the best of `orders` (default: the scripts' --alpha and Opacus's
        grid). "pld": §8.2, privacy loss distributions at discretisation `pld_interval` (b = ∞, one (σ, q)),
        ε the larger of the remove and add directions. Each Δ*/Γ is rounded up to a multiple of
        `rounding` (0: exact), as the scripts' --rounding. alphas: Opacus's name for `orders`. The values are
        bounds along the observed run where `certified` says so, held-Δ* estimates elsewhere (`kind`).
        """
        delta = arguments.probability("delta", delta)
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, not {accountant!r}")
        holder_b = arguments.number("holder_b", holder_b)
        if not holder_b > 1:
            raise ValueError(f"holder_b must be > 1 (math.inf: plain composition), not {holder_b!r}")
        rounding = _rounding(rounding)
        if alphas is not None:
            if orders is not DEFAULT_ORDERS:
                raise ValueError("give alphas (Opacus's name) or orders, not both")
            if accountant == "pld":
                raise ValueError("alphas are Rényi orders: accountant='pld' takes none")
            orders = alphas
        name = "orders" if alphas is None else "alphas"
        try:
            orders = np.unique(np.asarray(orders, dtype=float))
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be finite Rényi orders > 1, not {orders!r:.60}") from None
        if orders.size == 0 or not np.all(np.isfinite(orders) & (orders > 1)):
            raise ValueError(f"{name} must be finite Rényi orders > 1")
        mechanisms = self._mechanisms()
        if not mechanisms:
            return np.zeros(self.num_points)
        if len(mechanisms) > 1 and (accountant == "pld" or math.isfinite(holder_b)):
            what = "accountant='pld'" if accountant == "pld" else f"holder_b={holder_b:g}"
            raise ValueError(f"{what} needs one (noise_multiplier, sample_rate) for all steps, found "
                             f"{len(mechanisms)}; use accountant='rdp' with holder_b=math.inf")
        if accountant == "pld":
            if math.isfinite(holder_b):
                raise ValueError(f"holder_b must be math.inf with accountant='pld' (§8), not {holder_b:g}")
            pld_interval = arguments.positive_finite("pld_interval", pld_interval)
            noise_multiplier, sample_rate, checkpoints, sensitivity_ratio, total_steps = mechanisms[0]
            return pld.sum_rule_eps(sensitivity_ratio.T, checkpoints, total_steps, sample_rate=sample_rate,
                                    noise_multiplier=noise_multiplier, delta=delta, rounding=rounding,
                                    interval=pld_interval).max
        rdp = sum(self._composed_rdp(mechanism, orders, holder_b, rounding) for mechanism in mechanisms)
        eps, _ = rdp_composition.rdp_to_eps(orders, rdp, delta)
        return eps

    @staticmethod
    def _composed_rdp(mechanism, orders, holder_b, rounding):
        """The composed RDP of one (σ, q) before conversion, for one run (R = 1): composition.sum_rule_rdp."""
        noise_multiplier, sample_rate, checkpoints, sensitivity_ratio, total_steps = mechanism
        largest = rdp_composition.holder_orders(orders[-1], total_steps, holder_b)[-1]
        if not largest <= composition.LARGEST_ORDER:
            raise ValueError(f"holder_b={holder_b:g} inflates order {orders[-1]:g} to {largest:.3g} over "
                             f"{total_steps} steps; use a larger holder_b such as 3 * num_steps")
        return composition.sum_rule_rdp(sensitivity_ratio[None], checkpoints, sample_rate, noise_multiplier,
                                        orders=orders, holder_b=holder_b, rounding=rounding, horizons=[total_steps])[0]

    def state_dict(self, destination: dict | None = None) -> dict:
        """The accountant's state in the shape of Opacus's (`history` of (σ, q, steps), `mechanism`), with
        `num_points`, `sensitivity_ratios` (a float64 tensor, one row of Δ*/Γ per history entry, NaN for the worst
        case) and `measured_steps` (an int64 tensor): saves with torch.save, loads with
        torch.load(weights_only=True). `destination`: a mapping to fill (Opacus's argument)."""
        destination = {} if destination is None else destination
        rows = [np.full(self.num_points, np.nan) if entry[3] is None else entry[3] for entry in self._history]
        destination["history"] = [entry[:3] for entry in self._history]
        destination["mechanism"] = self.mechanism()
        destination["num_points"] = self.num_points
        destination["sensitivity_ratios"] = torch.from_numpy(np.array(rows, dtype=np.float64).reshape(-1, self.num_points))
        destination["measured_steps"] = torch.tensor([entry[4] for entry in self._history], dtype=torch.int64)
        return destination

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace the history by that of `state_dict` (from state_dict() of an accountant of as many points);
        every entry is checked as `step` checks it."""
        keys = {"history", "mechanism", "num_points", "sensitivity_ratios", "measured_steps"}
        if not isinstance(state_dict, Mapping) or not keys <= set(state_dict):
            raise ValueError(f"state_dict must be a mapping with keys {', '.join(sorted(keys))} (from state_dict())")
        if state_dict["mechanism"] != self.mechanism():
            raise ValueError(f"state_dict is of mechanism {state_dict['mechanism']!r}, not {self.mechanism()!r}")
        if state_dict["num_points"] != self.num_points:
            raise ValueError(f"state_dict has num_points={state_dict['num_points']!r}; this accountant follows "
                             f"{self.num_points} points")
        entries = list(state_dict["history"])
        sensitivity_ratio = np.asarray(state_dict["sensitivity_ratios"], dtype=float).reshape(-1, self.num_points)
        measured = np.asarray(state_dict["measured_steps"])
        if len(sensitivity_ratio) != len(entries) or measured.shape != (len(entries),):
            raise ValueError(f"state_dict has {len(entries)} history entries but {len(sensitivity_ratio)} rows of "
                             f"sensitivity_ratios and {measured.size} of measured_steps")
        history = []
        for (noise_multiplier, sample_rate, num_steps), row, measured_steps in zip(entries, sensitivity_ratio, measured):
            if isinstance(num_steps, bool) or not isinstance(num_steps, int | np.integer) or num_steps < 1:
                raise ValueError(f"state_dict num_steps must be an integer >= 1, not {num_steps!r}")
            if not 0 <= measured_steps <= num_steps:
                raise ValueError(f"state_dict measured_steps must be in [0, {num_steps}], not {measured_steps!r}")
            worst_case = bool(np.isnan(row).all())
            history.append((arguments.positive_finite("noise_multiplier", noise_multiplier),
                            arguments.sample_rate(sample_rate), int(num_steps),
                            None if worst_case else self._checked_ratios(row, "state_dict sensitivity_ratios"),
                            int(num_steps) if worst_case else int(measured_steps)))
        self._history = []
        for entry in history:
            self._append(*entry)


def checked_ratios(sensitivity_ratios: ArrayLike | torch.Tensor, num_points: int, name: str = "sensitivity_ratios",
                   active: np.ndarray | None = None) -> np.ndarray:
    """num_points ratios Δ*/Γ (an array-like or a tensor) as a float64 array, each in [0, 1 + RATIO_TOLERANCE], or a
    one-line ValueError naming `name`. active: a mask of the points checked; the others' ratios (a filter's points
    that left, not measured) are set to 0."""
    if isinstance(sensitivity_ratios, torch.Tensor):
        sensitivity_ratios = sensitivity_ratios.detach().cpu().numpy()
    try:
        sensitivity_ratio = np.array(sensitivity_ratios, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be numbers Δ*/Γ, one per point, not {sensitivity_ratios!r:.60}") from None
    if sensitivity_ratio.shape != (num_points,):
        raise ValueError(f"{name} must have shape ({num_points},) (one Δ*/Γ per point), not {sensitivity_ratio.shape}")
    if active is not None:
        sensitivity_ratio = np.where(active, sensitivity_ratio, 0.0)
    bad = sensitivity_ratio[~((sensitivity_ratio >= 0) & (sensitivity_ratio <= 1 + RATIO_TOLERANCE))]
    if bad.size:
        raise ValueError(f"{name} must be ratios Δ*/Γ in [0, 1], not {bad[0]!r}")
    return sensitivity_ratio


def _rounding(value):
    rounding = arguments.number("rounding", value)
    if not 0 <= rounding <= 1:
        raise ValueError(f"rounding must be in [0, 1] (a fraction of the clip bound), not {value!r}")
    return rounding

"""`IndividualAccountant` (docs/api.md), shaped like Opacus's accountants: one `step` per optimizer step, with
each point's sensitivity Δ*/Γ of that step, and `get_epsilon(delta)` gives one ε per point. It composes the sum
rule exactly as renyi_per_instance_sum_compo.py does (docs/accounting.md §4 by Rényi DP, §8.2 by privacy loss
distributions): a run of steps with the same Δ* is a checkpoint of the scripts.
"""

import math
from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import ArrayLike
from opacus.accountants import RDPAccountant

from perinstance.accountants import composition
from perinstance.accounting import pld, pld_grid, rdp_composition
from perinstance.api import arguments

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
    starts from). `history` holds (noise_multiplier, sample_rate, num_steps, sensitivities) with
    consecutive equal steps merged, as Opacus's RDPAccountant merges (σ, q); len() is its length.
    """

    def __init__(self, num_points: int) -> None:
        if isinstance(num_points, bool) or not isinstance(num_points, int | np.integer) or num_points < 1:
            raise ValueError(f"num_points must be an integer >= 1, not {num_points!r}")
        self.num_points = int(num_points)
        self._history: list[tuple[float, float, int, np.ndarray | None]] = []

    def _checked_ratios(self, sensitivities) -> np.ndarray | None:
        if sensitivities is None:
            return None
        if isinstance(sensitivities, torch.Tensor):
            sensitivities = sensitivities.detach().cpu().numpy()
        try:
            ratios = np.array(sensitivities, dtype=float)
        except (TypeError, ValueError):
            raise ValueError(f"sensitivities must be numbers Δ*/Γ, one per point, not {sensitivities!r:.60}") from None
        if ratios.shape != (self.num_points,):
            raise ValueError(f"sensitivities must have shape ({self.num_points},) (one Δ*/Γ per point), "
                             f"not {ratios.shape}")
        bad = ratios[~((ratios >= 0) & (ratios <= 1 + RATIO_TOLERANCE))]
        if bad.size:
            raise ValueError(f"sensitivities must be ratios Δ*/Γ in [0, 1], not {bad[0]!r}")
        ratios = np.minimum(ratios, 1.0)
        ratios.flags.writeable = False
        return ratios

    def step(self, *, noise_multiplier: float, sample_rate: float,
             sensitivities: ArrayLike | torch.Tensor | None = None) -> None:
        """Record one step of Poisson rate `sample_rate` and noise multiplier `noise_multiplier`.

        sensitivities: Δ*/Γ of every point at this step (array-like or tensor of num_points values in
        [0, 1]); None: every point at the worst case 1.
        """
        self._append(arguments.positive_finite("noise_multiplier", noise_multiplier),
                     arguments.sample_rate(sample_rate), 1, self._checked_ratios(sensitivities))

    def _append(self, noise_multiplier, sample_rate, num_steps, ratios):
        if self._history:
            last_noise, last_rate, last_steps, last_ratios = self._history[-1]
            same_ratios = (last_ratios is None and ratios is None) or (
                last_ratios is not None and ratios is not None and np.array_equal(last_ratios, ratios))
            if last_noise == noise_multiplier and last_rate == sample_rate and same_ratios:
                self._history[-1] = (last_noise, last_rate, last_steps + num_steps, last_ratios)
                return
        self._history.append((noise_multiplier, sample_rate, num_steps, ratios))

    @property
    def history(self) -> list[tuple[float, float, int, np.ndarray | None]]:
        """(noise_multiplier, sample_rate, num_steps, sensitivities or None) per run of equal steps."""
        return list(self._history)

    @property
    def num_steps(self) -> int:
        """The number of steps recorded."""
        return sum(entry[2] for entry in self._history)

    def __len__(self) -> int:
        return len(self._history)

    def _mechanisms(self) -> list[tuple[float, float, list[int], np.ndarray, int]]:
        """The steps grouped by (σ, q), each group as the scripts' input (§4): (σ, q, checkpoint steps,
        Δ*/Γ as (checkpoints, points), T). Under b = ∞ the composed RDP is a sum over steps, so a group's
        steps may be taken together whatever steps of other groups lie between them."""
        groups = {}
        for noise_multiplier, sample_rate, num_steps, ratios in self._history:
            group = groups.setdefault((noise_multiplier, sample_rate), ([], [], [0]))
            checkpoints, rows, total = group
            checkpoints.append(total[0])
            rows.append(np.ones(self.num_points) if ratios is None else ratios)
            total[0] += num_steps
        return [(noise_multiplier, sample_rate, checkpoints, np.array(rows), total[0])
                for (noise_multiplier, sample_rate), (checkpoints, rows, total) in groups.items()]

    def get_epsilon(self, delta: float, *, accountant: str = "rdp", holder_b: float = math.inf,
                    rounding: float = composition.SUM_RULE_ROUNDING,
                    orders: Sequence[float] = DEFAULT_ORDERS,
                    pld_interval: float = pld_grid.DEFAULT_INTERVAL) -> np.ndarray:
        """ε of every point at `delta` after the steps so far (float64 array of num_points values).

        accountant "rdp": §4, Rényi DP of each step composed with Hölder exponent `holder_b` (math.inf:
        along this one observed trajectory, Yu et al.'s individual accounting; a finite b needs one (σ, q)
        for all steps), converted at the best of `orders` (default: the scripts' --alpha and Opacus's
        grid). "pld": §8.2, privacy loss distributions at discretisation `pld_interval` (b = ∞, one (σ, q)),
        ε the larger of the remove and add directions. Each Δ*/Γ is rounded up to a multiple of
        `rounding` (0: exact), as the scripts' --rounding.
        """
        delta = arguments.number("delta", delta)
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), not {delta!r}")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, not {accountant!r}")
        holder_b = arguments.number("holder_b", holder_b)
        if not holder_b > 1:
            raise ValueError(f"holder_b must be > 1 (math.inf: plain composition), not {holder_b!r}")
        rounding = arguments.number("rounding", rounding)
        if not 0 <= rounding <= 1:
            raise ValueError(f"rounding must be in [0, 1] (a fraction of the clip bound), not {rounding!r}")
        orders = np.unique(np.asarray(orders, dtype=float))
        if orders.size == 0 or not np.all(np.isfinite(orders) & (orders > 1)):
            raise ValueError("orders must be finite Rényi orders > 1")
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
            noise_multiplier, sample_rate, checkpoints, ratios, total_steps = mechanisms[0]
            return pld.sum_rule_eps(ratios.T, checkpoints, total_steps, sample_rate=sample_rate,
                                    noise_multiplier=noise_multiplier, delta=delta, rounding=rounding,
                                    interval=pld_interval).max
        rdp = sum(self._composed_rdp(mechanism, orders, holder_b, rounding) for mechanism in mechanisms)
        eps, _ = rdp_composition.rdp_to_eps(orders, rdp, delta)
        return eps

    @staticmethod
    def _composed_rdp(mechanism, orders, holder_b, rounding):
        """The composed RDP of one (σ, q) before conversion, for one run (R = 1): composition.sum_rule_rdp."""
        noise_multiplier, sample_rate, checkpoints, ratios, total_steps = mechanism
        largest = rdp_composition.holder_orders(orders[-1], total_steps, holder_b)[-1]
        if not largest <= composition.LARGEST_ORDER:
            raise ValueError(f"holder_b={holder_b:g} inflates order {orders[-1]:g} to {largest:.3g} over "
                             f"{total_steps} steps; use a larger holder_b such as 3 * num_steps")
        return composition.sum_rule_rdp(ratios[None], checkpoints, sample_rate, noise_multiplier, orders=orders,
                                        holder_b=holder_b, rounding=rounding, horizons=[total_steps])[0]

    def state_dict(self) -> dict:
        """Plain data (ints, floats, lists, None): saves with json or torch.save, loads with
        torch.load(weights_only=True)."""
        return {"num_points": self.num_points,
                "history": [{"noise_multiplier": noise_multiplier, "sample_rate": sample_rate,
                             "num_steps": num_steps, "sensitivities": None if ratios is None else ratios.tolist()}
                            for noise_multiplier, sample_rate, num_steps, ratios in self._history]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace the history by that of `state_dict` (from state_dict() of an accountant of as many points)."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"num_points", "history"}:
            raise ValueError("state_dict must be a dict with keys num_points and history (from state_dict())")
        if state_dict["num_points"] != self.num_points:
            raise ValueError(f"state_dict has num_points={state_dict['num_points']!r}; this accountant follows "
                             f"{self.num_points} points")
        history = []
        for entry in state_dict["history"]:
            if not isinstance(entry, dict) or set(entry) != {"noise_multiplier", "sample_rate", "num_steps",
                                                              "sensitivities"}:
                raise ValueError("state_dict history entries must have keys noise_multiplier, sample_rate, "
                                 "num_steps and sensitivities")
            num_steps = entry["num_steps"]
            if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
                raise ValueError(f"state_dict num_steps must be an integer >= 1, not {num_steps!r}")
            history.append((arguments.positive_finite("noise_multiplier", entry["noise_multiplier"]),
                            arguments.sample_rate(entry["sample_rate"]), num_steps,
                            self._checked_ratios(entry["sensitivities"])))
        self._history = []
        for entry in history:
            self._append(*entry)

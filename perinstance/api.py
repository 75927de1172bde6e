"""The public Python API: per-instance privacy of DP-SGD for any training loop (docs/api.md).

`IndividualAccountant` is shaped like Opacus's accountants: one `step` per optimizer step, with each
point's sensitivity Δ*/Γ of that step, and `get_epsilon(delta)` gives one ε per point. It composes
the sum rule exactly as renyi_per_instance_sum_compo.py does (docs/accounting.md §4 by Rényi DP,
§8.2 by privacy loss distributions): a run of steps with the same Δ* is a checkpoint of the scripts.
`sensitivities` measures Δ* (§2, sum rule) at a model's current parameters.
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from numpy.typing import ArrayLike
from opacus.accountants import RDPAccountant
from opacus.grad_sample import AbstractGradSampleModule
from torch.utils.data import DataLoader, Dataset, TensorDataset

from perinstance.accounting import pld, pld_grid, rdp_composition
from perinstance.analysis import composition
from perinstance.audit.canary_auditor import CanaryScoreAuditor  # noqa: F401 (docs/api.md, the one-run auditor)
from perinstance.measure.gradient_rows import transformed_norms
from perinstance.train import user_code
from perinstance.train.clipping import CLIPPING_CHOICES, Transform

ACCOUNTANTS = ("rdp", "pld")
# The scripts' orders and Opacus's RDPAccountant's: ε at every sensitivity 1 is then never above Opacus's own,
# and never above the scripts' at their default --alpha.
DEFAULT_ORDERS = tuple(np.unique(np.concatenate([rdp_composition.COMPOSITION_ORDERS, RDPAccountant.DEFAULT_ALPHAS])))
# A clipped norm Δ* = min(||g||, C) divided by C can land a few float32 ulps above 1; such ratios count as 1.
RATIO_TOLERANCE = 1e-6


def _number(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, not {value!r}") from None


def _positive_finite(name: str, value: float) -> float:
    value = _number(name, value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, not {value!r}")
    return value


def _sample_rate(value: float) -> float:
    value = _number("sample_rate", value)
    if not 0 < value <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], not {value!r}")
    return value


class IndividualAccountant:
    """Per-point privacy of DP-SGD's sum rule (Opacus's update) over the steps taken so far.

    num_points: the training points followed (any subset of the training set, in the order that
    `sensitivity_ratios` arrays use). Each `step` records one DP-SGD step: its noise multiplier σ,
    Poisson sample rate q and each point's Δ*/Γ (docs/accounting.md §2, at the parameters the step
    starts from). `history` holds (noise_multiplier, sample_rate, num_steps, sensitivity_ratios) with
    consecutive equal steps merged, as Opacus's RDPAccountant merges (σ, q); len() is its length.
    """

    def __init__(self, num_points: int) -> None:
        if isinstance(num_points, bool) or not isinstance(num_points, int | np.integer) or num_points < 1:
            raise ValueError(f"num_points must be an integer >= 1, not {num_points!r}")
        self.num_points = int(num_points)
        self._history: list[tuple[float, float, int, np.ndarray | None]] = []

    def _checked_sensitivity_ratios(self, sensitivity_ratios) -> np.ndarray | None:
        if sensitivity_ratios is None:
            return None
        if isinstance(sensitivity_ratios, torch.Tensor):
            sensitivity_ratios = sensitivity_ratios.detach().cpu().numpy()
        try:
            sensitivity_ratio = np.array(sensitivity_ratios, dtype=float)
        except (TypeError, ValueError):
            raise ValueError(f"sensitivity_ratios must be numbers Δ*/Γ, one per point, not "
                             f"{sensitivity_ratios!r:.60}") from None
        if sensitivity_ratio.shape != (self.num_points,):
            raise ValueError(f"sensitivity_ratios must have shape ({self.num_points},) (one Δ*/Γ per point), "
                             f"not {sensitivity_ratio.shape}")
        bad = sensitivity_ratio[~((sensitivity_ratio >= 0) & (sensitivity_ratio <= 1 + RATIO_TOLERANCE))]
        if bad.size:
            raise ValueError(f"sensitivity_ratios must be ratios Δ*/Γ in [0, 1], not {bad[0]!r}")
        sensitivity_ratio = np.minimum(sensitivity_ratio, 1.0)
        sensitivity_ratio.flags.writeable = False
        return sensitivity_ratio

    def step(self, *, noise_multiplier: float, sample_rate: float,
             sensitivity_ratios: ArrayLike | torch.Tensor | None = None) -> None:
        """Record one step of Poisson rate `sample_rate` and noise multiplier `noise_multiplier`.

        sensitivity_ratios: Δ*/Γ of every point at this step (array-like or tensor of num_points values in
        [0, 1]); None: every point at the worst case 1.
        """
        self._append(_positive_finite("noise_multiplier", noise_multiplier), _sample_rate(sample_rate), 1,
                     self._checked_sensitivity_ratios(sensitivity_ratios))

    def _append(self, noise_multiplier, sample_rate, num_steps, sensitivity_ratio):
        if self._history:
            last_noise, last_rate, last_steps, last_ratio = self._history[-1]
            same_ratio = (last_ratio is None and sensitivity_ratio is None) or (last_ratio is not None and (
                sensitivity_ratio is not None and np.array_equal(last_ratio, sensitivity_ratio)))
            if last_noise == noise_multiplier and last_rate == sample_rate and same_ratio:
                self._history[-1] = (last_noise, last_rate, last_steps + num_steps, last_ratio)
                return
        self._history.append((noise_multiplier, sample_rate, num_steps, sensitivity_ratio))

    @property
    def history(self) -> list[tuple[float, float, int, np.ndarray | None]]:
        """(noise_multiplier, sample_rate, num_steps, sensitivity_ratios or None) per run of equal steps."""
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
        for noise_multiplier, sample_rate, num_steps, sensitivity_ratio in self._history:
            group = groups.setdefault((noise_multiplier, sample_rate), ([], [], [0]))
            checkpoints, rows, total = group
            checkpoints.append(total[0])
            rows.append(np.ones(self.num_points) if sensitivity_ratio is None else sensitivity_ratio)
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
        delta = _number("delta", delta)
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), not {delta!r}")
        if accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, not {accountant!r}")
        holder_b = _number("holder_b", holder_b)
        if not holder_b > 1:
            raise ValueError(f"holder_b must be > 1 (math.inf: plain composition), not {holder_b!r}")
        rounding = _number("rounding", rounding)
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
            pld_interval = _positive_finite("pld_interval", pld_interval)
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

    def state_dict(self) -> dict:
        """Plain data (ints, floats, lists, None): saves with json or torch.save, loads with
        torch.load(weights_only=True)."""
        return {"num_points": self.num_points,
                "history": [{"noise_multiplier": noise_multiplier, "sample_rate": sample_rate,
                             "num_steps": num_steps,
                             "sensitivity_ratios": None if sensitivity_ratio is None else sensitivity_ratio.tolist()}
                            for noise_multiplier, sample_rate, num_steps, sensitivity_ratio in self._history]}

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
                                                              "sensitivity_ratios"}:
                raise ValueError("state_dict history entries must have keys noise_multiplier, sample_rate, "
                                 "num_steps and sensitivity_ratios")
            num_steps = entry["num_steps"]
            if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
                raise ValueError(f"state_dict num_steps must be an integer >= 1, not {num_steps!r}")
            history.append((_positive_finite("noise_multiplier", entry["noise_multiplier"]),
                            _sample_rate(entry["sample_rate"]), num_steps,
                            self._checked_sensitivity_ratios(entry["sensitivity_ratios"])))
        self._history = []
        for entry in history:
            self._append(*entry)


# --- Δ* of a model's points ------------------------------------------------------------------

def _examples(data, points):
    """(inputs, labels) tensors of `points` (None: every example) of a Dataset, a DataLoader's dataset or a
    pair of tensors."""
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, tuple | list) and len(data) == 2 and all(isinstance(part, torch.Tensor) for part in data):
        inputs, labels = data
        if len(inputs) != len(labels):
            raise ValueError(f"data: {len(inputs)} inputs but {len(labels)} labels")
    elif isinstance(data, TensorDataset) and len(data.tensors) == 2:
        inputs, labels = data.tensors
    elif isinstance(data, Dataset):
        size = len(data)
        chosen = range(size) if points is None else [int(point) for point in points]
        if any(not 0 <= point < size for point in chosen):
            raise ValueError(f"points must be indices in [0, {size})")
        return user_code.pair_tensors(data, chosen)
    else:
        raise ValueError("data must be a torch Dataset of (input, label) pairs, a DataLoader over one, or a pair "
                         f"(inputs, labels) of tensors, not {type(data).__name__}")
    if points is None:
        return inputs, labels.long()
    index = torch.as_tensor(np.asarray(points, dtype=np.int64))
    if index.ndim != 1 or ((index < 0) | (index >= len(labels))).any():
        raise ValueError(f"points must be a list of indices in [0, {len(labels)})")
    return inputs[index], labels[index].long()


@contextmanager
def _without_opacus_hooks(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The network to measure: `model`, or the one inside an Opacus wrapper (GradSampleModule, ghost clipping's
    GradSampleModuleFastGradientClipping, ...), whose layers then run without the hooks Opacus registered on them
    until the block ends (the network's own hooks, such as weight norm's, stay). Even disabled, Opacus's full
    backward hooks stop torch.func, which takes the layers the engine lacks and checks the ones it covers, and
    ghost clipping's raise in any backward whose forward they did not see. Every hook is back after, in its
    place: the wrapper is left as it was. No copy of the network is made (a GPU model's memory twice)."""
    if not isinstance(model, AbstractGradSampleModule):
        yield model
        return
    opacus_hooks = {handle.id for handle in getattr(model, "autograd_grad_sample_hooks", [])}
    saved = []
    for module in model._module.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                      module._backward_hooks):
            if any(key in opacus_hooks for key in hooks):
                saved.append((hooks, list(hooks.items())))
                for key in [key for key in hooks if key in opacus_hooks]:
                    del hooks[key]
    try:
        yield model._module
    finally:
        for hooks, entries in saved:
            hooks.clear()
            hooks.update(entries)


def sensitivities(model: torch.nn.Module, data: Dataset | DataLoader | tuple[torch.Tensor, torch.Tensor],
                  clip_bound: float, clipping: str = "flat", points: Sequence[int] | None = None, *,
                  scale_r: float | None = None, scale_s: float | None = None) -> torch.Tensor:
    """Δ* = ||h(g_i)|| of each point at the model's current parameters (docs/accounting.md §2, sum rule).

    g_i is the gradient of the point's cross-entropy; h the transform of `clipping` (§1): flat gives
    min(||g_i||, clip_bound), psac and psasc need `scale_r` (and psasc `scale_s`) and are bounded by
    Γ = clip_bound (psasc: clip_bound/scale_s). Divide by Γ for IndividualAccountant.step.
    data: a torch Dataset of (input, label) pairs, a DataLoader (its dataset is read in index order, not
    its batches, which Poisson sampling draws at random), or a pair (inputs, labels) of tensors.
    points: indices into data (None: all). The model (or the module inside an Opacus wrapper) is
    evaluated in eval mode, as compute_sensitivity.py does, by the norms engine of perinstance/persample/gradients.py
    (Linear, Conv2d, GroupNorm; other layers by torch.func, perinstance/persample/fallback_norms.py), checked as a
    --model network is: a parameter that two layers share, or that is used outside its layer's forward, comes
    from torch.func too. Returns a float64 tensor, one Δ* per point, on the CPU.
    """
    if clipping not in CLIPPING_CHOICES:
        raise ValueError(f"clipping must be one of {', '.join(CLIPPING_CHOICES)}, not {clipping!r}")
    clip_bound = _positive_finite("clip_bound", clip_bound)
    if clipping in ("psac", "psasc"):
        scale_r = _positive_finite("scale_r", scale_r if scale_r is not None else math.nan)
    if clipping == "psasc":
        scale_s = _positive_finite("scale_s", scale_s if scale_s is not None else math.nan)
    transform = Transform(clipping, clip_bound, scale_r, scale_s)
    inputs, labels = _examples(data, points)
    if not any(param.requires_grad for param in model.parameters()):
        raise ValueError("model has no trainable parameter, so no gradient to measure (is every parameter frozen?)")
    with _without_opacus_hooks(model) as network:
        device = next(network.parameters()).device
        was_training = network.training
        network.eval()
        try:
            with user_code.checked_as_user_model(network):  # a tied weight, or one used outside its layer
                norms, _ = transformed_norms(network, inputs, labels, transform, device)
        finally:
            network.train(was_training)
    return torch.from_numpy(norms)

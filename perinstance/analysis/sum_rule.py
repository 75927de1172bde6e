"""The sum rule's per-step accountants (docs/accounting.md §3.1, §3.3): from the `grad_norm` rows (Δ* per
point and checkpoint) to per-step (ε, δ) and per-step Rényi DP, certified, next to the
data-independent baseline. Composition over a run is perinstance/analysis/composition.py.
"""

import math

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from perinstance.accounting import exact_eps_delta, renyi_step
from perinstance.accounting.guarantees import Direction, Kind, direction_rows, eps_by_direction
from perinstance.analysis.reading import Loaded, check_unique, parse_holder

KEYS = ["point", "step"]


def per_step_eps(loaded: Loaded, delta: float, method: str = "exact", holder_p: float = "1e4",
                 gaussian: str = "analytic") -> tuple[pd.DataFrame, str]:
    """eps_delta.py's sum rule: (rows, description). Per (point, step) and direction, the exact
    hockey-stick of the subsampled Gaussian at Δ* (method exact), or GLA's Hölder formula with
    exponent `holder_p` and the Gaussian mechanism's ε by `gaussian` (method holder), next to the
    baseline at Δ = Γ."""
    mechanism = loaded.mechanism
    check_unique(loaded, KEYS)
    rows = loaded.rows.sort_values(KEYS)
    index = pd.MultiIndex.from_frame(rows[KEYS])
    if method == "holder":
        holder_p = parse_holder(holder_p, mechanism.total_steps)
        eps = exact_eps_delta.eps_delta_holder(rows["value"].to_numpy()[:, None], mechanism.noise_std,
                                               mechanism.sample_rate, delta, holder_p, gaussian)
        baseline = exact_eps_delta.baseline_eps_delta(mechanism.noise_multiplier, mechanism.sample_rate, delta, gaussian)
        certified = dict.fromkeys((Direction.REMOVE, Direction.ADD, Direction.MAX), eps)
        worst = dict.fromkeys(certified, np.full(len(rows), baseline))
        method = f"holder p={holder_p:g}"
    else:
        certified = eps_by_direction(rows["value"].to_numpy()[:, None] / mechanism.noise_std, delta,
                                     mechanism.sample_rate)
        worst_one = eps_by_direction(np.array([[1.0 / mechanism.noise_multiplier]]), delta, mechanism.sample_rate)
        worst = {direction: np.full(len(rows), value[0]) for direction, value in worst_one.items()}
    common = dict(reduction="sum", delta_fail=0.0, k_min=math.nan, samples=1, method=method, eps_min=math.nan,
                  eps_max=math.nan)
    return pd.concat([direction_rows(index, Kind.CERTIFIED, certified, delta, **common),
                      direction_rows(index, Kind.BASELINE, worst, delta, **common)], ignore_index=True), (
        f"per-step (eps, delta) of {rows['point'].nunique()} points, sum rule, noise std {mechanism.noise_std:.4g}, "
        f"q={mechanism.sample_rate:.4g}, method {method}, delta={delta:g}")


def per_step_rdp(loaded: Loaded, orders: ArrayLike) -> tuple[pd.DataFrame, str]:
    """renyi_per_instance_sum.py: (rows, description). Per (point, step) and order λ,
    ρ(λ) = RDP_SGM(q, σΓ/Δ*, λ) of one step, a bound for both directions, next to the baseline
    RDP_SGM(q, σ, λ)."""
    check_unique(loaded, KEYS)
    mechanism, rows = loaded.mechanism, loaded.rows.sort_values(KEYS)
    rdp = renyi_step.rdp_sum_rule(rows["value"].to_numpy(), mechanism.clip_bound, mechanism.noise_multiplier,
                                  mechanism.sample_rate, orders)
    baseline = mechanism.baseline_rdp(orders, steps=1)
    keys = pd.DataFrame({"point": np.repeat(rows["point"].to_numpy(), len(orders)),
                         "step": np.repeat(rows["step"].to_numpy(), len(orders)),
                         "alpha": np.tile(orders, len(rows)), "direction": Direction.MAX.value})
    return pd.concat([keys.assign(kind=Kind.CERTIFIED.value, rdp=rdp.ravel()),
                      keys.assign(kind=Kind.BASELINE.value, rdp=np.tile(baseline, len(rows)))], ignore_index=True), (
        f"per-step Rényi DP of {rows['point'].nunique()} points, sum rule, sigma={mechanism.noise_multiplier:g}, "
        f"clip bound {mechanism.clip_bound:g}, q={mechanism.sample_rate:.4g}, "
        f"orders {', '.join(f'{alpha:g}' for alpha in orders)}")

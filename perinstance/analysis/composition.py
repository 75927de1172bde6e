"""Per-instance privacy over a whole training run, both update rules (docs/accounting.md §4).

The composition itself works on arrays, so that another accountant can take the same inputs:
compose_sum_rule takes Δ*/Γ per run, checkpoint and point; compose_mean_rule the per-step ρ
per checkpoint and point (perinstance/analysis/mean_rule.py checkpoint_rdp); perinstance/accounting/pld.py composes the
same per-step pairs by privacy loss distributions (§8). sum_rule, mean_rule_composed, sum_rule_pld and
mean_rule_pld turn the rows of a result file into those inputs and the composed ε into the output rows
of renyi_per_instance_sum_compo.py.
"""

import math

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy.special import logsumexp

from perinstance.accounting import individual_filter, pld, pld_grid, rdp_composition
from perinstance.accounting.guarantees import Kind
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis import mean_rule
from perinstance.analysis.reading import (
    Loaded,
    check_unique,
    check_values,
    checkpoint_sensitivity_ratio,
    every_step,
    parse_holder,
    run_key,
)
from perinstance.console import warn
from perinstance.errors import UsageError

# Orders above this (from a small Hölder exponent b) make the bound meaningless.
LARGEST_ORDER = 1e6
# The columns of renyi_per_instance_sum_compo.py's output: eps is the larger direction's where the accountant
# gives both (PLD); RDP's bound holds for both directions at once.
COLUMNS = ["point", "kind", "eps", "alpha", "delta", "delta_fail", "steps", "k_min", "reduction", "eps_remove",
           "eps_add", "accountant", "discretization"]
RDP_COLUMNS = dict(eps_remove=math.nan, eps_add=math.nan, accountant="rdp", discretization=math.nan)

# What renyi_per_instance_sum_compo.py's kinds and summary lines say a composition over checkpoints holds
# between them (§4): Δ* (sum rule), or the mean rule's certified or Monte Carlo per-step values (§3.5).
HELD_NOTES = {"sum": "Δ* held between checkpoints, not a bound",
              Kind.CERTIFIED: "certified per step, held between checkpoints; not a bound",
              Kind.ESTIMATE: "Monte Carlo per step, held between checkpoints; not a bound"}


def charged(every: bool, checkpoints: int, values: str = "Δ*") -> str:
    """How a composition charges its steps (§4), as its description says it."""
    if every:
        return f"{values} at every step (a bound along the observed run)"
    return f"{values} at {checkpoints} checkpoints, held between them (not a bound; accounting.md §4)"


def composed_kind(kind: Kind, every: bool) -> Kind:
    """§4, §3.5: the kind of a composition of per-step values of `kind`. Certified values at every step compose to
    a bound (`certified`), held between checkpoints to a `held_estimate`; Monte Carlo values stay an `estimate`."""
    if kind != Kind.CERTIFIED:
        return Kind.ESTIMATE
    return Kind.CERTIFIED if every else Kind.HELD_ESTIMATE


def kind_notes(kind: Kind, every: bool, rule: str) -> dict:
    """What the printed lines say about the composed kind where report.KIND_LABEL does not say it (§3.5, §4)."""
    if every:
        return {}
    return {composed_kind(kind, every): HELD_NOTES["sum" if rule == "sum" else kind]}


# The sum rule's Δ*/Γ is rounded up to multiples of this before the RDP lookup (--rounding's default): an
# upper bound, ~1% above the exact Δ* at most, and a table of at most ~100 levels.
SUM_RULE_ROUNDING = 0.01


def compose_sum_rule(sensitivity_ratio: np.ndarray, steps: ArrayLike, mechanism: Mechanism, *, orders: ArrayLike,
                     delta: float, holder_b: float = math.inf, rounding: float = 0.0,
                     horizons: ArrayLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """§4 for the sum rule: ε after each of `horizons` steps (default: T) at δ, and the order that gives it.

    sensitivity_ratio: Δ*/Γ as an (R, C, P) array over runs, checkpoint `steps` and points
    (rdp_composition.carry_forward);
    mechanism: its sample_rate, noise_multiplier and total_steps; orders: the Rényi orders converted
    from; holder_b: the Hölder exponent of the composition (inf: plain composition along the
    observed trajectory); rounding: Δ*/Γ rounded up to multiples of it (0: exact). Returns two
    (horizons, P) arrays.
    """
    horizons = [mechanism.total_steps] if horizons is None else list(horizons)
    composed = sum_rule_rdp(sensitivity_ratio, steps, mechanism.sample_rate, mechanism.noise_multiplier,
                            orders=orders, holder_b=holder_b, rounding=rounding, horizons=horizons)
    converted = [rdp_composition.rdp_to_eps(orders, rdp, delta) for rdp in composed]
    return np.array([eps for eps, _ in converted]), np.array([order for _, order in converted])


def sum_rule_rdp(sensitivity_ratio: np.ndarray, steps: ArrayLike, sample_rate: float, noise_multiplier: float, *,
                 orders: ArrayLike, holder_b: float, rounding: float, horizons: list[int]) -> list[np.ndarray]:
    """§4 for the sum rule before the conversion to ε: the composed RDP, (P, orders), after each of `horizons`
    steps, of the (R, C, P) `sensitivity_ratio` at checkpoint `steps` (compose_sum_rule's arguments). Sums over
    mechanisms of different (q, σ) add these before one conversion (perinstance.IndividualAccountant). With b = ∞
    and several horizons (the curves of figure 4), every horizon comes from one running sum over the steps."""
    levels = rdp_composition.sensitivity_levels(rounding, sensitivity_ratio)
    table = rdp_composition.RdpTable(sample_rate, noise_multiplier,
                                     rdp_composition.composition_orders(orders, max(horizons), holder_b), levels)
    if np.isinf(holder_b) and len(horizons) > 1:
        running = rdp_composition.running_composition(table, sensitivity_ratio, steps, max(horizons), orders)
        return [running[horizon - 1] for horizon in horizons]
    return [rdp_composition.compose_rdp(table, sensitivity_ratio, steps, horizon, orders, holder_b)
            for horizon in horizons]


def compose_mean_rule(checkpoint_rdp: np.ndarray, checkpoints: ArrayLike, baseline_rdp: np.ndarray,
                      total_steps: int) -> np.ndarray:
    """§4 for the mean rule (b = inf): the RDP of T steps, each step t using the per-step ρ of the
    latest checkpoint ≤ t−1 (the baseline's before the first). checkpoint_rdp: (C, P, orders) per
    checkpoint step of `checkpoints`; baseline_rdp: (orders,). Returns (P, orders)."""
    total = np.zeros(checkpoint_rdp.shape[1:])
    for first, last, checkpoint in rdp_composition.step_segments(checkpoints, total_steps):
        total += (last - first + 1) * (baseline_rdp if checkpoint is None else checkpoint_rdp[checkpoint])
    return total


def holder_exponent(text: str, orders: ArrayLike, total_steps: int) -> float:
    """--holder-b: a number, inf or a multiple of T, refused where it inflates the largest order
    beyond LARGEST_ORDER over the run (λ_k = 1 + (λ−1)(b/(b−1))^k)."""
    holder_b = parse_holder(text, total_steps, flag="--holder-b")
    largest = rdp_composition.holder_orders(orders[-1], total_steps, holder_b)[-1]
    if not largest <= LARGEST_ORDER:
        raise UsageError("--holder-b", f"b={holder_b:g} inflates order {orders[-1]:g} to {largest:.3g} over "
                         f"{total_steps} steps (λ_k = 1 + (λ-1)(b/(b-1))^k); use a larger b such as 3T")
    return holder_b


def warn_edge(best_order: ArrayLike, orders: ArrayLike) -> None:
    at_edge = np.isin(best_order, [orders[0], orders[-1]]).sum()
    if at_edge:
        warn(f"{at_edge} points have their best order at an end of --alpha ({orders[0]:g}..{orders[-1]:g}); a wider "
             "grid may lower their eps")


def sum_rule(loaded: Loaded, *, delta: float, orders: ArrayLike, holder_b: float | None = None,
             rounding: float = SUM_RULE_ROUNDING) -> tuple[pd.DataFrame, str, dict]:
    """renyi_per_instance_sum_compo.py's sum rule: (rows, description, kind notes). The per-step Rényi DP of
    the grad_norm rows (one or more runs, told apart by run and seed) composed over the T steps with the Hölder
    bound (holder_b: its text, default 3T), converted to (ε, δ), next to the baseline; `certified` when the rows
    hold Δ* at every step, else `held_estimate` (§4)."""
    check_unique(loaded, ["run", "seed", "step", "point"])
    mechanism = loaded.mechanism
    holder_b = holder_exponent(holder_b or "3T", orders, mechanism.total_steps)
    sensitivity_ratio, steps, points = checkpoint_sensitivity_ratio(loaded)
    every = every_step(loaded)
    eps, best_order = (values[0] for values in compose_sum_rule(sensitivity_ratio, steps, mechanism, orders=orders, delta=delta,
                                                                holder_b=holder_b, rounding=rounding))
    baseline_eps, baseline_order = mechanism.baseline_eps(delta, orders=orders)
    runs = sensitivity_ratio.shape[0]
    if runs == 1 and np.isfinite(holder_b):
        warn("with one run, --holder-b inf (plain composition along the observed trajectory) is never larger than "
             "a finite b")
    warn_edge(best_order, orders)
    common = dict(delta=delta, delta_fail=0.0, steps=mechanism.total_steps, k_min=math.nan, reduction="sum",
                  **RDP_COLUMNS)
    return pd.concat([pd.DataFrame({"point": points, "kind": composed_kind(Kind.CERTIFIED, every).value, "eps": eps,
                                    "alpha": best_order, **common}),
                      pd.DataFrame({"point": points, "kind": Kind.BASELINE.value, "eps": float(baseline_eps),
                                    "alpha": float(baseline_order), **common})], ignore_index=True), (
        f"per-instance (eps, delta) of {len(points)} points over T={mechanism.total_steps} steps, sum rule, "
        f"{runs} run(s), {charged(every, len(steps))}, sigma={mechanism.noise_multiplier:g}, "
        f"q={mechanism.sample_rate:.4g}, Hölder b={holder_b:g}, Δ rounded up to {rounding:g}·Γ, delta={delta:g}"), \
        kind_notes(Kind.CERTIFIED, every, "sum")


def _mean_rule_sizes(loaded, delta, kind, failure):
    """The size model of one run's mean-rule rows and delta_fail of `kind` (§3.4), refusing rows of several
    runs and a δ that T·delta_fail uses up."""
    runs = run_key(loaded.rows).unique()
    if len(runs) > 1:
        raise UsageError("--filter", f"the mean rule composes one run at a time (found {', '.join(runs)}); "
                         "keep one with --filter run=...")
    sizes = mean_rule.size_model(loaded, failure)
    fail = sizes.delta_fail(kind)
    total_steps = loaded.mechanism.total_steps
    if delta - total_steps * fail <= 0:
        raise UsageError("--delta", f"{delta:g} is used up by T·delta_fail = {total_steps}·{fail:.3g}; measure "
                         "with a smaller --size-delta or report a larger --delta")
    return sizes, fail


def mean_rule_composed(loaded: Loaded, *, delta: float, orders: ArrayLike, kind: Kind = Kind.CERTIFIED,
                       holder_b: float | None = None, failure: float | None = None) -> tuple[pd.DataFrame, str, dict]:
    """renyi_per_instance_sum_compo.py's mean rule: (rows, description, kind notes). The per-step ρ of `kind`
    (certified or estimate) of one run composed with b = inf, converted at δ − T·delta_fail
    (§3.4), next to the mean rule's own composed baseline; certified per-step values held between
    checkpoints compose to a `held_estimate` (§4), Monte Carlo ones stay an `estimate`."""
    mechanism = loaded.mechanism
    total_steps = mechanism.total_steps
    if holder_exponent(holder_b or "inf", orders, total_steps) != math.inf:
        raise UsageError("--holder-b", "the mean rule is composed with b = inf only (allowed here: inf)")
    sizes, fail = _mean_rule_sizes(loaded, delta, kind, failure)
    budget = delta - total_steps * fail
    checkpoints, points, checkpoint_rdp, baseline_step = mean_rule.checkpoint_rdp(loaded, orders, kind, sizes)
    every = every_step(loaded)
    total = compose_mean_rule(checkpoint_rdp, checkpoints, baseline_step, total_steps)
    if checkpoints[0] > 0:
        warn(f"no checkpoint at step 0: steps 1..{checkpoints[0]} use the mean rule's baseline (§4)")
    eps, best_order = rdp_composition.rdp_to_eps(orders, total, budget)
    baseline_fail = sizes.delta_fail(Kind.BASELINE)
    baseline_eps, baseline_order = rdp_composition.rdp_to_eps(orders, total_steps * baseline_step,
                                                              delta - total_steps * baseline_fail)
    warn_edge(best_order, orders)
    common = dict(delta=delta, steps=total_steps, k_min=sizes.k_min, reduction="mean", **RDP_COLUMNS)
    return pd.concat([
        pd.DataFrame({"point": points, "kind": composed_kind(kind, every).value, "eps": eps, "alpha": best_order,
                      "delta_fail": fail, **common}),
        pd.DataFrame({"point": points, "kind": Kind.BASELINE.value, "eps": float(baseline_eps),
                      "alpha": float(baseline_order), "delta_fail": baseline_fail, **common})], ignore_index=True), (
        f"per-instance (eps, delta) of {len(points)} points over T={total_steps} steps, mean rule ({kind}), "
        f"{charged(every, len(checkpoints), 'per-step values')}, sigma={mechanism.noise_multiplier:g}, "
        f"q={mechanism.sample_rate:.4g}, k_min={sizes.k_min}, delta_fail={fail:.3g} per step, converted at "
        f"delta - T·delta_fail = {budget:.4g}"), kind_notes(kind, every, "mean")


# --- the same compositions by privacy loss distributions (§8) --------------------------------------

def _pld_columns(eps, interval):
    """The output columns of a PLD result (§8): eps is the larger direction. A result of one row (the
    baseline) gives numbers, for every point."""
    values = dict(eps=eps.max, eps_remove=eps.remove, eps_add=eps.add)
    if len(eps.max) == 1:
        values = {name: float(value[0]) for name, value in values.items()}
    return dict(values, alpha=math.nan, accountant="pld", discretization=interval)


def _check_pld_holder(holder_b):
    if holder_b is not None and parse_holder(holder_b, 1, flag="--holder-b") != math.inf:
        raise UsageError("--holder-b", "--accountant pld composes along the observed trajectory only (allowed: inf)")


def sum_rule_pld(loaded: Loaded, *, delta: float, holder_b: float | None = None, rounding: float = SUM_RULE_ROUNDING,
                 interval: float = pld_grid.DEFAULT_INTERVAL) -> tuple[pd.DataFrame, str, dict]:
    """§8.2: renyi_per_instance_sum_compo.py's sum rule by PLD: (rows, description, kind notes). Every point's
    composition along the observed trajectory; with several runs each step takes the largest Δ* over them (b = inf);
    `certified` when the rows hold Δ* at every step, else `held_estimate` (§4)."""
    _check_pld_holder(holder_b)
    check_unique(loaded, ["run", "seed", "step", "point"])
    mechanism = loaded.mechanism
    sensitivity_ratio, steps, points = checkpoint_sensitivity_ratio(loaded)
    every = every_step(loaded)
    common = dict(sample_rate=mechanism.sample_rate, noise_multiplier=mechanism.noise_multiplier, delta=delta,
                  rounding=rounding, interval=interval)
    eps = pld.sum_rule_eps(sensitivity_ratio.max(axis=0).T, steps, mechanism.total_steps, **common)
    baseline = pld.sum_rule_eps(np.ones((1, len(steps))), steps, mechanism.total_steps, **common)
    common = dict(delta=delta, delta_fail=0.0, steps=mechanism.total_steps, k_min=math.nan, reduction="sum")
    return pd.concat([
        pd.DataFrame({"point": points, "kind": composed_kind(Kind.CERTIFIED, every).value, **_pld_columns(eps, interval),
                      **common}),
        pd.DataFrame({"point": points, "kind": Kind.BASELINE.value, **_pld_columns(baseline, interval), **common})],
        ignore_index=True), (
        f"per-instance (eps, delta) of {len(points)} points over T={mechanism.total_steps} steps, sum rule, "
        f"{sensitivity_ratio.shape[0]} run(s) (the largest Δ* per step), {charged(every, len(steps))}, "
        f"sigma={mechanism.noise_multiplier:g}, q={mechanism.sample_rate:.4g}, Δ rounded up to {rounding:g}·Γ, "
        f"delta={delta:g}; composed by PLD (dp_accounting, pessimistic, discretisation {interval:g}), "
        "eps = max(remove, add)"), kind_notes(Kind.CERTIFIED, every, "sum")


def mean_rule_pld(loaded: Loaded, *, delta: float, kind: Kind = Kind.CERTIFIED, holder_b: float | None = None,
                  failure: float | None = None,
                  interval: float = pld_grid.DEFAULT_INTERVAL) -> tuple[pd.DataFrame, str, dict]:
    """§8.4: renyi_per_instance_sum_compo.py's mean rule by PLD: (rows, description, kind notes). Every point's
    composition of the per-step revealed-size mixture of `kind` (certified or estimate), next to the
    baseline's, converted at δ − T·delta_fail; certified per-step values held between checkpoints compose to
    a `held_estimate` (§4), Monte Carlo ones stay an `estimate`."""
    _check_pld_holder(holder_b)
    mechanism = loaded.mechanism
    total_steps = mechanism.total_steps
    sizes, fail = _mean_rule_sizes(loaded, delta, kind, failure)
    if kind == Kind.CERTIFIED:
        statistics = mean_rule.require(mean_rule.statistics_of(loaded), kind, loaded)
        certified = mean_rule.certified_sensitivities(statistics, mechanism.clip_bound, sizes)
        index, values = statistics.index, certified.sensitivities
        row_log_weights, log_mass = certified.log_weights, sizes.log_mass(kind)
    else:
        samples = mean_rule.require(mean_rule.samples_of(loaded, sizes), kind, loaded)
        index, values = samples.index, samples.values
        sample_weights = samples.log_weights(sizes)
        row_log_weights = pld.estimate_log_weights(samples.batch_sizes, samples.grid, sample_weights)
        # P(k ≥ k_min) when the samples start at k_min (as measured); else the law of the sizes sampled.
        log_mass = float(logsumexp(sample_weights))
    points = index.get_level_values("point").unique().to_numpy()
    checkpoints = index.get_level_values("step").unique().sort_values().to_numpy()
    every = every_step(loaded)
    if len(index) != len(points) * len(checkpoints):
        raise UsageError(loaded.flag, f"{loaded.path}: every point needs a value at every checkpoint (steps "
                         f"{', '.join(map(str, checkpoints))})")
    shape = (len(points), len(checkpoints), -1)
    law = pld.step_law(values.reshape(shape), np.broadcast_to(row_log_weights, values.shape).reshape(shape), log_mass,
                       dominate=kind == Kind.CERTIFIED)
    worst = mean_rule.baseline_sensitivities(mechanism.clip_bound, sizes).sensitivities[0]
    worst_law = pld.step_law(worst, sizes.log_weights, sizes.log_mass(Kind.BASELINE), dominate=False)
    common = dict(sample_rate=mechanism.sample_rate, noise_std=mechanism.noise_std, delta=delta,
                  relative_step=mean_rule.COMPOSITION_LEVEL_STEP, interval=interval)
    eps = pld.mean_rule_eps(values.reshape(shape), law, checkpoints, total_steps, delta_fail=fail,
                            before_first=(worst, worst_law), **common)
    baseline_fail = sizes.delta_fail(Kind.BASELINE)
    baseline = pld.mean_rule_eps(worst[None, None], worst_law[None, None], [0], total_steps, delta_fail=baseline_fail,
                                 **common)
    if checkpoints[0] > 0:
        warn(f"no checkpoint at step 0: steps 1..{checkpoints[0]} use the mean rule's baseline (§4)")
    common = dict(delta=delta, steps=total_steps, k_min=sizes.k_min, reduction="mean")
    return pd.concat([
        pd.DataFrame({"point": points, "kind": composed_kind(kind, every).value, **_pld_columns(eps, interval),
                      "delta_fail": fail, **common}),
        pd.DataFrame({"point": points, "kind": Kind.BASELINE.value, **_pld_columns(baseline, interval),
                      "delta_fail": baseline_fail, **common})], ignore_index=True), (
        f"per-instance (eps, delta) of {len(points)} points over T={total_steps} steps, mean rule ({kind}), "
        f"{charged(every, len(checkpoints), 'per-step values')}, sigma={mechanism.noise_multiplier:g}, "
        f"q={mechanism.sample_rate:.4g}, k_min={sizes.k_min}, delta_fail={fail:.3g} per step, converted at "
        f"delta - T·delta_fail = {delta - total_steps * fail:.4g}; composed by PLD (dp_accounting, pessimistic, "
        f"discretisation {interval:g}), eps = max(remove, add)"), kind_notes(kind, every, "mean")


def repeated_step_eps(per_step_rdp: ArrayLike, steps: int, orders: ArrayLike, delta: float,
                      delta_fail: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """§4 when one checkpoint charges every step (b = inf): the ε of `steps` steps whose per-step Rényi DP is
    `per_step_rdp` (..., orders), converted at δ − steps·delta_fail (§3.4). Returns (ε, best order)."""
    return rdp_composition.rdp_to_eps(orders, steps * np.asarray(per_step_rdp, dtype=float), delta - steps * delta_fail)


def mean_rule_repeated(loaded: Loaded, *, steps: int, delta: float, orders: ArrayLike, kind: Kind = Kind.CERTIFIED,
                       failure: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """§4 for the mean rule when the rows' one checkpoint charges each of `steps` steps (b = inf): per point the ε
    of `kind` (certified or estimate), and the baseline's, each converted at δ − steps·delta_fail (§3.4).
    Returns (points, ε per point, baseline ε)."""
    sizes = mean_rule.size_model(loaded, failure)
    checkpoints, points, checkpoint_rdp, baseline_step = mean_rule.checkpoint_rdp(loaded, orders, kind, sizes)
    if len(checkpoints) != 1:
        raise UsageError(loaded.flag, f"{loaded.path}: one checkpoint is repeated, found steps "
                         f"{', '.join(map(str, checkpoints))}")
    eps, _ = repeated_step_eps(checkpoint_rdp[0], steps, orders, delta, sizes.delta_fail(kind))
    baseline, _ = repeated_step_eps(baseline_step, steps, orders, delta, sizes.delta_fail(Kind.BASELINE))
    return points, eps, float(baseline)


# --- per-point clip bounds held between measurements, and the filter's guarantees (§12.3-12.4, §13) -----------

def has_held_bounds(loaded: Loaded) -> bool:
    """Whether the rows are a tracked table with per-point clip bounds (quantity held_bound: a filtered run, or one
    measured every k > 1 steps)."""
    return bool((loaded.rows["quantity"] == "held_bound").any())


def held_bound_ratio(loaded: Loaded) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """C/Γ of the held_bound rows as an (R, S, P) array over runs, the union of their steps and points: each point's
    bound from its row's step until its next row (training clipped it there, §12.4), so every step has a bound.
    Every point needs a row at step 0. Returns (ratio, steps, points)."""
    rows = loaded.rows[loaded.rows["quantity"] == "held_bound"]
    rows = rows.assign(run_key=run_key(rows))
    check_values(loaded, rows.duplicated(subset=["run_key", "step", "point"]),
                 lambda row: "repeats the held_bound of its run, step and point", rows)
    steps, points = np.sort(rows["step"].unique()), np.sort(rows["point"].unique())
    runs = sorted(rows["run_key"].unique())
    ratio = np.empty((len(runs), len(steps), len(points)))
    for index, run in enumerate(runs):
        bounds = rows[rows["run_key"] == run].pivot(index="step", columns="point", values="value")
        bounds = bounds.reindex(index=steps, columns=points).ffill()
        if bounds.iloc[0].isna().any():
            point = bounds.columns[bounds.iloc[0].isna().to_numpy()][0]
            raise UsageError(loaded.flag, f"{loaded.path}: run {run} has no held_bound of point {point} at step 0 "
                             "(a run with per-point clipping bounds every point from its first step)")
        ratio[index] = bounds.to_numpy() / loaded.mechanism.clip_bound
    return np.minimum(ratio, 1.0), steps, points


def filter_guarantees(loaded: Loaded, delta: float) -> pd.DataFrame | None:
    """§12.3: each filtered point's guarantee, its Rényi budget at λ_f (the filter_budget rows) as ε at `delta`
    (§12.1's conversion): rows of kind guarantee; None without budgets."""
    rows = loaded.rows[loaded.rows["quantity"] == "filter_budget"]
    if rows.empty:
        return None
    check_values(loaded, rows.duplicated(subset=["run", "seed", "point"]),
                 lambda row: "repeats the filter_budget of its run and point", rows)
    budget = rows.groupby("point")[["value", "alpha"]].max()
    orders = pd.to_numeric(budget["alpha"]).to_numpy(dtype=float)
    eps = [float(individual_filter.guarantee_eps([value], delta, order)[0])
           for value, order in zip(budget["value"].to_numpy(dtype=float), orders)]
    return pd.DataFrame({"point": budget.index.to_numpy(), "kind": Kind.GUARANTEE.value, "eps": eps, "alpha": orders,
                         "delta": delta, "delta_fail": 0.0, "steps": loaded.mechanism.total_steps, "k_min": math.nan,
                         "reduction": "sum", **RDP_COLUMNS})


def sum_rule_held(loaded: Loaded, *, delta: float, orders: ArrayLike, holder_b: str | None = None,
                  accountant: str = "rdp", rounding: float = SUM_RULE_ROUNDING,
                  interval: float = pld_grid.DEFAULT_INTERVAL) -> tuple[pd.DataFrame, str, dict]:
    """renyi_per_instance_sum_compo.py on a tracked table with per-point clip bounds (§12.4): (rows, description,
    kind notes). The bounds, held from one row to the next, bound every step's sensitivity, so their composition is
    `certified` (a bound along the observed run) however rarely they were measured; next to it each filtered point's
    `guarantee` (filter_guarantees) and the baseline. By RDP the bounds are composed as charged (no further
    rounding) with λ_f among the orders, so that a point's certified ε is never above its guarantee at b = inf
    (default with one run); by PLD (§8.2) with Δ rounded up to `rounding`·Γ."""
    mechanism = loaded.mechanism
    ratio, steps, points = held_bound_ratio(loaded)
    guarantees = filter_guarantees(loaded, delta)
    common = dict(delta=delta, delta_fail=0.0, steps=mechanism.total_steps, k_min=math.nan, reduction="sum")
    if accountant == "pld":
        _check_pld_holder(holder_b)
        pld_common = dict(sample_rate=mechanism.sample_rate, noise_multiplier=mechanism.noise_multiplier, delta=delta,
                          rounding=rounding, interval=interval)
        composed = _pld_columns(pld.sum_rule_eps(ratio.max(axis=0).T, steps, mechanism.total_steps, **pld_common),
                                interval)
        baseline = _pld_columns(pld.sum_rule_eps(np.ones((1, 1)), [0], mechanism.total_steps, **pld_common), interval)
        how = f"composed by PLD (dp_accounting, pessimistic, discretisation {interval:g}), Δ rounded up to {rounding:g}·Γ"
    else:
        if guarantees is not None:
            orders = np.union1d(orders, guarantees["alpha"].unique())
        holder = holder_exponent(holder_b or ("inf" if ratio.shape[0] == 1 else "3T"), orders, mechanism.total_steps)
        eps, best_order = (values[0] for values in compose_sum_rule(ratio, steps, mechanism, orders=orders,
                                                                    delta=delta, holder_b=holder))
        warn_edge(best_order, orders)
        baseline_eps, baseline_order = mechanism.baseline_eps(delta, orders=orders)
        composed = dict(eps=eps, alpha=best_order, **RDP_COLUMNS)
        baseline = dict(eps=float(baseline_eps), alpha=float(baseline_order), **RDP_COLUMNS)
        how = f"Hölder b={holder:g}, the bounds as charged"
    frames = [pd.DataFrame({"point": points, "kind": Kind.CERTIFIED.value, **composed, **common}),
              pd.DataFrame({"point": points, "kind": Kind.BASELINE.value, **baseline, **common})]
    if guarantees is not None:
        frames.insert(0, guarantees[guarantees["point"].isin(points)])
    every = loaded.rows.loc[loaded.rows["quantity"] == "grad_norm", "step"].nunique()
    filtered = "" if guarantees is None else \
        f"; each point's guarantee: its filter budget at order {', '.join(map('{:g}'.format, guarantees['alpha'].unique()))}"
    return pd.concat(frames, ignore_index=True)[COLUMNS], (
        f"per-instance (eps, delta) of {len(points)} points over T={mechanism.total_steps} steps, sum rule, "
        f"{ratio.shape[0]} run(s), per-point clip bounds C = min(Γ, (1+m)·Δ*) from {every} measurements, held between "
        f"them (a bound along the observed run: training clipped each point at its bound, accounting.md §12.4)"
        f"{filtered}, sigma={mechanism.noise_multiplier:g}, q={mechanism.sample_rate:.4g}, {how}, delta={delta:g}"), {}

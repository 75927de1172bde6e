"""The mean rule's accountant (docs/accounting.md §3.2–§3.4), shared by the three accountant scripts.

From the coupling rows of compute_sensitivity.py --reduction mean, each (point, step) gets its
per-step guarantee in three kinds side by side: the estimate (stratified Monte Carlo over the Δ_B
samples: not a bound), the certified bound (from the dataset statistics d*, v_X, b_X; valid with
probability 1 − delta_fail) and the mean rule's own data-independent baseline. Each is a mixture
over batch sizes k ≥ k_min (the size model, §3.4): per-step (ε, δ) by §3.3 (per_step_eps),
per-step Rényi DP (per_step_rdp) and the per-step ρ per checkpoint that composition adds up
(checkpoint_rdp, perinstance/analysis/composition.py). GLA's statistic S (--estimator jensen) is in
perinstance/analysis/gla_statistic.py.
"""

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike

from perinstance.accounting import batch_sizes, certified_radius, rdp_composition
from perinstance.accounting.guarantees import Direction, Kind, direction_rows, eps_by_direction
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis.reading import Loaded, check_unique, check_values
from perinstance.console import warn
from perinstance.errors import UsageError
from perinstance.files.results import STATISTICS

# Sizes at which the certified bound and the baseline are evaluated (each size's probability is
# lumped onto the grid size below it, which keeps the bound valid: batch_sizes.size_grid).
CERTIFIED_SIZES = 64
# Sensitivities are rounded up onto a geometric grid with this relative step before RDP_SGM is
# looked up (certified_radius.geometric_levels): at most 0.1% on Δ, an upper bound.
LEVEL_STEP = 1e-3
# Composition looks up 47 orders for every point, size and checkpoint: a coarser rounding (1%,
# upward) keeps its tables to a few hundred levels.
COMPOSITION_LEVEL_STEP = 1e-2


@dataclass(frozen=True)
class SizeModel:
    """The batch sizes of one mean-rule configuration (§3.4): n = |X|, q, k_min and what it costs,
    and the grid of sizes the certified bound and the baseline are evaluated at."""

    n: int
    sample_rate: float
    k_min: int
    delta_size: float
    failure: float  # β of the certified event
    grid: np.ndarray  # sizes from k_min up (batch_sizes.size_grid)
    log_weights: np.ndarray  # their lumped log-probabilities (batch_sizes.lumped_size_log_weights)

    def delta_fail(self, kind: Kind) -> float:
        """§3.4: δ_size for the estimate and the baseline, δ_size + β for the certified bound."""
        return self.delta_size + (self.failure if kind == Kind.CERTIFIED else 0.0)

    def log_mass(self, kind: Kind) -> float:
        """log(1 − delta_fail): the probability the mixture weights of `kind` are normalised by."""
        return math.log(1 - self.delta_fail(kind))


def size_model(loaded: Loaded, failure: float | None = None) -> SizeModel:
    """§3.4 from the rows: k_min as measured (column k_min), n = N − 1 points besides x*.

    failure: β of the certified event; default δ_size, or δ/(10·T) with the run's training δ when
    k_min = 0 forces δ_size = 0."""
    k_mins = pd.to_numeric(loaded.rows["k_min"], errors="coerce").dropna().unique()
    if len(k_mins) != 1:
        raise UsageError(loaded.flag, f"{loaded.path}: mean-rule rows need one k_min (found "
                         f"{', '.join(f'{value:g}' for value in k_mins) or 'none'}); measure them with "
                         "compute_sensitivity.py --reduction mean")
    mechanism = loaded.mechanism
    n = mechanism.dataset_size - 1
    k_min = int(k_mins[0])
    delta_size = batch_sizes.size_failure(n, mechanism.sample_rate, k_min)
    if failure is None:
        training_delta = pd.to_numeric(loaded.rows["delta"], errors="coerce").dropna()
        fallback = (float(training_delta.iloc[0]) if len(training_delta) else 1e-5) / (10 * mechanism.total_steps)
        failure = delta_size if delta_size > 0 else fallback
    grid = batch_sizes.size_grid(n, mechanism.sample_rate, k_min, CERTIFIED_SIZES)
    return SizeModel(n=n, sample_rate=mechanism.sample_rate, k_min=k_min, delta_size=delta_size, failure=failure,
                     grid=grid, log_weights=batch_sizes.lumped_size_log_weights(grid, n, mechanism.sample_rate))


# --- the rows: dataset statistics and Δ_B samples -------------------------------------------------

def statistics_of(loaded: Loaded) -> pd.DataFrame | None:
    """d*, v_X, b_X per (point, step): a frame with one column per statistic; None without them."""
    rows = loaded.rows[loaded.rows["quantity"].isin(list(STATISTICS))]
    if rows.empty:
        return None
    # Every --mc-seed of one checkpoint records the same statistics: keep one copy.
    rows = rows.drop_duplicates(subset=["point", "step", "quantity", "value"])
    check_unique(dataclasses.replace(loaded, rows=rows), ["point", "step", "quantity"])
    table = rows.pivot(index=["point", "step"], columns="quantity", values="value")
    missing = table.isna().any(axis=1) | (len(table.columns) < len(STATISTICS))
    if missing.any():
        point, step = table.index[np.argmax(missing.to_numpy())]
        raise UsageError(loaded.flag, f"{loaded.path}: point {point} at step {step} lacks one of "
                         f"{', '.join(STATISTICS)} (measure with compute_sensitivity.py --reduction mean)")
    return table


@dataclass(frozen=True)
class Samples:
    """The Δ_B samples per (point, step) of `index`: (P, S) arrays of value, size k and Monte-Carlo
    block (NaN = absent), and the sizes they were drawn at."""

    index: pd.MultiIndex
    values: np.ndarray
    batch_sizes: np.ndarray
    blocks: np.ndarray
    grid: np.ndarray

    def log_weights(self, sizes: SizeModel) -> np.ndarray:
        """The lumped log-probabilities of the drawn sizes (§3.2)."""
        return batch_sizes.lumped_size_log_weights(self.grid, sizes.n, sizes.sample_rate)

    def block_masks(self) -> list[np.ndarray]:
        """Per Monte-Carlo block, which samples are its."""
        return [self.blocks == block for block in np.unique(self.blocks[~np.isnan(self.blocks)])]


def samples_of(loaded: Loaded, sizes: SizeModel) -> Samples | None:
    """The Samples of the batch_sensitivity rows (None without any), checked against `sizes`."""
    rows = loaded.rows[loaded.rows["quantity"] == "batch_sensitivity"]
    if rows.empty:
        return None
    batch_sizes = pd.to_numeric(rows["k"], errors="coerce")
    check_values(loaded, batch_sizes.isna().to_numpy() | (batch_sizes < 0).to_numpy(),
                 lambda row: f"batch_sensitivity row without a batch size k ({row['k']!r}); re-measure with "
                 "compute_sensitivity.py --reduction mean (Δ_B samples must carry k, accounting.md §2)", rows)
    # Samples of several --mc-seed values pool; each (mc_seed, block) is a block of its own.
    seed = pd.to_numeric(rows["mc_seed"], errors="coerce").fillna(-1)
    block = pd.to_numeric(rows["block"], errors="coerce").fillna(0)
    rows = rows.assign(k=batch_sizes.astype(int), mc_seed=seed,
                       block=pd.MultiIndex.from_arrays([seed, block]).factorize()[0])
    check_unique(dataclasses.replace(loaded, rows=rows), ["point", "step", "mc_seed", "block", "sample"])
    rows = _expand_histograms(rows, loaded)
    rows = rows.assign(column=rows.groupby(["point", "step"]).cumcount())
    index = pd.MultiIndex.from_frame(rows[["point", "step"]].drop_duplicates().sort_values(["point", "step"]))

    def dense(column):
        return rows.pivot(index=["point", "step"], columns="column", values=column).reindex(index).to_numpy(float)

    values, drawn = dense("value"), dense("k")
    grid = np.unique(drawn[~np.isnan(drawn)]).astype(int)
    if len(grid) and grid[0] < sizes.k_min:
        raise UsageError(loaded.flag, f"{loaded.path}: Δ_B samples at size {grid[0]} below k_min={sizes.k_min}")
    return Samples(index, values, drawn, dense("block"), grid)


def _expand_histograms(rows, loaded):
    """Δ_B rows with their `count` (a histogram row of storage.histogram_rows stands for `count`
    samples of its value; empty: 1) as that many samples, ordered by (point, step, block, k, value):
    a histogram and the rounded-up samples it was made from give the same arrays, hence the same
    numbers from every estimator, to the last bit (docs/sensitivity.md)."""
    counts = pd.to_numeric(rows["count"], errors="coerce").fillna(1)
    check_values(loaded, ((counts < 1) | (counts != np.round(counts))).to_numpy(),
                 lambda row: f"count {row['count']} is not an integer >= 1 (the samples a histogram row stands for)",
                 rows)
    rows = rows.loc[rows.index.repeat(counts.astype(int).to_numpy())]
    return rows.sort_values(["point", "step", "block", "k", "value"], kind="mergesort")


def require(part: pd.DataFrame | Samples | None, kind: Kind, loaded: Loaded) -> pd.DataFrame | Samples:
    """The statistics (certified) or samples (estimate) a composition of `kind` needs."""
    if part is None and kind == Kind.CERTIFIED:
        raise UsageError(loaded.flag, f"{loaded.path} has no mean-rule statistics (center_distance, spread, "
                         "max_deviation) to certify; measure with compute_sensitivity.py --reduction mean")
    if part is None:
        raise UsageError(loaded.flag, f"{loaded.path} has no Δ_B samples to estimate from (--kind estimate)")
    return part


# --- sensitivities per size, and their mixtures -----------------------------------------------------

@dataclass(frozen=True)
class Mixture:
    """One step's bound as a mixture (§3.2, §7.3): per row (a (point, step), or the one baseline row) the
    sensitivity of every component, the components' log weights and the batch size k each belongs to
    (components of one size are contiguous, sizes ascending)."""

    sensitivities: np.ndarray  # (P, C)
    log_weights: np.ndarray  # (C,)
    sizes: np.ndarray  # (C,)

    def size_starts(self) -> np.ndarray:
        """Index of the first component of each size."""
        return np.flatnonzero(np.concatenate([[True], np.diff(self.sizes) != 0]))


def certified_sensitivities(statistics: pd.DataFrame, clip_bound: float, sizes: SizeModel) -> Mixture:
    """§3.2 with §7's radius: the certified Mixture of each (point, step) of `statistics`, over the grid sizes
    × the tail levels of certified_radius.certified_mixture (this is the one place that builds it)."""
    bound, log_weights, component_sizes = certified_radius.certified_mixture(
        statistics["center_distance"], statistics["spread"], statistics["max_deviation"], clip_bound, sizes.grid,
        sizes.log_weights, sizes.failure)
    return Mixture(bound, log_weights, component_sizes)


def baseline_sensitivities(clip_bound: float, sizes: SizeModel) -> Mixture:
    """§3.2 baseline Δ̄_k = 2Γ/(k+1) at every size of sizes.grid, as a Mixture of one row."""
    return Mixture(certified_radius.baseline_mean_sensitivity(clip_bound, sizes.grid)[None, :], sizes.log_weights,
                   np.asarray(sizes.grid))


def rdp_table(mechanism: Mechanism, orders: ArrayLike, sensitivities: list[ArrayLike],
              relative_step: float = LEVEL_STEP) -> rdp_composition.RdpTable:
    """RDP_SGM(q, s_m/Δ, λ) for the mean rule (noise σΓ/B_exp) at the levels that the given
    sensitivities round up to (§5)."""
    sensitivity_ratio = np.concatenate([np.ravel(np.asarray(values, dtype=float)) / mechanism.clip_bound
                             for values in sensitivities])
    levels = certified_radius.geometric_levels(sensitivity_ratio, relative_step)
    return rdp_composition.RdpTable(mechanism.sample_rate, mechanism.noise_multiplier / mechanism.batch_size, orders,
                                    levels)


# Entries (rows × components × orders) of one chunk of mixture_rdp: its float64 arrays stay near 32 MB.
MIXTURE_CHUNK_ENTRIES = 1 << 22


def mixture_rdp(table: rdp_composition.RdpTable, mixture: Mixture, log_mass: float, clip_bound: float,
                dominant_sizes: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """§3.2 for every row of `mixture` and order of `table`: (1/(λ−1))·(log Σ_c w_c·exp(M_c(λ)) − log mass),
    and the dominant size k* (the size whose components carry the largest part of the sum; only with
    `dominant_sizes`), computed in chunks of rows. Returns two (P, orders) arrays (the second None without)."""
    orders = table.orders
    rows, components = mixture.sensitivities.shape
    result = np.empty((rows, len(orders)))
    dominant = np.empty(result.shape, dtype=np.int64) if dominant_sizes else None
    starts = mixture.size_starts()
    chunk = max(1, MIXTURE_CHUNK_ENTRIES // (components * len(orders)))
    for start in range(0, rows, chunk):
        terms = table.log_moments(mixture.sensitivities[start:start + chunk] / clip_bound)
        terms += mixture.log_weights[None, :, None]
        # log Σ exp, shifted by each (row, order)'s largest term; the shifted terms also give each size's share.
        top = terms.max(axis=1, keepdims=True)
        terms -= top
        np.exp(terms, out=terms)
        result[start:start + chunk] = (top[:, 0] + np.log(terms.sum(axis=1)) - log_mass) / (orders - 1.0)
        if dominant_sizes:
            shares = np.add.reduceat(terms, starts, axis=1)
            dominant[start:start + chunk] = mixture.sizes[starts][np.argmax(shares, axis=1)]
    # Every term's M_c ≥ 0 and the weights add up to at least the mass, so ρ ≥ 0; rounding can leave it a
    # few ulps below (certified_radius.mixture_rdp floors it likewise).
    return np.maximum(result, 0.0), dominant


def estimate_rdp(table: rdp_composition.RdpTable, samples: Samples, sizes: SizeModel, clip_bound: float,
                 masks: tuple[np.ndarray | None, ...] = (None,)) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """§3.2 estimate for every (point, step) and order of `table`, from the samples each mask keeps
    (None: all): per mask, the (P, orders) ρ, the stratified log-means (P, K, orders) and the
    samples per size (P, K) of the last order."""
    log_weights = samples.log_weights(sizes)
    log_mass = sizes.log_mass(Kind.ESTIMATE)
    moments = table.log_moments(np.nan_to_num(samples.values) / clip_bound)
    results = []
    for mask in masks:
        absent = np.isnan(samples.values) if mask is None else np.isnan(samples.values) | ~mask
        means, counts = certified_radius.stratified_log_means(np.where(absent[..., None], np.nan, moments),
                                                              samples.batch_sizes, samples.grid)
        rdp = np.stack([certified_radius.mixture_rdp(means[..., column], log_weights, log_mass, alpha)
                        for column, alpha in enumerate(table.orders)], axis=1)
        results.append((rdp, means, counts))
    return results


def sample_weights(batch_sizes: np.ndarray, samples: Samples, sizes: SizeModel) -> tuple[np.ndarray, np.ndarray]:
    """Weight of each Δ_B sample (NaN size = absent) in the stratified expectation of §3.2: its
    size's lumped probability split equally over that point's samples of that size; and per point
    whether some size has no sample (its probability would be lost: no estimate)."""
    log_weights = samples.log_weights(sizes)
    grid = samples.grid
    present = ~np.isnan(batch_sizes)
    position = np.searchsorted(grid, np.where(present, batch_sizes, grid[0]))
    counts = np.stack([((position == column) & present).sum(axis=1) for column in range(len(grid))], axis=1)
    share = np.exp(log_weights)[position] / np.maximum(np.take_along_axis(counts, position, axis=1), 1)
    return np.where(present, share, 0.0), (counts == 0).any(axis=1)


def _warn_k_min_zero(sizes):
    if sizes.k_min == 0:
        warn("k_min = 0: batches without any other point are in the guarantee, and the realised-size mean rule "
             "then has no useful bound (accounting.md §3.4)")


def _describe(mechanism, sizes):
    return (f"noise std {mechanism.noise_std:.4g}, q={mechanism.sample_rate:.4g}, n={sizes.n}, k_min={sizes.k_min} "
            f"(delta_size={sizes.delta_size:.3g}), beta={sizes.failure:.3g}")


# --- per-step (ε, δ) (§3.3) ---------------------------------------------------------------------------

def per_step_eps(loaded: Loaded, delta: float, failure: float | None = None) -> tuple[pd.DataFrame, str]:
    """eps_delta.py's mean rule: (rows, description). Per (point, step) and direction, the estimate
    with its min..max over Monte-Carlo blocks, the certified bound and the baseline, each with
    k_min and delta_fail; the reported δ includes delta_fail (§3.4)."""
    mechanism = loaded.mechanism
    sizes = size_model(loaded, failure)
    statistics, samples = statistics_of(loaded), samples_of(loaded, sizes)
    common = dict(reduction="mean", k_min=sizes.k_min, method="exact")
    frames, index = [], None
    if statistics is not None:
        index = statistics.index
        fail = sizes.delta_fail(Kind.CERTIFIED)
        certified = certified_sensitivities(statistics, mechanism.clip_bound, sizes)
        eps = eps_by_direction(certified.sensitivities / mechanism.noise_std, delta, mechanism.sample_rate,
                               np.exp(certified.log_weights), fail)
        frames.append(direction_rows(index, Kind.CERTIFIED, eps, delta, delta_fail=fail, samples=0, eps_min=math.nan,
                                     eps_max=math.nan, **common))
    if samples is not None:
        fail = sizes.delta_fail(Kind.ESTIMATE)
        mu = samples.values / mechanism.noise_std

        def estimate(mask):
            weights, incomplete = sample_weights(np.where(mask, samples.batch_sizes, np.nan), samples, sizes)
            eps = eps_by_direction(np.where(mask, mu, np.nan), delta, mechanism.sample_rate, weights, fail)
            return {direction: np.where(incomplete, np.nan, value) for direction, value in eps.items()}

        eps = estimate(np.ones(mu.shape, dtype=bool))
        if np.isnan(eps[Direction.MAX]).any():
            warn(f"{int(np.isnan(eps[Direction.MAX]).sum())} (point, step) estimates lack samples at some size and "
                 "are left empty (measure more --num-batches)")
        per_block = [estimate(mask) for mask in samples.block_masks()]
        spread = {name: {direction: reducer([block[direction] for block in per_block], axis=0)
                         for direction in eps} for name, reducer in (("eps_min", np.min), ("eps_max", np.max))}
        frames.append(direction_rows(samples.index, Kind.ESTIMATE, eps, delta, delta_fail=fail,
                                     samples=(~np.isnan(samples.values)).sum(axis=1), **spread, **common))
        index = samples.index if index is None else index.union(samples.index)
    fail = sizes.delta_fail(Kind.BASELINE)
    baseline = baseline_sensitivities(mechanism.clip_bound, sizes)
    worst = eps_by_direction(baseline.sensitivities / mechanism.noise_std, delta, mechanism.sample_rate,
                             np.exp(baseline.log_weights), fail)
    frames.append(direction_rows(index, Kind.BASELINE, {direction: np.full(len(index), value[0])
                                                        for direction, value in worst.items()},
                                 delta, delta_fail=fail, samples=0, eps_min=math.nan, eps_max=math.nan, **common))
    _warn_k_min_zero(sizes)
    return pd.concat(frames, ignore_index=True), (
        f"per-step (eps, delta) of {index.get_level_values('point').nunique()} points, mean rule (coupling, "
        f"§3.2-§3.4), {_describe(mechanism, sizes)}, delta={delta:g} including delta_fail")


# --- per-step Rényi DP (§3.2) -------------------------------------------------------------------------

def per_step_rdp(loaded: Loaded, orders: ArrayLike, failure: float | None = None) -> tuple[pd.DataFrame, str]:
    """renyi_per_instance_mean.py's coupling: (rows, description). Per (point, step) and order, the
    estimate (with its min..max over blocks), the certified bound and the baseline, each with
    k_min, delta_fail and the dominant size k*; directions remove, add (capped, §3.2) and max."""
    mechanism = loaded.mechanism
    sizes = size_model(loaded, failure)
    statistics, samples = statistics_of(loaded), samples_of(loaded, sizes)
    baseline = baseline_sensitivities(mechanism.clip_bound, sizes)
    certified = None if statistics is None else certified_sensitivities(statistics, mechanism.clip_bound, sizes)
    needed = [part.sensitivities for part in (baseline, certified) if part is not None]
    if samples is not None:
        needed.append(samples.values[~np.isnan(samples.values)])
    table = rdp_table(mechanism, orders, needed)
    frames, index = [], None
    if statistics is not None:
        fail = sizes.delta_fail(Kind.CERTIFIED)
        rdp, k_star = mixture_rdp(table, certified, sizes.log_mass(Kind.CERTIFIED), mechanism.clip_bound)
        frames += [statistics.index.to_frame(index=False).assign(
            alpha=alpha, kind=Kind.CERTIFIED.value, rdp=rdp[:, column], rdp_min=math.nan, rdp_max=math.nan, samples=0,
            k_star=k_star[:, column], delta_fail=fail) for column, alpha in enumerate(table.orders)]
        index = statistics.index
    if samples is not None:
        frames += _estimate_frames(table, samples, sizes, mechanism.clip_bound)
        index = samples.index if index is None else index.union(samples.index)
    rdp, k_star = mixture_rdp(table, baseline, sizes.log_mass(Kind.BASELINE), mechanism.clip_bound)
    frames += [index.to_frame(index=False).assign(
        alpha=alpha, kind=Kind.BASELINE.value, rdp=rdp[0, column], rdp_min=math.nan, rdp_max=math.nan, samples=0,
        k_star=k_star[0, column], delta_fail=sizes.delta_fail(Kind.BASELINE))
        for column, alpha in enumerate(table.orders)]
    result = pd.concat(frames, ignore_index=True).assign(k_min=sizes.k_min, estimator="coupling")
    result["k_star_at_k_min"] = (result["k_star"] == sizes.k_min).astype(int)
    flagged = result[result["kind"] != Kind.BASELINE].groupby("kind")["k_star_at_k_min"].sum()
    if flagged.any():
        counts = ", ".join(f"{count} {kind}" for kind, count in flagged.items() if count)
        warn(f"values dominated by the smallest size k_min (over every order): {counts}; they mostly reflect the "
             "chosen δ_size, not the data (column k_star_at_k_min)")
    _warn_k_min_zero(sizes)
    return with_directions(result, mechanism.sample_rate), (
        f"per-step Rényi DP of {index.get_level_values('point').nunique()} points, mean rule (coupling), "
        f"{_describe(mechanism, sizes)}")


def _estimate_frames(table, samples, sizes, clip_bound):
    """Per order, the §3.2 estimate rows: pooled over blocks, with the min and max of the per-block estimates."""
    (pooled, means, counts), *per_block = estimate_rdp(table, samples, sizes, clip_bound,
                                                       [None, *samples.block_masks()])
    per_block = np.array([rdp for rdp, _, _ in per_block])
    if (counts == 0).any():
        warn(f"{int((counts == 0).any(axis=1).sum())} points lack samples at some size: their estimate is NaN "
             "(measure more --num-batches)")
    dominant = np.argmax(np.nan_to_num(means, nan=-np.inf) + samples.log_weights(sizes)[None, :, None], axis=1)
    frame = samples.index.to_frame(index=False).assign(kind=Kind.ESTIMATE.value,
                                                       samples=(~np.isnan(samples.values)).sum(axis=1),
                                                       delta_fail=sizes.delta_fail(Kind.ESTIMATE))
    return [frame.assign(alpha=alpha, rdp=pooled[:, column], rdp_min=per_block[:, :, column].min(axis=0),
                         rdp_max=per_block[:, :, column].max(axis=0), k_star=samples.grid[dominant[:, column]])
            for column, alpha in enumerate(table.orders)]


def with_directions(frame: pd.DataFrame, sample_rate: float) -> pd.DataFrame:
    """§3.2: a mean-rule value bounds both directions; the add direction is also at most log(1/(1−q))."""
    cap = certified_radius.add_direction_cap(sample_rate)
    added = frame.assign(direction=Direction.ADD.value)
    for column in ("rdp", "rdp_min", "rdp_max"):
        added[column] = np.minimum(added[column], cap)
    return pd.concat([frame.assign(direction=Direction.REMOVE.value), added,
                      frame.assign(direction=Direction.MAX.value)], ignore_index=True)


# --- per-step ρ per checkpoint, for composition (§4) ------------------------------------------------

# Rows of statistics whose certified mixtures are held at once (each row: sizes × tail levels floats, and
# the temporaries of building them): composition reads every point at every checkpoint.
CERTIFIED_CHUNK = 2048


def certified_rdp(statistics: pd.DataFrame, mechanism: Mechanism, orders: ArrayLike, sizes: SizeModel) -> np.ndarray:
    """The certified per-step ρ (§3.2, §7) of every row of `statistics` at `orders`, for composition: the
    mixtures are built a chunk of rows at a time, twice (once for the RDP table's levels, once for the sums),
    so that memory does not grow with the rows."""
    chunks = [statistics.iloc[start:start + CERTIFIED_CHUNK] for start in range(0, len(statistics), CERTIFIED_CHUNK)]
    levels = np.unique(np.concatenate([
        certified_radius.geometric_levels(certified_sensitivities(chunk, mechanism.clip_bound, sizes).sensitivities
                                          / mechanism.clip_bound, COMPOSITION_LEVEL_STEP) for chunk in chunks]))
    table = rdp_composition.RdpTable(mechanism.sample_rate, mechanism.noise_multiplier / mechanism.batch_size, orders,
                                     levels)
    return np.concatenate([
        mixture_rdp(table, certified_sensitivities(chunk, mechanism.clip_bound, sizes), sizes.log_mass(Kind.CERTIFIED),
                    mechanism.clip_bound, dominant_sizes=False)[0] for chunk in chunks])


def checkpoint_rdp(loaded: Loaded, orders: ArrayLike, kind: Kind,
                   sizes: SizeModel) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The per-step ρ of `kind` (certified or estimate) of every point at every checkpoint (§3.2),
    and the baseline's: (checkpoint steps, points, (C, P, orders) ρ, (orders,) baseline ρ). Every
    point needs a value at every checkpoint."""
    mechanism = loaded.mechanism
    if kind == Kind.CERTIFIED:
        statistics = require(statistics_of(loaded), kind, loaded)
        # A checkpoint at T (or later) charges no step of the run (§4): it is not needed.
        used = statistics.index.get_level_values("step") < mechanism.total_steps
        statistics = statistics[used] if used.any() else statistics
        rdp = certified_rdp(statistics, mechanism, orders, sizes)
        index = statistics.index
    else:
        samples = require(samples_of(loaded, sizes), kind, loaded)
        table = rdp_table(mechanism, orders, [samples.values[~np.isnan(samples.values)]], COMPOSITION_LEVEL_STEP)
        rdp = estimate_rdp(table, samples, sizes, mechanism.clip_bound)[0][0]
        index = samples.index
    steps = index.get_level_values("step").to_numpy()
    points = index.get_level_values("point").to_numpy()
    checkpoints = np.unique(steps)
    chosen = points[steps == checkpoints[0]]
    for step in checkpoints:
        if not np.array_equal(points[steps == step], chosen):
            raise UsageError(loaded.flag, f"{loaded.path}: step {step} has other points than step {checkpoints[0]} "
                             "(every point needs a value at every checkpoint)")
    baseline = baseline_sensitivities(mechanism.clip_bound, sizes)
    baseline_table = rdp_table(mechanism, orders, [baseline.sensitivities], COMPOSITION_LEVEL_STEP)
    baseline_step = mixture_rdp(baseline_table, baseline, sizes.log_mass(Kind.BASELINE), mechanism.clip_bound,
                                dominant_sizes=False)[0][0]
    return checkpoints, chosen, np.stack([rdp[steps == step] for step in checkpoints]), baseline_step

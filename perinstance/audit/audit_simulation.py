"""The torch side of the audit (docs/audit.md): one DP-SGD step at a checkpoint, simulated with and without x*.

The audited points' transformed gradients (perinstance/measure/gradient_rows.py), the directions the
releases are projected on, the Monte-Carlo simulation of one released step, and the accountant's
upper bound it is held against. The mathematics (Clopper–Pearson, the ε conversion, Fisher
directions, threshold choice) is in perinstance/accounting/audit_bounds.py.

Cost trick of the simulation: everything is projected on one unit direction e per point. Then
⟨u(B), e⟩ = Σ_{i∈B} a_i with a_i = ⟨h_i, e⟩ computed once, and the isotropic Gaussian noise
projected on e is exactly one-dimensional; a trial is a batch draw and two normal draws.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from perinstance.accounting import audit_bounds, exact_eps_delta, intervals
from perinstance.accounting.mechanism import Mechanism
from perinstance.console import progress_bar
from perinstance.files import fileio, results
from perinstance.measure import measurement, poisson_batches
from perinstance.measure.batch_sums import Bags
from perinstance.measure.gradient_rows import (
    HeldRows,
    PointGradients,
    RecomputedRows,
    checkpoint_gradients,
    held_rows,
)
from perinstance.measure.predictions import Predictions
from perinstance.train import sampling, training
from perinstance.train.clipping import Transform
from perinstance.train.memory import return_free_pages
from perinstance.train.runs import OpenRun

# Trials per chunk of the simulation: the chunk's batch members (~ CHUNK_TRIALS·B_exp int64)
# stay in the tens of megabytes.
CHUNK_TRIALS = 8192
# Scores of the points simulated together: (trials × points × 2) float32 at most this many bytes.
SCORE_BYTES = 1 << 27
# Whitening: the leading principal directions of the other points' gradients (randomised SVD,
# Halko, Martinsson & Tropp 2011), with oversampling and power iterations for accuracy.
WHITENING_RANK = 128
WHITENING_OVERSAMPLE = 16
WHITENING_POWER_ITERATIONS = 2
# Rows the spread of the other points' gradients is estimated from (as many as a CPU holds of LeNet-5's).
WHITENING_ROWS = 1024
STATISTICS = ("whitened", "projection", "known-batch")
TABLE_ROWS = 20


# --- per-sample gradients of the audited points ---------------------------------------------------

@dataclass
class AuditedPoints:
    """The points under audit at one checkpoint: full-dataset indices, h* as rows (P × d),
    training rows (−1 outside the training set), and their losses and correctness."""

    points: np.ndarray
    gradients: torch.Tensor
    train_rows: np.ndarray
    predictions: Predictions

    def point_gradients(self) -> PointGradients:
        return PointGradients(self.gradients, self.train_rows, self.predictions)


def audited_gradients(run: OpenRun, model: torch.nn.Module, transform: Transform, points: Sequence[int] | None,
                      spread: int | None, device: str, progress: tqdm | None
                      ) -> tuple[HeldRows | RecomputedRows, AuditedPoints]:
    """The gradients of every training row (gradient_rows.checkpoint_gradients: on a GPU held as far as the
    memory budget allows, the others recomputed on each pass) and the audited points.

    `points` (full-dataset indices), or None and `spread` points chosen by
    audit_bounds.spread_points from every training row's Δ* and correctness at this checkpoint.
    """
    query = np.asarray(points if points is not None else run.train_columns[:1])
    # An audit passes over the rows two or three times. On a CPU, holding part of them (at most HELD_BYTES_CPU)
    # would spare a fraction of one recomputation per pass for as much memory as the mean rule's batch sums take
    # beside them: there, all rows are held when they fit and none otherwise (the results are the same).
    hold = None
    if torch.device(device).type == "cpu":
        hold = held_rows(model, len(run.train_y), device) >= len(run.train_y)
    rows, given = checkpoint_gradients(model, run.train_x, run.train_y, run.dataset.train_x[query],
                                       run.dataset.train_y[query], run.train_rows(query), transform, device,
                                       hold=hold, progress=progress, loss_fn=training.loss_for_run(run.config))
    if points is not None:
        return rows, AuditedPoints(query, given.rows, run.train_rows(query), given.predictions)
    norms = np.minimum(rows.square_norms().sqrt().cpu().numpy(), transform.bound)
    # Correctness undefined (targets that are not class labels, NaN) counts as correct: the ranks span all points.
    chosen = audit_bounds.spread_points(norms, rows.predictions.correct != 0, spread)
    return rows, AuditedPoints(run.train_columns[chosen], rows.take(chosen), chosen, rows.predictions.take(chosen))


def top_components(rows: HeldRows | RecomputedRows, center: np.ndarray | None, rank: int,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Leading right singular vectors V (d × l) and singular values of H − 1·centerᵀ, H the
    training rows (center None: H itself), by randomised SVD with power iterations. Each product
    is one pass over the rows."""
    dim, count = rows.dim, rows.num_rows
    size = min(rank + WHITENING_OVERSAMPLE, count, dim)
    dtype, device = rows.dtype, rows.device
    shift = None if center is None else torch.as_tensor(center, dtype=dtype, device=device)

    def times(right):  # (H − 1cᵀ)·right: (count × size)
        product = rows.products(right.T, dtype)
        return product if shift is None else product - (shift @ right)[None, :]

    def transposed_times(left):  # (H − 1cᵀ)ᵀ·left: (dim × size)
        product = rows.transposed_product(left)
        return product if shift is None else product - shift[:, None] * left.sum(dim=0)[None, :]

    def orthonormal(matrix):
        return torch.linalg.qr(matrix.double())[0].to(dtype)

    generator = torch.Generator(device=device).manual_seed(int(seed))
    basis = orthonormal(times(torch.randn(dim, size, generator=generator, dtype=dtype, device=device)))
    for _ in range(WHITENING_POWER_ITERATIONS):
        basis = orthonormal(times(orthonormal(transposed_times(basis))))
    _, singular, right_vectors = torch.linalg.svd(transposed_times(basis).double().T, full_matrices=False)
    return right_vectors.T.cpu().numpy(), singular.cpu().numpy()


def shift_targets(rows: HeldRows | RecomputedRows, audited: AuditedPoints, rule: str) -> np.ndarray:
    """What x* moves the update along: h* (sum rule), h* − μ_X (mean rule, the coupling
    direction of accounting.md §3.2, μ_X the mean of the other points' h_i). (P × d) float64."""
    own = audited.gradients.double().cpu().numpy()
    if rule == "sum":
        return own
    total = rows.column_sums().cpu().numpy()
    count = rows.num_rows
    inside = (audited.train_rows >= 0)[:, None]
    others_mean = (total[None, :] - inside * own) / (count - inside)
    return own - others_mean


def directions(rows: HeldRows | RecomputedRows, audited: AuditedPoints, mechanism: Mechanism, statistic: str,
               seed: int) -> np.ndarray:
    """Unit directions e (P × d): the shift itself (projection, known-batch), or Fisher's
    discriminant against the other points' batch spread plus the noise (whitened, docs/audit.md)."""
    targets = shift_targets(rows, audited, mechanism.rule)
    noise_var = mechanism.noise_std ** 2
    if statistic != "whitened":
        return audit_bounds.fisher_directions(targets, np.zeros((targets.shape[1], 0)), np.zeros(0), noise_var)
    count = rows.num_rows
    # The spread is estimated from the first WHITENING_ROWS rows: any direction chosen before the trials keeps the
    # audit's bound valid, and these rows are held in memory, where the randomised SVD's passes cost little.
    sample = rows.leading(min(WHITENING_ROWS, count))
    # The passes that formed them freed their chunks' gradients; handed back, the SVD's arrays (tens of MB each) do
    # not stand on them (90 MiB less at the quick preset's audit).
    return_free_pages()
    if mechanism.rule == "sum":
        # Var Σ_{i∈B} h_i = q(1−q)·Σ_i h_i h_iᵀ under Poisson sampling, Σ_i over all rows estimated from the sample.
        basis, singular = top_components(sample, None, WHITENING_RANK, seed)
        variances = mechanism.sample_rate * (1 - mechanism.sample_rate) * singular ** 2 * count / sample.num_rows
    else:
        # The mean of a uniform k-subset has covariance Σ_X·(n−k)/(k(n−1)), at k = B_exp.
        basis, singular = top_components(sample, rows.column_sums().cpu().numpy() / count, WHITENING_RANK, seed)
        size = min(mechanism.batch_size, count - 1)
        variances = singular ** 2 / sample.num_rows * (count - size) / (size * max(count - 1, 1))
    return audit_bounds.fisher_directions(targets, basis, variances, noise_var)


# --- the simulation ---------------------------------------------------------------------------------

def projections_on(rows: HeldRows | RecomputedRows, unit: np.ndarray) -> np.ndarray:
    """a_i = ⟨h_i, e_p⟩ for every training row and direction (float32 products, float64 result)."""
    unit = torch.as_tensor(unit, dtype=rows.dtype, device=rows.device)
    return rows.products(unit, rows.dtype).double().cpu().numpy()


def memberships(members: np.ndarray, sizes: np.ndarray, own_rows: np.ndarray) -> np.ndarray:
    """(batches, points) booleans: point p's training row own_rows[p] is in the batch (never for −1)."""
    lookup = np.full(int(max(members.max(initial=-1), own_rows.max(initial=-1))) + 1, -1, dtype=np.int64)
    inside = np.flatnonzero(own_rows >= 0)
    lookup[own_rows[inside]] = inside
    found = lookup[members] if len(members) else np.zeros(0, dtype=np.int64)
    hit = np.flatnonzero(found >= 0)
    result = np.zeros((len(sizes), len(own_rows)), dtype=bool)
    result[np.repeat(np.arange(len(sizes)), sizes)[hit], found[hit]] = True
    return result


def _chunk_rng(seed, step, *key):
    return sampling.stream_rng(seed, sampling.AUDIT_STREAM, step, *key)


def simulate_releases(projections: np.ndarray, own_rows: np.ndarray, own_values: np.ndarray, mechanism: Mechanism,
                      trials: int, seed: int, step: int, points: np.ndarray, known_batch: bool = False,
                      progress: tqdm | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The projected release ⟨ũ, e_p⟩ of one step over `trials` trials, with x* in the
    training set (law P) and without (law Q): two (trials, P) float32 arrays.
    known_batch: the adversary also knows the other points' batch B and subtracts the
    update without x*, ⟨u(B) or m(B), e_p⟩ (docs/audit.md).

    projections: (n, P) a_i = ⟨h_i, e_p⟩ over the run's training rows; own_rows: each point's
    row (−1 outside the training set); own_values: ⟨h*, e_p⟩. A trial draws one Poisson batch
    D over all rows, shared by the points (the other points' batch is D without x*, exactly
    Poisson_q(X)), then per point x*'s own Bernoulli(q) and the two noises from a stream of
    (seed, step, chunk, point), so a point's scores do not depend on the points beside it.
    The two laws share D: each rate's interval needs only independent trials of its own law.
    """
    count = projections.shape[0]
    center = projections.mean(axis=0)
    # Centred float32 for the gather-and-add; the exact centre is added back in float64.
    centred = torch.from_numpy((projections - center).astype(np.float32))
    own_rows = np.asarray(own_rows)
    own_in_rows = np.where(own_rows >= 0, projections[np.maximum(own_rows, 0), np.arange(len(own_rows))], 0.0)
    scores_in = np.empty((trials, len(own_rows)), dtype=np.float32)
    scores_out = np.empty_like(scores_in)
    for chunk, start in enumerate(range(0, trials, CHUNK_TRIALS)):
        stop = min(start + CHUNK_TRIALS, trials)
        members, sizes = sampling.poisson_members(_chunk_rng(seed, step, sampling.TRIAL_KEY, chunk), stop - start,
                                                  count, mechanism.sample_rate)
        member = memberships(members, sizes, own_rows)
        others_sum = (Bags(members, sizes, centred.device).sums(centred).double().numpy() + sizes[:, None] * center
                      - member * own_in_rows)
        others_count = sizes[:, None] - member
        for column, point in enumerate(points):
            rng = _chunk_rng(seed, step, sampling.TRIAL_KEY, chunk, point)
            joined = rng.random(stop - start) < mechanism.sample_rate
            noise = rng.standard_normal((2, stop - start)) * mechanism.noise_std
            parts = others_sum[:, column], others_count[:, column]
            known = audit_bounds.projected_release(*parts, False, 0.0, 0.0, mechanism.rule) if known_batch else 0.0
            scores_in[start:stop, column] = audit_bounds.projected_release(
                *parts, joined, own_values[column], noise[0], mechanism.rule) - known
            scores_out[start:stop, column] = audit_bounds.projected_release(
                *parts, False, own_values[column], noise[1], mechanism.rule) - known
        if progress is not None:
            progress.update(stop - start)
    return scores_in, scores_out


# --- the upper bounds the audit holds them against ------------------------------------------------

def upper_bounds(rows: HeldRows | RecomputedRows, audited: AuditedPoints, mechanism: Mechanism, delta: float,
                 upper_batches: int, seed: int, step: int, clip_bound: float) -> tuple[np.ndarray, np.ndarray, str]:
    """(eps_upper, sensitivity, kind) per point: the matching accountant's per-step ε at δ.

    Sum rule: exact (accounting.md §3.3 with Δ = Δ*). Mean rule: the estimate of §3.3 from
    `upper_batches` Poisson batches of Δ_B, equal weights (its Monte-Carlo error is not a bound).
    `sensitivity` is Δ* (sum) or the largest sampled Δ_B (mean).
    """
    if mechanism.rule == "sum":
        norms = np.minimum(np.linalg.norm(audited.gradients.double().cpu().numpy(), axis=1), clip_bound)
        eps = exact_eps_delta.per_step_eps(norms[:, None] / mechanism.noise_std, delta, mechanism.sample_rate)
        return eps, norms, "exact"
    members, sizes = sampling.poisson_members(_chunk_rng(seed, step, sampling.UPPER_KEY), upper_batches,
                                              rows.num_rows, mechanism.sample_rate)
    samples = poisson_batches.batch_sensitivities(rows, audited.point_gradients(),
                                                  sampling.members_mask(members, sizes, rows.num_rows))
    eps = exact_eps_delta.per_step_eps(samples / mechanism.noise_std, delta, mechanism.sample_rate)
    return eps, samples.max(axis=1), "estimate"


# --- the audit of one checkpoint -------------------------------------------------------------------

AUDIT_COLUMNS = ["point", "step", "rule", "label", "loss", "correct", "sensitivity", "eps_lower", "eps_upper",
                 "upper_kind", "ratio", "violated", "direction", "threshold", "tpr", "fpr", "trials", "delta",
                 "confidence", "statistic", "seed"]


@dataclass(frozen=True)
class AuditRequest:
    rule: str
    trials: int
    delta: float
    statistic: str
    upper_batches: int
    seed: int
    points: np.ndarray | None
    spread: int | None


def audit_checkpoint(run: OpenRun, step: int, request: AuditRequest, device: str = "cpu") -> pd.DataFrame:
    """Audit rows (AUDIT_COLUMNS) of the requested points at checkpoint `step`.

    trials: released steps simulated per law and point; half choose the test, half count it.
    eps_lower holds with 95% confidence; eps_upper is the accountant's per-step ε; violated
    marks eps_lower > eps_upper, i.e. an upper bound the audit proves wrong. A value that is not finite is
    refused (measurement.refusing_non_finite).
    """
    with measurement.refusing_non_finite(run, step, [] if request.points is None else request.points, device):
        return _audited_checkpoint(run, step, request, device)


def _audited_checkpoint(run, step, request, device):
    mechanism = Mechanism.of_run(run.config, request.rule)
    model, _ = training.load_model(run.config, run.run_dir, step, device)
    transform = Transform.of_run(run.config)
    with progress_bar(len(run.train_y), f"per-sample gradients, step {step}") as bar:
        rows, audited = audited_gradients(run, model, transform, request.points, request.spread, device, bar)
    unit = directions(rows, audited, mechanism, request.statistic, _chunk_rng(request.seed, step, sampling.WHITENING_KEY)
                      .integers(2**62))
    projections = projections_on(rows, unit)
    own_values = np.einsum("pd,pd->p", audited.gradients.double().cpu().numpy(), unit)
    eps_upper, sensitivities, kind = upper_bounds(rows, audited, mechanism, request.delta, request.upper_batches,
                                                  request.seed, step, transform.bound)
    del rows  # the held gradients are no longer needed; the simulation only uses the projections
    outcomes = []
    per_pass = max(1, SCORE_BYTES // (8 * request.trials))
    with progress_bar(request.trials * -(-len(audited.points) // per_pass), f"simulated steps, step {step}") as bar:
        for start in range(0, len(audited.points), per_pass):
            part = slice(start, start + per_pass)
            scores_in, scores_out = simulate_releases(projections[:, part], audited.train_rows[part],
                                                      own_values[part], mechanism, request.trials, request.seed,
                                                      step, audited.points[part],
                                                      request.statistic == "known-batch", bar)
            outcomes += [audit_bounds.audit_scores(scores_in[:, column], scores_out[:, column], request.delta)
                         for column in range(scores_in.shape[1])]
    return audit_rows(run, step, request, audited, outcomes, eps_upper, sensitivities, kind)


def audit_rows(run: OpenRun, step: int, request: AuditRequest, audited: AuditedPoints,
               outcomes: Sequence[audit_bounds.Outcome], eps_upper: np.ndarray, sensitivities: np.ndarray,
               kind: str) -> pd.DataFrame:
    eps_lower = np.array([outcome.eps_lower for outcome in outcomes])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(eps_upper > 0, eps_lower / eps_upper, np.where(eps_lower > 0, np.inf, 0.0))
    return pd.DataFrame({
        "point": audited.points,
        "step": step,
        "rule": request.rule,
        "label": results.class_labels(run.dataset.train_y[audited.points].numpy()),
        "loss": audited.predictions.losses,
        "correct": results.correct_column(audited.predictions.correct),
        "sensitivity": sensitivities,
        "eps_lower": eps_lower,
        "eps_upper": eps_upper,
        "upper_kind": kind,
        "ratio": ratio,
        "violated": (eps_lower > eps_upper).astype(int),
        "direction": [outcome.direction for outcome in outcomes],
        "threshold": [outcome.threshold for outcome in outcomes],
        "tpr": [outcome.hits_in / outcome.trials for outcome in outcomes],
        "fpr": [outcome.hits_out / outcome.trials for outcome in outcomes],
        "trials": request.trials,
        "delta": request.delta,
        "confidence": audit_bounds.CONFIDENCE,
        "statistic": request.statistic,
        "seed": request.seed,
    })[AUDIT_COLUMNS]


def audit_summary(rows: pd.DataFrame) -> dict[int, dict]:
    """Per checkpoint step: the rule, the kind of upper bound, trials, δ, the number of violated
    points, and per group (audit_bounds.point_groups: easy, hard, misclassified; and all) the number of points and
    the medians of eps_lower, eps_upper and their ratio, the ratio's with its 95% interval (docs/accounting.md §10)."""
    summary = {}
    for step, group in rows.groupby("step"):
        masks = audit_bounds.point_groups(group["eps_upper"].to_numpy(), group["correct"].to_numpy() == 1)
        subsets = {**{name: group[mask] for name, mask in masks.items()}, "all": group}
        summary[int(step)] = {
            "rule": group["rule"].iloc[0], "upper_kind": group["upper_kind"].iloc[0],
            "trials": int(group["trials"].iloc[0]), "delta": float(group["delta"].iloc[0]),
            "violated": int(group["violated"].sum()), "points": len(group),
            "groups": {name: {"points": len(subset), "median_lower": float(subset["eps_lower"].median()),
                              "median_upper": float(subset["eps_upper"].median()),
                              "median_ratio": float(subset["ratio"].median()),
                              "ratio_interval": intervals.median_interval(subset["ratio"].dropna().to_numpy())
                              if subset["ratio"].notna().any() else None}
                       for name, subset in subsets.items() if len(subset)},
        }
    return summary


def gap_summary(rows: pd.DataFrame, mechanism: Mechanism, size_delta: float | None = None) -> dict[int, dict]:
    """The audit of the realised-size mean rule held against the sum rule's accounting at the same
    σ and q (docs/audit.md §1). Per checkpoint step: the sum rule's per-step ε (Δ = Γ, accounting.md
    §3.3: what its accountant prints for one step), the mean rule's own baseline with its k_min and
    δ_size (§3.2-§3.4), and how many points' eps_lower exceed each. A point above the sum rule's ε
    proves that the sum rule's accounting does not cover the mean rule; one above the mean rule's
    baseline would prove that baseline wrong. `above_sum_rule_jointly` counts the points above the
    sum rule's ε when all the step's bounds must hold together (Bonferroni over its points).
    `mechanism`: the run's (mechanism.Mechanism)."""
    rules = set(rows["rule"])
    if rules != {"mean"}:
        raise ValueError(f"the gap is the mean rule's: rows of rule {', '.join(sorted(rules))}")
    delta = float(rows["delta"].iloc[0])
    sum_eps, _, _ = replace(mechanism, rule="sum").per_step_baseline_eps(delta)
    mean_eps, k_min, delta_size = replace(mechanism, rule="mean").per_step_baseline_eps(delta, size_delta)
    summary = {}
    for step, group in rows.groupby("step"):
        lower = group["eps_lower"]
        # The same events at confidence 1 − (1 − c)/points (Bonferroni): these bounds hold for all the
        # step's points together with probability >= c. The evaluation half has trials − ⌊trials/2⌋.
        counted = group["trials"].to_numpy() - group["trials"].to_numpy() // 2
        jointly = audit_bounds.epsilon_lower_bound(np.round(group["tpr"].to_numpy() * counted),
                                                   np.round(group["fpr"].to_numpy() * counted), counted, counted, delta,
                                                   1 - (1 - float(group["confidence"].iloc[0])) / len(group))
        summary[int(step)] = {
            "points": len(group), "trials": int(group["trials"].iloc[0]), "delta": delta,
            "noise_multiplier": mechanism.noise_multiplier, "sample_rate": mechanism.sample_rate,
            "batch_size": mechanism.batch_size, "dataset_size": mechanism.dataset_size,
            "sum_rule_eps": sum_eps, "mean_baseline_eps": mean_eps, "k_min": k_min, "delta_size": delta_size,
            "above_sum_rule": int((lower > sum_eps).sum()), "above_baseline": int((lower > mean_eps).sum()),
            "above_sum_rule_jointly": int((jointly > sum_eps).sum()), "median_lower_jointly": float(np.median(jointly)),
            "median_lower": float(lower.median()), "median_lower_interval": intervals.median_interval(lower.to_numpy()),
            "max_lower": float(lower.max()), "median_upper": float(group["eps_upper"].median()),
        }
    return summary


def report_lines(rows: pd.DataFrame, out: str, gaps: dict[int, dict] | None = None) -> list[str]:
    """What audit.py prints of its rows (written to `out`): the first rows, then per checkpoint the
    summary of audit_summary, and for the mean rule the comparison of gap_summary (`gaps`)."""
    shown = rows.head(TABLE_ROWS)
    lines = [shown[["point", "step", "label", "correct", "loss", "sensitivity", "eps_lower", "eps_upper", "ratio",
                    "violated", "direction"]].to_string(index=False, float_format=lambda value: f"{value:.4g}")]
    if len(rows) > len(shown):
        lines.append(f"... {len(rows) - len(shown)} more rows in {out}")
    lines.append("")
    for step, summary in audit_summary(rows).items():
        lines.append(f"step {step}, {summary['rule']} rule, {summary['upper_kind']} upper bound, "
                     f"{summary['trials']} trials per law, delta={summary['delta']:g}:")
        for name, group in summary["groups"].items():
            lines.append(f"  {name:>13}: {group['points']:3d} points, median eps_lower {group['median_lower']:.4g}, "
                         f"eps_upper {group['median_upper']:.4g}, eps_lower/eps_upper {group['median_ratio']:.3g}")
        lines.append(f"  violated (eps_lower > eps_upper): {summary['violated']} of {summary['points']}"
                     + (" — these upper bounds are WRONG (or, for an estimate, too noisy)" if summary["violated"]
                        else ""))
        gap = (gaps or {}).get(step)
        if gap is not None:
            lines.append(f"  against the sum rule's accounting at the same sigma={gap['noise_multiplier']:g}, "
                         f"q={gap['sample_rate']:.4g} (one step: eps {gap['sum_rule_eps']:.4g}, exact): eps_lower above "
                         f"it for {gap['above_sum_rule']} of {gap['points']} points ({gap['above_sum_rule_jointly']} "
                         "with all bounds holding together, Bonferroni)"
                         + (" — the realised-size mean rule leaks more than the sum rule's accounting says"
                            if gap["above_sum_rule"] else ""))
            lines.append(f"  against the mean rule's own baseline (one step: eps {gap['mean_baseline_eps']:.4g}, "
                         f"k_min={gap['k_min']}, delta_size={gap['delta_size']:.3g}): eps_lower above it for "
                         f"{gap['above_baseline']} of {gap['points']} points"
                         + (" — that baseline is WRONG" if gap["above_baseline"] else ""))
    return lines


def output_paths(out: str | None, figure: str | None, run_name: str, rule: str) -> tuple[str, str]:
    """audit.py's --out and --figure (default res/<run>_audit_<rule>.csv, figures/<run>_audit_<rule>.png),
    refused where they could not be written (fileio.check_output; missing folders are created with the file)."""
    out = out or os.path.join("res", f"{run_name}_audit_{rule}.csv")
    figure = figure or os.path.join("figures", f"{run_name}_audit_{rule}.png")
    for flag, path in (("--out", out), ("--figure", figure)):
        fileio.check_output(path, flag)
    return out, figure

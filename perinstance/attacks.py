"""The torch and file side of the audit and of the membership attack (docs/audit.md).

Loading a run and its checkpoints, per-sample transformed gradients (perinstance/sensitivity.py),
the directions the releases are projected on, the Monte-Carlo simulation of one DP-SGD step
with and without x*, and the per-class loss-threshold attack. The mathematics (Clopper–Pearson,
the ε conversion, Fisher directions, threshold choice) is in perinstance/audit.py.

Cost trick of the simulation: everything is projected on one unit direction e per point. Then
⟨u(B), e⟩ = Σ_{i∈B} a_i with a_i = ⟨h_i, e⟩ computed once, and the isotropic Gaussian noise
projected on e is exactly one-dimensional; a trial is a batch draw and two normal draws.
"""

import os
import sys
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm

from perinstance import accounting, audit, runs, sensitivity, training
from perinstance.data import load_dataset
from perinstance.errors import UsageError
from perinstance.mechanism import Mechanism

# Random stream of the audit's trials, apart from sampling.py's streams 0-3 (batches, noise,
# sensitivity pools, initialisation), so that the audit never replays training's own draws.
AUDIT_STREAM = 17
MEMBERSHIP_STREAM = 18
# Keys within the audit stream: the trial batches (then chunk, point), the Δ_B batches of the
# mean rule's upper bound, the random start of the whitening.
TRIAL_KEY, UPPER_KEY, WHITENING_KEY = 0, 1, 2
# Trials per chunk of the simulation: the chunk's batch members (~ CHUNK_TRIALS·B_exp int64)
# stay in the tens of megabytes.
CHUNK_TRIALS = 8192
# Batches of the mean rule's upper bound per pass over the rows (their float32 sums: 63 MB for LeNet-5).
UPPER_PASS_BATCHES = 256
# Scores of the points simulated together: (trials × points × 2) float32 at most this many bytes.
SCORE_BYTES = 1 << 29
# Whitening: the leading principal directions of the other points' gradients (randomised SVD,
# Halko, Martinsson & Tropp 2011), with oversampling and power iterations for accuracy.
WHITENING_RANK = 128
WHITENING_OVERSAMPLE = 16
WHITENING_POWER_ITERATIONS = 2
LOSS_CHUNK = 1024
STATISTICS = ("whitened", "projection", "known-batch")


def progress_bar(total, desc):
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, disable=None, leave=False)


# --- the run ------------------------------------------------------------------------------------

def run_folder(name, models_dir, flag):
    """A run given as a folder holding run.json, or as a name under `models_dir`."""
    for folder in (name, os.path.join(models_dir, name)):
        if os.path.isfile(runs.run_file(folder)):
            return folder
    raise UsageError(flag, f"no run {name!r}: neither a folder with run.json nor {os.path.join(models_dir, name)} "
                           "(train it with train_dpsgd.py --save-name NAME)")


def open_run(name, models_dir, data_root, flag="--run"):
    """The run `name` with its datasets, checked against the dataset fingerprint in run.json."""
    run_dir = run_folder(name, models_dir, flag)
    config = runs.load_run(run_dir)
    dataset = load_dataset(config.dataset, data_root)
    if dataset.fingerprint != config.dataset_fingerprint:
        raise UsageError("--data-root", f"the dataset {config.dataset} under {data_root} is not the one "
                                        f"{run_dir} was trained on (fingerprints differ)")
    training_set = dataset if config.less_point is None else load_dataset(config.dataset, data_root,
                                                                          config.less_point)
    run = runs.OpenRun(run_dir, config, dataset, training_set.train_x, training_set.train_y)
    if not run.saved_steps():
        raise UsageError(flag, f"{run_dir} has no checkpoints")
    return run


# --- per-sample gradients of the audited points ---------------------------------------------------

@dataclass
class AuditedPoints:
    """The points under audit at one checkpoint: full-dataset indices, h* as rows (P × d),
    training rows (−1 outside the training set), and their losses and correctness."""

    points: np.ndarray
    gradients: torch.Tensor
    train_rows: np.ndarray
    predictions: object


def row_norms(rows):
    """||h_i|| of every training row (float64)."""
    squares = torch.cat([sum((block.double() ** 2).sum(dim=1) for block in blocks) for _, blocks in rows.chunks()])
    return squares.sqrt().cpu().numpy()


def checkpoint_gradients(run, model, transform, points, spread, device, progress):
    """The gradients of every training row (sensitivity.checkpoint_gradients: held as far as the
    memory budget allows, the others recomputed on each pass) and the audited points.

    `points` (full-dataset indices), or None and `spread` points chosen by
    audit.spread_points from every training row's Δ* and correctness at this checkpoint.
    """
    query = np.asarray(points if points is not None else run.train_columns[:1])
    rows, given = sensitivity.checkpoint_gradients(model, run.train_x, run.train_y, run.dataset.train_x[query],
                                                   run.dataset.train_y[query], run.train_rows(query), transform,
                                                   device, progress=progress)
    if points is not None:
        return rows, AuditedPoints(query, given.rows, run.train_rows(query), given.predictions)
    norms = np.minimum(row_norms(rows), transform.bound)
    chosen = audit.spread_points(norms, rows.predictions.correct, spread)
    return rows, AuditedPoints(run.train_columns[chosen], rows.take(chosen), chosen, rows.predictions.take(chosen))


def column_sums(rows):
    """Σ_i h_i over every training row (float64, length d)."""
    return rows.column_sums().cpu().numpy()


def top_components(rows, center, rank, seed):
    """Leading right singular vectors V (d × l) and singular values of H − 1·centerᵀ, H the
    training rows (center None: H itself), by randomised SVD with power iterations. Each product
    is one pass over the rows' chunks (sensitivity._Rows.chunks)."""
    dim, count = rows.dim, rows.num_rows
    edges = [0, *np.cumsum([high - low for low, high in sensitivity.column_spans(dim)])]
    size = min(rank + WHITENING_OVERSAMPLE, count, dim)
    dtype, device = rows.dtype, rows.device
    shift = None if center is None else torch.as_tensor(center, dtype=dtype, device=device)

    def times(right):  # (H − 1cᵀ)·right: (count × size)
        product = torch.cat([sum(block @ right[low:high] for block, low, high in zip(blocks, edges[:-1], edges[1:]))
                             for _, blocks in rows.chunks()])
        return product if shift is None else product - (shift @ right)[None, :]

    def transposed_times(left):  # (H − 1cᵀ)ᵀ·left: (dim × size), the chunks added in row order
        product = None
        for start, blocks in rows.chunks():
            part = torch.cat([block.T @ left[start:start + len(block)] for block in blocks])
            product = part if product is None else product.add_(part)
        return product if shift is None else product - shift[:, None] * left.sum(dim=0)[None, :]

    def orthonormal(matrix):
        return torch.linalg.qr(matrix.double())[0].to(dtype)

    generator = torch.Generator(device=device).manual_seed(int(seed))
    basis = orthonormal(times(torch.randn(dim, size, generator=generator, dtype=dtype, device=device)))
    for _ in range(WHITENING_POWER_ITERATIONS):
        basis = orthonormal(times(orthonormal(transposed_times(basis))))
    _, singular, right_vectors = torch.linalg.svd(transposed_times(basis).double().T, full_matrices=False)
    return right_vectors.T.cpu().numpy(), singular.cpu().numpy()


def shift_targets(rows, audited, rule):
    """What x* moves the update along: h* (sum rule), h* − μ_X (mean rule, the coupling
    direction of accounting.md §3.2, μ_X the mean of the other points' h_i). (P × d) float64."""
    own = audited.gradients.double().cpu().numpy()
    if rule == "sum":
        return own
    total = column_sums(rows)
    count = rows.num_rows
    inside = (audited.train_rows >= 0)[:, None]
    others_mean = (total[None, :] - inside * own) / (count - inside)
    return own - others_mean


def directions(rows, audited, mechanism, statistic, seed):
    """Unit directions e (P × d): the shift itself (projection, known-batch), or Fisher's
    discriminant against the other points' batch spread plus the noise (whitened, docs/audit.md)."""
    targets = shift_targets(rows, audited, mechanism.rule)
    noise_var = mechanism.noise_std ** 2
    if statistic != "whitened":
        return audit.fisher_directions(targets, np.zeros((targets.shape[1], 0)), np.zeros(0), noise_var)
    count = rows.num_rows
    if mechanism.rule == "sum":
        # Var Σ_{i∈B} h_i = q(1−q)·Σ_i h_i h_iᵀ under Poisson sampling.
        basis, singular = top_components(rows, None, WHITENING_RANK, seed)
        variances = mechanism.sample_rate * (1 - mechanism.sample_rate) * singular ** 2
    else:
        # The mean of a uniform k-subset has covariance Σ_X·(n−k)/(k(n−1)), at k = B_exp.
        basis, singular = top_components(rows, column_sums(rows) / count, WHITENING_RANK, seed)
        size = min(mechanism.batch_size, count - 1)
        variances = singular ** 2 / count * (count - size) / (size * max(count - 1, 1))
    return audit.fisher_directions(targets, basis, variances, noise_var)


# --- Poisson batches and the simulation ----------------------------------------------------------

def poisson_batches(rng, count, size, sample_rate, width=None):
    """`count` independent Poisson_q subsets of range(size), exactly: the gaps between
    consecutive members of a Bernoulli(q) sequence are i.i.d. Geometric(q), so a batch costs
    about q·size + 1 draws instead of `size`. Gaps by inversion, ⌈log(1 − U)/log(1 − q)⌉ with
    U uniform on [0, 1) (twice as fast as numpy's geometric here), `width` per batch and round
    (default: enough for all but a 1e-8 fraction of batches), rounds until every batch has
    passed the end. Returns (members, sizes): the members of every batch in order,
    concatenated, and each batch's size."""
    if sample_rate <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(count, dtype=np.int64)
    mean = size * sample_rate
    width = width or max(8, int(mean + 6 * np.sqrt(mean) + 8))
    scale = 1 / np.log1p(-sample_rate) if sample_rate < 1 else 0.0

    def gaps():
        uniform = rng.random((count, width))
        np.log1p(-uniform, out=uniform)
        uniform *= scale
        return np.maximum(np.ceil(uniform), 1).astype(np.int64)

    positions = np.cumsum(gaps(), axis=1) - 1
    while np.any(positions[:, -1] < size):
        positions = np.concatenate([positions, np.cumsum(gaps(), axis=1) + positions[:, -1:]], axis=1)
    inside = positions < size
    return positions[inside], inside.sum(axis=1)


def projections_on(rows, unit):
    """a_i = ⟨h_i, e_p⟩ for every training row and direction (float32 products, float64 result)."""
    unit = torch.as_tensor(unit, dtype=rows.dtype, device=rows.device)
    parts = [unit[:, low:high].T for low, high in sensitivity.column_spans(rows.dim)]
    product = torch.cat([sum(block @ part for block, part in zip(blocks, parts)) for _, blocks in rows.chunks()])
    return product.double().cpu().numpy()


def bag_sums(matrix, members, sizes):
    """Σ over each batch's members of `matrix`'s rows: (batches, columns) torch tensor."""
    if len(members) == 0:
        return matrix.new_zeros((len(sizes), matrix.shape[1]))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return F.embedding_bag(torch.from_numpy(members).to(matrix.device), matrix,
                           torch.from_numpy(offsets).to(matrix.device), mode="sum")


def memberships(members, sizes, own_rows):
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
    return np.random.default_rng(np.random.SeedSequence([int(seed), AUDIT_STREAM, int(step), *map(int, key)]))


def simulate_releases(projections, own_rows, own_values, mechanism, trials, seed, step, points, known_batch=False,
                      progress=None):
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
        members, sizes = poisson_batches(_chunk_rng(seed, step, TRIAL_KEY, chunk), stop - start, count,
                                         mechanism.sample_rate)
        member = memberships(members, sizes, own_rows)
        others_sum = (bag_sums(centred, members, sizes).double().numpy() + sizes[:, None] * center
                      - member * own_in_rows)
        others_count = sizes[:, None] - member
        for column, point in enumerate(points):
            rng = _chunk_rng(seed, step, TRIAL_KEY, chunk, point)
            joined = rng.random(stop - start) < mechanism.sample_rate
            noise = rng.standard_normal((2, stop - start)) * mechanism.noise_std
            parts = others_sum[:, column], others_count[:, column]
            known = audit.projected_release(*parts, False, 0.0, 0.0, mechanism.rule) if known_batch else 0.0
            scores_in[start:stop, column] = audit.projected_release(
                *parts, joined, own_values[column], noise[0], mechanism.rule) - known
            scores_out[start:stop, column] = audit.projected_release(
                *parts, False, own_values[column], noise[1], mechanism.rule) - known
        if progress is not None:
            progress.update(stop - start)
    return scores_in, scores_out


# --- the upper bounds the audit holds them against ------------------------------------------------

def mean_rule_sensitivities(rows, audited, members, sizes):
    """Δ_B = ||m(B ∪ {x*}) − m(B)|| (accounting.md §2) for each batch D (members, sizes over the
    training rows) with B = D without x*: (P, batches) float64.

    ||h* − s_B/k||² = ||h*||² − 2⟨h*, s_B⟩/k + ||s_B||²/k² with s_B = s_D − [x* ∈ D]·h*, so only
    ||s_D||², ⟨s_D, h*⟩ and the memberships are needed; Δ_B = ||h*|| for an empty B.
    """
    own = audited.gradients
    # ||s_D||² in passes of at most UPPER_PASS_BATCHES batches: recomputed rows hold every batch's
    # sums of a pass at once. A batch's sum does not depend on the batches beside it.
    mask = np.zeros((len(sizes), rows.num_rows), dtype=bool)
    mask[np.repeat(np.arange(len(sizes)), sizes), members] = True
    per_pass = min(UPPER_PASS_BATCHES, rows.pass_batches(len(audited.points)))
    sum_squares = np.concatenate([
        sum((block.double() ** 2).sum(dim=1) for block in rows.sum_blocks(mask[start:start + per_pass], rows.dtype))
        .cpu().numpy() for start in range(0, len(sizes), per_pass)])
    own_dots = bag_sums(rows.dots(own), members, sizes).cpu().numpy()
    own_squares = (own.double() ** 2).sum(dim=1).cpu().numpy()
    member = memberships(members, sizes, audited.train_rows)
    dots = own_dots - member * own_squares
    squares = sum_squares[:, None] - 2 * member * own_dots + member * own_squares
    size = sizes[:, None] - member
    safe = np.maximum(size, 1)
    distance = np.sqrt(np.maximum(own_squares - 2 * dots / safe + squares / safe ** 2, 0.0))
    return np.where(size > 0, distance / (size + 1), np.sqrt(own_squares)).T


def upper_bounds(rows, audited, mechanism, delta, upper_batches, seed, step, clip_bound):
    """(eps_upper, sensitivity, kind) per point: the matching accountant's per-step ε at δ.

    Sum rule: exact (accounting.md §3.3 with Δ = Δ*). Mean rule: the estimate of §3.3 from
    `upper_batches` Poisson batches of Δ_B, equal weights (its Monte-Carlo error is not a bound).
    `sensitivity` is Δ* (sum) or the largest sampled Δ_B (mean).
    """
    if mechanism.rule == "sum":
        norms = np.minimum(np.linalg.norm(audited.gradients.double().cpu().numpy(), axis=1), clip_bound)
        eps = accounting.per_step_eps(norms[:, None] / mechanism.noise_std, delta, mechanism.sample_rate)
        return eps, norms, "exact"
    members, sizes = poisson_batches(_chunk_rng(seed, step, UPPER_KEY), upper_batches, rows.num_rows,
                                     mechanism.sample_rate)
    samples = mean_rule_sensitivities(rows, audited, members, sizes)
    eps = accounting.per_step_eps(samples / mechanism.noise_std, delta, mechanism.sample_rate)
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


def audit_checkpoint(run, step, request, device="cpu"):
    """Audit rows (AUDIT_COLUMNS) of the requested points at checkpoint `step`.

    trials: released steps simulated per law and point; half choose the test, half count it.
    eps_lower holds with 95% confidence; eps_upper is the accountant's per-step ε; violated
    marks eps_lower > eps_upper, i.e. an upper bound the audit proves wrong.
    """
    mechanism = Mechanism.of_run(run.config, request.rule)
    model, _ = training.load_model(run.config, run.run_dir, step, device)
    transform = sensitivity.Transform.of_run(run.config)
    with progress_bar(len(run.train_y), f"per-sample gradients, step {step}") as bar:
        rows, audited = checkpoint_gradients(run, model, transform, request.points, request.spread, device, bar)
    unit = directions(rows, audited, mechanism, request.statistic, _chunk_rng(request.seed, step, WHITENING_KEY)
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
            outcomes += [audit.audit_scores(scores_in[:, column], scores_out[:, column], request.delta)
                         for column in range(scores_in.shape[1])]
    return audit_rows(run, step, request, audited, outcomes, eps_upper, sensitivities, kind)


def audit_rows(run, step, request, audited, outcomes, eps_upper, sensitivities, kind):
    eps_lower = np.array([outcome.eps_lower for outcome in outcomes])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(eps_upper > 0, eps_lower / eps_upper, np.where(eps_lower > 0, np.inf, 0.0))
    return pd.DataFrame({
        "point": audited.points,
        "step": step,
        "rule": request.rule,
        "label": run.dataset.train_y[audited.points].numpy(),
        "loss": audited.predictions.losses,
        "correct": audited.predictions.correct.astype(int),
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
        "confidence": audit.CONFIDENCE,
        "statistic": request.statistic,
        "seed": request.seed,
    })[AUDIT_COLUMNS]


def audit_summary(rows):
    """Per checkpoint step: the rule, the kind of upper bound, trials, δ, the number of violated
    points, and per group (easy, hard, misclassified, all) the number of points and the medians
    of eps_lower, eps_upper and their ratio. Easy/hard: correctly classified points below / at
    or above the median eps_upper of the correctly classified points audited at that step."""
    summary = {}
    for step, group in rows.groupby("step"):
        right = group[group["correct"] == 1]
        cut = right["eps_upper"].median()
        subsets = {"easy": right[right["eps_upper"] < cut], "hard": right[right["eps_upper"] >= cut],
                   "misclassified": group[group["correct"] == 0], "all": group}
        summary[int(step)] = {
            "rule": group["rule"].iloc[0], "upper_kind": group["upper_kind"].iloc[0],
            "trials": int(group["trials"].iloc[0]), "delta": float(group["delta"].iloc[0]),
            "violated": int(group["violated"].sum()), "points": len(group),
            "groups": {name: {"points": len(subset), "median_lower": float(subset["eps_lower"].median()),
                              "median_upper": float(subset["eps_upper"].median()),
                              "median_ratio": float(subset["ratio"].median())}
                       for name, subset in subsets.items() if len(subset)},
        }
    return summary


def gap_summary(rows, mechanism, size_delta=None):
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
        jointly = audit.epsilon_lower_bound(np.round(group["tpr"].to_numpy() * counted),
                                            np.round(group["fpr"].to_numpy() * counted), counted, counted, delta,
                                            1 - (1 - float(group["confidence"].iloc[0])) / len(group))
        summary[int(step)] = {
            "points": len(group), "trials": int(group["trials"].iloc[0]), "delta": delta,
            "noise_multiplier": mechanism.noise_multiplier, "sample_rate": mechanism.sample_rate,
            "batch_size": mechanism.batch_size, "dataset_size": mechanism.dataset_size,
            "sum_rule_eps": sum_eps, "mean_baseline_eps": mean_eps, "k_min": k_min, "delta_size": delta_size,
            "above_sum_rule": int((lower > sum_eps).sum()), "above_baseline": int((lower > mean_eps).sum()),
            "above_sum_rule_jointly": int((jointly > sum_eps).sum()), "median_lower_jointly": float(np.median(jointly)),
            "median_lower": float(lower.median()), "max_lower": float(lower.max()),
            "median_upper": float(group["eps_upper"].median()),
        }
    return summary


# --- membership inference (Yu et al., Appendix D) --------------------------------------------------

@torch.no_grad()
def losses_and_predictions(model, inputs, labels, device):
    """Cross-entropy loss and predicted class of every example (float64, int64 arrays)."""
    model.eval()
    losses, predicted = [], []
    for start in range(0, len(labels), LOSS_CHUNK):
        logits = model(inputs[start:start + LOSS_CHUNK].to(device))
        target = labels[start:start + LOSS_CHUNK].to(device)
        losses.append(F.cross_entropy(logits, target, reduction="none").double().cpu())
        predicted.append(logits.argmax(dim=1).cpu())
    return torch.cat(losses).numpy(), torch.cat(predicted).numpy()


def class_members(train_labels, test_labels, num_classes, seed):
    """Per class c: as many training rows of class c as there are test points of class c
    (all of them if fewer), drawn at random from (seed, c): the members the attack sees."""
    chosen = {}
    for label in range(num_classes):
        candidates = np.flatnonzero(train_labels == label)
        wanted = min(len(candidates), int(np.sum(test_labels == label)))
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), MEMBERSHIP_STREAM, label]))
        chosen[label] = np.sort(rng.choice(candidates, size=wanted, replace=False))
    return chosen


def attack_by_class(run, step, members, splits, seed, device):
    """Per class: the loss-threshold attack's balanced accuracy and advantage (members: the
    class_members rows of the run's training set; non-members: the class's test points) and
    the class's test accuracy. A DataFrame with one row per class."""
    model, _ = training.load_model(run.config, run.run_dir, step, device)
    train_losses, _ = losses_and_predictions(model, run.train_x, run.train_y, device)
    test_y = run.dataset.test_y.numpy()
    test_losses, test_predicted = losses_and_predictions(model, run.dataset.test_x, run.dataset.test_y, device)
    rows = []
    for label, member_rows in members.items():
        nonmember = test_y == label
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), MEMBERSHIP_STREAM, label, 1]))
        if len(member_rows) >= 2 and nonmember.sum() >= 2:
            accuracy, advantage, spread = audit.loss_threshold_attack(train_losses[member_rows],
                                                                      test_losses[nonmember], rng, splits)
        else:
            accuracy = advantage = spread = np.nan
        rows.append({"class": label, "members": len(member_rows), "nonmembers": int(nonmember.sum()),
                     "attack_accuracy": accuracy, "attack_advantage": advantage, "accuracy_std": spread,
                     "test_accuracy": float(np.mean(test_predicted[nonmember] == label)) if nonmember.any()
                     else np.nan})
    return pd.DataFrame(rows)


def class_mean_eps(path, labels, total_steps, flag="--eps-csv"):
    """Mean composed ε per class from a renyi_per_instance_sum_compo.py output (columns point,
    eps, optionally steps and kind: then the certified rows, or the one kind that is not the
    baseline); `labels` are the full dataset's training labels. A Series indexed by class."""
    try:
        frame = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise UsageError(flag, f"cannot read {path}: {str(error).splitlines()[0]}") from None
    missing = [column for column in ("point", "eps") if column not in frame.columns]
    if missing:
        raise UsageError(flag, f"{path} is not a renyi_per_instance_sum_compo.py output (no column "
                               f"{', '.join(missing)})")
    if "kind" in frame.columns:
        # One row per point and kind (certified, estimate, baseline): the point's own bound.
        kinds = sorted(set(frame["kind"].astype(str)) - {"baseline"})
        chosen = "certified" if "certified" in kinds else (kinds[0] if len(kinds) == 1 else None)
        if chosen is None:
            raise UsageError(flag, f"{path} has no per-point kind to take (kinds: {', '.join(kinds) or 'baseline'})")
        frame = frame[frame["kind"].astype(str) == chosen].reset_index(drop=True)
    if frame["point"].duplicated().any():
        raise UsageError(flag, f"{path} has point {frame['point'][frame['point'].duplicated()].iloc[0]} twice")
    points = pd.to_numeric(frame["point"], errors="coerce").to_numpy()
    eps = pd.to_numeric(frame["eps"], errors="coerce").to_numpy()
    bad = ~np.isfinite(points) | (points < 0) | (points >= len(labels)) | (points != np.round(points)) | ~(eps >= 0)
    if bad.any():
        line = int(np.argmax(bad)) + 2
        raise UsageError(flag, f"{path} line {line}: point {frame['point'].iloc[line - 2]!r}, eps "
                               f"{frame['eps'].iloc[line - 2]!r} is not a point of this dataset with an ε >= 0")
    if "steps" in frame.columns and (frame["steps"] != total_steps).any():
        raise UsageError(flag, f"{path} composes {sorted(set(frame['steps']))} steps, the run has {total_steps}; "
                               "give the composition of this run")
    means = pd.Series(eps).groupby(labels[points.astype(np.int64)]).mean()
    missing = sorted(set(np.unique(labels).tolist()) - set(means.index.tolist()))
    if missing:
        raise UsageError(flag, f"{path} has no point of class {missing[0]}: give the ε of every training point "
                               "(compute_sensitivity.py --points all)")
    return means


def membership_summary(rows):
    """Per model: classes, mean attack accuracy, and the Pearson r across classes of the attack
    accuracy and of the test accuracy with the class's mean composed ε."""
    summary = {}
    for model, group in rows.groupby("model", sort=False):
        valid = group.dropna(subset=["attack_accuracy", "mean_eps"])
        summary[model] = {"classes": len(valid), "mean_attack_accuracy": float(valid["attack_accuracy"].mean()),
                          "pearson_attack": audit.pearson(valid["mean_eps"], valid["attack_accuracy"]),
                          "pearson_test": audit.pearson(valid["mean_eps"], valid["test_accuracy"])}
    return summary

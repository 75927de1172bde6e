"""The rows of one checkpoint, as compute_sensitivity.py measures them (accounting.md §2): Δ* (sum
rule), the coupling's dataset statistics and Δ_B draws, or GLA's statistic S (mean rule), each
row with the point's label, loss and correctness (perinstance/files/results.py)."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from perinstance.accounting.guarantees import Direction
from perinstance.console import progress_bar
from perinstance.errors import UsageError
from perinstance.files import results, storage
from perinstance.measure import coupling, poisson_batches
from perinstance.measure.gradient_rows import checkpoint_gradients, parameter_count, transformed_norms
from perinstance.measure.gram import checkpoint_gram, gram_route
from perinstance.measure.predictions import Predictions
from perinstance.persample import gradients
from perinstance.persample.finite import NonFiniteValues
from perinstance.train import non_finite, training
from perinstance.train.clipping import Transform
from perinstance.train.runs import OpenRun, RunConfig

NO_DIRECTION = Direction.NONE.value
# What a row measures, stored in its `exp` column: Δ* (sum rule), the coupling samples and
# dataset statistics (mean rule), GLA's statistic S (mean rule, --estimator jensen). The
# accountant (--exp) does not enter: eps_delta and renyi read the same Δ* or coupling rows.
NORM, COUPLING, JENSEN = "norm", "coupling", "jensen"
# Defaults of --num-batches: Δ_B draws per point (coupling), or sets of α batches per target (jensen).
DEFAULT_NUM_BATCHES = {COUPLING: 10_000, JENSEN: 100}
# accounting.md §3.2: every size of [k_min, k_hi], or at least 32 grid sizes.
MIN_GRID_SIZES = 32


@dataclass(frozen=True)
class Measurement:
    """What compute_sensitivity.py measures and where its rows go, validated. `rule`, `mc_seed`,
    `size_delta` and `num_batches` may be None until `for_run` fills them from the run (its trained rule,
    seed, δ and T)."""

    exp: str
    rule: str | None  # the update rule analysed (--reduction)
    estimator: str
    stages: list
    alpha: int | None
    num_batches: int | None
    num_iters: int
    directions: tuple
    mc_seed: int | None
    mc_blocks: int
    size_delta: float | None
    max_sizes: int
    res_path: str
    overwrite: bool
    automatic_format: bool = False  # --res-name without .csv/.parquet: CSV, Parquet when large
    histogram_precision: float | None = None  # coupling: Δ_B stored as histograms (storage.histogram_rows)

    @property
    def family(self) -> str:
        """What the rows measure, their `exp`: norm (sum rule), coupling or jensen (mean rule)."""
        return NORM if self.rule == "sum" else self.estimator

    def for_run(self, config: RunConfig, estimator_given: bool = False) -> "Measurement":
        """The measurement completed from the run: the rule analysed defaults to the rule trained (with
        --run), the Monte-Carlo seed to the run's seed, δ_size to δ/(10·T) (accounting.md §3.4).
        `estimator_given`: --estimator was given (the sum rule has none)."""
        rule = self.rule or config.update_rule
        if rule == "sum" and estimator_given:
            raise UsageError("--estimator", "the sum rule has no estimator: Δ* is measured exactly "
                                            "(use --reduction mean)")
        jensen = rule == "mean" and self.estimator == JENSEN
        if self.histogram_precision is not None and (rule == "sum" or jensen):
            raise UsageError("--histogram-precision", "only the mean rule's Δ_B samples (--reduction mean, coupling "
                                                      "estimator) are stored as histograms")
        return replace(
            self, rule=rule,
            mc_seed=None if rule == "sum" else config.seed if self.mc_seed is None else self.mc_seed,
            size_delta=self.size_delta or config.delta / (10 * config.total_steps),
            num_batches=DEFAULT_NUM_BATCHES[self.estimator] if self.num_batches is None else self.num_batches,
            alpha=self.alpha if jensen else None, directions=self.directions if jensen else (NO_DIRECTION,))



@contextmanager
def refusing_non_finite(run: OpenRun, step: int, points: Sequence[int] | np.ndarray, device: str) -> Iterator[None]:
    """Within the block, which measures checkpoint `step` of `run` for `points`: a value that is not finite that a
    pass met (finite.NonFiniteValues) becomes the one-line error of `non_finite_error`."""
    try:
        yield
    except NonFiniteValues:
        raise non_finite_error(run, step, points, device) from None


def non_finite_error(run: OpenRun, step: int, points: Sequence[int] | np.ndarray, device: str) -> UsageError:
    """The error for a measurement of checkpoint `step` that met a value that is not finite: weights that are not
    finite are the checkpoint's (--run); else the first of the points, then of the training set, whose input,
    output, loss or gradient is not finite (non_finite.locate), named as the user's code's where it made it."""
    config = run.config
    model, _ = training.load_model(config, run.run_dir, step, device)
    when = f"at checkpoint step {step} of run {config.run}"
    if not all(bool(torch.isfinite(param).all()) for param in model.parameters()):
        return UsageError("--run", f"checkpoint step {step} of run {config.run} holds weights that are not finite; "
                                   "train the run again (--overwrite)")
    loss_fn = training.loss_for_run(config)
    per_pass = gradients.examples_per_pass(model, run.train_x, device)
    points = np.asarray(points)
    for indices, inputs, targets in ((points, run.dataset.train_x[points], run.dataset.train_y[points]),
                                     (run.train_columns, run.train_x, run.train_y)):
        located = non_finite.locate(model, inputs, targets, device, per_pass, loss_fn)
        if located is not None:
            found, source = located
            example = f"point {indices[found.position]}"
            parts = non_finite.user_parts(config, found, source)
            if parts:
                return non_finite.user_code_stop(parts, found, example, when, source)
            return UsageError("--run", f"the {found.kind} of {example} is {found.value:g} {when}, whose weights are "
                                       "finite but so large that the suite's own network overflows: the run diverged; "
                                       "train it with a smaller --lr")
    return UsageError("--run", f"a value that is not finite met {when}, though every point's values are finite alone")


def measure_checkpoint(request: Measurement, run: OpenRun, step: int,
                       points: Sequence[int] | np.ndarray, device: str,
                       blocks: Sequence[int] | None = None) -> pd.DataFrame:
    """The rows of one checkpoint for `points` (every requested direction). Coupling under
    torchrun: `blocks`, the Monte-Carlo blocks of one part, and the dataset statistics with block 0. A value that
    is not finite is refused (`refusing_non_finite`)."""
    with refusing_non_finite(run, step, points, device):
        return _measured_checkpoint(request, run, step, points, device, blocks)


def _measured_checkpoint(request, run, step, points, device, blocks):
    config = run.config
    points = np.asarray(points)
    model, payload = training.load_model(config, run.run_dir, step, device)
    loss_fn = training.loss_for_run(config)
    transform = Transform.of_run(config)
    point_x, point_y, point_rows = run.dataset.train_x[points], run.dataset.train_y[points], run.train_rows(points)
    statistics_only = request.family == COUPLING and request.num_batches == 0
    hold = plan = pool = workload = None
    if request.family == COUPLING:
        # n = N − 1 for the sizes: a --less-point point has n = N, and k_min computed at N − 1 is no
        # larger, so its δ_size stays below --size-delta.
        plan = coupling.coupling_plan(request.mc_seed, step, config.dataset_size - 1, config.sample_rate,
                                      request.size_delta, request.num_batches, request.mc_blocks, request.max_sizes)
        workload = coupling.coupling_workload(len(points), [plan])
        # With one pass of draws after the first pass, held rows would spare one recomputation of themselves
        # for all their memory: hold none.
        if coupling.pass_count(plan, len(points), parameter_count(model), next(model.parameters()).element_size(),
                               blocks) <= 1:
            hold = False
    elif request.rule != "sum":
        pool = poisson_batches.Pool(request.mc_seed, step, run.universe, config.sample_rate, run.train_columns)
        workload = poisson_batches.renyi_workload(len(points), pool, request.alpha, request.num_iters,
                                                  request.num_batches)
    # The Monte Carlo's per-sample work: the checkpoint's Gram where it fits, else its gradient rows.
    gram = workload is not None and not statistics_only and gram_route(model, _gram_size(run, point_rows), device)
    with progress_bar(len(points) if request.rule == "sum" else
                      _gram_size(run, point_rows) if gram else len(run.train_y),
                      f"per-sample gradients, step {step}") as bar:
        if request.rule == "sum":
            norms, predictions = transformed_norms(model, point_x, point_y, transform, device, bar, loss_fn)
        elif statistics_only and loss_fn is None:
            statistics, predictions = coupling.checkpoint_statistics(model, run.train_x, run.train_y, point_x,
                                                                     point_y, point_rows, transform, device, bar)
        elif gram:
            rows, point_gradients = checkpoint_gram(model, run.train_x, run.train_y, point_x, point_y, point_rows,
                                                    transform, workload, device, bar, loss_fn)
            predictions = point_gradients.predictions
        else:
            # A loss of the run's own: its statistics from the rows, as the Δ_B draws take them (the two passes of
            # checkpoint_statistics differentiate the cross-entropy in closed form along μ).
            rows, point_gradients = checkpoint_gradients(model, run.train_x, run.train_y, point_x, point_y,
                                                         point_rows, transform, device, hold=hold, progress=bar,
                                                         point_rows=not statistics_only, loss_fn=loss_fn)
            predictions = point_gradients.predictions
            if statistics_only:
                statistics, _, _ = coupling.measure_statistics(rows, point_gradients)
    if request.rule == "sum":
        columns = norm_columns(norms)
    elif request.family == COUPLING:
        if statistics_only:
            samples = coupling.CouplingSamples(np.zeros((len(points), 0)), plan)
        else:
            measured = plan.blocks if blocks is None else len(blocks)
            with progress_bar(measured * plan.permutations, f"permutations, step {step}") as bar:
                statistics, samples = coupling.measure_coupling(rows, point_gradients, plan, bar, blocks)
        columns = coupling_columns(config.clip_bound, statistics, samples, blocks)
    else:
        with progress_bar(request.num_iters * request.num_batches, f"sets of α batches, step {step}") as bar:
            statistics = poisson_batches.renyi_statistics(rows, point_gradients, points, pool, request.alpha,
                                                          request.num_iters, request.num_batches, request.directions,
                                                          bar)
        columns = jensen_columns(request, statistics)
    frame = measurement_rows(request.rule, request.family, request.mc_seed, config, step,
                             payload["test_accuracy"], points, run.dataset.train_y[points].numpy(), predictions, columns)
    if request.histogram_precision is None:
        return frame
    return storage.histogram_rows(frame, request.histogram_precision)


def norm_columns(norms: np.ndarray) -> dict:
    """Sum rule: one grad_norm row (Δ*) per point."""
    return {"position": np.arange(len(norms)), "quantity": "grad_norm", "value": norms, "direction": NO_DIRECTION,
            "target_batch": 0, "sample": 0}


def coupling_columns(clip_bound: float, statistics: coupling.DatasetStatistics, samples: coupling.CouplingSamples,
                     blocks: Sequence[int] | None = None) -> dict:
    """Mean rule by coupling (accounting.md §2): per point the center_distance, spread and
    max_deviation rows, then a batch_sensitivity row (Δ_B with its k and block) per accepted draw.
    With `blocks`, only their draws, and the statistics rows only with block 0 (each part of a
    torchrun measurement holds its own rows)."""
    count = len(statistics.spread) if blocks is None or 0 in blocks else 0
    position, block, sample, size, value = samples.accepted()
    # Δ_B ≤ ||h*|| ≤ Γ for k = 0 and ≤ 2Γ/(k+1) otherwise; float32 products can round one ulp above.
    value = np.minimum(value, np.where(size > 0, 2 * clip_bound / (size + 1), clip_bound))
    stats = [statistics.center_distance[:count], statistics.spread[:count], statistics.max_deviation[:count]]
    return {
        "position": np.concatenate([np.tile(np.arange(count), 3), position]),
        "quantity": np.concatenate([np.repeat(results.STATISTICS, count),
                                    np.full(len(value), "batch_sensitivity")]),
        "value": np.concatenate([*stats, value]),
        "direction": NO_DIRECTION,
        "target_batch": 0,
        "sample": np.concatenate([np.zeros(3 * count, dtype=np.int64), sample]),
        "block": np.concatenate([np.full(3 * count, np.nan), block]),
        "k": np.concatenate([np.full(3 * count, np.nan), size]),
        "k_min": samples.plan.k_min,
    }


def jensen_columns(request: Measurement,
                   statistics: dict[Direction, np.ndarray]) -> dict:
    """GLA's statistic S: one renyi_statistic row per direction, point, target batch and set."""
    parts = []
    for direction, array in statistics.items():
        count, targets, samples = array.shape
        parts.append({"position": np.repeat(np.arange(count), targets * samples),
                      "target_batch": np.tile(np.repeat(np.arange(targets), samples), count),
                      "sample": np.tile(np.arange(samples), count * targets),
                      "value": array.reshape(-1), "direction": np.full(array.size, direction)})
    columns = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    return {**columns, "quantity": "renyi_statistic", "alpha": float(request.alpha)}


def measurement_rows(rule: str, family: str, mc_seed: int | None, config: RunConfig, step: int, accuracy: float,
                     points: np.ndarray, labels: np.ndarray, predictions: Predictions, columns: dict) -> pd.DataFrame:
    """Long-format rows from `columns` (per-row arrays or one value for all; `position` is the
    point's index in `points`) with the point's label, loss and correctness (results.result_rows; label and
    correctness NaN where the targets are not class labels)."""
    position = columns.pop("position")
    return results.result_rows(config, rule, step, {
        "point": points[position],
        "label": results.class_labels(labels)[position],
        "correct": results.correct_column(predictions.correct)[position],
        "loss": predictions.losses[position],
        "exp": family,
        "accuracy": accuracy,
        "mc_seed": np.nan if mc_seed is None else mc_seed,
        **columns,
    })


def measure_at_rates(run: OpenRun, step: int, points: Sequence[int] | np.ndarray, configs: Sequence[RunConfig],
                     size_deltas: Sequence[float], *, num_batches: int, mc_blocks: int, max_sizes: int, mc_seed: int,
                     device: str = "cpu") -> Iterator[pd.DataFrame]:
    """One checkpoint of `run` measured for one step of the mean rule under each of `configs` (the run's
    RunConfig with another sampling rate, B_exp and σ): the points' dataset statistics and Δ_B draws from
    each config's own batch sizes, k_min from its δ_size (accounting.md §3.4).
    Where the checkpoint's Gram pays (gram.gram_route) it is built once and serves every config; otherwise the
    per-sample rows are recomputed on each config's pass and none are held (their batch sums are what the pass
    holds). The statistics do not depend on the mechanism. Yields one frame of result rows per
    config, in their order, as compute_sensitivity.py --reduction mean would write it for a run trained with that
    config (reproduce.py's fixed-checkpoint design): the caller can store each before the next pass. A value that
    is not finite is refused (`refusing_non_finite`)."""
    with refusing_non_finite(run, step, points, device):
        yield from _measured_at_rates(run, step, points, configs, size_deltas, num_batches, mc_blocks, max_sizes,
                                      mc_seed, device)


def _measured_at_rates(run, step, points, configs, size_deltas, num_batches, mc_blocks, max_sizes, mc_seed, device):
    config = run.config
    points = np.asarray(points)
    model, payload = training.load_model(config, run.run_dir, step, device)
    loss_fn = training.loss_for_run(config)
    point_rows = run.train_rows(points)
    plans = [coupling.coupling_plan(mc_seed, step, analysed.dataset_size - 1, analysed.sample_rate, size_delta,
                                    num_batches, mc_blocks, max_sizes)
             for analysed, size_delta in zip(configs, size_deltas)]
    gram = gram_route(model, _gram_size(run, point_rows), device)
    with progress_bar(_gram_size(run, point_rows) if gram else len(run.train_y),
                      f"per-sample gradients, step {step}") as bar:
        arguments = (model, run.train_x, run.train_y, run.dataset.train_x[points], run.dataset.train_y[points],
                     point_rows, Transform.of_run(config))
        if gram:
            rows, point_gradients = checkpoint_gram(*arguments, coupling.coupling_workload(len(points), plans), device,
                                                    bar, loss_fn)
        else:
            rows, point_gradients = checkpoint_gradients(*arguments, device, hold=False, progress=bar,
                                                         loss_fn=loss_fn)
    # The statistics come from the Gram, or from the rows' centred norms, which the first rate's pass over the rows
    # measures too.
    statistics = coupling.gram_statistics(rows, point_gradients) if gram else None
    mean, point_centred_sq = (None, None) if gram else (rows.mean(), None)
    labels = run.dataset.train_y[points].numpy()
    for analysed, plan in zip(configs, plans):
        with progress_bar(plan.blocks * plan.permutations, f"permutations, step {step}, q={analysed.sample_rate:g}") \
                as bar:
            if gram:
                samples = coupling.gram_coupling_sensitivities(rows, point_gradients, plan, bar)
            else:
                samples, row_centred_sq = coupling.coupling_sensitivities(rows, point_gradients, plan, mean,
                                                                          point_centred_sq, bar)
        if statistics is None:
            statistics, _, point_centred_sq = coupling.measure_statistics(rows, point_gradients, mean, row_centred_sq)
        columns = coupling_columns(analysed.clip_bound, statistics, samples)
        yield measurement_rows("mean", COUPLING, mc_seed, analysed, step, payload["test_accuracy"], points, labels,
                               point_gradients.predictions, columns)


def _gram_size(run: OpenRun, point_rows: np.ndarray) -> int:
    """Rows of the checkpoint's Gram: the training rows and the points outside them."""
    return len(run.train_y) + int(np.count_nonzero(np.asarray(point_rows) < 0))


def keep_missing(rows: pd.DataFrame, missing: dict[str, list[int]]) -> pd.DataFrame:
    """Only the rows of (direction, point) combinations that `missing` lists."""
    wanted = np.zeros(len(rows), dtype=bool)
    for direction, points in missing.items():
        wanted |= (rows["direction"] == direction).to_numpy() & rows["point"].isin(points).to_numpy()
    return rows[wanted].reset_index(drop=True)

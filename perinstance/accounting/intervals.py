"""95% intervals for the report's findings, and verdicts drawn from them (docs/accounting.md §10).

Percentile bootstrap: resample the points (with replacement, as many as there are), recompute the
statistic on each resample, and take the 2.5% and 97.5% quantiles of the replicates. Groups that were
measured on different points are resampled independently; paired values (the same points at two
settings) are resampled together, so that their correlation stays in the interval. Pure numpy, seeded.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
# Replicates computed per array operation: bounds memory at CHUNK × points values.
CHUNK = 256
FALLS, RISES, NO_DIFFERENCE = "falls", "rises", "no difference at this precision"


@dataclass(frozen=True)
class Interval:
    """A statistic, its percentile-bootstrap interval, and the number of points (or blocks) behind it."""

    estimate: float
    low: float
    high: float
    count: int


def bootstrap(statistic: Callable[..., np.ndarray], *samples: np.ndarray, paired: bool, resamples: int,
              seed: int) -> np.ndarray:
    """§10: `resamples` replicates of `statistic` on resampled `samples`.

    statistic maps one array per sample, each (resamples in a chunk, its points), to one value per row.
    paired: the samples have the same length and are resampled with the same indices.
    """
    if paired and len({len(sample) for sample in samples}) != 1:
        raise ValueError("paired samples must have the same length")
    generator = np.random.default_rng(seed)
    replicates = []
    for start in range(0, resamples, CHUNK):
        rows = min(CHUNK, resamples - start)
        if paired:
            indices = generator.integers(0, len(samples[0]), size=(rows, len(samples[0])))
            resampled = [sample[indices] for sample in samples]
        else:
            resampled = [sample[generator.integers(0, len(sample), size=(rows, len(sample)))] for sample in samples]
        replicates.append(statistic(*resampled))
    return np.concatenate(replicates)


def quantile(values: np.ndarray, q: float) -> float:
    """np.nanquantile(values, q), for the summaries of bounds in the reports and figures, except where it would
    interpolate towards +inf: +inf there (or the value it falls on). numpy computes b − (b − a)·(1 − t) even at
    t = 0, NaN when b is +inf: a bound infinite for the top tenth of the points was printed as q90 NaN. +inf is
    replaced by the largest float, so that every other quantile is numpy's to the bit; a result above every
    finite value is +inf. NaN when no value is left."""
    kept = values[~np.isnan(values)]
    if not len(kept):
        return float("nan")
    largest_finite = kept[np.isfinite(kept)].max(initial=-np.inf)
    result = float(np.quantile(np.where(kept == np.inf, np.finfo(float).max, kept), q))
    return np.inf if result > largest_finite else result


def _percentile_interval(estimate: float, replicates: np.ndarray, count: int, confidence: float) -> Interval:
    """The central `confidence` quantiles of the finite replicates (a resample on which the statistic is
    undefined, e.g. a constant one for a correlation, counts for neither end)."""
    finite = replicates[np.isfinite(replicates)]
    tail = (1 - confidence) / 2
    if len(finite) == 0:
        return Interval(estimate, float("nan"), float("nan"), count)
    low, high = np.quantile(finite, [tail, 1 - tail])
    return Interval(float(estimate), float(low), float(high), count)


def _as_points(values: np.ndarray) -> np.ndarray:
    points = np.asarray(values, dtype=float).ravel()
    if len(points) == 0:
        raise ValueError("an interval needs at least one point")
    return points


def _median(values: np.ndarray) -> np.ndarray:
    return np.median(values, axis=-1)


def _mean(values: np.ndarray) -> np.ndarray:
    return np.mean(values, axis=-1)


def _pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x = x - x.mean(axis=-1, keepdims=True)
    y = y - y.mean(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (x * y).sum(axis=-1) / np.sqrt((x * x).sum(axis=-1) * (y * y).sum(axis=-1))


def _log_median_ratio(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(_median(second)) - np.log(_median(first))


def median_interval(values: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0,
                    confidence: float = CONFIDENCE) -> Interval:
    """§10: the median of the points with its percentile-bootstrap interval."""
    points = _as_points(values)
    replicates = bootstrap(_median, points, paired=False, resamples=resamples, seed=seed)
    return _percentile_interval(np.median(points), replicates, len(points), confidence)


def share_interval(holds: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0,
                   confidence: float = CONFIDENCE) -> Interval:
    """§10: the share of the points where `holds` (booleans) is true, with its percentile-bootstrap interval: the
    mean of their 0/1 values, resampled as block_mean_interval resamples blocks."""
    return block_mean_interval(np.asarray(holds, dtype=bool), resamples=resamples, seed=seed, confidence=confidence)


def maximum_interval(values: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0,
                     confidence: float = CONFIDENCE) -> Interval:
    """§10: the largest of the points with its percentile-bootstrap interval. A resample's maximum is one of the
    points, never above the largest: the interval says how much the maximum rests on a few points, not where the
    maximum of a larger population lies."""
    points = _as_points(values)
    replicates = bootstrap(lambda rows: np.max(rows, axis=-1), points, paired=False, resamples=resamples, seed=seed)
    return _percentile_interval(np.max(points), replicates, len(points), confidence)


def median_ratio_interval(numerator: np.ndarray, denominator: np.ndarray, *, resamples: int = RESAMPLES,
                          seed: int = 0, confidence: float = CONFIDENCE) -> Interval:
    """§10: median(numerator)/median(denominator) of two independent groups, each resampled on its own;
    count is the smaller group's size."""
    top, bottom = _as_points(numerator), _as_points(denominator)

    def ratio(top_rows, bottom_rows):
        with np.errstate(divide="ignore", invalid="ignore"):
            return _median(top_rows) / _median(bottom_rows)

    replicates = bootstrap(ratio, top, bottom, paired=False, resamples=resamples, seed=seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = np.median(top) / np.median(bottom)
    return _percentile_interval(estimate, replicates, min(len(top), len(bottom)), confidence)


def pearson_interval(x: np.ndarray, y: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0,
                     confidence: float = CONFIDENCE) -> Interval:
    """§10: Pearson's r of paired values, the pairs resampled together."""
    first, second = _as_points(x), _as_points(y)
    replicates = bootstrap(_pearson, first, second, paired=True, resamples=resamples, seed=seed)
    return _percentile_interval(_pearson(first, second), replicates, len(first), confidence)


def block_mean_interval(block_values: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0,
                        confidence: float = CONFIDENCE) -> Interval:
    """§10: the mean of a Monte-Carlo estimate's independent blocks, the blocks resampled."""
    blocks = _as_points(block_values)
    replicates = bootstrap(_mean, blocks, paired=False, resamples=resamples, seed=seed)
    return _percentile_interval(np.mean(blocks), replicates, len(blocks), confidence)


def change_interval(first: np.ndarray, second: np.ndarray, *, paired: bool, resamples: int = RESAMPLES,
                    seed: int = 0, confidence: float = CONFIDENCE) -> Interval:
    """§10: log(median(second)/median(first)) for positive values, the interval of the change from the
    first setting to the second; paired when both are the same points."""
    before, after = _as_points(first), _as_points(second)
    if np.any(before <= 0) or np.any(after <= 0):
        raise ValueError("a log-ratio of medians needs positive values")
    replicates = bootstrap(_log_median_ratio, before, after, paired=paired, resamples=resamples, seed=seed)
    return _percentile_interval(_log_median_ratio(before, after), replicates, min(len(before), len(after)),
                                confidence)


def verdict(first: np.ndarray, second: np.ndarray, *, paired: bool, resamples: int = RESAMPLES, seed: int = 0,
            confidence: float = CONFIDENCE) -> str:
    """§10: "falls" or "rises" when the interval of the change from `first` to `second` excludes no
    change, else "no difference at this precision"."""
    return verdict_of_change(change_interval(first, second, paired=paired, resamples=resamples, seed=seed,
                                             confidence=confidence))


def verdict_of_change(change: Interval) -> str:
    """§10: the verdict that the interval of a log-ratio `change` (change_interval) supports."""
    if change.high < 0:
        return FALLS
    if change.low > 0:
        return RISES
    return NO_DIFFERENCE

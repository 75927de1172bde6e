"""The report's intervals (perinstance/accounting/intervals.py, accounting.md §10) against independent computations:
coverage over many seeds, an exact enumeration of a small bootstrap, Fisher's and Student's intervals."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from perinstance.accounting import intervals


def coverage(make_interval, truth, seeds):
    return np.mean([make_interval(seed).low <= truth <= make_interval(seed).high for seed in range(seeds)])


def test_the_median_interval_covers_the_true_median_about_95_percent_of_the_time():
    # 300 normal samples of 101 points: the share covering 0 has a standard error of 1.3 points.
    def interval(seed):
        return intervals.median_interval(np.random.default_rng(1000 + seed).normal(size=101), resamples=1000,
                                         seed=seed)

    assert 0.90 <= coverage(interval, 0.0, 300) <= 0.99


def test_the_bootstrap_of_a_median_has_the_enumerated_law():
    # Four points: the 4^4 equally likely resamples give the exact law of the resampled median.
    points = np.array([1.0, 2.0, 4.0, 8.0])
    exact = {}
    for resample in itertools.product(points, repeat=4):
        median = float(np.median(resample))
        exact[median] = exact.get(median, 0) + 1 / 4 ** 4
    replicates = intervals.bootstrap(lambda rows: np.median(rows, axis=-1), points, paired=False, resamples=40000,
                                     seed=3)
    for value, probability in exact.items():
        share = np.mean(replicates == value)
        assert abs(share - probability) <= 4 * math.sqrt(probability * (1 - probability) / 40000), value
    assert set(np.unique(replicates)) <= set(exact)
    cumulative = np.cumsum([exact[value] for value in sorted(exact)])
    interval = intervals.median_interval(points, resamples=40000, seed=3)
    assert interval.low == sorted(exact)[np.searchsorted(cumulative, 0.025)]
    assert interval.high == sorted(exact)[np.searchsorted(cumulative, 0.975)]
    assert (interval.estimate, interval.count) == (3.0, 4)


def test_the_ratio_of_two_medians_covers_the_true_ratio():
    # Exponential groups with rates 1 and 1/3: medians log 2 and 3·log 2, ratio 1/3.
    def interval(seed):
        generator = np.random.default_rng(seed)
        return intervals.median_ratio_interval(generator.exponential(1.0, 80), generator.exponential(3.0, 120),
                                               resamples=1000, seed=seed)

    assert 0.88 <= coverage(interval, 1 / 3, 200) <= 0.99
    assert interval(0).count == 80


def test_the_share_interval_agrees_with_the_binomials_normal_interval_and_covers_the_share():
    holds = np.random.default_rng(11).random(2000) < 0.3
    interval = intervals.share_interval(holds, resamples=4000, seed=2)
    share = holds.mean()
    half_width = 1.96 * math.sqrt(share * (1 - share) / len(holds))
    assert interval.estimate == share and interval.count == 2000
    assert interval.low == pytest.approx(share - half_width, abs=0.004)
    assert interval.high == pytest.approx(share + half_width, abs=0.004)

    def covering(seed):
        return intervals.share_interval(np.random.default_rng(500 + seed).random(150) < 0.2, resamples=1000, seed=seed)

    assert 0.90 <= coverage(covering, 0.2, 300) <= 0.99


def test_the_bootstrap_of_a_maximum_has_the_enumerated_law():
    # n points: the resampled maximum is at most the k-th smallest with probability (k/n)^n.
    points = np.array([5.0, 1.0, 3.0, 2.0])
    ordered = np.sort(points)
    cumulative = (np.arange(1, 5) / 4) ** 4
    interval = intervals.maximum_interval(points, resamples=40000, seed=5)
    assert interval.low == ordered[np.searchsorted(cumulative, 0.025)]
    assert interval.high == ordered[np.searchsorted(cumulative, 0.975)] == 5.0
    assert (interval.estimate, interval.count) == (5.0, 4)


def test_pearson_interval_agrees_with_fishers_for_a_bivariate_normal_sample():
    generator = np.random.default_rng(7)
    x = generator.normal(size=400)
    y = 0.6 * x + 0.8 * generator.normal(size=400)
    interval = intervals.pearson_interval(x, y, resamples=4000, seed=1)
    r = stats.pearsonr(x, y).statistic
    half = stats.norm.ppf(0.975) / math.sqrt(len(x) - 3)
    assert interval.estimate == pytest.approx(r, rel=1e-12)
    assert interval.low == pytest.approx(math.tanh(math.atanh(r) - half), abs=0.02)
    assert interval.high == pytest.approx(math.tanh(math.atanh(r) + half), abs=0.02)


def test_the_block_mean_interval_agrees_with_students():
    blocks = np.random.default_rng(11).normal(5.0, 2.0, size=60)
    interval = intervals.block_mean_interval(blocks, resamples=8000, seed=2)
    low, high = stats.t.interval(0.95, len(blocks) - 1, loc=blocks.mean(), scale=stats.sem(blocks))
    # The percentile bootstrap's interval is narrower by about sqrt((n−1)/n) and the t quantile's excess.
    assert interval.low == pytest.approx(low, abs=0.1 * (high - low))
    assert interval.high == pytest.approx(high, abs=0.1 * (high - low))
    assert interval.count == 60


@pytest.mark.parametrize("paired", [False, True])
def test_a_large_change_falls_or_rises_and_identical_samples_show_no_difference(paired):
    values = np.random.default_rng(5).lognormal(size=100)
    assert intervals.verdict(values, values / 2, paired=paired) == intervals.FALLS
    assert intervals.verdict(values, values * 2, paired=paired) == intervals.RISES
    assert intervals.verdict(values, values.copy(), paired=paired) == intervals.NO_DIFFERENCE


def test_pairing_resolves_a_small_change_that_independent_groups_cannot():
    # A 2% fall of every point, among points spread over two orders of magnitude.
    values = np.random.default_rng(9).lognormal(sigma=1.5, size=100)
    assert intervals.verdict(values, values * 0.98, paired=True) == intervals.FALLS
    assert intervals.verdict(values, values * 0.98, paired=False) == intervals.NO_DIFFERENCE


def test_the_same_seed_gives_the_same_interval():
    values = np.random.default_rng(4).normal(size=50)
    assert intervals.median_interval(values, seed=8) == intervals.median_interval(values, seed=8)


@pytest.mark.parametrize("call", [
    lambda: intervals.median_interval(np.array([])),
    lambda: intervals.change_interval(np.array([1.0, -1.0]), np.array([1.0, 2.0]), paired=True),
    lambda: intervals.pearson_interval(np.ones(3), np.ones(4)),
])
def test_bad_inputs_are_refused(call):
    with pytest.raises(ValueError):
        call()

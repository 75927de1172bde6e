"""The four accountant scripts end to end on small synthetic result CSVs, and their bad inputs.

Outputs are long: one row per value, labelled by `kind` (estimate, certified, baseline,
gla_statistic) and, per step, by `direction` (remove, add, max). Every number is held against a
computation made here: the §3.3 closed forms written with scipy.stats.norm and solved with
scipy's brentq, binomial size probabilities from scipy.stats.binom, Opacus's RDP and
get_privacy_spent, and dp_accounting's PLD accountant.
"""

import math
import os

import dp_accounting
import numpy as np
import pandas as pd
import pytest
from conftest import assert_usage_error, leave_one_out_statistics, run_in_process, run_script, snapshot
from dp_accounting.pld import pld_privacy_accountant
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy import optimize, stats
from scipy.special import logsumexp

from perinstance.accounting import batch_sizes, exact_eps_delta, renyi_step
from perinstance.accounting.intervals import quantile
from perinstance.files.results import COLUMNS

SIGMA, CLIP, RATE, BATCH, SIZE, STEPS = 1.2, 2.0, 0.02, 20, 1000, 60
DIRECTIONS = ("remove", "add", "max")


def row(**values):
    """One result row with every column of results.COLUMNS (a sum-rule grad_norm by default)."""
    base = dict(run="a", seed=0, step=0, stage="", total_steps=STEPS, point=0, label=3, correct=1, loss=0.4,
                exp="grad_norm", reduction="sum", direction="", target_batch=0, sample=0, quantity="grad_norm",
                value=1.0, alpha="", sigma=SIGMA, clip_bound=CLIP, sample_rate=RATE, batch_size=BATCH,
                dataset_size=SIZE, noise_std=SIGMA * CLIP, dataset="synthetic", model="mlp", clipping="flat",
                update_rule="sum", target_eps="", delta=1e-5, accuracy=0.8)
    base.update(values)
    return base


def write(path, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pd.DataFrame(rows, columns=COLUMNS).to_csv(path, index=False)
    return path


def norm_of(point, step, run="a"):
    """Deterministic Δ* in [0, Γ]: point 0 always Γ, point 1 always 0, the rest shrink with steps."""
    if point == 0:
        return CLIP
    if point == 1:
        return 0.0
    return CLIP * ((point * 37 + len(run)) % 10 + 1) / 11 * (1 - step / (2 * STEPS))


def grad_norm_rows(steps=(0, 20, 40), points=range(6), run="a", seed=0, **values):
    return [row(run=run, seed=seed, step=step, point=point, value=norm_of(point, step, run),
                correct=int(point % 2 == 0), **values) for step in steps for point in points]


MEAN = dict(reduction="mean", update_rule="mean", noise_std=SIGMA * CLIP / BATCH)


def renyi_rows(directions=("remove", "add")):
    """GLA's statistic S (compute_sensitivity.py --estimator jensen)."""
    rng = np.random.default_rng(2)
    values = dict(MEAN, exp="renyi", quantity="renyi_statistic")
    return [row(step=step, point=point, direction=direction, alpha=alpha, target_batch=target, sample=sample,
                value=rng.normal(-0.002, 0.002) * alpha * (alpha - 1), correct=point % 2, **values)
            for step in (0, 30) for point in range(3) for direction in directions for alpha in (2, 4)
            for target in range(3) for sample in range(5)]


def population(count, seed, scale=1.0):
    """Per-sample gradients with a shared component (as at a real checkpoint), norms at most Γ."""
    rng = np.random.default_rng(seed)
    gradients = np.full((count, 20), 0.1) + rng.normal(scale=0.05, size=(count, 20))
    return scale * CLIP * gradients / np.maximum(np.linalg.norm(gradients, axis=1, keepdims=True), 1.0)


def coupling_rows(gradients, points, batch, size_delta, draws, step=0, blocks=2, seed=0, k_min=None):
    """Mean-rule rows as compute_sensitivity.py --reduction mean writes them (§2): d*, v_X, b_X per
    point, then Δ_B of uniform k-subsets of the other points at every size k in [k_min, k_hi], each
    with its k and block. Point p has draws + p samples per size and block (ragged counts)."""
    count = len(gradients)
    n, rate = count - 1, batch / count
    if k_min is None:
        k_min = batch_sizes.size_threshold(n, rate, size_delta)
    rng = np.random.default_rng(seed + step)
    base = dict(MEAN, step=step, exp="coupling", sample_rate=rate, batch_size=batch, dataset_size=count,
                noise_std=SIGMA * CLIP / batch, mc_seed=0, k_min=k_min)
    rows = []
    for point in points:
        others = np.delete(gradients, point, axis=0)
        for quantity, value in leave_one_out_statistics(gradients, point):
            rows.append(row(**base, point=point, correct=point % 2, quantity=quantity, value=value))
        for block in range(blocks):
            sample = 0
            for k in range(k_min, size_upper(n, rate) + 1):
                for _ in range(draws + point):
                    batch_mean = others[rng.choice(n, k, replace=False)].mean(axis=0) if k else 0.0
                    value = np.linalg.norm(gradients[point] - batch_mean) / (k + 1)
                    rows.append(row(**base, point=point, correct=point % 2, quantity="batch_sensitivity",
                                    value=value, sample=sample, block=block, k=k))
                    sample += 1
    return rows


def size_upper(n, rate):
    """k_hi of §3.2: P(k > k_hi) <= 1e-12."""
    return int(stats.binom.isf(1e-12, n, rate))


@pytest.fixture
def results(tmp_path):
    """Writes res/<name>.csv under tmp_path (the scripts' working directory)."""
    return lambda name, rows: write(os.path.join(tmp_path, "res", f"{name}.csv"), rows)


def output(tmp_path, name):
    return pd.read_csv(os.path.join(tmp_path, "res", f"{name}.csv"))


def values_of(frame, kind, direction=None, value="eps"):
    """One kind's (and direction's) values of a long output, indexed by its keys."""
    chosen = frame[(frame["kind"] == kind) & ((frame["direction"] == direction) if direction else True)]
    assert len(chosen), f"no {kind} rows (kinds: {sorted(set(frame['kind']))})"  # a comparison of nothing passes
    # alpha is a key of the per-step Rényi outputs; in the composition it is the best order, a value.
    keys = [key for key in ("point", "step") if key in frame.columns] + (["alpha"] if "rdp" in frame.columns else [])
    return chosen.set_index(keys)[value]


# --- independent computations (accounting.md §3.2-§3.4) --------------------------------------

def remove_delta(eps, mu, rate):
    """§3.3 δ_rem(ε; μ) of the subsampled Gaussian pair, elementwise over μ, with scipy's normal tails."""
    mu = np.asarray(mu, dtype=float)
    moving = mu > 0
    safe = np.where(moving, mu, 1.0)
    factor = math.expm1(eps) + rate
    threshold = math.log(factor / rate) / safe + safe / 2
    return np.where(moving, rate * stats.norm.sf(threshold - safe) - factor * stats.norm.sf(threshold), 0.0)


def add_delta(eps, mu, rate):
    """§3.3 δ_add(ε; μ), elementwise over μ; 0 once c = 1 − e^ε(1−q) <= 0."""
    mu = np.asarray(mu, dtype=float)
    c = 1 - math.exp(eps) * (1 - rate)
    if c <= 0:
        return np.zeros(mu.shape)
    moving = mu > 0
    safe = np.where(moving, mu, 1.0)
    threshold = math.log(c / (math.exp(eps) * rate)) / safe + safe / 2
    return np.where(moving, c * stats.norm.cdf(threshold) - math.exp(eps) * rate * stats.norm.cdf(threshold - safe),
                    0.0)


def exact_eps(mu, weights, rate, delta, delta_fail, direction):
    """§3.3: the smallest ε >= 0 with Σ_j w_j·δ_dir(ε; μ_j) + δ_fail <= δ, by scipy's brentq (δ(ε) is
    continuous and nonincreasing); "max" is the larger of the two directions' ε."""
    if direction == "max":
        return max(exact_eps(mu, weights, rate, delta, delta_fail, one) for one in ("remove", "add"))
    one = remove_delta if direction == "remove" else add_delta

    def excess(eps):
        return float(np.sum(np.asarray(weights) * one(eps, mu, rate))) + delta_fail - delta

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:
        high *= 2
    return optimize.brentq(excess, 0.0, high, xtol=1e-13, rtol=1e-11)


def size_probabilities(n, rate, sizes):
    """π_k for the drawn sizes, the last one taking the tail above it (lumping, §3.2)."""
    sizes = np.asarray(sizes)
    probabilities = stats.binom.pmf(sizes, n, rate)
    probabilities[-1] = stats.binom.sf(sizes[-1] - 1, n, rate)
    return probabilities


def statistics_of(rows, point, step):
    """d*, v_X and b_X of a point at a checkpoint, as written in the rows."""
    mine = {record["quantity"]: record["value"] for record in rows
            if record["point"] == point and record["step"] == step and record["quantity"] != "batch_sensitivity"}
    return mine["center_distance"], mine["spread"], mine["max_deviation"]


def pinelis_radius(spread, deviation, size, failure):
    """§7.2 Pinelis radius t/k, (1 + (v/b²)·(e^{λb} − 1 − λb))^k / cosh(λt) = β, minimised over λ by scipy."""
    if deviation == 0:
        return 0.0
    ratio, log_inverse = spread / deviation**2, -math.log(failure)

    def radius(log_lambda):
        scaled = math.exp(log_lambda)
        exponent = size * math.log1p(ratio * (math.expm1(scaled) - scaled)) + log_inverse
        return deviation * math.acosh(math.exp(min(exponent, 700.0))) / scaled / size

    return optimize.minimize_scalar(radius, bounds=(math.log(1e-4), math.log(64.0)), method="bounded",
                                    options={"xatol": 1e-9}).fun


def certified_components(statistics, sizes, probabilities, beta, levels=16):
    """§7 certified mixture: per size (probability π_j, j = 0 at k_min) the failure β_j (shares of β ∝
    1/(j+1), at most 1/2, the rest of a capped share to the others), tails β_j^{(l/L)²}, l = 1..L, each
    with Δ̄ = min(2Γ, d* + r)/(k+1), r = min(McDiarmid, Pinelis, b_X), and weight π_j·(β_{l−1} − β_l)
    (β_0 = 1; the last level takes β_{L−1}). Returns (sensitivities, weights), flat."""
    center, spread, deviation = statistics
    probabilities = np.asarray(probabilities, dtype=float)
    share = 1 / np.arange(1, len(sizes) + 1)
    failures = np.zeros(len(sizes))
    capped = np.zeros(len(sizes), dtype=bool)
    while True:
        left = beta - 0.5 * probabilities[capped].sum()
        trial = left * share / share[~capped].sum() / probabilities
        over = ~capped & (trial > 0.5)
        if not over.any():
            failures = np.where(capped, 0.5, trial)
            break
        capped |= over
    assert np.sum(probabilities * failures) <= beta * (1 + 1e-12)
    bounds, weights = [], []
    for size, probability, failure in zip(sizes, probabilities, failures):
        tails = failure ** ((np.arange(1, levels + 1) / levels) ** 2)
        previous = np.concatenate([[1.0], tails[:-1]])
        mass = np.append(previous[:-1] - tails[:-1], previous[-1])
        for tail, part in zip(tails, mass):
            radius = min(math.sqrt(spread / size) + deviation * math.sqrt(2 * math.log(1 / tail) / size),
                         pinelis_radius(spread, deviation, size, tail), deviation)
            bounds.append(min(2 * CLIP, center + radius) / (size + 1))
            weights.append(probability * part)
    return np.array(bounds), np.array(weights)


def log_moments(rate, noise_std, sensitivities, orders):
    """(α−1)·RDP_SGM(q, s/Δ, α) straight from Opacus, shape (sensitivities, orders); 0 at Δ = 0."""
    orders = np.asarray(orders, dtype=float)
    moments = np.zeros((len(sensitivities), len(orders)))
    for index, sensitivity in enumerate(sensitivities):
        if sensitivity > 0:
            moments[index] = (orders - 1) * opacus_rdp.compute_rdp(q=rate, noise_multiplier=noise_std / sensitivity,
                                                                   steps=1, orders=orders)
    return moments


def mixture_rdp(moments, probabilities, mass, orders):
    """§3.2 per order: (1/(α−1))·(log Σ_k π_k·exp(M_k(α)) − log mass)."""
    combined = logsumexp(moments, b=np.asarray(probabilities)[:, None], axis=0)
    return (combined - math.log(mass)) / (np.asarray(orders, dtype=float) - 1)


def samples_of(rows, point, step, block=None):
    """A point's Δ_B samples at a checkpoint (one block, or all) and their sizes k, as written in the rows."""
    chosen = [record for record in rows if record["quantity"] == "batch_sensitivity" and record["point"] == point
              and record["step"] == step and (block is None or record["block"] == block)]
    return np.array([record["value"] for record in chosen]), np.array([record["k"] for record in chosen])


def sample_weights(sizes, n, rate):
    """Each Δ_B sample's weight in the stratified expectation: its size's π_k split equally over the
    point's samples of that size."""
    grid, counts = np.unique(sizes, return_counts=True)
    share = dict(zip(grid, size_probabilities(n, rate, grid) / counts))
    return np.array([share[size] for size in sizes])


# --- eps_delta.py: sum rule -------------------------------------------------------------------

EPS_DELTA_COLUMNS = ["point", "step", "reduction", "direction", "kind", "eps", "eps_min", "eps_max", "delta",
                     "delta_fail", "k_min", "samples", "method"]


def test_eps_delta_sum_rule_is_exact(tmp_path, run, results):
    results("toy", grad_norm_rows())
    result = run("eps_delta.py", "--res-name", "toy")
    assert result.returncode == 0, result.stderr
    frame = output(tmp_path, "toy_eps_delta")
    assert list(frame.columns) == EPS_DELTA_COLUMNS
    assert len(frame) == 18 * 3 * 2 and set(frame["kind"]) == {"certified", "baseline"}
    assert set(frame["direction"]) == set(DIRECTIONS) and set(frame["reduction"]) == {"sum"}
    assert set(frame["method"]) == {"exact"} and np.all(frame["delta_fail"] == 0) and np.all(frame["delta"] == 1e-5)
    for direction in DIRECTIONS:
        certified = values_of(frame, "certified", direction)
        for (point, step), eps in certified.items():
            expected = exact_eps([norm_of(point, step) / (SIGMA * CLIP)], [1.0], RATE, 1e-5, 0.0, direction)
            assert eps == pytest.approx(expected, rel=1e-7, abs=1e-12)
        baseline = values_of(frame, "baseline", direction)
        assert baseline.nunique() == 1
        assert baseline.iloc[0] == pytest.approx(exact_eps([1 / SIGMA], [1.0], RATE, 1e-5, 0.0, direction), rel=1e-7)
        # Δ* = Γ is the baseline, Δ* = 0 costs nothing.
        np.testing.assert_allclose(certified.loc[0], baseline.loc[0], rtol=1e-12)
        assert np.all(certified.loc[1] == 0)
    certified = {direction: values_of(frame, "certified", direction) for direction in DIRECTIONS}
    np.testing.assert_array_equal(certified["max"], np.maximum(certified["remove"], certified["add"]))
    assert np.all(certified["add"] <= -math.log1p(-RATE) + 1e-12)  # P >= (1−q)·Q
    # §6 identity 3: the baseline is one step of dp_accounting's PLD accountant.
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(RATE, dp_accounting.GaussianDpEvent(SIGMA)))
    assert values_of(frame, "baseline", "max").iloc[0] == pytest.approx(accountant.get_epsilon(1e-5), rel=2e-3)
    assert "summary" in result.stdout and "misclassified" in result.stdout and "certified" in result.stdout


def test_eps_delta_sum_rule_holder(tmp_path, run, results):
    results("toy", grad_norm_rows())
    assert run("eps_delta.py", "--res-name", "toy").returncode == 0
    exact = output(tmp_path, "toy_eps_delta")
    result = run("eps_delta.py", "--res-name", "toy", "--method", "holder", "--out", "holder.csv")
    assert result.returncode == 0, result.stderr
    frame = pd.read_csv(tmp_path / "holder.csv")
    assert list(frame.columns) == EPS_DELTA_COLUMNS and set(frame["method"]) == {"holder p=10000"}
    for record in frame[frame["kind"] == "certified"].itertuples():
        expected = exact_eps_delta.eps_delta_holder([norm_of(record.point, record.step)], SIGMA * CLIP, RATE, 1e-5, 1e4)
        assert record.eps == pytest.approx(float(expected), rel=1e-8)
    assert values_of(frame, "certified", "max").loc[1].max() < 1e-3  # Δ* = 0: only the Hölder term remains
    assert np.allclose(values_of(frame, "baseline"), exact_eps_delta.baseline_eps_delta(SIGMA, RATE, 1e-5))
    # GLA's formula is never tighter than the exact per-step ε (§3.3).
    for kind in ("certified", "baseline"):
        assert np.all(values_of(exact, kind, "max") <= values_of(frame, kind, "max") * (1 + 1e-9))

    result = run("eps_delta.py", "--res-name", "toy", "--method", "holder", "--holder-p", "inf", "--gaussian",
                 "classic", "--delta", "1e-6", "--out", "inf.csv")
    assert result.returncode == 0, result.stderr
    frame = pd.read_csv(tmp_path / "inf.csv")
    assert set(frame["method"]) == {"holder p=inf"} and np.all(frame["delta"] == 1e-6)
    for record in frame[frame["kind"] == "certified"].itertuples():
        # p = ∞: log(1 − q + q·exp(ε_G)) with the classic ε_G = Δ·sqrt(2 ln(1.25q/δ))/s at δ_G = δ/q.
        eps_gaussian = norm_of(record.point, record.step) * math.sqrt(2 * math.log(1.25 * RATE / 1e-6)) / (SIGMA * CLIP)
        assert record.eps == pytest.approx(math.log(1 - RATE + RATE * math.exp(eps_gaussian)), rel=1e-8)


# --- eps_delta.py: mean rule by coupling --------------------------------------------------------

MEAN_COUNT, MEAN_BATCH = 200, 20


@pytest.fixture(scope="module")
def mean_rows():
    """Three points of a typical population at two checkpoints; k_min at δ_size <= 1e-7."""
    gradients = population(MEAN_COUNT, 0)
    return (coupling_rows(gradients, [0, 1, 2], MEAN_BATCH, 1e-7, draws=2)
            + coupling_rows(population(MEAN_COUNT, 0, scale=0.5), [0, 1, 2], MEAN_BATCH, 1e-7, draws=2, step=30))


def test_eps_delta_mean_rule(tmp_path, run, results, mean_rows):
    results("mean", mean_rows)
    result = run("eps_delta.py", "--res-name", "mean")
    assert result.returncode == 0, result.stderr
    frame = output(tmp_path, "mean_eps_delta")
    assert list(frame.columns) == EPS_DELTA_COLUMNS and set(frame["reduction"]) == {"mean"}
    assert len(frame) == 3 * 2 * 3 * 3 and set(frame["kind"]) == {"estimate", "certified", "baseline"}
    n, rate, noise = MEAN_COUNT - 1, MEAN_BATCH / MEAN_COUNT, SIGMA * CLIP / MEAN_BATCH
    k_min = mean_rows[0]["k_min"]
    assert k_min > 0 and set(frame["k_min"]) == {k_min}
    delta_size = stats.binom.cdf(k_min - 1, n, rate)
    fail = {"estimate": delta_size, "baseline": delta_size, "certified": 2 * delta_size}  # β = δ_size by default
    for kind, expected in fail.items():
        np.testing.assert_allclose(frame.loc[frame["kind"] == kind, "delta_fail"], expected, rtol=1e-9)
    every_size = np.arange(k_min, n + 1)
    probabilities = stats.binom.pmf(every_size, n, rate)
    certified_sizes = np.arange(k_min, size_upper(n, rate) + 1)
    assert list(batch_sizes.size_grid(n, rate, k_min, 64)) == list(certified_sizes)
    for direction in ("remove", "add"):
        for record in frame[(frame["kind"] == "estimate") & (frame["direction"] == direction)].itertuples():
            # The reported δ includes delta_fail: Σ_b w_b·δ(ε; Δ_b/s) + δ_size = δ, from the file's own rows.
            values, sizes = samples_of(mean_rows, record.point, record.step)
            assert record.samples == len(values) == 2 * (2 + record.point) * (size_upper(n, rate) - k_min + 1)
            expected = exact_eps(values / noise, sample_weights(sizes, n, rate), rate, 1e-5, delta_size, direction)
            assert record.eps == pytest.approx(expected, rel=1e-6)
            per_block = [exact_eps(values / noise, sample_weights(sizes, n, rate), rate, 1e-5, delta_size, direction)
                         for values, sizes in (samples_of(mean_rows, record.point, record.step, block)
                                               for block in (0, 1))]
            assert record.eps_min == pytest.approx(min(per_block), rel=1e-6)
            assert record.eps_max == pytest.approx(max(per_block), rel=1e-6)
        for record in frame[(frame["kind"] == "certified") & (frame["direction"] == direction)].itertuples():
            # §7 over the script's sizes [k_min, k_hi] (the last one lumping the tail); the script rounds v_X/b_X²
            # up by at most 1e-4 (§7.2), which moves Δ̄ up by less than that.
            bound, weights = certified_components(statistics_of(mean_rows, record.point, record.step), certified_sizes,
                                                  size_probabilities(n, rate, certified_sizes), delta_size)
            low = exact_eps(bound / noise, weights, rate, 1e-5, 2 * delta_size, direction)
            high = exact_eps(bound * (1 + 1e-4) / noise, weights, rate, 1e-5, 2 * delta_size, direction)
            assert low * (1 - 1e-6) <= record.eps <= high * (1 + 1e-6)
        expected = exact_eps(2 * CLIP / (every_size + 1) / noise, probabilities, rate, 1e-5, delta_size, direction)
        np.testing.assert_allclose(values_of(frame, "baseline", direction), expected, rtol=1e-6)
    for kind in ("estimate", "certified", "baseline"):
        np.testing.assert_array_equal(values_of(frame, kind, "max"), np.maximum(values_of(frame, kind, "remove"),
                                                                                values_of(frame, kind, "add")))
    estimate = frame[frame["kind"] == "estimate"]
    assert np.all(estimate["eps_min"] <= estimate["eps"]) and np.all(estimate["eps"] <= estimate["eps_max"])
    # A typical population: the certified bound and the estimate are below the mean rule's own baseline.
    for direction in DIRECTIONS:
        for kind in ("certified", "estimate"):
            assert np.all(values_of(frame, kind, direction) < values_of(frame, "baseline", direction))
    assert np.all(frame.loc[frame["kind"] != "estimate", "samples"] == 0)
    assert f"k_min={k_min}" in result.stdout and "including delta_fail" in result.stdout


def test_eps_delta_mean_rule_flags_and_k_min_zero(tmp_path, run, results):
    rows = coupling_rows(population(40, 3), [0, 1], 8, 0.0, draws=1, k_min=0)
    results("zero", rows)
    result = run("eps_delta.py", "--res-name", "zero", "--delta", "1e-3")
    assert result.returncode == 0 and "k_min = 0" in result.stderr
    frame = output(tmp_path, "zero_eps_delta")
    # δ_size = 0: estimate and baseline fail with probability 0, β defaults to the training δ/(10·T).
    assert set(frame["k_min"]) == {0} and np.all(frame.loc[frame["kind"] != "certified", "delta_fail"] == 0)
    training_delta = rows[0]["delta"]
    np.testing.assert_allclose(frame.loc[frame["kind"] == "certified", "delta_fail"], training_delta / (10 * STEPS))
    assert run("eps_delta.py", "--res-name", "zero", "--delta", "1e-3", "--failure", "1e-4", "--out",
               "failure.csv").returncode == 0
    failure = pd.read_csv(tmp_path / "failure.csv")
    np.testing.assert_allclose(failure.loc[failure["kind"] == "certified", "delta_fail"], 1e-4)
    # A larger β shrinks the radius r_k but costs δ: the estimate and the baseline do not move.
    for kind in ("estimate", "baseline"):
        np.testing.assert_array_equal(values_of(failure, kind), values_of(frame, kind))
    # δ at most delta_fail leaves nothing to spend.
    result = run("eps_delta.py", "--res-name", "zero", "--delta", "1e-3", "--failure", "2e-3", "--out", "spent.csv")
    assert result.returncode == 0
    spent = pd.read_csv(tmp_path / "spent.csv")
    assert np.all(np.isinf(spent.loc[spent["kind"] == "certified", "eps"]))
    # The summary's quantiles of bounds that are all infinite are inf, not NaN.
    summary = result.stdout.split("summary of eps")[1]
    assert "NaN" not in summary and summary.count("inf") >= 3


def test_summary_quantile_is_numpys_and_inf_where_the_upper_value_is_inf():
    """The report's q10/q90: numpy's linear interpolation between finite values (NaN left out), +inf where it
    would interpolate towards +inf (numpy gives NaN there), the lower value where the quantile falls on it."""
    generator = np.random.default_rng(0)
    for count in (1, 2, 7, 40):
        values = generator.exponential(size=count)
        values[generator.random(count) < 0.2] = np.nan
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            expected = np.nanquantile(values, q) if not np.isnan(values).all() else np.nan
            np.testing.assert_equal(quantile(values, q), expected)
    assert quantile(np.array([1.0, np.inf]), 0.9) == np.inf
    assert quantile(np.array([1.0, np.inf]), 0.0) == 1.0
    assert quantile(np.array([np.inf, np.inf, np.nan]), 0.5) == np.inf
    assert quantile(np.array([1.0, 2.0, np.inf]), 0.5) == 2.0
    assert quantile(np.array([1.0, 2.0, np.inf]), 0.75) == np.inf
    assert quantile(np.array([1.0, 2.0, 4.0, np.inf, np.inf]), 0.5) == 4.0
    assert np.isnan(quantile(np.array([np.nan, np.nan]), 0.5))


# --- Rényi DP per step ----------------------------------------------------------------------

def test_renyi_sum_rule(tmp_path, run, results):
    results("toy", grad_norm_rows())
    result = run("renyi_per_instance_sum.py", "--res-name", "toy", "--alpha", "2", "8.5")
    assert result.returncode == 0, result.stderr
    frame = output(tmp_path, "toy_renyi_per_instance_sum")
    assert list(frame.columns) == ["point", "step", "alpha", "direction", "kind", "rdp"]
    assert len(frame) == 18 * 2 * 2 and set(frame["direction"]) == {"max"}
    certified = values_of(frame, "certified", value="rdp")
    for (point, step, alpha), rdp in certified.items():
        expected = renyi_step.rdp_sum_rule([norm_of(point, step)], CLIP, SIGMA, RATE, [alpha])
        assert rdp == pytest.approx(float(expected[0, 0]), rel=1e-8)
    assert np.all(certified.loc[1] == 0)
    baseline = values_of(frame, "baseline", value="rdp")
    # The baseline is Opacus's RDP of (q, σ) (§6 identity 1); at Δ* = Γ the point is the baseline.
    for alpha in (2.0, 8.5):
        opacus = float(opacus_rdp.compute_rdp(q=RATE, noise_multiplier=SIGMA, steps=1, orders=[alpha])[0])
        np.testing.assert_allclose(baseline.xs(alpha, level="alpha"), opacus, rtol=1e-6)
    np.testing.assert_allclose(certified.loc[0], baseline.loc[0], rtol=1e-8)


def test_renyi_mean_rule_coupling_from_the_file(tmp_path, run, results, mean_rows):
    """The estimate, certified bound and baseline of §3.2, recomputed from the rows with Opacus."""
    results("mean", mean_rows)
    result = run("renyi_per_instance_mean.py", "--res-name", "mean", "--alpha", "2", "8")
    assert result.returncode == 0, result.stderr
    frame = output(tmp_path, "mean_renyi_per_instance_mean")
    assert list(frame.columns) == ["point", "step", "alpha", "direction", "kind", "rdp", "rdp_min", "rdp_max",
                                   "samples", "k_min", "k_star", "k_star_at_k_min", "delta_fail", "estimator"]
    assert len(frame) == 3 * 2 * 2 * 3 * 3 and set(frame["estimator"]) == {"coupling"}
    orders = [2.0, 8.0]
    n, rate, noise = MEAN_COUNT - 1, MEAN_BATCH / MEAN_COUNT, SIGMA * CLIP / MEAN_BATCH
    k_min = mean_rows[0]["k_min"]
    delta_size = stats.binom.cdf(k_min - 1, n, rate)
    every_size = np.arange(k_min, size_upper(n, rate) + 1)  # P(k > k_hi) <= 1e-12 is left out: a lower value
    probabilities = stats.binom.pmf(every_size, n, rate)
    assert list(batch_sizes.size_grid(n, rate, k_min, 64)) == list(every_size)
    remove = frame[frame["direction"] == "remove"].set_index(["kind", "point", "step", "alpha"])

    def bracket(rdp_at, reported, rounding=1.001):
        """The script rounds each Δ up by at most 0.1% before the RDP lookup (§5), and ρ is nondecreasing in Δ:
        the reported value lies between the exact ones at Δ and at 1.001·Δ."""
        low, high = rdp_at(1.0), rdp_at(rounding)
        assert np.all(low * (1 - 1e-9) <= reported) and np.all(reported <= high * (1 + 1e-9)), (low, high, reported)

    def estimate(point, step, block=None, scale=1.0):
        values, sizes = samples_of(mean_rows, point, step, block)
        return mixture_rdp(log_moments(rate, noise, scale * values, orders), sample_weights(sizes, n, rate),
                           1 - delta_size, orders)

    def mixture(bound, fail, scale=1.0, weights=probabilities):
        return mixture_rdp(log_moments(rate, noise, scale * bound, orders), weights, 1 - fail, orders)

    def certified(point, step, beta):
        """§7's components over the script's sizes [k_min, k_hi], the last one lumping the tail."""
        return certified_components(statistics_of(mean_rows, point, step), every_size,
                                    size_probabilities(n, rate, every_size), beta)

    for point in range(3):
        for step in (0, 30):
            mine = remove.xs((point, step), level=("point", "step"))
            bracket(lambda scale, point=point, step=step: estimate(point, step, scale=scale),
                    mine.loc["estimate", "rdp"].to_numpy())
            for value, reduce in (("rdp_min", np.min), ("rdp_max", np.max)):
                bracket(lambda scale, point=point, step=step, reduce=reduce: reduce(
                    [estimate(point, step, block, scale) for block in (0, 1)], axis=0),
                    mine.loc["estimate", value].to_numpy())
            # The script also rounds v_X/b_X² up by at most 1e-4 (§7.2): Δ̄ by less than that.
            bound, weights = certified(point, step, delta_size)
            bracket(lambda scale, bound=bound, weights=weights: mixture(bound, 2 * delta_size, scale, weights),
                    mine.loc["certified", "rdp"], rounding=1.001 * 1.0001)
            # k* = argmax_k Σ_l w_{k,l}·exp(M_{k,l}): the size whose components decide the bound.
            terms = np.log(weights)[:, None] + log_moments(rate, noise, bound, orders)
            per_size = logsumexp(terms.reshape(len(every_size), -1, len(orders)), axis=1)
            np.testing.assert_array_equal(mine.loc["certified", "k_star"], every_size[np.argmax(per_size, axis=0)])
            bracket(lambda scale: mixture(2 * CLIP / (every_size + 1), delta_size, scale),
                    mine.loc["baseline", "rdp"].to_numpy())
            assert np.all(mine.loc["estimate", "samples"] == 2 * (2 + point) * len(every_size))
    # A typical population: estimate < certified < the mean rule's own baseline (the add direction may all be
    # at its cap log(1/(1−q))).
    assert np.all(values_of(frame, "estimate", "remove", "rdp") < values_of(frame, "certified", "remove", "rdp"))
    assert np.all(values_of(frame, "certified", "remove", "rdp") < values_of(frame, "baseline", "remove", "rdp"))
    assert set(frame["k_min"]) == {k_min}
    np.testing.assert_array_equal(frame["k_star_at_k_min"], (frame["k_star"] == k_min).astype(int))
    for kind, expected in {"estimate": delta_size, "baseline": delta_size, "certified": 2 * delta_size}.items():
        np.testing.assert_allclose(frame.loc[frame["kind"] == kind, "delta_fail"], expected, rtol=1e-9)
    # The coupling value bounds both directions; add is also at most log(1/(1−q)) (§3.2).
    for kind in ("estimate", "certified", "baseline"):
        for value in ("rdp", "rdp_min", "rdp_max"):
            remove, add, maximum = (values_of(frame, kind, direction, value) for direction in DIRECTIONS)
            np.testing.assert_allclose(add, np.minimum(remove, -math.log1p(-rate)), rtol=1e-9)  # CSV: 10 digits
            np.testing.assert_array_equal(maximum, remove)
    assert "estimate (Monte Carlo, not a bound)" in result.stdout
    # A large β: a smaller radius r_k, and a certified mass 1 − δ_size − β far from 1.
    assert run("renyi_per_instance_mean.py", "--res-name", "mean", "--alpha", "2", "8", "--failure", "0.3",
               "--out", "beta.csv").returncode == 0
    beta = pd.read_csv(tmp_path / "beta.csv")
    np.testing.assert_allclose(beta.loc[beta["kind"] == "certified", "delta_fail"], delta_size + 0.3)
    for (point, step), reported in values_of(beta, "certified", "remove", "rdp").groupby(level=["point", "step"]):
        bound, weights = certified(point, step, 0.3)
        bracket(lambda scale, bound=bound, weights=weights: mixture(bound, delta_size + 0.3, scale, weights),
                reported.to_numpy(), rounding=1.001 * 1.0001)


def test_renyi_mean_rule_jensen(tmp_path, run, results):
    rows = pd.DataFrame(renyi_rows())
    results("renyi", rows.to_dict("records"))
    result = run("renyi_per_instance_mean.py", "--res-name", "renyi", "--estimator", "jensen", "--alpha", "2", "4")
    assert result.returncode == 0, result.stderr
    assert "not a measure of the point's influence" in result.stdout
    joint = output(tmp_path, "renyi_renyi_per_instance_mean")
    assert set(joint["kind"]) == {"gla_statistic"} and set(joint["estimator"]) == {"jensen joint"}
    assert set(joint["direction"]) == set(DIRECTIONS) and len(joint) == 3 * 2 * 2 * 3
    assert joint["delta_fail"].isna().all() and joint["k_min"].isna().all()
    noise_std = SIGMA * CLIP / BATCH
    for record in joint[joint["direction"] != "max"].itertuples():
        mine = rows[(rows["point"] == record.point) & (rows["step"] == record.step)
                    & (rows["direction"] == record.direction) & (rows["alpha"] == record.alpha)]["value"]
        # ρ̂_J = (logsumexp_k(−S_k/(2 s_m²)) − log K)/(α−1)
        expected = (logsumexp(-mine / (2 * noise_std ** 2)) - math.log(len(mine))) / (record.alpha - 1)
        assert record.rdp == pytest.approx(expected, rel=1e-8)
    pivot = joint.pivot_table(index=["point", "step", "alpha"], columns="direction", values="rdp")
    np.testing.assert_allclose(pivot["max"], np.maximum(pivot["remove"], pivot["add"]))

    result = run("renyi_per_instance_mean.py", "--res-name", "renyi", "--estimator", "jensen", "--alpha", "2", "4",
                 "--aggregate", "per-target", "--out", "per_target.csv")
    assert result.returncode == 0 and "NOT an upper bound" in result.stderr
    per_target = pd.read_csv(tmp_path / "per_target.csv")
    assert set(per_target["estimator"]) == {"jensen per-target (not an upper bound)"}
    order = ["point", "step", "alpha", "direction"]
    assert np.all(per_target.sort_values(order)["rdp"].to_numpy() <= joint.sort_values(order)["rdp"].to_numpy()
                  + 1e-12)


def test_renyi_mean_rule_jensen_one_direction(tmp_path, run, results):
    results("renyi", renyi_rows(directions=("remove",)))
    result = run("renyi_per_instance_mean.py", "--res-name", "renyi", "--estimator", "jensen", "--alpha", "2")
    assert result.returncode == 0 and "only one direction" in result.stderr
    assert "gla_statistic = GLA statistic (loose)" in result.stdout  # the table shows the one direction
    assert set(output(tmp_path, "renyi_renyi_per_instance_mean")["direction"]) == {"remove"}


# --- composition over a run: sum rule -------------------------------------------------------

COMPO_COLUMNS = ["point", "kind", "eps", "alpha", "delta", "delta_fail", "steps", "k_min", "reduction", "eps_remove",
                 "eps_add", "accountant", "discretization"]
ORDERS = [2, 4, 8, 16, 32]


def compo(run, tmp_path, name, *flags, orders=ORDERS):
    out = f"{name}{'_'.join(flags)}.csv"
    result = run("renyi_per_instance_sum_compo.py", "--res-name", name, "--alpha", *orders, *flags, "--out", out)
    assert result.returncode == 0, result.stderr
    frame = pd.read_csv(tmp_path / out)
    assert list(frame.columns) == COMPO_COLUMNS
    return frame, result


def opacus_eps(rdp, orders, delta):
    eps, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=np.asarray(rdp), delta=delta)
    return eps


def test_composition_worst_case_is_the_baseline(tmp_path, run, results):
    # Δ* at every step 0..T−1 (and at T, which charges no step): a bound along the run, labelled certified (§4).
    results("worst", [row(step=step, point=point, value=CLIP) for step in range(STEPS + 1) for point in range(3)])
    frame, result = compo(run, tmp_path, "worst", "--holder-b", "inf")
    certified, baseline = values_of(frame, "certified"), values_of(frame, "baseline")
    np.testing.assert_allclose(certified, baseline, rtol=1e-10)
    # §6 identity 7: Opacus's accountant for (q, σ, T).
    expected = opacus_eps(opacus_rdp.compute_rdp(q=RATE, noise_multiplier=SIGMA, steps=STEPS, orders=ORDERS),
                          ORDERS, 1e-5)
    np.testing.assert_allclose(baseline, expected, rtol=1e-9)
    assert set(frame["steps"]) == {STEPS} and set(frame["reduction"]) == {"sum"} and np.all(frame["delta_fail"] == 0)
    assert frame["k_min"].isna().all() and set(frame["alpha"]) <= set(ORDERS)
    # The default b = 3T with one run only inflates the orders (and says so).
    default, result = compo(run, tmp_path, "worst")
    assert np.all(values_of(default, "certified") >= certified) and "--holder-b inf" in result.stderr


def test_composition_per_step_norms_equal_checkpoints(tmp_path, run, results):
    # Norms constant between checkpoints: a file with every step gives the same numbers, certified, where the
    # checkpoints' composition holds Δ* between them and is a held-Δ* estimate (§4).
    checkpoints = [row(step=step, point=point, value=norm_of(point, step))
                   for step in (0, 20, 40) for point in range(4)]
    every_step = [row(step=step, point=point, value=norm_of(point, step // 20 * 20))
                  for step in range(STEPS) for point in range(4)]
    results("checkpoints", checkpoints)
    results("every_step", every_step)
    for flags in [("--holder-b", "inf"), ("--holder-b", "3T")]:
        sparse, _ = compo(run, tmp_path, "checkpoints", *flags)
        dense, _ = compo(run, tmp_path, "every_step", *flags)
        assert set(dense["kind"]) == {"certified", "baseline"} and set(sparse["kind"]) == {"held_estimate", "baseline"}
        np.testing.assert_allclose(values_of(dense, "certified"), values_of(sparse, "held_estimate"), rtol=1e-8)
    certified = values_of(dense, "certified")
    assert certified.loc[1] < certified.loc[2] < certified.loc[0]
    # b = inf with one run, no rounding: Σ_t ρ_t(λ), 20 steps at each checkpoint's Δ*.
    inf, _ = compo(run, tmp_path, "checkpoints", "--holder-b", "inf", "--rounding", "0")
    for point in range(4):
        rdp = sum(20 * renyi_step.rdp_sum_rule([norm_of(point, step)], CLIP, SIGMA, RATE, ORDERS)[0]
                  for step in (0, 20, 40))
        assert values_of(inf, "held_estimate").loc[point] == pytest.approx(opacus_eps(rdp, ORDERS, 1e-5), rel=1e-9)


def test_composition_without_step_zero_uses_worst_case(tmp_path, run, results):
    late = [row(step=step, point=point, value=0.0) for step in (10, 40) for point in range(2)]
    results("late", late)
    results("early", [row(step=0, point=point, value=CLIP) for point in range(2)] + late)
    frame, result = compo(run, tmp_path, "late", "--holder-b", "inf")
    assert "no checkpoint at step 0" in result.stderr
    early, _ = compo(run, tmp_path, "early", "--holder-b", "inf")
    # Steps 1..10 at Γ in both files, zero cost afterwards.
    np.testing.assert_allclose(values_of(frame, "held_estimate"), values_of(early, "held_estimate"), rtol=1e-8)
    expected = opacus_eps(opacus_rdp.compute_rdp(q=RATE, noise_multiplier=SIGMA, steps=10, orders=ORDERS),
                          ORDERS, 1e-5)
    np.testing.assert_allclose(values_of(frame, "held_estimate"), expected, rtol=1e-9)
    assert np.all(values_of(frame, "held_estimate") < values_of(frame, "baseline"))


def test_composition_several_runs(tmp_path, run, results):
    rows = grad_norm_rows(steps=(0, 20, 40), run="a", seed=0) + grad_norm_rows(steps=(0, 30), run="bb", seed=1)
    results("runs", rows)
    both, result = compo(run, tmp_path, "runs", "--holder-b", "inf")
    assert "2 run(s)" in result.stdout
    single = [values_of(compo(run, tmp_path, "runs", "--holder-b", "inf", "--filter", f"run={name}")[0], "held_estimate")
              for name in ("a", "bb")]
    # b = ∞ takes the max over runs at every step: at least each run's own value.
    assert len(single[0]) == 6 and np.all(values_of(both, "held_estimate") >= np.maximum(single[0], single[1]) - 1e-12)
    finite, _ = compo(run, tmp_path, "runs", "--holder-b", "100")
    assert np.all(np.isfinite(finite["eps"]))
    exact, _ = compo(run, tmp_path, "runs", "--holder-b", "inf", "--rounding", "0")
    assert len(values_of(exact, "held_estimate")) == 6
    assert np.all(values_of(exact, "held_estimate") <= values_of(both, "held_estimate") + 1e-12)


# --- composition over a run: mean rule ------------------------------------------------------

COMPO_COUNT, COMPO_BATCH = 1000, 200


def test_composition_of_the_mean_rule(tmp_path, run, results):
    """Certified composed ε = the T steps' certified ρ of §3.2 (each checkpoint's for the steps after it),
    converted by Opacus at δ − T·delta_fail (§3.4, §4)."""
    # Large batches, so that the bulk of sizes and not the rarest ones decides the bound (§3.4); δ_size such
    # that T·delta_fail is a good part of δ. draws=0: point 0 has no Δ_B samples, point 1 one per size.
    rows = (coupling_rows(population(COMPO_COUNT, 4), [0, 1], COMPO_BATCH, 5e-8, draws=0, blocks=1)
            + coupling_rows(population(COMPO_COUNT, 4, scale=0.5), [0, 1], COMPO_BATCH, 5e-8, draws=0, blocks=1,
                            step=30))
    results("mean", rows)
    orders = [2, 3, 4, 6, 8, 16, 32, 64]  # integer orders: Opacus's fractional series is slow
    frame, result = compo(run, tmp_path, "mean", orders=orders)
    n, rate, noise = COMPO_COUNT - 1, COMPO_BATCH / COMPO_COUNT, SIGMA * CLIP / COMPO_BATCH
    k_min = rows[0]["k_min"]
    delta_size = stats.binom.cdf(k_min - 1, n, rate)
    # Certified per step, held between the two checkpoints: a held estimate (§4).
    assert set(frame["kind"]) == {"held_estimate", "baseline"} and set(frame["reduction"]) == {"mean"}
    assert "per-step values at 2 checkpoints, held between them" in result.stdout
    assert "held_estimate = held_estimate (certified per step, held between checkpoints; not a bound)" in result.stdout
    assert set(frame["k_min"]) == {k_min} and set(frame["steps"]) == {STEPS} and np.all(frame["delta"] == 1e-5)
    np.testing.assert_allclose(frame.loc[frame["kind"] == "held_estimate", "delta_fail"], 2 * delta_size, rtol=1e-9)
    np.testing.assert_allclose(frame.loc[frame["kind"] == "baseline", "delta_fail"], delta_size, rtol=1e-9)
    assert "converted at delta - T·delta_fail" in result.stdout and STEPS * 2 * delta_size > 0.2e-5
    # The script evaluates its 64 sizes (each taking the probability of the sizes up to the next one) at Δ̄
    # rounded up by at most 1% (§5): its ε lies between the exact ones at Δ̄ and at 1.01·Δ̄ on those sizes. For
    # the baseline, the lower end is every size in [k_min, k_hi] (P(k > k_hi) <= 1e-12 left out).
    every_size = np.arange(k_min, size_upper(n, rate) + 1)
    grid = batch_sizes.size_grid(n, rate, k_min, 64)
    assert len(grid) < len(every_size)
    lumped = np.diff(stats.binom.cdf(np.append(grid - 1, n), n, rate))

    def composed(components_of, steps, fail, sizes, probabilities, scale):
        """ε of Σ over checkpoints of (steps after it)·ρ, the components (Δ̄, weight) of each step's mixture."""
        rdp = 0
        for step, count in steps:
            bound, weights = components_of(sizes, probabilities, step)
            rdp = rdp + count * mixture_rdp(log_moments(rate, noise, scale * bound, orders), weights, 1 - fail, orders)
        return opacus_eps(rdp, orders, 1e-5 - STEPS * fail)

    certified = values_of(frame, "held_estimate")
    for point in (0, 1):
        def components(sizes, probabilities, step, point=point):
            return certified_components(statistics_of(rows, point, step), sizes, probabilities, delta_size)
        low, high = (composed(components, [(0, 30), (30, 30)], 2 * delta_size, grid, lumped, scale)
                     for scale in (1.0, 1.01))
        assert low * (1 - 1e-9) <= certified.loc[point] <= high * (1 + 1e-9)

    def baseline_components(sizes, probabilities, step):
        return 2 * CLIP / (sizes + 1), probabilities
    low = composed(baseline_components, [(0, STEPS)], delta_size, every_size, stats.binom.pmf(every_size, n, rate), 1.0)
    high = composed(baseline_components, [(0, STEPS)], delta_size, grid, lumped, 1.01)
    baseline = values_of(frame, "baseline")
    assert np.all(low * (1 - 1e-9) <= baseline) and np.all(baseline <= high * (1 + 1e-9))
    assert np.all(certified < baseline)

    estimate, result = compo(run, tmp_path, "mean", "--kind", "estimate", orders=orders)
    assert set(estimate["kind"]) == {"estimate", "baseline"} and set(estimate["point"]) == {1}
    assert "estimate = estimate (Monte Carlo per step, held between checkpoints; not a bound)" in result.stdout
    np.testing.assert_allclose(estimate.loc[estimate["kind"] == "estimate", "delta_fail"], delta_size, rtol=1e-9)
    assert values_of(estimate, "estimate").loc[1] < certified.loc[1]
    # Point 0 has nothing to estimate from.
    assert_usage_error(run("renyi_per_instance_sum_compo.py", "--res-name", "mean", "--kind", "estimate",
                           "--points", "0", "--out", "none.csv"), "--res-name")


def test_composition_of_the_mean_rule_refuses(tmp_path, run, results):
    rows = coupling_rows(population(COMPO_COUNT, 5), [0], COMPO_BATCH, 1e-9, draws=0, blocks=1)
    results("mean", rows)
    assert_usage_error(run("renyi_per_instance_sum_compo.py", "--res-name", "mean", "--holder-b", "3T"),
                       "--holder-b")
    # T·delta_fail must leave some δ.
    assert_usage_error(run("renyi_per_instance_sum_compo.py", "--res-name", "mean", "--delta", "1e-8"), "--delta")
    results("two", rows + [dict(record, run="b") for record in rows])
    assert_usage_error(run("renyi_per_instance_sum_compo.py", "--res-name", "two"), "--filter")


# --- selecting rows and the default output -------------------------------------------------------

def test_filter_points_and_default_output(tmp_path, run):
    rows = grad_norm_rows() + grad_norm_rows(sigma=2.0, noise_std=2.0 * CLIP)
    source = write(os.path.join(tmp_path, "data", "mixed.csv"), rows)
    result = run("eps_delta.py", "--res-file", source, "--filter", "sigma=1.2", "--points", "2-4",
                 "--filter", "step=20")
    assert result.returncode == 0, result.stderr
    frame = pd.read_csv(tmp_path / "data" / "mixed_eps_delta.csv")
    assert sorted(frame["point"].unique()) == [2, 3, 4] and set(frame["step"]) == {20} and len(frame) == 3 * 3 * 2
    assert values_of(frame, "certified", "max").loc[2].iloc[0] == pytest.approx(
        exact_eps([norm_of(2, 20) / (SIGMA * CLIP)], [1.0], RATE, 1e-5, 0.0, "max"), rel=1e-7)


def test_res_dir_holds_the_input_and_the_default_output(tmp_path, run):
    write(os.path.join(tmp_path, "elsewhere", "toy.csv"), grad_norm_rows())
    result = run("eps_delta.py", "--res-name", "toy", "--res-dir", "elsewhere")
    assert result.returncode == 0, result.stderr
    assert not os.path.exists(tmp_path / "res")
    frame = pd.read_csv(tmp_path / "elsewhere" / "toy_eps_delta.csv")
    assert values_of(frame, "certified", "max").loc[2].iloc[0] == pytest.approx(
        exact_eps([norm_of(2, 0) / (SIGMA * CLIP)], [1.0], RATE, 1e-5, 0.0, "max"), rel=1e-7)
    # The same script on the same input replaces its own output; a foreign file needs --overwrite.
    assert run("eps_delta.py", "--res-name", "toy", "--res-dir", "elsewhere").returncode == 0
    (tmp_path / "elsewhere" / "toy_eps_delta.csv").write_text("someone else's\n")
    assert_usage_error(run("eps_delta.py", "--res-name", "toy", "--res-dir", "elsewhere"), "--out")
    assert run("eps_delta.py", "--res-name", "toy", "--res-dir", "elsewhere", "--overwrite").returncode == 0


# --- bad input: one line, exit 2, nothing written -------------------------------------------

def bad(tmp_path, script, rows, *flags, name="toy"):
    if rows is not None:
        write(os.path.join(tmp_path, "res", f"{name}.csv"), rows)
    before = snapshot(tmp_path)
    result = run_in_process(script, "--res-name", name, *flags, cwd=tmp_path)
    assert snapshot(tmp_path) == before, "a file was written or changed"
    return result


def test_bad_input_from_a_real_process(tmp_path):
    """What a user sees: exit status 2 and one line, without a traceback, from the interpreter."""
    write(os.path.join(tmp_path, "res", "toy.csv"), grad_norm_rows())
    result = run_script("renyi_per_instance_sum_compo.py", "--res-name", "toy", "--holder-b", "lots", cwd=tmp_path)
    assert_usage_error(result, "--holder-b")


@pytest.mark.parametrize("script", ["eps_delta.py", "renyi_per_instance_sum.py", "renyi_per_instance_mean.py",
                                    "renyi_per_instance_sum_compo.py"])
def test_missing_file(tmp_path, script):
    assert_usage_error(bad(tmp_path, script, None), "--res-name")


def test_unreadable_and_foreign_files(tmp_path):
    os.makedirs(tmp_path / "res")
    (tmp_path / "res" / "binary.csv").write_bytes(b"\xff\xfe\x00garbage\x00\xff")
    assert_usage_error(bad(tmp_path, "eps_delta.py", None, name="binary"), "--res-name")
    (tmp_path / "res" / "foreign.csv").write_text("a,b\n1,2\n")
    assert_usage_error(bad(tmp_path, "eps_delta.py", None, name="foreign"), "--res-name")


def test_no_rows_of_the_needed_quantity(tmp_path):
    result = bad(tmp_path, "renyi_per_instance_mean.py", grad_norm_rows())
    assert_usage_error(result, "--res-name")
    assert "batch_sensitivity" in result.stderr and "compute_sensitivity.py --reduction mean" in result.stderr
    result = bad(tmp_path, "renyi_per_instance_mean.py", grad_norm_rows(), "--estimator", "jensen")
    assert_usage_error(result, "--res-name")
    assert "renyi_statistic" in result.stderr and "--estimator jensen" in result.stderr


def test_mixed_configurations(tmp_path):
    rows = grad_norm_rows() + grad_norm_rows(sigma=2.0, noise_std=2.0 * CLIP)
    result = bad(tmp_path, "renyi_per_instance_sum_compo.py", rows)
    assert_usage_error(result, "--filter")
    assert "sigma has 1.2, 2.0" in result.stderr and "--filter sigma=" in result.stderr


def test_per_step_script_with_two_runs(tmp_path):
    result = bad(tmp_path, "renyi_per_instance_sum.py", grad_norm_rows() + grad_norm_rows(run="b", seed=1))
    assert_usage_error(result, "--filter")
    assert "run" in result.stderr


@pytest.mark.parametrize("script, flags, flag", [
    ("renyi_per_instance_sum.py", ["--alpha", "1"], "--alpha"),
    ("renyi_per_instance_sum_compo.py", ["--alpha", "2", "0.5"], "--alpha"),
    ("eps_delta.py", ["--delta", "0"], "--delta"),
    ("renyi_per_instance_sum_compo.py", ["--delta", "1.5"], "--delta"),
    ("eps_delta.py", ["--method", "pld"], "--method"),
    ("eps_delta.py", ["--method", "holder", "--holder-p", "1"], "--holder-p"),
    ("eps_delta.py", ["--method", "holder", "--holder-p", "many"], "--holder-p"),
    ("renyi_per_instance_sum_compo.py", ["--holder-b", "0.01T"], "--holder-b"),
    ("renyi_per_instance_sum_compo.py", ["--holder-b", "1.01"], "--holder-b"),  # orders explode
    ("renyi_per_instance_sum_compo.py", ["--holder-b", "lots"], "--holder-b"),
    ("renyi_per_instance_sum_compo.py", ["--holder-p", "3T"], "--holder-p"),  # the old name is refused
    ("renyi_per_instance_sum_compo.py", ["--rounding", "2"], "--rounding"),
    ("renyi_per_instance_sum_compo.py", ["--kind", "baseline"], "--kind"),
    ("renyi_per_instance_mean.py", ["--estimator", "exact"], "--estimator"),
    ("eps_delta.py", ["--failure", "0"], "--failure"),
    ("renyi_per_instance_mean.py", ["--failure", "1"], "--failure"),
    ("renyi_per_instance_sum_compo.py", ["--failure", "nan"], "--failure"),
    ("eps_delta.py", ["--points", "5000"], "--points"),
    ("eps_delta.py", ["--filter", "sigma=3"], "--filter"),
    ("eps_delta.py", ["--filter", "colour=red"], "--filter"),
    ("eps_delta.py", ["--out", "res/toy.csv"], "--out"),
    ("eps_delta.py", ["--res-file", "x.csv"], "--res-file"),
])
def test_bad_flags(tmp_path, script, flags, flag):
    assert_usage_error(bad(tmp_path, script, grad_norm_rows(), *flags), flag)


@pytest.mark.parametrize("script, change, message", [
    ("renyi_per_instance_sum_compo.py", {"step": STEPS + 1}, "step 61"),
    ("eps_delta.py", {"value": -0.5}, "negative"),
    ("renyi_per_instance_sum.py", {"value": CLIP * (1 + 1e-5)}, "exceeds clip_bound"),
    ("renyi_per_instance_sum_compo.py", {"value": "nan"}, "not a finite number"),
])
def test_values_that_break_the_contract_name_the_row(tmp_path, script, change, message):
    rows = grad_norm_rows()
    rows[7].update(change)
    result = bad(tmp_path, script, rows)
    assert_usage_error(result, "--res-name")
    assert message in result.stderr and "line 9 " in result.stderr


@pytest.mark.parametrize("change, message", [
    ({"sigma": 0.0, "noise_std": 0.0}, "sigma must be > 0"),
    ({"sample_rate": 1.5}, "sample_rate must be in (0, 1]"),
    ({"noise_std": 1.0}, "noise_std 1.0 is not sigma*clip_bound"),
    ({"reduction": "mean"}, "grad_norm rows have reduction sum"),
])
def test_configuration_that_breaks_the_contract(tmp_path, change, message):
    result = bad(tmp_path, "eps_delta.py", [dict(record, **change) for record in grad_norm_rows()])
    assert_usage_error(result, "--res-name")
    assert message in result.stderr and "line 2 " in result.stderr


def test_jensen_bad_rows(tmp_path):
    rows = renyi_rows()
    rows[4]["direction"] = "sideways"
    result = bad(tmp_path, "renyi_per_instance_mean.py", rows, "--estimator", "jensen")
    assert_usage_error(result, "--res-name")
    assert "line 6 " in result.stderr and "sideways" in result.stderr
    result = bad(tmp_path, "renyi_per_instance_mean.py", renyi_rows(), "--estimator", "jensen", "--alpha", "3",
                 name="other")
    assert_usage_error(result, "--alpha")


@pytest.fixture(scope="module")
def small_mean_rows():
    return coupling_rows(population(30, 6), [0, 1], 6, 1e-3, draws=1)


@pytest.mark.parametrize("script", ["eps_delta.py", "renyi_per_instance_mean.py"])
def test_mean_rule_bad_rows(tmp_path, script, small_mean_rows):
    samples = [index for index, record in enumerate(small_mean_rows) if record["quantity"] == "batch_sensitivity"]
    without_k = [dict(record) for record in small_mean_rows]
    without_k[samples[0]]["k"] = ""
    result = bad(tmp_path, script, without_k)
    assert_usage_error(result, "--res-name")
    assert f"line {samples[0] + 2} " in result.stderr and "without a batch size k" in result.stderr
    two_thresholds = [dict(record) for record in small_mean_rows]
    two_thresholds[0]["k_min"] += 1
    assert_usage_error(bad(tmp_path, script, two_thresholds, name="kmin"), "--res-name")
    below = [dict(record, k_min=record["k_min"] + 1) for record in small_mean_rows]
    result = bad(tmp_path, script, below, name="below")
    assert_usage_error(result, "--res-name")
    assert "below k_min" in result.stderr
    lacking = [record for record in small_mean_rows if not (record["point"] == 1 and record["quantity"] == "spread")]
    result = bad(tmp_path, script, lacking, name="lacking")
    assert_usage_error(result, "--res-name")
    assert "point 1" in result.stderr and "spread" in result.stderr
    if script == "eps_delta.py":
        # GLA's Hölder formula is kept for the sum rule only.
        assert_usage_error(bad(tmp_path, script, small_mean_rows, "--method", "holder", name="holder"), "--method")


def test_composition_point_missing_at_a_checkpoint(tmp_path):
    rows = grad_norm_rows()
    del rows[8]
    result = bad(tmp_path, "renyi_per_instance_sum_compo.py", rows)
    assert_usage_error(result, "--res-name")
    assert "point 2" in result.stderr and "step 20" in result.stderr


def test_repeated_measurements(tmp_path):
    result = bad(tmp_path, "renyi_per_instance_sum_compo.py", grad_norm_rows() + grad_norm_rows(exp="renyi"))
    assert_usage_error(result, "--res-name")
    assert "line 20 " in result.stderr and "repeats line 2 " in result.stderr and "--filter exp=" in result.stderr

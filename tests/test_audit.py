"""The per-instance audit: its statistics by hand and against scipy, and audit.py on a tiny run."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch.nn.functional as F
from conftest import assert_usage_error, run_in_process, snapshot
from reference import reference_batch_means, reference_batch_sensitivities
from scipy.stats import beta, binom, binomtest

from perinstance.accounting import audit_bounds, exact_eps_delta
from perinstance.accounting.mechanism import Mechanism
from perinstance.audit import audit_simulation
from perinstance.measure import poisson_batches
from perinstance.train import runs, sampling, training
from perinstance.train.clipping import Transform
from perinstance.train.data import load_dataset

# psac: every point has its own Δ* (flat clipping gives Γ to most points this early).
RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--save-freq", "8", "--clipping", "psac", "--save-name", "tiny"]
DELTA = 1e-5


# --- Clopper–Pearson and the ε conversion --------------------------------------------------------

@pytest.mark.parametrize("successes, trials", [(0, 10), (1, 10), (5, 10), (10, 10), (3, 100000), (49_000, 100_000)])
def test_clopper_pearson_is_scipys_exact_interval(successes, trials):
    interval = binomtest(successes, trials).proportion_ci(confidence_level=0.95, method="exact")
    lower, upper = audit_bounds.clopper_pearson(successes, trials)
    assert lower == pytest.approx(interval.low, rel=1e-7, abs=1e-15)
    assert upper == pytest.approx(interval.high, rel=1e-7, abs=1e-15)


def test_clopper_pearson_covers_at_its_level():
    # Each end alone is a 97.5% one-sided bound: with p = 0.3 and n = 50, the exact probability
    # (summed over every outcome) that the lower end is above p is at most 2.5%.
    outcomes = np.arange(51)
    lower, upper = audit_bounds.clopper_pearson(outcomes, 50)
    weights = binom.pmf(outcomes, 50, 0.3)
    assert weights[lower > 0.3].sum() <= 0.025 and weights[upper < 0.3].sum() <= 0.025


def test_epsilon_conversion_by_hand():
    # TPR 0.5, FPR 0.05, δ 0.01: ε ≥ log(0.49/0.05).
    assert audit_bounds.epsilon_from_rates(0.5, 0.05, 0.01) == pytest.approx(math.log(9.8))
    assert audit_bounds.epsilon_from_rates(0.01, 0.001, 0.01) == 0  # nothing above δ: nothing proved
    assert audit_bounds.epsilon_from_rates(0.3, 0.4, 0.0) == 0  # a bad test proves only ε ≥ 0
    assert audit_bounds.epsilon_from_rates(0.2, 0.0, 1e-5) == np.inf
    # 500 of 1000 hits under P, 50 of 1000 under Q: the 2.5% lower end of one, the 97.5% upper end of the other.
    expected = math.log((beta.ppf(0.025, 500, 501) - 0.01) / beta.ppf(0.975, 51, 950))
    assert audit_bounds.epsilon_lower_bound(500, 50, 1000, 1000, 0.01) == pytest.approx(expected, rel=1e-9)
    assert expected < math.log(0.49 / 0.05)


def _gaussian_pair(mu, sample_rate, trials, seed, shift=0.0):
    """Scores of the 1-D subsampled Gaussian pair (accounting.md §3.3): (1−q)N(0,1) + qN(μ,1) vs N(0,1)."""
    rng = np.random.default_rng(seed)
    joined = rng.random(trials) < sample_rate
    return (rng.standard_normal(trials) + joined * mu + shift, rng.standard_normal(trials) + shift)


def test_audit_of_the_gaussian_pair_stays_below_the_exact_bound_and_catches_a_smaller_one():
    mu, sample_rate = 2.0, 0.05
    scores_in, scores_out = _gaussian_pair(mu, sample_rate, 400_000, 0)
    outcome = audit_bounds.audit_scores(scores_in, scores_out, DELTA)
    exact = exact_eps_delta.per_step_eps([[mu]], DELTA, sample_rate)[0]
    quarter = exact_eps_delta.per_step_eps([[mu / 4]], DELTA, sample_rate)[0]
    assert outcome.direction == "remove" and quarter < outcome.eps_lower <= exact
    assert outcome.eps_lower > 0.4 * exact  # a strong test: M = 4e5 trials get this close


def test_the_add_direction_is_found_when_it_is_the_one_that_leaks():
    # Mirror the pair: the law without x* is the mixture shifted down, so the lower tail
    # {T < τ} tells them apart, and it is the law Q that it favours (accounting.md §1 "add").
    scores_mixture, scores_plain = _gaussian_pair(-2.0, 0.05, 400_000, 1)
    outcome = audit_bounds.audit_scores(scores_plain, scores_mixture, DELTA)
    assert outcome.direction == "add"
    assert exact_eps_delta.per_step_eps([[0.5]], DELTA, 0.05)[0] < outcome.eps_lower <= \
        exact_eps_delta.per_step_eps([[2.0]], DELTA, 0.05)[0]


def test_the_threshold_is_chosen_on_the_first_half_and_counted_on_the_second():
    rng = np.random.default_rng(2)
    half = 50_000
    # First half: a perfect separation that a test chosen on it would exploit; second half: none.
    scores_in = np.concatenate([rng.normal(5, 1, half), rng.normal(0, 1, half)])
    scores_out = np.concatenate([rng.normal(0, 1, half), rng.normal(0, 1, half)])
    outcome = audit_bounds.audit_scores(scores_in, scores_out, DELTA)
    assert outcome.threshold in set(scores_out[:half]) | set(scores_in[:half])
    hits_in, hits_out = audit_bounds.event_counts(scores_in[half:], scores_out[half:], outcome.direction, outcome.threshold)
    assert (outcome.hits_in, outcome.hits_out, outcome.trials) == (hits_in, hits_out, half)
    assert outcome.eps_lower == audit_bounds.epsilon_lower_bound(hits_in, hits_out, half, half, DELTA)
    assert outcome.eps_lower < 0.1


def test_a_null_pair_proves_nothing():
    rng = np.random.default_rng(3)
    outcome = audit_bounds.audit_scores(rng.standard_normal(200_000), rng.standard_normal(200_000), DELTA)
    assert outcome.eps_lower < 0.05


# --- the statistic ------------------------------------------------------------------------------

def test_projected_release_by_hand():
    # Sum rule: Σ + own if joined, plus noise.
    np.testing.assert_allclose(audit_bounds.projected_release(np.array([1.0, 1.0]), np.array([3, 3]), np.array([True, False]),
                                                              0.5, np.array([0.1, 0.1]), "sum"), [1.6, 1.1])
    # Mean rule: (Σ + own)/(k + 1) if joined, Σ/k if not, 0 or own for an empty batch.
    released = audit_bounds.projected_release(np.array([3.0, 3.0, 0.0, 0.0]), np.array([3, 3, 0, 0]),
                                              np.array([True, False, True, False]), 1.0, 0.0, "mean")
    np.testing.assert_allclose(released, [1.0, 1.0, 1.0, 0.0])


def test_fisher_directions_solve_the_covariance():
    rng = np.random.default_rng(4)
    basis, _ = np.linalg.qr(rng.standard_normal((12, 3)))
    variances = np.array([5.0, 2.0, 0.5])
    targets = rng.standard_normal((4, 12))
    targets[2] = 0
    covariance = 0.3 * np.eye(12) + basis @ np.diag(variances) @ basis.T
    expected = np.linalg.solve(covariance, targets.T).T
    norms = np.linalg.norm(expected, axis=1, keepdims=True)
    expected = np.divide(expected, norms, out=np.zeros_like(expected), where=norms > 0)
    np.testing.assert_allclose(audit_bounds.fisher_directions(targets, basis, variances, 0.3), expected, atol=1e-12)
    # Fisher's direction has the best signal-to-noise ratio tᵀe / sqrt(eᵀΣe) of all directions.
    def ratio(direction):
        return targets[0] @ direction / math.sqrt(direction @ covariance @ direction)
    best = ratio(expected[0])
    assert all(ratio(rng.standard_normal(12)) < best for _ in range(200)) and ratio(targets[0]) < best


def test_spread_points_span_the_range():
    sensitivities = np.arange(100) / 100.0
    correct = np.ones(100, dtype=bool)
    correct[[5, 50, 95]] = False
    chosen = audit_bounds.spread_points(sensitivities, correct, 10)
    assert len(chosen) == 10 and set(chosen) >= {0, 99} and set(chosen) >= {5, 95}
    assert np.all(np.diff(chosen) > 0)
    assert len(audit_bounds.spread_points(sensitivities, correct, 500)) == 100


# --- exact Poisson batches ----------------------------------------------------------------------

@pytest.mark.parametrize("width", [None, 2])
def test_poisson_batches_are_independent_bernoulli_draws(width):
    count, size, rate = 20_000, 40, 0.3
    members, sizes = sampling.poisson_members(np.random.default_rng(5), count, size, rate, width=width)
    assert sizes.sum() == len(members) and members.min() >= 0 and members.max() < size
    mask = np.zeros((count, size), dtype=bool)
    mask[np.repeat(np.arange(count), sizes), members] = True
    assert mask.sum() == len(members)  # no index twice in a batch
    tolerance = 4.5 * math.sqrt(rate * (1 - rate) / count)
    assert np.all(np.abs(mask.mean(axis=0) - rate) < tolerance)
    assert abs((mask[:, 0] & mask[:, 1]).mean() - rate**2) < 4.5 * math.sqrt(rate**2 / count)
    assert abs(sizes.var() - size * rate * (1 - rate)) < 0.05 * size * rate * (1 - rate)


def test_memberships_find_each_points_row():
    members, sizes = np.array([0, 3, 5, 3, 1, 2]), np.array([3, 0, 1, 2])
    found = audit_simulation.memberships(members, sizes, np.array([3, -1, 1, 5]))
    expected = np.array([[True, False, False, True], [False] * 4, [True, False, False, False],
                         [False, False, True, False]])
    np.testing.assert_array_equal(found, expected)


@pytest.mark.parametrize("rule", ["sum", "mean"])
def test_simulated_releases_have_the_mechanisms_moments(rule):
    rng = np.random.default_rng(6)
    count, rate, std, trials = 300, 0.1, 0.4, 200_000
    projections = rng.normal(0.2, 0.5, (count, 2))
    own_rows = np.array([7, -1])  # a training point and one outside the training set
    own_values = np.array([projections[7, 0], 1.5])
    mechanism = Mechanism(noise_multiplier=std * (30 if rule == "mean" else 1), clip_bound=1.0, sample_rate=rate, batch_size=30, dataset_size=1000,
                          total_steps=1, rule=rule)
    scores_in, scores_out = audit_simulation.simulate_releases(projections, own_rows, own_values, mechanism, trials, 1, 2,
                                                      [7, 300])
    others = [np.delete(projections[:, 0], 7), projections[:, 1]]
    for column, values in enumerate(others):
        if rule == "sum":
            mean_out = rate * values.sum()
            var_out = rate * (1 - rate) * (values**2).sum() + std**2
            mean_in = mean_out + rate * own_values[column]
        else:
            # Batch sizes ~ Bin(n, q); given k ≥ 1, the mean of a uniform k-subset has mean ā.
            mean_out = values.mean() * (1 - (1 - rate) ** len(values))
            var_out = None
            sizes = np.arange(len(values) + 1)
            weights = binom.pmf(sizes, len(values), rate)
            mean_in = mean_out + rate * np.sum(weights * (own_values[column] - values.mean() * (sizes > 0))
                                               / (sizes + 1))
        spread = math.sqrt(scores_out[:, column].var() / trials)
        assert abs(scores_out[:, column].mean() - mean_out) < 5 * spread
        assert abs(scores_in[:, column].mean() - mean_in) < 5 * spread
        if var_out is not None:
            assert scores_out[:, column].var() == pytest.approx(var_out, rel=0.02)
    # The noise is the mechanism's: a known batch leaves exactly N(0, std²) without x*.
    _, known_out = audit_simulation.simulate_releases(projections, own_rows, own_values, mechanism, 50_000, 1, 2, [7, 300],
                                             known_batch=True)
    assert known_out.std() == pytest.approx(std, rel=0.02)


# --- audit.py on a tiny run ------------------------------------------------------------------------

def trained(tmp_path_factory, flags):
    """The models folder of a run trained with these train_dpsgd.py flags in a fresh folder."""
    folder = tmp_path_factory.mktemp("run")
    result = run_in_process("train_dpsgd.py", *flags, "--models-dir", folder / "models", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / "models"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return trained(tmp_path_factory, RUN)


@pytest.fixture
def audit_run(tmp_path, models):
    def run(*flags, name="out", check=True):
        result = run_in_process("audit.py", "--run", "tiny", "--models-dir", models, "--out", tmp_path / f"{name}.csv",
                                "--figure", tmp_path / f"{name}.png", *flags, cwd=tmp_path)
        if check:
            assert result.returncode in (0, 1), result.stderr
        path = tmp_path / f"{name}.csv"
        return result, (pd.read_csv(path) if path.exists() else None)
    return run


def reference_norms(models, points, step):
    """Δ* = ||h(g*)|| by one forward/backward per point (tests/reference.py), and the model."""
    run_dir = models / "tiny"
    metadata = runs.load_run(run_dir)
    model, _ = training.load_model(metadata, run_dir, step)
    dataset = load_dataset("synthetic")
    singles = reference_batch_means(model, dataset.train_x, dataset.train_y, Transform.of_run(metadata),
                                    [[point] for point in points])
    return metadata, model, dataset, np.linalg.norm(singles, axis=1)


def test_sum_rule_audit_holds_and_its_upper_bound_is_the_accountants(audit_run, models, tmp_path):
    result, rows = audit_run("--spread", "6", "--trials", "200000")
    assert result.returncode == 0 and (tmp_path / "out.png").exists()
    assert len(rows) == 6 and set(rows["step"]) == {16} and set(rows["upper_kind"]) == {"exact"}
    assert (rows["eps_lower"] <= rows["eps_upper"]).all() and (rows["violated"] == 0).all()
    assert (rows["eps_lower"] > 0).any()  # the audit has power: it proves something
    metadata, model, dataset, norms = reference_norms(models, rows["point"], 16)
    np.testing.assert_allclose(rows["sensitivity"], norms, rtol=1e-5)
    noise_std = metadata.noise_multiplier * metadata.clip_bound
    expected = exact_eps_delta.per_step_eps(norms[:, None] / noise_std, DELTA, metadata.sample_rate)
    np.testing.assert_allclose(rows["eps_upper"], expected, rtol=1e-5)
    np.testing.assert_allclose(rows["ratio"], rows["eps_lower"] / rows["eps_upper"])
    points = rows["point"].to_list()
    inputs, labels = dataset.train_x[points], dataset.train_y[points]
    logits = model(inputs)
    np.testing.assert_allclose(rows["loss"], F.cross_entropy(logits, labels, reduction="none").detach().numpy(),
                               rtol=1e-5)
    np.testing.assert_array_equal(rows["correct"], (logits.argmax(1) == labels).int().numpy())
    np.testing.assert_array_equal(rows["label"], labels.numpy())
    assert "violated (eps_lower > eps_upper): 0 of 6" in result.stdout
    assert "against the sum rule's accounting" not in result.stdout  # the gap is the mean rule's


def test_a_too_small_upper_bound_is_flagged(audit_run, monkeypatch):
    # Hand the audit the accountant's bound for Δ*/4 instead of Δ*: it must prove that bound wrong.
    exact = exact_eps_delta.per_step_eps
    monkeypatch.setattr(audit_simulation.exact_eps_delta, "per_step_eps", lambda mu, *args, **kw: exact(mu / 4, *args, **kw))
    result, rows = audit_run("--points", "0-3", "--trials", "200000")
    assert result.returncode == 1 and (rows["violated"] == 1).all()
    assert (rows["eps_lower"] > rows["eps_upper"]).all()
    assert "violated (eps_lower > eps_upper): 4 of 4 — these upper bounds are WRONG" in result.stdout


def test_mean_rule_audit_holds(audit_run):
    result, rows = audit_run("--rule", "mean", "--points", "0-3", "--trials", "100000", "--upper-batches", "300")
    assert result.returncode == 0 and set(rows["upper_kind"]) == {"estimate"} and set(rows["rule"]) == {"mean"}
    assert (rows["eps_lower"] <= rows["eps_upper"]).all()


def test_mean_rule_sensitivities_are_the_reference_ones(models):
    run = runs.open_run(str(models / "tiny"), "unused", "./data")
    metadata, model, dataset, _ = reference_norms(models, [0], 8)
    transform = Transform.of_run(metadata)
    points = np.array([3, 10])
    rows, audited = audit_simulation.audited_gradients(run, model, transform, points, None, "cpu", None)
    members, sizes = sampling.poisson_members(np.random.default_rng(7), 4, len(run.train_y), 0.05)
    batches = np.split(members, np.cumsum(sizes)[:-1])
    # As the audit's upper bound takes them: two batches per pass over the rows.
    values = poisson_batches.batch_sensitivities(rows, audited.point_gradients(),
                                                 sampling.members_mask(members, sizes, len(run.train_y)),
                                                 most_per_pass=2)
    for row, point in enumerate(points):
        expected = reference_batch_sensitivities(model, dataset.train_x, dataset.train_y, transform, point,
                                                 [batch[batch != point] for batch in batches])
        np.testing.assert_allclose(values[row], expected, rtol=1e-4)


def test_known_batch_adversary_and_whitening_are_stronger_than_the_plain_projection(audit_run):
    outcomes = {statistic: audit_run("--points", "0-3", "--trials", "100000", "--statistic", statistic,
                                     name=statistic)[1]["eps_lower"]
                for statistic in ("projection", "whitened", "known-batch")}
    assert outcomes["projection"].mean() < outcomes["whitened"].mean() < outcomes["known-batch"].mean()


def test_a_points_result_does_not_depend_on_the_points_beside_it(audit_run, tmp_path):
    _, together = audit_run("--points", "2", "9", "--trials", "20000", "--stage", "0.5", name="together")
    _, alone = audit_run("--points", "9", "--trials", "20000", "--stage", "0.5", name="alone")
    pd.testing.assert_frame_equal(together[together["point"] == 9].reset_index(drop=True), alone)
    audit_run("--points", "2", "9", "--trials", "20000", "--stage", "0.5", name="again")
    assert (tmp_path / "again.csv").read_bytes() == (tmp_path / "together.csv").read_bytes()


BAD_INPUTS = [
    (["--points", "0", "--trials", "10"], "--trials"),
    (["--points", "0", "--delta", "0"], "--delta"),
    (["--points", "0", "--delta", "1.5"], "--delta"),
    (["--points", "0", "--upper-batches", "0"], "--upper-batches"),
    (["--spread", "0"], "--spread"),
    (["--points", "600"], "--points"),
    (["--points", "0", "--stage", "late"], "--stage"),
    (["--points", "0", "--statistic", "oracle"], "--statistic"),
    (["--points", "0", "--rule", "median"], "--rule"),
]


def test_outputs_in_missing_folders_create_them_and_a_file_in_the_way_is_refused(audit_run, tmp_path):
    out, figure = tmp_path / "new" / "deeper" / "a.csv", tmp_path / "figs" / "a.png"
    audit_run("--points", "0", "--trials", "1000", "--out", out, "--figure", figure)
    assert len(pd.read_csv(out)) == 1 and figure.exists()
    (tmp_path / "notes.txt").write_text("the user's\n")
    before = snapshot(tmp_path)
    for flag in ("--out", "--figure"):
        result, _ = audit_run("--points", "0", "--trials", "1000", flag, tmp_path / "notes.txt" / "a.csv",
                              check=False)
        assert_usage_error(result, flag)
        assert "notes.txt is a file" in result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flags, flag", BAD_INPUTS, ids=[" ".join(flags) for flags, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_writes_nothing(audit_run, tmp_path, flags, flag):
    before = snapshot(tmp_path)
    result, _ = audit_run(*flags, check=False)
    assert_usage_error(result, flag)
    assert snapshot(tmp_path) == before


def test_missing_and_non_private_runs_are_refused(models, tmp_path):
    result = run_in_process("audit.py", "--run", "nosuch", "--models-dir", models, "--points", "0", cwd=tmp_path)
    assert_usage_error(result, "--run")
    shutil.copytree(models / "tiny", tmp_path / "public")
    metadata = json.loads((tmp_path / "public" / "run.json").read_text())
    metadata.update(dp=0, noise_multiplier=0.0)
    (tmp_path / "public" / "run.json").write_text(json.dumps(metadata))
    result = run_in_process("audit.py", "--run", tmp_path / "public", "--points", "0", cwd=tmp_path)
    assert_usage_error(result, "--run")
    assert "no privacy to audit" in result.stderr


# --- the realised-size mean rule against the sum rule's accounting (docs/audit.md §1) -------------

def test_gap_summary_by_hand():
    mechanism = Mechanism(noise_multiplier=1.0, clip_bound=1.0, sample_rate=4 / 64, batch_size=4, dataset_size=64,
                          total_steps=32, rule="mean")
    sum_rule = exact_eps_delta.per_step_eps([[1.0]], DELTA, 4 / 64)[0]
    # Evaluation halves of 500 trials (trials − ⌊trials/2⌋) with these event counts.
    hits_in, hits_out = np.array([10, 400, 500, 100]), np.array([10, 2, 0, 30])
    rows = pd.DataFrame({"step": [0, 0, 0, 8], "rule": "mean", "eps_lower": [0.0, 2.0, 20.0, 1.0],
                         "eps_upper": [4.0, 13.0, 13.0, 5.0], "trials": 1000, "delta": DELTA,
                         "tpr": hits_in / 500, "fpr": hits_out / 500, "confidence": 0.95})
    summary = audit_simulation.gap_summary(rows, mechanism)
    assert set(summary) == {0, 8}
    first = summary[0]
    assert first["sum_rule_eps"] == pytest.approx(sum_rule, rel=1e-12)
    assert first["mean_baseline_eps"] == pytest.approx(mechanism.per_step_baseline_eps(DELTA)[0], rel=1e-12)
    assert (first["above_sum_rule"], first["above_baseline"], first["points"]) == (2, 1, 3)
    assert (first["median_lower"], first["max_lower"], first["median_upper"]) == (2.0, 20.0, 13.0)
    assert (summary[8]["above_sum_rule"], summary[8]["above_baseline"]) == (0, 0)
    # Jointly: each of the 3 points of step 0 at 1 − 0.05/3 (each end at 1 − 0.025/3), by scipy's beta.
    tail = 0.05 / 3 / 2
    joint = np.log((beta.ppf(tail, hits_in[:3], 500 - hits_in[:3] + 1) - DELTA)
                   / beta.ppf(1 - tail, hits_out[:3] + 1, 500 - hits_out[:3]))
    joint = np.where(np.isfinite(joint), np.maximum(joint, 0.0), 0.0)
    assert first["median_lower_jointly"] == pytest.approx(np.median(joint), rel=1e-9)
    assert first["above_sum_rule_jointly"] == (joint > sum_rule).sum() == 2
    with pytest.raises(ValueError, match="the mean rule's"):
        audit_simulation.gap_summary(rows.assign(rule="sum"), mechanism)


# N = 64, B_exp = 4, σ = 1: x* alone in its batch (probability q·(1 − q)^63 ≈ 1e-3) releases h*
# against noise σΓ/B_exp; test_mean_rule.py has the exact one-step ε of this setting.
GAP_RUN = ["--dataset", "first:64:synthetic", "--model", "mlp", "--reduction", "mean", "--batch-size", "4",
           "--sigma", "1", "--epochs", "0.5", "--lr", "0.5", "--save-name", "gap"]


@pytest.fixture(scope="module")
def gap_models(tmp_path_factory):
    return trained(tmp_path_factory, GAP_RUN)


def gap_audit(models, tmp_path):
    result = run_in_process("audit.py", "--run", "gap", "--models-dir", models, "--points", "0-7", "--stage", "initial",
                            "--trials", "200000", "--out", tmp_path / "gap.csv", "--figure", tmp_path / "gap.png",
                            cwd=tmp_path)
    return result, pd.read_csv(tmp_path / "gap.csv")


def test_the_audit_catches_the_mean_rule_above_the_sum_rules_accounting(gap_models, tmp_path):
    result, rows = gap_audit(gap_models, tmp_path)
    assert result.returncode == 0, result.stderr
    mechanism = Mechanism.of_run(runs.load_run(gap_models / "gap"))
    [gap] = audit_simulation.gap_summary(rows, mechanism).values()
    assert gap["sum_rule_eps"] == pytest.approx(exact_eps_delta.per_step_eps([[1.0]], DELTA, 4 / 64)[0], rel=1e-12)
    assert (gap["k_min"], gap["delta_size"], gap["points"], gap["trials"]) == (0, 0.0, 8, 200_000)
    # Every bound holds; most points prove more than the sum rule's accounting allows.
    assert (rows["eps_lower"] <= rows["eps_upper"]).all() and gap["above_baseline"] == 0
    assert gap["above_sum_rule"] >= 6 and gap["median_lower"] > gap["sum_rule_eps"]
    assert gap["above_sum_rule"] == (rows["eps_lower"] > gap["sum_rule_eps"]).sum()
    assert gap["above_sum_rule_jointly"] <= gap["above_sum_rule"]
    assert (f"eps_lower above it for {gap['above_sum_rule']} of 8 points ({gap['above_sum_rule_jointly']} with all "
            "bounds holding together, Bonferroni) — the realised-size mean rule leaks more than the sum rule's "
            "accounting says") in result.stdout
    assert "mean rule's own baseline (one step: eps 16.13, k_min=0" in result.stdout


def test_a_mean_rule_baseline_below_the_audit_is_flagged(gap_models, tmp_path, monkeypatch):
    # Hand the audit a hundredth of the mean rule's baseline: it must prove that baseline wrong.
    exact = Mechanism.per_step_baseline_eps

    def too_small(self, *args, **kwargs):
        eps, k_min, delta_size = exact(self, *args, **kwargs)
        return (eps / 100 if self.rule == "mean" else eps), k_min, delta_size

    monkeypatch.setattr(Mechanism, "per_step_baseline_eps", too_small)
    result, rows = gap_audit(gap_models, tmp_path)
    assert result.returncode == 1 and (rows["violated"] == 0).all()
    assert "— that baseline is WRONG" in result.stdout

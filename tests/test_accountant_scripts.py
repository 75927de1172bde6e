"""The four accountant scripts end to end on small synthetic result CSVs, and their bad inputs."""

import math
import os

import numpy as np
import pandas as pd
import pytest
from conftest import assert_usage_error, run_script, snapshot

from perinstance import accounting
from perinstance.results import COLUMNS

SIGMA, CLIP, RATE, BATCH, SIZE, STEPS = 1.2, 2.0, 0.02, 20, 1000, 60


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


MEAN = dict(exp="eps_delta", reduction="mean", update_rule="mean", noise_std=SIGMA * CLIP / BATCH,
            quantity="batch_sensitivity")


def batch_rows():
    """Point p has 4 + p batch samples (a ragged sample count)."""
    rng = np.random.default_rng(1)
    return [row(step=step, point=point, sample=sample, value=rng.uniform(0, 0.2), correct=point % 2, **MEAN)
            for step in (0, 30) for point in range(4) for sample in range(4 + point)]


def renyi_rows(directions=("remove", "add")):
    rng = np.random.default_rng(2)
    values = dict(MEAN, exp="renyi", quantity="renyi_statistic")
    return [row(step=step, point=point, direction=direction, alpha=alpha, target_batch=target, sample=sample,
                value=rng.normal(-0.002, 0.002) * alpha * (alpha - 1), correct=point % 2, **values)
            for step in (0, 30) for point in range(3) for direction in directions for alpha in (2, 4)
            for target in range(3) for sample in range(5)]


@pytest.fixture
def results(tmp_path):
    """Writes res/<name>.csv under tmp_path (the scripts' working directory)."""
    return lambda name, rows: write(os.path.join(tmp_path, "res", f"{name}.csv"), rows)


def output(tmp_path, name):
    return pd.read_csv(os.path.join(tmp_path, "res", f"{name}.csv"))


# --- end to end -----------------------------------------------------------------------------

def test_eps_delta_sum_rule(tmp_path, run, results):
    results("toy", grad_norm_rows())
    result = run("eps_delta.py", "--res-name", "toy")
    assert result.returncode == 0, result.stderr
    frame = output(tmp_path, "toy_eps_delta")
    assert list(frame.columns) == ["point", "step", "reduction", "eps", "baseline_eps", "delta"]
    assert len(frame) == 18 and set(frame["reduction"]) == {"sum"}
    for record in frame.itertuples():
        expected = accounting.eps_delta_holder([norm_of(record.point, record.step)], SIGMA * CLIP, RATE, 1e-5, 1e4)
        assert record.eps == pytest.approx(float(expected), rel=1e-8)
    assert frame.loc[frame["point"] == 1, "eps"].max() < 1e-3  # Δ* = 0: only the Hölder term remains
    assert np.allclose(frame["baseline_eps"], accounting.baseline_eps_delta(SIGMA, RATE, 1e-5))
    assert "summary" in result.stdout and "misclassified" in result.stdout


def test_eps_delta_mean_rule_ragged_samples(tmp_path, run, results):
    rows = batch_rows()
    results("mean", rows)
    result = run("eps_delta.py", "--res-name", "mean", "--holder-p", "inf", "--gaussian", "classic", "--delta", "1e-6")
    assert result.returncode == 0, result.stderr
    frame = output(tmp_path, "mean_eps_delta")
    assert set(frame["reduction"]) == {"mean"} and len(frame) == 8
    samples = pd.DataFrame(rows)
    for record in frame.itertuples():
        mine = samples[(samples["point"] == record.point) & (samples["step"] == record.step)]["value"]
        assert len(mine) == 4 + record.point
        expected = accounting.eps_delta_holder(mine.to_numpy(), SIGMA * CLIP / BATCH, RATE, 1e-6, math.inf, "classic")
        assert record.eps == pytest.approx(float(expected), rel=1e-8)
    assert np.allclose(frame["delta"], 1e-6)


def test_renyi_sum_rule(tmp_path, run, results):
    results("toy", grad_norm_rows())
    result = run("renyi_per_instance_sum.py", "--res-name", "toy", "--alpha", "2", "8.5")
    assert result.returncode == 0, result.stderr
    frame = output(tmp_path, "toy_renyi_per_instance_sum")
    assert list(frame.columns) == ["point", "step", "alpha", "rdp", "baseline_rdp"]
    assert len(frame) == 36
    for record in frame.itertuples():
        expected = accounting.rdp_sum_rule([norm_of(record.point, record.step)], CLIP, SIGMA, RATE, [record.alpha])
        assert record.rdp == pytest.approx(float(expected[0, 0]), rel=1e-8)
    assert np.all(frame.loc[frame["point"] == 1, "rdp"] == 0)
    worst = frame[frame["point"] == 0]
    np.testing.assert_allclose(worst["rdp"], worst["baseline_rdp"], rtol=1e-8)


def test_renyi_mean_rule_directions_and_aggregates(tmp_path, run, results):
    rows = pd.DataFrame(renyi_rows())
    results("renyi", rows.to_dict("records"))
    assert run("renyi_per_instance_mean.py", "--res-name", "renyi", "--alpha", "2", "4").returncode == 0
    joint = output(tmp_path, "renyi_renyi_per_instance_mean")
    assert list(joint.columns) == ["point", "step", "alpha", "direction", "rdp", "baseline_rdp", "aggregate"]
    assert set(joint["direction"]) == {"remove", "add", "max"} and set(joint["aggregate"]) == {"joint"}
    noise_std = SIGMA * CLIP / BATCH
    for record in joint[joint["direction"] != "max"].itertuples():
        mine = rows[(rows["point"] == record.point) & (rows["step"] == record.step)
                    & (rows["direction"] == record.direction) & (rows["alpha"] == record.alpha)]
        assert record.rdp == pytest.approx(accounting.rdp_mean_rule(mine["value"], noise_std, record.alpha), rel=1e-8)
    pivot = joint.pivot_table(index=["point", "step", "alpha"], columns="direction", values="rdp")
    np.testing.assert_allclose(pivot["max"], np.maximum(pivot["remove"], pivot["add"]))
    np.testing.assert_allclose(joint["baseline_rdp"], accounting.rdp_sgm(RATE, SIGMA, joint["alpha"].to_numpy()))

    result = run("renyi_per_instance_mean.py", "--res-name", "renyi", "--alpha", "2", "4", "--aggregate", "per-target",
                 "--out", "per_target.csv")
    assert result.returncode == 0 and "NOT an upper bound" in result.stderr
    per_target = pd.read_csv(tmp_path / "per_target.csv")
    assert set(per_target["aggregate"]) == {"per-target (not an upper bound)"}
    assert np.all(per_target["rdp"].to_numpy() <= joint["rdp"].to_numpy() + 1e-12)


def test_renyi_mean_rule_one_direction(tmp_path, run, results):
    results("renyi", renyi_rows(directions=("remove",)))
    result = run("renyi_per_instance_mean.py", "--res-name", "renyi", "--alpha", "2")
    assert result.returncode == 0 and "only one direction" in result.stderr
    assert set(output(tmp_path, "renyi_renyi_per_instance_mean")["direction"]) == {"remove"}


def compo(run, tmp_path, name, *flags):
    result = run("renyi_per_instance_sum_compo.py", "--res-name", name, "--alpha", "2", "4", "8", "16", "32", *flags,
                 "--out", f"{name}{'_'.join(flags)}.csv")
    assert result.returncode == 0, result.stderr
    return pd.read_csv(tmp_path / f"{name}{'_'.join(flags)}.csv").set_index("point"), result


def test_composition_worst_case_is_the_baseline(tmp_path, run, results):
    results("worst", [row(step=step, point=point, value=CLIP) for step in (0, 30) for point in range(3)])
    frame, result = compo(run, tmp_path, "worst", "--holder-p", "inf")
    assert list(frame.reset_index().columns) == ["point", "eps", "order", "baseline_eps", "delta", "steps"]
    np.testing.assert_allclose(frame["eps"], frame["baseline_eps"], rtol=1e-10)
    assert set(frame["steps"]) == {STEPS}
    # The default b = 3T with one run only inflates the orders (and says so).
    default, result = compo(run, tmp_path, "worst")
    assert np.all(default["eps"] >= frame["eps"]) and "--holder-p inf" in result.stderr


def test_composition_per_step_norms_equal_checkpoints(tmp_path, run, results):
    # Norms constant between checkpoints: a file with every step gives the same bound.
    checkpoints = [row(step=step, point=point, value=norm_of(point, step))
                   for step in (0, 20, 40) for point in range(4)]
    every_step = [row(step=step, point=point, value=norm_of(point, step // 20 * 20))
                  for step in range(STEPS) for point in range(4)]
    results("checkpoints", checkpoints)
    results("every_step", every_step)
    for flags in [("--holder-p", "inf"), ("--holder-p", "3T")]:
        sparse, _ = compo(run, tmp_path, "checkpoints", *flags)
        dense, _ = compo(run, tmp_path, "every_step", *flags)
        np.testing.assert_allclose(dense["eps"], sparse["eps"], rtol=1e-8)
    assert sparse.loc[1, "eps"] < sparse.loc[2, "eps"] < sparse.loc[0, "eps"]


def test_composition_without_step_zero_uses_worst_case(tmp_path, run, results):
    late = [row(step=step, point=point, value=0.0) for step in (10, 40) for point in range(2)]
    results("late", late)
    results("early", [row(step=0, point=point, value=CLIP) for point in range(2)] + late)
    frame, result = compo(run, tmp_path, "late", "--holder-p", "inf")
    assert "no checkpoint at step 0" in result.stderr
    early, _ = compo(run, tmp_path, "early", "--holder-p", "inf")
    # Steps 1..10 at Γ in both files, zero cost afterwards.
    np.testing.assert_allclose(frame["eps"], early["eps"], rtol=1e-8)
    assert np.all(frame["eps"] < frame["baseline_eps"])


def test_composition_several_runs(tmp_path, run, results):
    rows = grad_norm_rows(steps=(0, 20, 40), run="a", seed=0) + grad_norm_rows(steps=(0, 30), run="bb", seed=1)
    results("runs", rows)
    both, result = compo(run, tmp_path, "runs", "--holder-p", "inf")
    assert "2 run(s)" in result.stdout
    single = [compo(run, tmp_path, "runs", "--holder-p", "inf", "--filter", f"run={name}")[0] for name in ("a", "bb")]
    # b = ∞ takes the max over runs at every step: at least each run's own bound.
    assert np.all(both["eps"] >= np.maximum(single[0]["eps"], single[1]["eps"]) - 1e-12)
    finite, _ = compo(run, tmp_path, "runs", "--holder-p", "100")
    assert np.all(np.isfinite(finite["eps"]))
    exact, _ = compo(run, tmp_path, "runs", "--holder-p", "inf", "--rounding", "0")
    assert np.all(exact["eps"] <= both["eps"] + 1e-12)


def test_filter_points_and_default_output(tmp_path, run):
    rows = grad_norm_rows() + grad_norm_rows(sigma=2.0, noise_std=2.0 * CLIP)
    source = write(os.path.join(tmp_path, "data", "mixed.csv"), rows)
    result = run("eps_delta.py", "--res-file", source, "--filter", "sigma=1.2", "--points", "2-4",
                 "--filter", "step=20")
    assert result.returncode == 0, result.stderr
    frame = pd.read_csv(tmp_path / "data" / "mixed_eps_delta.csv")
    assert list(frame["point"]) == [2, 3, 4] and set(frame["step"]) == {20}


# --- bad input: one line, exit 2, nothing written -------------------------------------------

def bad(tmp_path, script, rows, *flags, name="toy"):
    if rows is not None:
        write(os.path.join(tmp_path, "res", f"{name}.csv"), rows)
    before = snapshot(tmp_path)
    result = run_script(script, "--res-name", name, *flags, cwd=tmp_path)
    assert snapshot(tmp_path) == before, "a file was written or changed"
    return result


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
    assert "renyi_statistic" in result.stderr and "compute_sensitivity.py" in result.stderr


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
    ("eps_delta.py", ["--holder-p", "1"], "--holder-p"),
    ("renyi_per_instance_sum_compo.py", ["--holder-p", "0.01T"], "--holder-p"),
    ("renyi_per_instance_sum_compo.py", ["--holder-p", "1.01"], "--holder-p"),  # orders explode
    ("renyi_per_instance_sum_compo.py", ["--holder-p", "lots"], "--holder-p"),
    ("renyi_per_instance_sum_compo.py", ["--rounding", "2"], "--rounding"),
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


def test_mean_rule_bad_rows(tmp_path):
    rows = renyi_rows()
    rows[4]["direction"] = "sideways"
    result = bad(tmp_path, "renyi_per_instance_mean.py", rows)
    assert_usage_error(result, "--res-name")
    assert "line 6 " in result.stderr and "sideways" in result.stderr
    result = bad(tmp_path, "renyi_per_instance_mean.py", renyi_rows(), "--alpha", "3", name="other")
    assert_usage_error(result, "--alpha")


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

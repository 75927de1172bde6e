"""compute_sensitivity.py end to end on a tiny synthetic run, and its bad inputs."""

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_usage_error, run_in_process, run_script, snapshot
from reference import reference_batch_means, reference_batch_sensitivities, reference_renyi_statistics

from perinstance.accounting import batch_sizes
from perinstance.cli import options
from perinstance.files import results
from perinstance.measure import coupling, measurement
from perinstance.measure.gradient_rows import transformed_norms
from perinstance.measure.poisson_batches import Pool
from perinstance.train import runs, training
from perinstance.train.clipping import Transform
from perinstance.train.data import load_dataset
from perinstance.train.sampling import RENYI_SET_KEY, RENYI_TARGET_KEY

# psac: every point's Δ* differs (flat clipping would give C for most of them).
RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--save-freq", "8", "--clipping", "psac"]
STEPS = [0, 8, 16]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A models folder with the sum- and mean-rule runs, trained by compute_sensitivity.py itself."""
    folder = tmp_path_factory.mktemp("shared")
    for reduction in ("sum", "mean"):
        result = run_in_process("compute_sensitivity.py", *RUN, "--reduction", reduction, "--points", "0",
                                "--num-batches", "64", "--res-name", f"first_{reduction}", "--models-dir",
                                folder / "models", cwd=folder)
        assert result.returncode == 0, result.stderr
    return str(folder / "models")


@pytest.fixture
def measure(tmp_path, models):
    """Run compute_sensitivity.py in tmp_path on the shared runs; returns (result, rows)."""
    def run(*flags, res_name="out", check=True):
        result = run_in_process("compute_sensitivity.py", *RUN, "--models-dir", models, "--res-name", res_name, *flags,
                                cwd=tmp_path)
        if check:
            assert result.returncode == 0, result.stderr
        path = tmp_path / "res" / f"{res_name}.csv"
        return result, (pd.read_csv(path, keep_default_na=False, na_values=[""]) if path.exists() else None)
    return run


def checkpoint(models, run, step):
    """The run's metadata, model at `step` and checkpoint payload."""
    run_dir = os.path.join(models, run)
    metadata = runs.load_run(run_dir)
    return metadata, *training.load_model(metadata, run_dir, step)


def test_sum_rule_rows_are_the_points_norms_at_each_checkpoint(measure, models):
    result, rows = measure("--reduction", "sum", "--points", "0-9", "--stage", "all")
    assert list(rows.columns) == results.COLUMNS
    assert len(rows) == 10 * len(STEPS) and sorted(set(rows["step"])) == STEPS
    assert set(rows["quantity"]) == {"grad_norm"} and set(rows["direction"]) == {"none"}
    assert rows["alpha"].isna().all() and (rows["target_batch"] == 0).all() and (rows["sample"] == 0).all()
    assert (rows["value"] <= rows["clip_bound"]).all()
    np.testing.assert_allclose(rows["noise_std"], rows["sigma"] * rows["clip_bound"])
    np.testing.assert_allclose(rows["stage"], rows["step"] / 16)
    dataset = load_dataset("synthetic")
    metadata, model, payload = checkpoint(models, rows["run"][0], 8)
    mine = rows[rows["step"] == 8].sort_values("point")
    transform = Transform.of_run(metadata)
    singles = reference_batch_means(model, dataset.train_x, dataset.train_y, transform,
                                    [[point] for point in range(10)])
    np.testing.assert_allclose(mine["value"], np.linalg.norm(singles, axis=1), rtol=1e-5)
    logits = model(dataset.train_x[:10])
    np.testing.assert_allclose(mine["loss"], F.cross_entropy(logits, dataset.train_y[:10], reduction="none")
                               .detach().numpy(), rtol=1e-6)
    np.testing.assert_array_equal(mine["correct"], (logits.argmax(1) == dataset.train_y[:10]).int().numpy())
    np.testing.assert_array_equal(mine["label"], dataset.train_y[:10].numpy())
    assert (mine["accuracy"] == payload["test_accuracy"]).all()
    assert "10 points × 3 stages" in result.stdout and "30 rows written" in result.stdout


def drawn_batches(plan, point):
    """{(block, sample): index list} of the draws of `plan` that `point` keeps (its prefix misses it)."""
    kept = {}
    for block in range(plan.blocks):
        sample = 0
        for index in range(plan.permutations):
            permutation = plan.permutation(block, index, 512)
            for size in plan.sizes:
                if point not in permutation[:size]:
                    kept[block, sample] = permutation[:size]
                    sample += 1
    return kept


def test_mean_rule_coupling_rows_match_the_reference(measure, models):
    _, rows = measure("--reduction", "mean", "--exp", "eps_delta", "--points", "3", "7", "--stage", "final",
                      "--num-batches", "300", "--mc-seed", "5")
    assert list(rows.columns) == results.COLUMNS and (rows["step"] == 16).all()
    assert set(rows["exp"]) == {"coupling"} and (rows["mc_seed"] == 5).all() and set(rows["direction"]) == {"none"}
    assert set(rows["update_rule"]) == {"mean"} and set(rows["reduction"]) == {"mean"}
    np.testing.assert_allclose(rows["noise_std"], rows["sigma"] * rows["clip_bound"] / 32)
    metadata, model, _ = checkpoint(models, rows["run"][0], 16)
    # accounting.md §3.4: k_min from δ_size = δ/(10·T), n = N − 1.
    plan = coupling.coupling_plan(5, 16, 511, 32 / 512, 1e-5 / 160, 300, 4, 32)
    assert plan.k_min == batch_sizes.size_threshold(511, 32 / 512, 1e-5 / 160) > 0
    assert (rows["k_min"] == plan.k_min).all()
    dataset = load_dataset("synthetic")
    transform = Transform.of_run(metadata)
    h = reference_batch_means(model, dataset.train_x, dataset.train_y, transform, [[index] for index in range(512)])
    for point in (3, 7):
        mine = rows[rows["point"] == point]
        statistics = mine[mine["quantity"] != "batch_sensitivity"].set_index("quantity")["value"]
        others = np.delete(h, point, axis=0)
        mean_x = others.mean(axis=0)
        np.testing.assert_allclose(statistics["center_distance"], np.linalg.norm(h[point] - mean_x), rtol=1e-5)
        np.testing.assert_allclose(statistics["spread"], np.mean(np.sum((others - mean_x) ** 2, axis=1)), rtol=1e-5)
        assert statistics["max_deviation"] >= np.max(np.linalg.norm(others - mean_x, axis=1)) * (1 - 1e-6)
        samples = mine[mine["quantity"] == "batch_sensitivity"]
        kept = drawn_batches(plan, point)
        assert len(samples) == len(kept) and plan.draws >= 300
        assert {(int(block), int(sample)) for block, sample in zip(samples["block"], samples["sample"])} == set(kept)
        np.testing.assert_array_equal(samples["k"], [len(kept[int(b), int(s)]) for b, s in
                                                     zip(samples["block"], samples["sample"])])
        checked = samples.iloc[::25]
        reference = reference_batch_sensitivities(
            model, dataset.train_x, dataset.train_y, transform, point,
            [kept[int(block), int(sample)] for block, sample in zip(checked["block"], checked["sample"])])
        np.testing.assert_allclose(checked["value"], reference, rtol=1e-4)
    # Δ_B <= 2Γ/(k+1) <= Γ; the dataset statistics are distances between transformed gradients (up to 2Γ).
    assert (rows["value"] >= 0).all() and (rows["value"] <= 2 * rows["clip_bound"]).all()
    samples = rows[rows["quantity"] == "batch_sensitivity"]
    assert (samples["value"] <= 2 * samples["clip_bound"] / (samples["k"] + 1)).all()


def test_renyi_mean_rows_match_the_reference(measure, models):
    _, rows = measure("--reduction", "mean", "--exp", "renyi", "--estimator", "jensen", "--points", "5", "--stage",
                      "0.6", "--alpha", "3", "--num-iters", "2", "--num-batches", "3")
    assert set(rows["exp"]) == {"jensen"} and (rows["mc_seed"] == 0).all()
    assert len(rows) == 2 * 2 * 3 and set(rows["direction"]) == {"remove", "add"}
    assert (rows["alpha"] == 3).all() and (rows["step"] == 8).all()
    metadata, model, _ = checkpoint(models, rows["run"][0], 8)
    dataset = load_dataset("synthetic")
    pool = Pool(0, 8, 512, metadata.sample_rate, np.arange(512))
    target = np.flatnonzero(pool.draw(1, RENYI_TARGET_KEY, 1)[0])
    sets = [[np.flatnonzero(mask) for mask in pool.draw(3, RENYI_SET_KEY, 1, key)] for key in range(3)]
    without_point = [[batch[batch != 5] for batch in batches] for batches in sets]
    expected = reference_renyi_statistics(model, dataset.train_x, dataset.train_y, Transform.of_run(metadata),
                                          target, without_point)
    mine = rows[(rows["direction"] == "add") & (rows["target_batch"] == 1)].sort_values("sample")
    np.testing.assert_allclose(mine["value"], expected, rtol=1e-4)


def test_less_point_run_measures_the_left_out_point_by_its_full_dataset_index(measure, models):
    _, rows = measure("--reduction", "sum", "--less-point", "3", "--points", "2-4", "--stage", "final")
    dataset = load_dataset("synthetic")
    assert list(rows["point"]) == [2, 3, 4] and rows["run"][0].startswith("synthetic_mlp_sum_psac_eps10_bs32_seed0_less3")
    np.testing.assert_array_equal(rows["label"], dataset.train_y[2:5].numpy())
    assert set(rows["dataset_size"]) == {511}
    metadata, model, _ = checkpoint(models, rows["run"][0], 16)
    singles = reference_batch_means(model, dataset.train_x, dataset.train_y, Transform.of_run(metadata),
                                    [[2], [3], [4]])
    np.testing.assert_allclose(rows["value"], np.linalg.norm(singles, axis=1), rtol=1e-5)


def test_run_trained_on_other_data_is_refused(measure, models, tmp_path):
    _, rows = measure("--reduction", "sum", "--points", "0")
    shutil.copytree(models, tmp_path / "models")
    metadata_path = tmp_path / "models" / rows["run"][0] / "run.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["dataset_fingerprint"] = "0" * 64
    metadata_path.write_text(json.dumps(metadata))
    before = snapshot(tmp_path)
    result = run_in_process("compute_sensitivity.py", *RUN, "--points", "0", "--res-name", "x", cwd=tmp_path)
    assert_usage_error(result, "--save-name")
    assert "differs in dataset contents" in result.stderr and snapshot(tmp_path) == before


def test_same_seed_gives_identical_file_and_rerun_skips(measure, tmp_path):
    flags = ["--reduction", "mean", "--exp", "renyi", "--estimator", "jensen", "--points", "1", "4", "--stage", "all",
             "--alpha", "2", "--num-iters", "2", "--num-batches", "2"]
    measure(*flags, res_name="a")
    measure(*flags, res_name="b")
    first, second = (tmp_path / "res" / "a.csv").read_bytes(), (tmp_path / "res" / "b.csv").read_bytes()
    assert first == second
    result, _ = measure(*flags, res_name="a")
    assert "0 rows written" in result.stdout and "12 (point, stage, experiment) combinations" in result.stdout
    assert (tmp_path / "res" / "a.csv").read_bytes() == first
    measure(*flags[:-6], "--alpha", "2", "--num-iters", "2", "--num-batches", "3", "--overwrite", "1", res_name="a")
    assert len(pd.read_csv(tmp_path / "res" / "a.csv")) == 2 * 3 * 2 * 2 * 3


def test_interrupted_run_resumes_to_the_same_file(measure, tmp_path, monkeypatch):
    flags = ["--reduction", "mean", "--exp", "eps_delta", "--points", "0-5", "--stage", "all", "--num-batches", "4"]
    measure(*flags, res_name="whole")
    measured = measurement.measure_checkpoint
    calls = []

    def interrupted(*args):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measured(*args)

    monkeypatch.setattr(measurement, "measure_checkpoint", interrupted)
    result, partial = measure(*flags, res_name="resumed", check=False)
    assert result.returncode == 130 and sorted(set(partial["step"])) == [0]
    monkeypatch.setattr(measurement, "measure_checkpoint", measured)
    result, _ = measure(*flags, res_name="resumed")
    assert "6 (point, stage, experiment) combinations already there skipped" in result.stdout
    assert (tmp_path / "res" / "resumed.csv").read_bytes() == (tmp_path / "res" / "whole.csv").read_bytes()


def test_no_train_names_the_training_command(tmp_path):
    result = run_in_process("compute_sensitivity.py", *RUN, "--sigma", "3", "--points", "0", "--res-name", "x",
                            "--no-train", cwd=tmp_path)
    assert_usage_error(result, "--no-train")
    assert "python train_dpsgd.py --dataset synthetic --model mlp" in result.stderr and "--sigma 3.0" in result.stderr
    assert snapshot(tmp_path) == {}


def test_stages_resolve_to_the_nearest_saved_checkpoint():
    saved = [0, 10, 20, 30, 40]
    resolve = runs.resolve_stages
    assert resolve(options.parse_stages(["initial", "final"]), saved, 40) == [0, 40]
    assert resolve(options.parse_stages(["middle", "0.26"]), saved, 40) == [10, 20]
    assert resolve(options.parse_stages(["0.125"]), saved, 40) == [0]  # 5 is as near 0 as 10: the earlier
    assert resolve(options.parse_stages(["all"]), saved, 40) == saved


BAD_INPUTS = [
    (["--points", "600"], "--points"),
    (["--points", "-3"], "--points"),
    (["--points", "1.5"], "--points"),
    (["--points", "random:0"], "--points"),
    (["--stage", "1.5"], "--stage"),
    (["--stage", "late"], "--stage"),
    (["--exp", "renyi", "--reduction", "mean", "--estimator", "jensen", "--alpha", "1"], "--alpha"),
    (["--exp", "renyi", "--reduction", "mean", "--estimator", "jensen", "--alpha", "2.5"], "--alpha"),
    (["--exp", "eps_delta", "--reduction", "mean", "--estimator", "jensen"], "--estimator"),
    # --alpha is GLA's statistic's order only: refused, not ignored, elsewhere.
    (["--reduction", "mean", "--alpha", "1"], "--alpha"),
    (["--reduction", "mean", "--estimator", "coupling", "--exp", "renyi", "--alpha", "8"], "--alpha"),
    (["--reduction", "sum", "--alpha", "8"], "--alpha"),
    (["--reduction", "sum", "--estimator", "coupling"], "--estimator"),
    (["--reduction", "mean", "--mc-blocks", "0"], "--mc-blocks"),
    (["--reduction", "mean", "--max-sizes", "8"], "--max-sizes"),
    (["--reduction", "mean", "--size-delta", "1.5"], "--size-delta"),
    (["--mc-seed", "-1"], "--mc-seed"),
    (["--run", "..", "--reduction", "sum"], "--run"),
    (["--run", "elsewhere", "--save-name", "other"], "--save-name"),
    (["--num-batches", "-1"], "--num-batches"),
    (["--num-batches", "0", "--estimator", "jensen", "--exp", "renyi", "--reduction", "mean"], "--num-batches"),
    (["--num-iters", "-1"], "--num-iters"),
    (["--exp", "gaussian"], "--exp"),
    (["--reduction", "median"], "--reduction"),
]


@pytest.mark.parametrize("flags, flag", BAD_INPUTS, ids=[" ".join(flags) for flags, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_writes_nothing(measure, tmp_path, flags, flag):
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "out.csv").write_text("kept as it is\n")
    before = snapshot(tmp_path)
    result, _ = measure("--points", "0", *flags, check=False)
    assert_usage_error(result, flag)
    assert snapshot(tmp_path) == before


def test_result_file_takes_other_seeds_but_refuses_another_configuration(measure, tmp_path):
    measure("--reduction", "sum", "--points", "0")
    _, rows = measure("--reduction", "sum", "--points", "0", "--seed", "1")
    assert sorted(rows["seed"]) == [0, 1]  # runs of several seeds belong together (composition over runs)
    before = snapshot(tmp_path)
    result, _ = measure("--reduction", "mean", "--points", "0", check=False)
    assert_usage_error(result, "--res-name")
    assert "column update_rule has sum in file, mean now" in result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"a,b\n1,2\n"], ids=["binary", "foreign"])
def test_unreadable_result_file_is_refused(models, tmp_path, content):
    """As a user runs it: a real process, exit 2, one line, no traceback, file untouched."""
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "out.csv").write_bytes(content)
    result = run_script("compute_sensitivity.py", *RUN, "--models-dir", models, "--points", "0", "--res-name", "out",
                        cwd=tmp_path)
    assert_usage_error(result, "--res-name")
    assert (tmp_path / "res" / "out.csv").read_bytes() == content


def test_engine_runs_on_cuda_when_present():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3)).cuda()
    norms, _ = transformed_norms(model, torch.randn(5, 1, 2, 2), torch.arange(5) % 3, Transform("flat", 1.0),
                                 device="cuda")
    assert (norms <= 1 + 1e-6).all()


def test_train_dpsgd_names_the_same_run(models, tmp_path):
    """The flags name one run for both scripts: what compute_sensitivity.py trained is found finished."""
    result = run_in_process("train_dpsgd.py", *RUN, "--reduction", "sum", "--models-dir", models, cwd=tmp_path)
    assert result.returncode == 0 and "already trained" in result.stdout


# --- issue 11: a run named once, Monte-Carlo seeds, what was measured -----------------------

def sum_run_name(models):
    return next(name for name in sorted(os.listdir(models)) if name.startswith("synthetic_mlp_sum_psac_eps10_bs32_seed0_")
                and "less" not in name)


def test_run_by_name_measures_a_sum_run_under_the_mean_rule_with_no_training_flag(models, tmp_path):
    name = sum_run_name(models)
    result = run_in_process("compute_sensitivity.py", "--run", name, "--models-dir", models, "--exp", "eps_delta",
                            "--reduction", "mean", "--points", "0-9", "--stage", "final", "--num-batches", "200",
                            "--res-name", "by_name", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = pd.read_csv(tmp_path / "res" / "by_name.csv")
    assert set(rows["run"]) == {name} and set(rows["update_rule"]) == {"sum"} and set(rows["reduction"]) == {"mean"}
    assert set(rows["exp"]) == {"coupling"} and sorted(rows["point"].unique()) == list(range(10))
    np.testing.assert_allclose(rows["noise_std"], rows["sigma"] * rows["clip_bound"] / 32)
    assert set(rows["quantity"]) == {"batch_sensitivity", "center_distance", "spread", "max_deviation"}
    # The same run by folder, with the flags it was trained with, adds nothing.
    again = run_in_process("compute_sensitivity.py", "--run", os.path.join(models, name), *RUN, "--reduction", "mean",
                           "--points", "0-9", "--num-batches", "200", "--res-name", "by_name", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "0 rows written" in again.stdout and "10 (point, stage, experiment)" in again.stdout


def test_run_by_name_defaults_to_its_trained_rule(models, tmp_path):
    result = run_in_process("compute_sensitivity.py", "--run", sum_run_name(models), "--models-dir", models,
                            "--points", "0", "--res-name", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = pd.read_csv(tmp_path / "res" / "x.csv")
    assert set(rows["quantity"]) == {"grad_norm"} and set(rows["exp"]) == {"norm"} and rows["mc_seed"].isna().all()


def test_a_flag_that_disagrees_with_run_json_shows_both_values(models, tmp_path):
    name = sum_run_name(models)
    result = run_in_process("compute_sensitivity.py", "--run", name, "--models-dir", models, "--epochs", "2",
                            "--points", "0", "--res-name", "x", cwd=tmp_path)
    assert_usage_error(result, "--epochs")
    assert "given 2.0" in result.stderr and "has 1.0" in result.stderr and "run.json" in result.stderr
    assert snapshot(tmp_path) == {}


def test_run_that_does_not_exist_is_trained_under_its_name(tmp_path):
    result = run_in_process("compute_sensitivity.py", "--run", "fresh", *RUN, "--epochs", "0.25", "--points", "0",
                            "--res-name", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    metadata = json.loads((tmp_path / "models" / "fresh" / "run.json").read_text())
    assert metadata["run"] == "fresh" and metadata["total_steps"] == 4
    assert set(pd.read_csv(tmp_path / "res" / "x.csv")["run"]) == {"fresh"}


def test_two_mc_seeds_give_two_independent_sets_of_rows(measure):
    flags = ["--reduction", "mean", "--points", "2", "--num-batches", "100"]
    _, first = measure(*flags)
    assert set(first["mc_seed"]) == {0}  # the run's seed
    result, rows = measure(*flags, "--mc-seed", "9")
    assert "0 (point, stage, experiment) combinations already there" in result.stdout
    assert sorted(rows["mc_seed"].unique()) == [0, 9]
    samples = {seed: part[part["quantity"] == "batch_sensitivity"] for seed, part in rows.groupby("mc_seed")}
    assert not np.array_equal(samples[0]["value"].to_numpy()[:50], samples[9]["value"].to_numpy()[:50])
    statistics = {seed: part[part["quantity"] == "spread"]["value"].item() for seed, part in rows.groupby("mc_seed")}
    assert statistics[0] == statistics[9]  # no Monte Carlo in the dataset statistics
    result, _ = measure(*flags, "--mc-seed", "9")
    assert "0 rows written" in result.stdout


def test_sum_rule_norms_are_measured_once_whatever_the_accountant(measure):
    measure("--reduction", "sum", "--exp", "eps_delta", "--points", "0-2")
    result, rows = measure("--reduction", "sum", "--exp", "renyi", "--points", "0-2", "--mc-seed", "4")
    assert "0 rows written" in result.stdout and len(rows) == 3 and set(rows["exp"]) == {"norm"}


def test_rows_are_added_to_a_file_written_before_the_new_columns(measure, tmp_path):
    _, rows = measure("--reduction", "sum", "--points", "0")
    old = rows.drop(columns=["mc_seed", "block", "k", "k_min"])
    old.to_csv(tmp_path / "res" / "out.csv", index=False)
    _, rows = measure("--reduction", "sum", "--points", "0-1")
    assert list(rows["point"]) == [0, 1] and rows["mc_seed"].isna().all()


def test_res_dir_chooses_the_folder(measure, tmp_path):
    measure("--reduction", "sum", "--points", "0", "--res-dir", "elsewhere")
    assert (tmp_path / "elsewhere" / "out.csv").exists() and not (tmp_path / "res").exists()

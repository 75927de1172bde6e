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

from perinstance import results, sensitivity, sensitivity_cli, training
from perinstance.data import load_dataset
from perinstance.sensitivity import RENYI_SET_KEY, RENYI_TARGET_KEY

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
                                "--res-name", f"first_{reduction}", "--models-dir", folder / "models", cwd=folder)
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
    metadata = training.checkpoints.load_metadata(run_dir)
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
    transform = sensitivity.Transform.of_run(metadata)
    singles = sensitivity.reference_batch_means(model, dataset.train_x, dataset.train_y, transform,
                                                [[point] for point in range(10)])
    np.testing.assert_allclose(mine["value"], np.linalg.norm(singles, axis=1), rtol=1e-5)
    logits = model(dataset.train_x[:10])
    np.testing.assert_allclose(mine["loss"], F.cross_entropy(logits, dataset.train_y[:10], reduction="none")
                               .detach().numpy(), rtol=1e-6)
    np.testing.assert_array_equal(mine["correct"], (logits.argmax(1) == dataset.train_y[:10]).int().numpy())
    np.testing.assert_array_equal(mine["label"], dataset.train_y[:10].numpy())
    assert (mine["accuracy"] == payload["test_accuracy"]).all()
    assert "10 points × 3 stages" in result.stdout and "30 rows written" in result.stdout


def test_mean_rule_eps_delta_rows(measure):
    _, rows = measure("--reduction", "mean", "--exp", "eps_delta", "--points", "3", "7", "--stage", "final",
                      "--num-batches", "9")
    assert len(rows) == 2 * 9 and set(rows["quantity"]) == {"batch_sensitivity"}
    assert sorted(rows["sample"].unique()) == list(range(9)) and (rows["step"] == 16).all()
    assert ((rows["value"] > 0) & (rows["value"] <= rows["clip_bound"])).all()
    np.testing.assert_allclose(rows["noise_std"], rows["sigma"] * rows["clip_bound"] / 32)
    assert set(rows["update_rule"]) == {"mean"} and set(rows["reduction"]) == {"mean"}


def test_renyi_mean_rows_match_the_reference(measure, models):
    _, rows = measure("--reduction", "mean", "--exp", "renyi", "--points", "5", "--stage", "0.6", "--alpha", "3",
                      "--num-iters", "2", "--num-batches", "3")
    assert len(rows) == 2 * 2 * 3 and set(rows["direction"]) == {"remove", "add"}
    assert (rows["alpha"] == 3).all() and (rows["step"] == 8).all()
    metadata, model, _ = checkpoint(models, rows["run"][0], 8)
    dataset = load_dataset("synthetic")
    pool = sensitivity.Pool(0, 8, 512, metadata["sample_rate"], np.arange(512))
    target = np.flatnonzero(pool.draw(1, RENYI_TARGET_KEY, 1)[0])
    sets = [[np.flatnonzero(mask) for mask in pool.draw(3, RENYI_SET_KEY, 1, key)] for key in range(3)]
    without_point = [[batch[batch != 5] for batch in batches] for batches in sets]
    expected = sensitivity.reference_renyi_statistics(model, dataset.train_x, dataset.train_y,
                                                      sensitivity.Transform.of_run(metadata), target, without_point)
    mine = rows[(rows["direction"] == "add") & (rows["target_batch"] == 1)].sort_values("sample")
    np.testing.assert_allclose(mine["value"], expected, rtol=1e-4)


def test_less_point_run_measures_the_left_out_point_by_its_full_dataset_index(measure, models):
    _, rows = measure("--reduction", "sum", "--less-point", "3", "--points", "2-4", "--stage", "final")
    dataset = load_dataset("synthetic")
    assert list(rows["point"]) == [2, 3, 4] and rows["run"][0].startswith("synthetic_mlp_sum_psac_eps10_bs32_seed0_less3")
    np.testing.assert_array_equal(rows["label"], dataset.train_y[2:5].numpy())
    assert set(rows["dataset_size"]) == {511}
    metadata, model, _ = checkpoint(models, rows["run"][0], 16)
    singles = sensitivity.reference_batch_means(model, dataset.train_x, dataset.train_y,
                                                sensitivity.Transform.of_run(metadata), [[2], [3], [4]])
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
    flags = ["--reduction", "mean", "--exp", "renyi", "--points", "1", "4", "--stage", "all", "--alpha", "2",
             "--num-iters", "2", "--num-batches", "2"]
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
    measured = sensitivity_cli.measure_checkpoint
    calls = []

    def interrupted(*args):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measured(*args)

    monkeypatch.setattr(sensitivity_cli, "measure_checkpoint", interrupted)
    result, partial = measure(*flags, res_name="resumed", check=False)
    assert result.returncode == 130 and sorted(set(partial["step"])) == [0]
    monkeypatch.setattr(sensitivity_cli, "measure_checkpoint", measured)
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
    resolve = sensitivity_cli.resolve_stages
    assert resolve(sensitivity_cli.parse_stages(["initial", "final"]), saved, 40) == [0, 40]
    assert resolve(sensitivity_cli.parse_stages(["middle", "0.26"]), saved, 40) == [10, 20]
    assert resolve(sensitivity_cli.parse_stages(["0.125"]), saved, 40) == [0]  # 5 is as near 0 as 10: the earlier
    assert resolve(sensitivity_cli.parse_stages(["all"]), saved, 40) == saved


BAD_INPUTS = [
    (["--points", "600"], "--points"),
    (["--points", "-3"], "--points"),
    (["--points", "1.5"], "--points"),
    (["--points", "random:0"], "--points"),
    (["--stage", "1.5"], "--stage"),
    (["--stage", "late"], "--stage"),
    (["--exp", "renyi", "--reduction", "mean", "--alpha", "1"], "--alpha"),
    (["--exp", "renyi", "--reduction", "mean", "--alpha", "2.5"], "--alpha"),
    (["--num-batches", "0"], "--num-batches"),
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
    norms, _ = sensitivity.transformed_norms(model, torch.randn(5, 1, 2, 2), torch.arange(5) % 3,
                                             sensitivity.Transform("flat", 1.0), device="cuda")
    assert (norms <= 1 + 1e-6).all()


def test_train_dpsgd_names_the_same_run(models, tmp_path):
    """The flags name one run for both scripts: what compute_sensitivity.py trained is found finished."""
    result = run_in_process("train_dpsgd.py", *RUN, "--reduction", "sum", "--models-dir", models, cwd=tmp_path)
    assert result.returncode == 0 and "already trained" in result.stdout

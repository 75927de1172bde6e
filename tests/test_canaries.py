"""Canaries in a training run and audit.py's one-run modes (issue 26 items 1-3)."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import assert_usage_error, run_in_process, snapshot

from perinstance.accounting import one_run_audit
from perinstance.accounting.mechanism import Mechanism
from perinstance.audit import one_run
from perinstance.cli import options
from perinstance.train import canaries, run_plan, runs

RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "2",
       "--sigma", "0.8", "--save-freq", "8", "--canaries", "60", "--canary-norms", "0.5,1", "--save-name", "tiny"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    result = run_in_process("train_dpsgd.py", *RUN, "--models-dir", folder / "models", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / "models"


def test_the_run_records_its_canaries(models):
    config = runs.load_run(models / "tiny")
    assert (config.canaries, config.canary_norms) == (60, (0.5, 1.0))
    table = pd.read_csv(models / "tiny" / canaries.CANARY_FILE)
    assert list(table["norm"]) == [0.5] * 30 + [1.0] * 30
    np.testing.assert_array_equal(table["included"], canaries.canary_inclusions(config.seed, 60))
    assert 10 < table["included"].sum() < 50
    assert np.all(np.isfinite(table["score"])) and table["score"].std() > 0


def test_canaries_name_the_run():
    plain = options.parse_training_flags(["--dataset", "synthetic", "--sigma", "1"])
    with_canaries = options.parse_training_flags(["--dataset", "synthetic", "--sigma", "1", "--canaries", "60"])
    other_norms = options.parse_training_flags(["--dataset", "synthetic", "--sigma", "1", "--canaries", "60",
                                            "--canary-norms", "0.5"])
    names = {run_plan.default_save_name(flags) for flags in (plain, with_canaries, other_norms)}
    assert len(names) == 3 and "canaries60" in run_plan.default_save_name(with_canaries)
    assert "canaries" not in json.dumps(run_plan.identity_args(plain))


def test_resuming_gives_the_same_scores(models, tmp_path):
    copy = tmp_path / "models"
    shutil.copytree(models / "tiny", copy / "tiny")
    config = runs.load_run(copy / "tiny")
    os.remove(copy / "tiny" / f"step_{config.total_steps:07d}.pt")
    os.remove(copy / "tiny" / canaries.CANARY_FILE)
    result = run_in_process("train_dpsgd.py", *RUN, "--models-dir", copy, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resumed = pd.read_csv(copy / "tiny" / canaries.CANARY_FILE)
    pd.testing.assert_frame_equal(resumed, pd.read_csv(models / "tiny" / canaries.CANARY_FILE), rtol=1e-9)


class _Run:
    seed, canaries, canary_norms, clip_bound, sample_rate = 3, 4, (0.5, 1.0), 2.0, 0.5


def test_a_canary_adds_c_times_gamma_along_its_unit_direction():
    params = [torch.zeros(5, 7), torch.zeros(11)]
    canary_set = canaries.Canaries(_Run, params, torch.device("cpu"))
    dense = np.zeros((4, 46))
    for row, (where, weights) in enumerate(zip(canary_set.coordinates.numpy(), canary_set.weights.numpy())):
        dense[row, where] = weights
    np.testing.assert_allclose(np.linalg.norm(dense, axis=1), 1.0, rtol=1e-6)
    summed = [torch.zeros(5, 7), torch.zeros(11)]
    canary_set.add_to(summed, np.array([1, 3]))
    flat = torch.cat([part.reshape(-1) for part in summed]).numpy()
    np.testing.assert_allclose(flat, 0.5 * 2.0 * dense[1] + 1.0 * 2.0 * dense[3], atol=1e-6)
    canary_set.score(summed)
    np.testing.assert_allclose(canary_set.scores.numpy(), dense @ flat, atol=1e-6)


def test_upper_bounds_are_the_accountants_at_the_scaled_noise(models):
    # RDP at sensitivity c·Γ is the baseline of σ/c (Opacus's RDP, accounting.md §3.1).
    config = runs.load_run(models / "tiny")
    rdp, pld_eps = one_run.upper_bounds(config, np.array([0.5, 1.0]), 1e-5)
    for norm, eps in zip((0.5, 1.0), rdp, strict=True):
        scaled = dataclasses.replace(Mechanism.of_run(config, "sum"), noise_multiplier=config.noise_multiplier / norm)
        assert eps == pytest.approx(scaled.baseline_eps(1e-5)[0], rel=1e-3)
    assert np.all(pld_eps <= rdp) and np.all(pld_eps > 0)


def test_one_run_audit_of_the_run(models, tmp_path):
    result = run_in_process("audit.py", "--run", "tiny", "--models-dir", models, "--one-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(tmp_path / "res" / "tiny_one_run_audit.csv")
    assert list(table["norm"]) == [0.5, 1.0] and list(table["canaries"]) == [30, 30]
    assert not table["violated"].any()
    assert np.all(table["eps_lower"] <= table[["eps_upper_rdp", "eps_upper_pld"]].min(axis=1))
    scores = canaries.read_canaries(models / "tiny")
    group = scores.norms == 1.0
    expected = one_run_audit.one_run_epsilon(scores.scores[group & scores.included],
                                             scores.scores[group & ~scores.included], significance=0.05, delta=1e-5)
    assert table["eps_lower"].iloc[1] == pytest.approx(expected, abs=1e-9)
    assert "lower/upper" in result.stdout


def copy_run(models, tmp_path):
    """The trained run's files that the one-run audit reads, copied under tmp_path/models/tiny: (folder, config)."""
    copy = tmp_path / "models" / "tiny"
    os.makedirs(copy)
    config = runs.load_run(models / "tiny")
    for name in ("run.json", canaries.CANARY_FILE, f"step_{config.total_steps:07d}.pt"):
        with open(models / "tiny" / name, "rb") as source, open(copy / name, "wb") as target:
            target.write(source.read())
    return copy, config


def test_a_lower_bound_above_the_accounting_is_a_loud_violation(models, tmp_path):
    # The same canaries held against the accounting of a run with 1000 times the noise: they must break it.
    copy, config = copy_run(models, tmp_path)
    table = pd.read_csv(copy / canaries.CANARY_FILE)
    table["score"] = np.where(table["included"] == 1, 10.0, 0.0) + table["canary"] * 1e-3
    table.to_csv(copy / canaries.CANARY_FILE, index=False)
    loud = {**json.load(open(copy / "run.json")), "noise_multiplier": config.noise_multiplier * 1000}
    json.dump(loud, open(copy / "run.json", "w"))
    result = run_in_process("audit.py", "--run", "tiny", "--models-dir", tmp_path / "models", "--one-run",
                            cwd=tmp_path)
    assert result.returncode == 1
    assert "VIOLATION: the canaries prove more than the accounting allows at norm(s) 0.5, 1" in result.stdout
    assert pd.read_csv(tmp_path / "res" / "tiny_one_run_audit.csv")["violated"].all()


def test_a_group_without_held_out_canaries_is_refused(models, tmp_path):
    copy, _ = copy_run(models, tmp_path)
    table = pd.read_csv(copy / canaries.CANARY_FILE)
    table.loc[table["norm"] == 1.0, "included"] = 1
    table.to_csv(copy / canaries.CANARY_FILE, index=False)
    result = run_in_process("audit.py", "--run", "tiny", "--models-dir", tmp_path / "models", "--one-run",
                            cwd=tmp_path)
    assert_usage_error(result, "--run")
    assert "every canary of norm 1 is held in" in result.stderr
    assert not (tmp_path / "res").exists()


def test_scores_from_files(tmp_path):
    rng = np.random.default_rng(0)
    in_scores, out_scores = rng.normal(2, 1, 300), rng.normal(0, 1, 300)
    np.savetxt(tmp_path / "in.txt", in_scores)
    np.save(tmp_path / "out.npy", out_scores)
    result = run_in_process("audit.py", "--in-scores", "in.txt", "--out-scores", "out.npy", "--significance", "0.05",
                            "--delta", "1e-6", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = dict(line.split(": ") for line in result.stdout.strip().splitlines())
    assert list(printed) == ["one_run_eps", "one_run_fdp_eps", "clopper_pearson_eps"]
    expected = one_run_audit.one_run_epsilon(in_scores, out_scores, significance=0.05, delta=1e-6)
    assert float(printed["one_run_eps"]) == pytest.approx(expected, abs=1e-6)
    assert float(printed["one_run_eps"]) > 0


@pytest.mark.parametrize("flags, flag", [
    (["--in-scores", "in.txt"], "--out-scores"),
    (["--in-scores", "missing.txt", "--out-scores", "out.txt"], "--in-scores"),
    (["--in-scores", "bad.txt", "--out-scores", "out.txt"], "--in-scores"),
    (["--in-scores", "in.txt", "--out-scores", "empty.txt"], "--out-scores"),
    (["--in-scores", "in.txt", "--out-scores", "out.txt", "--significance", "1.5"], "--significance"),
    (["--in-scores", "in.txt", "--out-scores", "out.txt", "--delta", "0"], "--delta"),
    (["--one-run"], "--one-run"),
    (["--points", "0"], "--run"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, flags, flag):
    (tmp_path / "in.txt").write_text("1\n2\n")
    (tmp_path / "out.txt").write_text("0\n")
    (tmp_path / "bad.txt").write_text("1\nabc\n")
    (tmp_path / "empty.txt").write_text("\n")
    before = snapshot(tmp_path)
    assert_usage_error(run_in_process("audit.py", *flags, cwd=tmp_path), flag)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flags, flag", [
    (["--canaries", "10", "--no-dp"], "--canaries"),
    (["--canaries", "10", "--canary-norms", "0.1,0.3,1"], "--canaries"),
    (["--canaries", "10", "--canary-norms", "0.1,2"], "--canary-norms"),
    (["--canaries", "10", "--canary-norms", "a"], "--canary-norms"),
    (["--canary-norms", "0.5"], "--canary-norms"),
    (["--canaries", "0"], "--canaries"),
])
def test_bad_canary_flags_are_one_line_errors(tmp_path, flags, flag):
    result = run_in_process("train_dpsgd.py", "--dataset", "synthetic", "--model", "mlp", *flags,
                            "--models-dir", tmp_path / "models", cwd=tmp_path)
    assert_usage_error(result, flag)
    assert not (tmp_path / "models").exists()


def test_a_run_without_canaries_is_refused(tmp_path):
    folder = tmp_path / "models"
    result = run_in_process("train_dpsgd.py", "--dataset", "synthetic", "--model", "mlp", "--epochs", "0.1",
                            "--save-name", "plain", "--models-dir", folder, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_usage_error(run_in_process("audit.py", "--run", "plain", "--models-dir", folder, "--one-run",
                                      cwd=tmp_path), "--run")

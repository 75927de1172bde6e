import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, assert_usage_error, snapshot
from opacus.accountants import RDPAccountant

from perinstance.cli import options
from perinstance.files import checkpoints, storage, tracked_rows
from perinstance.train import run_plan, runs, sampling, training
from perinstance.train.data import load_dataset

SYNTHETIC = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5"]


def parse(*argv):
    return options.parse_training_flags(list(map(str, argv)))


# --- Poisson sampling -------------------------------------------------------------------

def test_poisson_inclusion_rate_within_four_standard_errors():
    dataset_size, sample_rate, steps = 1000, 0.03, 400
    counts = np.zeros(dataset_size)
    for step in range(1, steps + 1):
        counts[sampling.poisson_batch(7, step, dataset_size, sample_rate)] += 1
    rate = counts.sum() / (dataset_size * steps)
    standard_error = np.sqrt(sample_rate * (1 - sample_rate) / (dataset_size * steps))
    assert abs(rate - sample_rate) < 4 * standard_error
    # Each point on its own too (a sampler that always picked the same points would fail).
    per_point_se = np.sqrt(sample_rate * (1 - sample_rate) / steps)
    assert np.mean(np.abs(counts / steps - sample_rate) < 4 * per_point_se) > 0.99


def test_poisson_batches_are_reproducible_and_vary_by_step():
    first = sampling.poisson_batch(3, 5, 500, 0.1)
    assert np.array_equal(first, sampling.poisson_batch(3, 5, 500, 0.1))
    assert not np.array_equal(first, sampling.poisson_batch(3, 6, 500, 0.1))
    assert not np.array_equal(first, sampling.poisson_batch(4, 5, 500, 0.1))


def test_empty_batches_happen_and_training_steps_through_them(tmp_path):
    sizes = [len(sampling.poisson_batch(0, step, 512, 1 / 512)) for step in range(1, 200)]
    assert 0 in sizes
    args = parse(*SYNTHETIC, "--batch-size", "1", "--epochs", "0.2", "--sigma", "1", "--models-dir", tmp_path)
    outcome = training.train(args, quiet=True)
    payload = checkpoints.load_checkpoint(outcome.run_dir, outcome.run.total_steps)
    assert all(torch.isfinite(value).all() for value in payload["model"].values())


# --- One step by hand -------------------------------------------------------------------

HAND_WEIGHTS = {
    # accounting.md §1 table, written out independently of perinstance.clipping.
    "flat": lambda norm, c, r, s: min(1.0, c / norm),
    "psac": lambda norm, c, r, s: c / (norm + r / (norm + r)),
    "psasc": lambda norm, c, r, s: c / (s * norm + r / (norm + r)),
}


def hand_step(model, inputs, labels, weight, noise, batch_size, lr, rule):
    """DP-SGD step of accounting.md §1 with a per-example autograd loop."""
    params = list(model.parameters())
    transformed = []
    for x, y in zip(inputs, labels):
        loss = F.cross_entropy(model(x[None]), y[None])
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
        transformed.append([g * weight(norm) for g in grads])
    summed = [sum(parts) for parts in zip(*transformed)]
    if rule == "sum":
        update = [(s + n) / batch_size for s, n in zip(summed, noise)]
    else:
        update = [s / len(inputs) + n / batch_size for s, n in zip(summed, noise)]
    return [p.detach() - lr * u for p, u in zip(params, update)]


@pytest.mark.parametrize("rule,transform", [("sum", "flat"), ("mean", "flat"), ("sum", "psac"), ("mean", "psasc"),
                                            ("sum", "psasc")])
def test_one_step_equals_hand_computation(tmp_path, rule, transform):
    clip_norm, scale_r, scale_s = 0.05, 0.1, 0.6
    scaling = {"flat": [], "psac": ["--scale-r", scale_r], "psasc": ["--scale-r", scale_r, "--scale-s", scale_s]}
    args = run_plan.resolve_training_args(parse(*SYNTHETIC, "--sigma", "0.7", "--cn", clip_norm, "--reduction", rule,
                                                "--clipping", transform, *scaling[transform],
                                                "--models-dir", tmp_path))
    dataset = load_dataset("synthetic")
    metadata = run_plan.plan_run(args, dataset)
    trainer = training.Trainer(metadata, dataset)
    reference = training.model_for_run(metadata)
    reference.load_state_dict(trainer.model.state_dict())

    batch = sampling.poisson_batch(args.seed, 1, metadata.dataset_size, metadata.sample_rate)
    assert len(batch) > 1
    generator = sampling.torch_generator(args.seed, sampling.NOISE_STREAM, 1)
    bound = clip_norm / scale_s if transform == "psasc" else clip_norm
    assert metadata.clip_bound == pytest.approx(bound)
    noise = [torch.normal(0.0, 0.7 * bound, p.shape, generator=generator) for p in reference.parameters()]

    def weight(norm):
        return HAND_WEIGHTS[transform](norm, clip_norm, scale_r, scale_s)

    expected = hand_step(reference, dataset.train_x[batch], dataset.train_y[batch], weight, noise, 32, args.lr, rule)
    trainer.step(1)
    for got, want in zip(trainer.model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    # The transform mattered: without it the step is different.
    untransformed = hand_step(reference, dataset.train_x[batch], dataset.train_y[batch], lambda norm: 1.0, noise, 32,
                              args.lr, rule)
    assert any(not torch.allclose(a, b) for a, b in zip(untransformed, expected))


def test_steps_take_per_sample_gradients_in_eval_mode_from_the_first(tmp_path):
    """Δ* is measured in eval mode (compute_sensitivity.py, the tracking), so every step clips the norms of eval mode
    too, from a fresh trainer's first step on, not only after the first evaluation (a resumed run evaluates only at
    its next checkpoint)."""
    args = run_plan.resolve_training_args(parse(*SYNTHETIC, "--sigma", "1", "--models-dir", tmp_path))
    dataset = load_dataset(args.dataset, args.data_root)
    trainer = training.Trainer(run_plan.plan_run(args, dataset), dataset)
    modes = []
    trainer.model.register_forward_pre_hook(lambda module, inputs: modes.append(module.training))
    trainer.step(1)
    assert modes and not any(modes)


def test_noise_has_the_recorded_std(tmp_path):
    # At σ = 1000 the clipped gradients (norm ≤ 1) are negligible next to the noise.
    args = run_plan.resolve_training_args(parse(*SYNTHETIC, "--sigma", "1000", "--cn", "1", "--lr", "1",
                                                "--models-dir", tmp_path))
    dataset = load_dataset("synthetic")
    metadata = run_plan.plan_run(args, dataset)
    trainer = training.Trainer(metadata, dataset)
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
    trainer.step(1)
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    measured = ((before - after) * metadata.batch_size).std().item()
    expected = metadata.noise_multiplier * metadata.clip_bound
    assert abs(measured - expected) / expected < 0.05


# --- Noise calibration ------------------------------------------------------------------

@pytest.mark.parametrize("target_eps", [1.0, 10.0])
def test_noise_multiplier_matches_opacus_calibration(tmp_path, target_eps):
    args = run_plan.resolve_training_args(parse(*SYNTHETIC, "--eps", target_eps, "--epochs", "3",
                                                "--models-dir", tmp_path))
    metadata = run_plan.plan_run(args, load_dataset("synthetic"))
    sigma, sample_rate, steps = metadata.noise_multiplier, metadata.sample_rate, metadata.total_steps
    assert sample_rate == 32 / 512 and steps == 48

    def spent(noise_multiplier):
        accountant = RDPAccountant()
        accountant.history = [(noise_multiplier, sample_rate, steps)]
        return accountant.get_epsilon(1e-5)

    assert spent(sigma) <= target_eps
    assert spent(sigma * 0.99) > target_eps  # calibrated tightly, not just conservatively


# --- Checkpoints, metadata, resume ------------------------------------------------------

METADATA_FIELDS = ["run", "seed", "dataset", "dataset_fingerprint", "dataset_size", "model", "clipping",
                   "clip_norm", "clip_bound", "noise_multiplier", "target_eps", "delta", "sample_rate",
                   "batch_size", "total_steps", "steps_per_epoch", "update_rule", "checkpoint_steps", "versions",
                   "flags", "lr", "optimizer", "momentum", "gamma", "dec_lr", "format"]


def test_checkpoints_load_weights_only_and_metadata_is_complete(tmp_path):
    args = parse(*SYNTHETIC, "--epochs", "1", "--save-freq", "5", "--models-dir", tmp_path)
    outcome = training.train(args, quiet=True)
    run_dir = outcome.run_dir
    steps = checkpoints.saved_steps(run_dir)
    assert steps == [0, 5, 10, 15, 16] == list(outcome.run.checkpoint_steps)
    for step in steps:
        payload = torch.load(checkpoints.checkpoint_path(run_dir, step), weights_only=True)
        assert payload["step"] == step and 0 <= payload["test_accuracy"] <= 1
    saved = json.loads(open(runs.run_file(run_dir)).read())
    assert set(METADATA_FIELDS) <= set(saved) and saved["format"] == runs.RUN_FORMAT
    assert saved["versions"]["torch"] == torch.__version__
    assert saved["flags"]["batch_size"] == 32 and saved["target_eps"] == 10.0
    assert runs.load_run(run_dir) == outcome.run  # what is written is what is read


def test_save_steps_add_checkpoints_and_leave_old_run_names_alone(tmp_path):
    """--save-steps: the listed steps (ranges allowed), with --save-freq's multiples when that is given, 0 and T."""
    assert run_plan.checkpoint_schedule(None, ["1-3", "7"], 16) == [0, 1, 2, 3, 7, 16]
    assert run_plan.checkpoint_schedule(5, ["1", "2"], 16) == [0, 1, 2, 5, 10, 15, 16]
    assert run_plan.checkpoint_schedule(None, None, 16) == run_plan.checkpoint_schedule(2, None, 16)  # ~10 checkpoints
    outcome = training.train(parse(*SYNTHETIC, "--epochs", "1", "--save-steps", "1", "2", "4", "8",
                                   "--models-dir", tmp_path), quiet=True)
    assert checkpoints.saved_steps(outcome.run_dir) == [0, 1, 2, 4, 8, 16]
    # A run named before the flag existed keeps its default name (save_steps is no part of it while not given).
    assert "save_steps" not in run_plan.identity_args(parse(*SYNTHETIC))
    named = [run_plan.default_save_name(run_plan.resolve_training_args(parse(*SYNTHETIC, *extra)))
             for extra in ([], ["--save-steps", "1"])]
    assert named[0] != named[1]


def final_weights(run_dir):
    steps = checkpoints.saved_steps(run_dir)
    return checkpoints.load_checkpoint(run_dir, steps[-1])["model"]


def test_resume_after_kill_is_bitwise_identical(tmp_path):
    # With every point tracked: the values at every step resume too (tests/test_tracking.py for the rest).
    flags = [*SYNTHETIC, "--epochs", "30", "--save-freq", "40", "--momentum", "0.5", "--track-points", "all"]
    whole = subprocess.run([sys.executable, os.path.join(ROOT, "train_dpsgd.py"), *flags, "--models-dir", "a"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    run_name = os.listdir(tmp_path / "a")[0]
    interrupted_dir = tmp_path / "b" / run_name
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_dpsgd.py"), *flags, "--models-dir", "b"],
                               cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(checkpoints.saved_steps(interrupted_dir)) < 3 and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = checkpoints.saved_steps(interrupted_dir)
    assert 3 <= len(saved) and saved[-1] < 480, saved  # really interrupted mid-run
    resumed = subprocess.run([sys.executable, os.path.join(ROOT, "train_dpsgd.py"), *flags, "--models-dir", "b"],
                             cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    expected, got = final_weights(tmp_path / "a" / run_name), final_weights(interrupted_dir)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    tracked = [storage.read_frame(tracked_rows.table_path(str(tmp_path / folder / run_name))) for folder in ("a", "b")]
    pd.testing.assert_frame_equal(*tracked)


def test_rerun_of_finished_run_trains_nothing(tmp_path, run):
    first = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "1")
    assert first.returncode == 0, first.stderr
    second = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "1")
    assert second.returncode == 0 and "already trained" in second.stdout


def test_less_point_trains_on_one_point_fewer(tmp_path):
    args = parse(*SYNTHETIC, "--epochs", "1", "--less-point", "3", "--models-dir", tmp_path)
    metadata = training.train(args, quiet=True).run
    assert metadata.dataset_size == 511 and metadata.less_point == 3
    assert "less3" in metadata.run


def test_track_points_records_every_step(tmp_path, run):
    # A clip norm far below the gradient norms: w·||g|| lands on Γ, where float rounding could exceed it.
    args = parse(*SYNTHETIC, "--epochs", "1", "--cn", "1e-6", "--track-points", "0-4", "--models-dir", tmp_path)
    outcome = training.train(args, quiet=True)
    metadata = outcome.run
    frame = pd.read_csv(os.path.join(outcome.run_dir, "tracked_norms.csv"))
    # θ_0 .. θ_{T−1}, which the T steps start from, and the final θ_T.
    assert sorted(frame["step"].unique()) == list(range(metadata.total_steps + 1))
    assert sorted(frame["point"].unique()) == [0, 1, 2, 3, 4]
    # The Γ cap holds exactly (the sensitivity engine's cap, clipping.transformed_norm), no tolerance.
    assert (frame["value"] <= metadata.clip_bound).all() and (frame["value"] > 0).all()
    # The tracked norms are the Δ* that compute_sensitivity.py measures at the same checkpoints.
    measured = run("compute_sensitivity.py", "--run", metadata.run, "--models-dir", tmp_path, "--points", "0-4",
                   "--stage", "all", "--res-name", "tracked")
    assert measured.returncode == 0, measured.stderr
    rows = pd.read_csv(tmp_path / "res" / "tracked.csv").set_index(["step", "point"])["value"]
    tracked = frame.set_index(["step", "point"])["value"].reindex(rows.index).dropna()
    assert len(tracked) >= 5 and np.allclose(tracked, rows.loc[tracked.index], rtol=1e-5, atol=0)


# --- Bad input --------------------------------------------------------------------------

BAD_INPUTS = [
    (["--dataset", "nope"], "--dataset"),
    (["--model", "vgg"], "--model"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "513"], "--batch-size"),
    (["--epochs", "0"], "--epochs"),
    (["--eps", "0"], "--eps"),
    (["--delta", "1.5"], "--delta"),
    (["--delta", "0"], "--delta"),
    (["--eps", "1", "--sigma", "1"], "--eps"),
    (["--cn", "0"], "--cn"),
    (["--save-freq", "0"], "--save-freq"),
    (["--save-steps", "17"], "--save-steps"),  # T = 16
    (["--save-steps", "two"], "--save-steps"),
    (["--less-point", "512"], "--less-point"),
    (["--less-point", "-1"], "--less-point"),
    (["--model", "resnet20", "--dataset", "synthetic", "--norm-type", "batch"], "--norm-type"),
    (["--reduction", "median"], "--reduction"),
    (["--batch-size", "ten"], "--batch-size"),
]


@pytest.mark.parametrize("flags,flag", BAD_INPUTS)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, run, flags, flag):
    before = snapshot(tmp_path)
    result = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "1", *flags)
    assert_usage_error(result, flag)
    assert snapshot(tmp_path) == before


def test_existing_run_with_other_flags_is_refused_unless_overwrite(tmp_path, run):
    assert run("train_dpsgd.py", *SYNTHETIC, "--epochs", "1", "--save-name", "x").returncode == 0
    before = snapshot(tmp_path)
    result = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "2", "--save-name", "x")
    assert_usage_error(result, "--overwrite")
    assert "epochs" in result.stderr
    assert snapshot(tmp_path) == before
    again = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "2", "--save-name", "x", "--overwrite", "1")
    assert again.returncode == 0, again.stderr


def test_corrupt_checkpoint_is_named_when_resuming(tmp_path, run):
    assert run("train_dpsgd.py", *SYNTHETIC, "--epochs", "1", "--save-name", "x", "--save-freq", "4").returncode == 0
    last = checkpoints.checkpoint_path(str(tmp_path / "models" / "x"), 16)
    with open(last, "r+b") as handle:
        handle.truncate(100)
    result = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "1", "--save-name", "x", "--save-freq", "4")
    assert_usage_error(result, "--save-name")
    assert "step_0000016.pt" in result.stderr


def test_short_real_run_on_embedded_mnist_learns(tmp_path):
    # Measured: 89.0% test accuracy after 2 epochs at ε = 10 (chance is 10%).
    args = parse("--epochs", "2", "--eps", "10", "--save-freq", "1000", "--models-dir", tmp_path)
    outcome = training.train(args, quiet=True)
    assert outcome.final_test_accuracy > 0.80


def test_a_diverging_run_stops_at_the_first_non_finite_loss(tmp_path, run):
    """ResNet-20 without clipping at the largest allowed learning rate: the loss overflows within a
    few steps. Training stops there with one line naming --lr, instead of finishing with NaN weights;
    the checkpoints before are kept, every weight finite, and none after."""
    models = tmp_path / "models"
    result = run("train_dpsgd.py", "--dataset", "synthetic", "--model", "resnet20", "--batch-size", "32", "--no-dp",
                 "--lr", "1e6", "--epochs", "1", "--save-freq", "1", "--models-dir", models, "--save-name", "wild")
    # The last line (the progress bar is above it): exit 2, naming --lr, no traceback.
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --lr: training diverged: the loss is nan at step")
    step = int(result.stderr.split("at step ")[1].split()[0])
    assert 1 < step < 16
    assert checkpoints.saved_steps(models / "wild") == list(range(step))
    for kept in range(step):
        weights = checkpoints.load_checkpoint(models / "wild", kept)["model"].values()
        assert all(torch.isfinite(tensor).all() for tensor in weights)

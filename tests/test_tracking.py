"""Δ* of the tracked points at every step (perinstance/train/tracking.py, docs/accounting.md §4): the values at θ_s are
compute_sensitivity.py's at checkpoint s, a resumed run ends with an uninterrupted one's values, the table turns
Parquet past the storage threshold and the composition reads it either way, torchrun's ranks share the points in
lockstep, and the cost is printed."""

import os

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_in_process
from test_distributed import torchrun

from perinstance.cli import options
from perinstance.files import checkpoints, storage, tracked_rows
from perinstance.persample.layer_pass import eval_mode
from perinstance.train import run_plan, training

SYNTHETIC = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--sigma", "1.0",
             "--clipping", "psac"]
# LeNet-5 on 256 MNIST digits: the convolutions' norm forms, at a size a test can afford.
LENET = ["--dataset", "first:256:mnist-embedded", "--model", "lenet5", "--batch-size", "32", "--lr", "1.0",
         "--sigma", "1.0", "--epochs", "0.5"]


def parse(*argv):
    return options.parse_training_flags(list(map(str, argv)))


def tracked_table(run_dir):
    return storage.read_frame(tracked_rows.table_path(str(run_dir))).sort_values(["step", "point"], ignore_index=True)


@pytest.mark.parametrize("flags", [LENET, [*SYNTHETIC, "--epochs", "1", "--save-freq", "5"]], ids=["lenet5", "mlp"])
def test_tracked_values_are_compute_sensitivitys_at_every_checkpoint(tmp_path, run, flags):
    outcome = training.train(parse(*flags, "--track-points", "all", "--models-dir", tmp_path), quiet=True)
    total = outcome.run.total_steps
    frame = tracked_table(outcome.run_dir)
    # θ_0 .. θ_T: the parameters each step starts from, and the final ones; every point at every one.
    assert sorted(frame["step"].unique()) == list(range(total + 1))
    assert len(frame) == (total + 1) * outcome.run.dataset_size
    assert set(frame["exp"]) == {"tracked"} and set(frame["quantity"]) == {"grad_norm"}
    measured = run("compute_sensitivity.py", "--run", outcome.run.run, "--models-dir", tmp_path, "--points", "all",
                   "--stage", "all", "--res-name", "checkpoints")
    assert measured.returncode == 0, measured.stderr
    at_checkpoints = pd.read_csv(tmp_path / "res" / "checkpoints.csv").set_index(["step", "point"])
    assert sorted(at_checkpoints.index.get_level_values("step").unique()) == checkpoints.saved_steps(outcome.run_dir)
    tracked = frame.set_index(["step", "point"]).loc[at_checkpoints.index]
    # float32 work on both sides, by the same norms pass (chunks may be cut alike or not).
    np.testing.assert_allclose(tracked["value"], at_checkpoints["value"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(tracked["loss"], at_checkpoints["loss"], rtol=1e-5, atol=1e-7)
    assert (tracked["correct"] == at_checkpoints["correct"]).mean() > 0.99  # a tie of two logits may flip
    assert (frame["value"] <= outcome.run.clip_bound).all()


def test_tracking_measures_in_eval_mode_and_restores_the_mode(tmp_path):
    args = run_plan.resolve_training_args(parse(*SYNTHETIC, "--track-points", "0-9", "--models-dir", tmp_path))
    dataset = training.load_dataset(args.dataset, args.data_root)
    run = run_plan.plan_run(args, dataset)
    trainer = training.Trainer(run, dataset)
    # A dropout layer draws anew in training mode: equal values twice means eval mode.
    trainer.model = torch.nn.Sequential(*trainer.model, torch.nn.Dropout(0.5))
    trainer.tracker.model = trainer.model
    trainer.model.train()
    trainer.tracker.measure(0)
    trainer.tracker.measure(1)
    assert trainer.model.training
    first, second = trainer.tracker.held
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, trainer.tracker.values(2))  # in training mode, dropout draws
    with eval_mode(trainer.model):
        np.testing.assert_array_equal(first, trainer.tracker.values(2))


def interrupt_after(monkeypatch, step, before_checkpoint):
    """Make the next training stop as a kill would: right after saving checkpoint `step`, or after writing the values
    that checkpoint `step` ends but before saving it."""
    save = checkpoints.save_checkpoint

    def saving(run_dir, at, payload):
        if at == step and before_checkpoint:
            raise KeyboardInterrupt
        save(run_dir, at, payload)
        if at == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints, "save_checkpoint", saving)


@pytest.mark.parametrize("step, before_checkpoint", [(8, False), (8, True), (16, True)])
def test_an_interrupted_run_resumes_to_the_same_tracked_values(tmp_path, monkeypatch, step, before_checkpoint):
    flags = [*SYNTHETIC, "--epochs", "1.5", "--save-freq", "4", "--track-points", "random:50"]
    whole = training.train(parse(*flags, "--models-dir", tmp_path / "a"), quiet=True)
    with monkeypatch.context() as patch:
        interrupt_after(patch, step, before_checkpoint)
        with pytest.raises(KeyboardInterrupt):
            training.train(parse(*flags, "--models-dir", tmp_path / "b"), quiet=True)
    run_dir = tmp_path / "b" / whole.run.run
    assert not tracked_rows.has_table(str(run_dir)) and tracked_rows.segments(str(run_dir))
    resumed = training.train(parse(*flags, "--models-dir", tmp_path / "b"), quiet=True)
    assert resumed.resumed_from == (step - 4 if before_checkpoint else step)
    pd.testing.assert_frame_equal(tracked_table(run_dir), tracked_table(whole.run_dir))
    # The values live in their own segments, never in a checkpoint.
    assert "tracked_norms" not in checkpoints.load_checkpoint(str(run_dir), step)
    assert not os.path.exists(run_dir / tracked_rows.FOLDER)


def test_a_checkpoint_of_the_earlier_format_resumes(tmp_path):
    """Checkpoints written before the segments held every tracked row so far in "tracked_norms": a run interrupted
    then resumes from them."""
    flags = [*SYNTHETIC, "--epochs", "1", "--save-freq", "4", "--track-points", "0-9"]
    whole = training.train(parse(*flags, "--models-dir", tmp_path / "a"), quiet=True)
    frame = tracked_table(whole.run_dir)
    run_dir = tmp_path / "b" / whole.run.run
    training.train(parse(*flags, "--models-dir", tmp_path / "b"), quiet=True)
    for name in os.listdir(run_dir):
        if name.startswith("tracked_norms") or checkpoints.CHECKPOINT_PATTERN.match(name) and \
                int(name[5:12]) > 8:
            os.remove(run_dir / name)
    payload = checkpoints.load_checkpoint(str(run_dir), 8)
    earlier = frame[frame["step"] < 8].pivot(index="step", columns="point")[["value", "loss", "correct"]]
    payload["tracked_norms"] = torch.tensor(earlier.to_numpy(dtype=float), dtype=torch.float64)
    checkpoints.save_checkpoint(str(run_dir), 8, payload)
    resumed = training.train(parse(*flags, "--models-dir", tmp_path / "b"), quiet=True)
    assert resumed.resumed_from == 8
    pd.testing.assert_frame_equal(tracked_table(run_dir), frame)


def test_the_table_turns_parquet_past_the_threshold_and_the_composition_reads_it(tmp_path, run, monkeypatch):
    monkeypatch.setattr(storage, "AUTO_PARQUET_ROWS", 1000)
    outcome = training.train(parse(*SYNTHETIC, "--epochs", "1", "--track-points", "all", "--models-dir", tmp_path),
                             quiet=True)
    path = tracked_rows.table_path(outcome.run_dir)
    assert path.endswith("tracked_norms.parquet") and not os.path.exists(path[:-len(".parquet")] + ".csv")
    composed = run("renyi_per_instance_sum_compo.py", "--res-file", path, "--holder-b", "inf", "--out", "p.csv")
    assert composed.returncode == 0, composed.stderr
    assert "Δ* at every step (a bound along the observed run)" in composed.stdout
    assert set(pd.read_csv(tmp_path / "p.csv")["kind"]) == {"certified", "baseline"}
    # The same rows as CSV compose to the same numbers.
    storage.write_frame(str(tmp_path / "same.csv"), storage.read_frame(path))
    again = run("renyi_per_instance_sum_compo.py", "--res-file", "same.csv", "--holder-b", "inf", "--out", "c.csv")
    assert again.returncode == 0, again.stderr
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "p.csv"), pd.read_csv(tmp_path / "c.csv"))


def test_the_summary_line_prints_the_cost_of_tracking(tmp_path, run):
    result = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "1", "--track-points", "all")
    assert result.returncode == 0, result.stderr
    assert "tracked 512 points at every step in " in result.stdout and "× the " in result.stdout
    assert "s of the training steps" in result.stdout


def test_two_ranks_track_their_shares_in_lockstep(tmp_path):
    """torchrun with 2 Gloo processes and one run: rank 0 trains it as a single process would (the same checkpoint
    bytes), both measure half of the points at rank 0's parameters, and the table is the single process's."""
    flags = [*SYNTHETIC, "--epochs", "1", "--save-freq", "5", "--track-points", "all"]
    (tmp_path / "two").mkdir()
    result = torchrun("train_dpsgd.py", *flags, cwd=tmp_path / "two")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1/2: " in result.stdout and "measured 256 of 512 tracked points at every step" in result.stdout
    assert "1 run(s) in lockstep, the tracked points shared over 2 processes" in result.stdout
    single = training.train(parse(*flags, "--models-dir", tmp_path / "one"), quiet=True)
    two_dir = tmp_path / "two" / "models" / single.run.run
    for step in checkpoints.saved_steps(single.run_dir):
        assert open(checkpoints.checkpoint_path(str(two_dir), step), "rb").read() == \
            open(checkpoints.checkpoint_path(single.run_dir, step), "rb").read()
    shared, alone = tracked_table(two_dir), tracked_table(single.run_dir)
    pd.testing.assert_frame_equal(shared.drop(columns=["value", "loss"]), alone.drop(columns=["value", "loss"]))
    np.testing.assert_allclose(shared[["value", "loss"]], alone[["value", "loss"]], rtol=1e-5, atol=1e-7)


def test_an_error_on_rank_0_stops_every_rank_of_the_lockstep(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "taken").write_text("not a run folder")
    result = torchrun("train_dpsgd.py", *SYNTHETIC, "--epochs", "1", "--track-points", "all", "--save-name", "taken",
                      cwd=tmp_path)
    assert result.returncode != 0 and "is a file, not a run folder" in result.stderr
    # Rank 0 fails once the lockstep has begun (resuming from a damaged checkpoint): the waiting rank stops with
    # the same one-line error instead of waiting for parameters that never come.
    flags = [*SYNTHETIC, "--epochs", "1", "--save-freq", "4", "--track-points", "all", "--save-name", "damaged"]
    with monkeypatch.context() as patch:
        interrupt_after(patch, 8, before_checkpoint=False)
        with pytest.raises(KeyboardInterrupt):
            training.train(parse(*flags, "--models-dir", tmp_path / "models"), quiet=True)
    (tmp_path / "models" / "damaged" / "step_0000008.pt").write_bytes(b"not a checkpoint")
    damaged = torchrun("train_dpsgd.py", *flags, cwd=tmp_path)
    assert damaged.returncode != 0
    assert damaged.stderr.count("error: --save-name: models/damaged/step_0000008.pt") == 2, damaged.stderr[-3000:]


def test_lockstep_is_only_for_fewer_runs_than_processes(tmp_path):
    result = run_in_process("train_dpsgd.py", *SYNTHETIC, "--epochs", "0.25", "--seeds", "0-1", "--track-points", "0-3",
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "lockstep" not in result.stdout

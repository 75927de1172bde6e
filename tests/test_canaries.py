"""Canaries in a training run and audit.py's one-run modes (issue 26 items 1-3, issue 38 items 1, 4, 5)."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_usage_error, run_in_process, snapshot

from perinstance.accounting import one_run_audit, one_run_fdp, one_run_ideal
from perinstance.accounting.mechanism import Mechanism
from perinstance.audit import canary_audit
from perinstance.cli import options
from perinstance.errors import UsageError
from perinstance.train import canaries, input_canaries, run_plan, runs, sampling, training
from perinstance.train.data import load_dataset

# Plain SGD at a constant learning rate and a checkpoint at every step: each step's privatised update is
# (θ_{t−1} − θ_t)/lr, an independent way to read what the run's projections must be.
RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--sigma", "0.8", "--save-freq", "1", "--canaries", "200", "--canary-norms", "0.5,1", "--input-canaries", "40",
       "--save-name", "tiny"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    result = run_in_process("train_dpsgd.py", *RUN, "--models-dir", folder / "models", cwd=folder)
    assert result.returncode == 0, result.stderr
    return folder / "models"


def test_the_run_records_its_canaries(models):
    config = runs.load_run(models / "tiny")
    assert (config.canaries, config.canary_norms, config.input_canaries) == (200, (0.5, 1.0), 40)
    table = pd.read_csv(models / "tiny" / canaries.CANARY_FILE)
    assert list(table["kind"]) == ["gradient"] * 200 + ["input"] * 40
    assert list(table["norm"]) == [0.5] * 100 + [1.0] * 100 + [1.0] * 40
    np.testing.assert_array_equal(table["included"][:200], canaries.canary_inclusions(config.seed, 200))
    np.testing.assert_array_equal(table["included"][200:], canaries.canary_inclusions(
        config.seed, 40, input_canaries.INCLUSION_KEY))
    assert 70 < table["included"][:200].sum() < 130 and 5 < table["included"][200:].sum() < 35
    record = canaries.read_canaries(models / "tiny")
    assert record.projections.shape == (240, config.total_steps) and np.all(np.isfinite(record.projections))
    np.testing.assert_allclose(table["score"], record.projections.sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(table["lr_score"][:100], one_run_ideal.likelihood_ratio_scores(
        record.projections[:100], norm=0.5, noise_multiplier=0.8, sample_rate=config.sample_rate), rtol=1e-6)


def step_updates(models, config):
    """Each step's privatised update, in average-gradient units, from consecutive checkpoints (plain SGD)."""
    weights = [torch.load(models / "tiny" / f"step_{step:07d}.pt", weights_only=True)["model"]
               for step in range(config.total_steps + 1)]
    return [[(before[name] - after[name]) / config.lr for name in before] for before, after in zip(weights, weights[1:])]


def test_gradient_canary_projections_are_the_updates_along_their_directions(models):
    config = runs.load_run(models / "tiny")
    updates = step_updates(models, config)
    dimension = sum(part.numel() for part in updates[0])
    coordinates, weights = canaries.canary_directions(config.seed, 200, dimension)
    record = canaries.read_canaries(models / "tiny")
    for step, update in enumerate(updates):
        flat = torch.cat([part.reshape(-1) for part in update]).double().numpy()
        expected = (flat[coordinates] * weights).sum(axis=1) * config.batch_size / config.clip_bound
        np.testing.assert_allclose(record.projections[:200, step], expected, atol=1e-4)


def test_input_canary_projections_are_the_updates_along_their_gradients(models):
    # One backward per canary at θ_{t−1} (from its checkpoint), not the engine's norms and forward-mode pass.
    config = runs.load_run(models / "tiny")
    dataset = load_dataset(config.dataset, "./data")
    inputs, labels = input_canaries.crafted_inputs(config.seed, 40, dataset.train_x, config.num_classes)
    updates = step_updates(models, config)
    record = canaries.read_canaries(models / "tiny")
    for step in (0, config.total_steps // 2, config.total_steps - 1):
        model, _ = training.load_model(config, str(models / "tiny"), step)
        params = [param for param in model.parameters() if param.requires_grad]
        direction = torch.cat([part.reshape(-1) for part in updates[step]]).double()
        for canary in range(0, 40, 7):
            loss = F.cross_entropy(model(inputs[canary:canary + 1]), labels[canary:canary + 1])
            grad = torch.cat([part.reshape(-1) for part in torch.autograd.grad(loss, params)]).double()
            expected = float(direction @ grad / grad.norm()) * config.batch_size / config.clip_bound
            assert record.projections[200 + canary, step] == pytest.approx(expected, rel=1e-3, abs=1e-4)


def test_crafted_inputs_are_orthogonal_to_every_training_input():
    dataset = load_dataset("mnist-embedded", "./data")
    inputs, labels = input_canaries.crafted_inputs(3, 20, dataset.train_x[:500], 10)
    flat = inputs.reshape(20, -1).double()
    assert torch.allclose(flat @ dataset.train_x[:500].reshape(500, -1).double().T, torch.zeros(20, 500).double(),
                          atol=1e-6 * flat.norm())
    assert (flat.abs() > 0).sum(dim=1).min() >= input_canaries.MIN_CONSTANT_FEATURES
    assert set(labels.tolist()) <= set(range(10))


def test_canaries_are_drawn_by_the_run_sampler(models):
    config = runs.load_run(models / "tiny")
    trainer = training.Trainer(config, load_dataset(config.dataset, "./data"))
    for step in (1, 5):
        batch, gradient_members = trainer.draw(step)
        drawn = sampling.poisson_batch(config.seed, step, config.dataset_size + 240, config.sample_rate)
        # The real points' batch is the one a run without canaries draws.
        real = sampling.poisson_batch(config.seed, step, config.dataset_size, config.sample_rate)
        np.testing.assert_array_equal(batch[batch < config.dataset_size], real)
        extra = drawn[drawn >= config.dataset_size] - config.dataset_size
        gradient = extra[extra < 200]
        np.testing.assert_array_equal(gradient_members, gradient[trainer.canaries.included[gradient]])
        inputs = extra[extra >= 200] - 200
        np.testing.assert_array_equal(batch[batch >= config.dataset_size] - config.dataset_size,
                                      inputs[trainer.input_canaries.included[inputs]])


def test_canaries_name_the_run():
    plain = options.parse_training_flags(["--dataset", "synthetic", "--sigma", "1"])
    with_canaries = options.parse_training_flags(["--dataset", "synthetic", "--sigma", "1", "--canaries", "60"])
    other_norms = options.parse_training_flags(["--dataset", "synthetic", "--sigma", "1", "--canaries", "60",
                                            "--canary-norms", "0.5"])
    with_inputs = options.parse_training_flags(["--dataset", "synthetic", "--sigma", "1", "--input-canaries", "60"])
    names = {run_plan.default_save_name(flags) for flags in (plain, with_canaries, other_norms, with_inputs)}
    assert len(names) == 4 and "canaries60" in run_plan.default_save_name(with_canaries)
    assert "inputcanaries60" in run_plan.default_save_name(with_inputs)
    assert "canaries" not in json.dumps(run_plan.identity_args(plain))


def test_resuming_gives_the_same_projections(models, tmp_path):
    copy = tmp_path / "models"
    shutil.copytree(models / "tiny", copy / "tiny")
    config = runs.load_run(copy / "tiny")
    for step in range(config.total_steps - 3, config.total_steps + 1):
        os.remove(copy / "tiny" / f"step_{step:07d}.pt")
    for name in (canaries.CANARY_FILE, canaries.PROJECTION_FILE):
        os.remove(copy / "tiny" / name)
    result = run_in_process("train_dpsgd.py", *RUN, "--models-dir", copy, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(canaries.read_canaries(copy / "tiny").projections,
                                  canaries.read_canaries(models / "tiny").projections)


class _Run:
    seed, canaries, canary_norms, clip_bound, sample_rate, batch_size = 3, 4, (0.5, 1.0), 2.0, 0.5, 8
    planted_fault = None


def test_a_canary_adds_c_times_gamma_along_its_unit_direction():
    params = [torch.zeros(5, 7), torch.zeros(11)]
    canary_set = canaries.Canaries(_Run, params, torch.device("cpu"))
    dense = np.zeros((4, 46))
    for row, (where, weights) in enumerate(zip(canary_set.coordinates.numpy(), canary_set.weights.numpy())):
        dense[row, where] = weights
    np.testing.assert_allclose(np.linalg.norm(dense, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(dense @ dense.T, np.eye(4), atol=1e-6)  # 4 canaries in 46 coordinates: disjoint
    summed = [torch.zeros(5, 7), torch.zeros(11)]
    canary_set.add_to(summed, np.array([1, 3]))
    flat = torch.cat([part.reshape(-1) for part in summed]).numpy()
    np.testing.assert_allclose(flat, 0.5 * 2.0 * dense[1] + 1.0 * 2.0 * dense[3], atol=1e-6)
    np.testing.assert_allclose(canary_set.project(summed).numpy(), dense @ flat * 8 / 2.0, atol=1e-5)


def dense_directions(coordinates, weights, dimension):
    dense = np.zeros((len(coordinates), dimension))
    for row, (where, values) in enumerate(zip(coordinates, weights)):
        dense[row, where] = values
    return dense


@pytest.mark.parametrize("count, dimension, support", [(5, 1000, 64), (300, 1000, 64), (1000, 1000, 8), (997, 1000, 8)])
def test_as_many_canaries_as_coordinates_are_orthogonal_on_as_many_coordinates_as_fit(count, dimension, support):
    coordinates, weights = canaries.canary_directions(0, count, dimension)
    assert coordinates.shape == (count, support)
    dense = dense_directions(coordinates, weights, dimension)
    np.testing.assert_allclose(dense @ dense.T, np.eye(count), atol=1e-12)


def test_more_canaries_than_coordinates_take_random_supports():
    coordinates, weights = canaries.canary_directions(0, 30, 20)
    assert coordinates.shape == (30, 20) and np.allclose((weights ** 2).sum(axis=1), 1.0)


def test_upper_bounds_are_the_accountants_at_the_scaled_noise(models):
    # RDP at sensitivity c·Γ is the baseline of σ/c (Opacus's RDP, accounting.md §3.1).
    config = runs.load_run(models / "tiny")
    rdp, pld_eps = canary_audit.upper_bounds(config, np.array([0.5, 1.0]), 1e-5)
    for norm, eps in zip((0.5, 1.0), rdp, strict=True):
        scaled = dataclasses.replace(Mechanism.of_run(config, "sum"), noise_multiplier=config.noise_multiplier / norm)
        assert eps == pytest.approx(scaled.baseline_eps(1e-5)[0], rel=1e-3)
    assert np.all(pld_eps <= rdp) and np.all(pld_eps > 0)


def test_one_run_audit_of_the_run(models, tmp_path):
    result = run_in_process("audit.py", "--run", "tiny", "--models-dir", models, "--one-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(tmp_path / "res" / "tiny_one_run_audit.csv")
    assert list(table["kind"]) == ["gradient", "gradient", "input"] and list(table["norm"]) == [0.5, 1.0, 1.0]
    assert list(table["canaries"]) == [100, 100, 40] and not table["violated"].any()
    assert table["group_significance"].tolist() == pytest.approx([0.05 / 3] * 3)
    assert np.all(table["lower_bound"] <= table["upper_bound"]) and np.all(table["lower_bound"] <= table["fdp_cap"])
    config = runs.load_run(models / "tiny")
    record = canaries.read_canaries(models / "tiny")
    group = (record.kinds == "gradient") & (record.norms == 1.0)
    scores = one_run_ideal.likelihood_ratio_scores(record.projections[group], norm=1.0, noise_multiplier=0.8,
                                                   sample_rate=config.sample_rate)
    included = record.included[group]
    family = one_run_fdp.family_lower_bound(scores[included], scores[~included], sample_rate=config.sample_rate,
                                            steps=config.total_steps, delta=1e-5, significance=0.05 / 3)
    assert table["lower_bound"].iloc[1] == pytest.approx(family.epsilon, abs=1e-9)
    summed = record.projections[group].sum(axis=1)
    assert table["steinke_lower_summed"].iloc[1] == pytest.approx(one_run_audit.one_run_epsilon(
        summed[included], summed[~included], significance=0.05 / 3, delta=1e-5), abs=1e-9)
    assert "consistent with the accounting" in result.stdout and "insertions of c·Γ·u" in result.stdout


def copy_run(models, tmp_path):
    """The trained run's files that the one-run audit reads, copied under tmp_path/models/tiny: (folder, config)."""
    copy = tmp_path / "models" / "tiny"
    os.makedirs(copy)
    config = runs.load_run(models / "tiny")
    for name in ("run.json", canaries.CANARY_FILE, canaries.PROJECTION_FILE, f"step_{config.total_steps:07d}.pt"):
        shutil.copyfile(models / "tiny" / name, copy / name)
    return copy, config


def test_a_rejected_curve_is_a_loud_violation(models, tmp_path):
    # The in-canaries of the norm-1 group made to stand out at every step, held against the accounting of a run
    # with 1000 times the noise: no curve of that noise allows it.
    copy, config = copy_run(models, tmp_path)
    runs.save_run(str(copy), dataclasses.replace(config, noise_multiplier=config.noise_multiplier * 1000))
    record = canaries.read_canaries(copy)
    loud = record.projections.copy()
    group = (record.kinds == "gradient") & (record.norms == 1.0)
    loud[group & record.included] += 5.0
    np.save(copy / canaries.PROJECTION_FILE, loud.astype(np.float32))
    result = run_in_process("audit.py", "--run", "tiny", "--models-dir", tmp_path / "models", "--one-run",
                            cwd=tmp_path)
    assert result.returncode == 1
    assert "VIOLATION: the canaries reject the accountant's trade-off curve for the gradient canaries of norm 1" \
        in result.stdout
    table = pd.read_csv(tmp_path / "res" / "tiny_one_run_audit.csv")
    assert table["violated"].tolist() == [False, True, False]
    assert table["lower_bound"].iloc[1] > table["upper_bound"].iloc[1]


def test_a_group_without_held_out_canaries_is_refused(models, tmp_path):
    copy, _ = copy_run(models, tmp_path)
    table = pd.read_csv(copy / canaries.CANARY_FILE)
    table.loc[(table["norm"] == 1.0) & (table["kind"] == "gradient"), "included"] = 1
    table.to_csv(copy / canaries.CANARY_FILE, index=False)
    result = run_in_process("audit.py", "--run", "tiny", "--models-dir", tmp_path / "models", "--one-run",
                            cwd=tmp_path)
    assert_usage_error(result, "--run")
    assert "every gradient canary of norm 1 is held in" in result.stderr
    assert not (tmp_path / "res").exists()


def test_a_run_of_an_earlier_version_is_refused(models, tmp_path):
    copy, _ = copy_run(models, tmp_path)
    os.remove(copy / canaries.PROJECTION_FILE)
    result = run_in_process("audit.py", "--run", "tiny", "--models-dir", tmp_path / "models", "--one-run",
                            cwd=tmp_path)
    assert_usage_error(result, "--run")
    assert "earlier version" in result.stderr


def test_a_planted_fault_is_recorded_and_never_read_as_a_real_run(models, tmp_path):
    copy, config = copy_run(models, tmp_path)
    runs.save_run(str(copy), dataclasses.replace(config, planted_fault="half_noise"))
    assert json.load(open(copy / "run.json"))["planted_fault"] == "half_noise"
    with pytest.raises(UsageError, match="positive control of audit.py --self-test"):
        runs.load_run(str(copy))
    assert_usage_error(run_in_process("audit.py", "--run", "tiny", "--models-dir", tmp_path / "models", "--one-run",
                                      cwd=tmp_path), "--save-name")


def test_each_planted_fault_changes_what_the_trainer_does(models):
    config = runs.load_run(models / "tiny")
    dataset = load_dataset(config.dataset, "./data")
    correct = training.Trainer(config, dataset)
    planted = {fault: training.Trainer(dataclasses.replace(config, planted_fault=fault), dataset)
               for fault in runs.PLANTED_FAULTS if fault != "noise_before_division"}
    assert planted["half_noise"].noise_std == pytest.approx(correct.noise_std / 2)
    norms = torch.tensor([0.1, 1.0, 30.0])
    assert torch.equal(planted["no_clipping"]._weights(norms), torch.ones(3)) and correct._weights(norms)[2] < 1
    sizes = [sum(len(trainer.draw(step)[0]) + len(trainer.draw(step)[1]) for step in range(1, 30))
             for trainer in (correct, planted["double_rate"])]
    assert 1.6 < sizes[1] / sizes[0] < 2.4
    # A drawn canary of norm c adds Γ/c instead of c·Γ: read back along its direction, in units of Γ.
    drawn = np.array([0, 150])  # norms 0.5 and 1
    for trainer, expected in ((correct, [0.5, 1.0]), (planted["inverted_norm"], [2.0, 1.0])):
        summed = [torch.zeros_like(param) for param in trainer.params]
        trainer.canaries.add_to(summed, drawn)
        added = trainer.canaries.project([part / config.batch_size for part in summed])[drawn]
        np.testing.assert_allclose(added.numpy(), expected, rtol=1e-5)
    # Under the mean rule the noise of the mean is added to the sum before the division by the batch's size |B|:
    # |B| times less noise on the update.
    mean_rule = dataclasses.replace(config, update_rule="mean")
    batch = np.arange(10)
    correct.log.begin(1, batch)  # a pass belongs to a step, whose values the trainer checks
    summed, _ = correct.per_sample_pass(torch.as_tensor(batch))
    noise_of = {}
    for fault in (None, "noise_before_division"):
        trainer = training.Trainer(dataclasses.replace(mean_rule, planted_fault=fault), dataset)
        trainer.log.begin(1, batch)
        update, _ = trainer.privatised_gradient(1, batch)
        noise_of[fault] = torch.cat([(part - total / len(batch)).reshape(-1) for part, total in zip(update, summed)])
    assert noise_of[None].std() > 0
    torch.testing.assert_close(noise_of["noise_before_division"] * len(batch), noise_of[None], rtol=1e-4, atol=1e-6)


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
    (["--self-test", "--run", "x"], "--self-test"),
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
    (["--input-canaries", "1"], "--input-canaries"),
    (["--input-canaries", "10", "--no-dp"], "--input-canaries"),
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

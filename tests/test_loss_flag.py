"""A loss of one's own from the command line (issue 39 item 2, `--loss PATH.py:NAME`): regression with a mean
squared error, a token-level sequence loss and label smoothing, written to temp files here, through train_dpsgd.py,
compute_sensitivity.py, the tracked points and the accountants; Δ* against one plain backward per example of the
same loss, written here; run.json's record of the file and a changed file refused; bad --loss values."""

import hashlib
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_usage_error, leave_one_out_statistics, snapshot
from test_user_code import CLIP, check_sensitivities, end_to_end, import_file, plain_gradients, plain_norms, write

from perinstance.cli import options
from perinstance.train import planned_run

REGRESSION = '''
import torch
from torch import nn


def make(input_shape, num_classes):
    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.Tanh(), nn.Linear(8, num_classes))


def data():
    """y = a linear function of 5 Gaussian inputs, plus noise: one float target per point."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 5, generator=generator)
    y = x @ torch.linspace(-1, 1, 5) + 0.1 * torch.randn(64, generator=generator)
    return (x[:48], y[:48]), (x[48:], y[48:])


def classes():
    """The same inputs, the sign of the linear function as the class."""
    (train_x, train_y), (test_x, test_y) = data()
    return (train_x, (train_y > 0).long()), (test_x, (test_y > 0).long())
'''

LOSSES = '''
import torch.nn.functional as F
from torch import nn


def mse(outputs, targets):
    return (outputs.squeeze(1) - targets) ** 2


smoothed = nn.CrossEntropyLoss(reduction="none", label_smoothing=0.2)
Smoothed = nn.CrossEntropyLoss
NUMBER = 3


def scalar(outputs, targets):
    return mse(outputs, targets).mean()


def raises(outputs, targets):
    raise ValueError("no such target")


def integers(outputs, targets):
    return (outputs.squeeze(1) > targets).long()


def late(outputs, targets):
    if len(targets) > 2:
        raise ValueError("a batch larger than the check")
    return mse(outputs, targets)
'''

SEQUENCE = '''
import torch
import torch.nn.functional as F
from torch import nn

VOCABULARY = 6


class NextToken(nn.Module):
    """Each token's embedding -> a Linear on every token -> logits over the vocabulary for the next token."""

    def __init__(self, width=8):
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCABULARY)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def text():
    """Sequences of 6 token ids; the target of each token is the token after it, (id + 1) mod 6."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCABULARY, (40, 6), generator=generator)
    return (ids[:32], (ids[:32] + 1) % VOCABULARY), (ids[32:], (ids[32:] + 1) % VOCABULARY)


def per_token(outputs, targets):
    """One loss per token, (n, tokens): the suite sums them per example."""
    return F.cross_entropy(outputs.transpose(1, 2), targets, reduction="none")
'''

# A loss summed over 6 tokens has a larger gradient than one example's: a bound that leaves some points unclipped.
TOKEN_CLIP = 30.0


def squared_error(output, target):
    """A batch of one's squared error, written here apart from the file's loss."""
    return F.mse_loss(output.squeeze(1), target, reduction="sum")


def test_regression_with_mean_squared_error_end_to_end(run, tmp_path):
    model_file = write(tmp_path, "regression.py", REGRESSION)
    loss_file = write(tmp_path, "losses.py", LOSSES)
    sums, run_dir, _, printed = end_to_end(run, tmp_path, "regression.py:make", "regression.py:data", 12,
                                           "--loss", "losses.py:mse")
    config = json.loads((run_dir / "run.json").read_text())
    assert config["loss"] == "losses.py:mse" and config["num_classes"] == 1
    assert config["user_code"]["loss"] == {"spec": "losses.py:mse", "path": loss_file,
                                           "sha256": hashlib.sha256(open(loss_file, "rb").read()).hexdigest()}
    # No accuracy where the targets are regression values: the summary gives the test loss instead.
    assert "no test accuracy (the targets are not class labels); test loss " in printed, printed
    assert sums["label"].isna().all() and sums["correct"].isna().all() and sums["accuracy"].isna().all()
    (inputs, targets), _ = import_file(model_file).data()
    check_sensitivities(sums, model_file, "make", run_dir, inputs, targets, squared_error)
    # The recorded loss at the checkpoint: the squared error, not a cross-entropy.
    final = sums[sums["step"] == sums["step"].max()].sort_values("point")
    model = import_file(model_file).make(input_shape=[5], num_classes=1)
    model.load_state_dict(torch.load(run_dir / f"step_{final['step'].iloc[0]:07d}.pt", weights_only=True)["model"])
    with torch.no_grad():
        expected = (model(inputs).squeeze(1) - targets) ** 2
    np.testing.assert_allclose(final["loss"].to_numpy(), expected.numpy(), rtol=1e-5, atol=1e-7)
    # The mean rule's dataset statistics of the same loss: leave-one-out moments of the clipped rows h_i.
    measured = run("compute_sensitivity.py", "--run", "mine", "--reduction", "mean", "--points", "0-3", "--stage",
                   "final", "--num-batches", 0, "--res-name", "statistics")
    assert measured.returncode == 0, measured.stderr
    statistics = pd.read_csv(tmp_path / "res" / "statistics.csv").set_index(["point", "quantity"])["value"]
    gradients = plain_gradients(model_file, "make", run_dir, int(final["step"].iloc[0]), inputs, targets,
                                squared_error)
    clipped = gradients * np.minimum(1.0, CLIP / np.linalg.norm(gradients, axis=1))[:, None]
    for point in range(4):
        exact = dict(leave_one_out_statistics(clipped, point))
        for quantity in ("center_distance", "spread"):
            np.testing.assert_allclose(statistics[(point, quantity)], exact[quantity], rtol=1e-4, atol=1e-6)
        # b_X is bounded from above (coupling.dataset_statistics: the triangle inequality), never below it.
        assert exact["max_deviation"] * (1 - 1e-5) <= statistics[(point, "max_deviation")]


def test_token_level_loss_summed_over_tokens_with_tracked_points(run, tmp_path):
    model_file = write(tmp_path, "sequence.py", SEQUENCE)
    flags = ["--model", "sequence.py:NextToken", "--dataset", "sequence.py:text", "--loss", "sequence.py:per_token",
             "--batch-size", 8, "--epochs", 1, "--lr", 0.5, "--cn", TOKEN_CLIP, "--save-name", "tokens",
             "--track-points", "all"]
    trained = run("train_dpsgd.py", *flags)
    assert trained.returncode == 0, trained.stderr
    measured = run("compute_sensitivity.py", "--run", "tokens", "--reduction", "sum", "--points", "all", "--stage",
                   "all", "--res-name", "tokens")
    assert measured.returncode == 0, measured.stderr
    sums = pd.read_csv(tmp_path / "res" / "tokens.csv")
    run_dir = tmp_path / "models" / "tokens"
    (inputs, targets), _ = import_file(model_file).text()
    check_sensitivities(sums, model_file, "NextToken", run_dir, inputs, targets,
                        lambda output, target: F.cross_entropy(output.transpose(1, 2), target, reduction="sum"),
                        TOKEN_CLIP)
    # The tracked points at each checkpoint: the same loss, the same Δ* as compute_sensitivity.py's.
    tracked = pd.read_csv(run_dir / "tracked_norms.csv").set_index(["step", "point"])
    at_checkpoints = sums.set_index(["step", "point"])
    tracked = tracked.loc[at_checkpoints.index]
    np.testing.assert_allclose(tracked["value"], at_checkpoints["value"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(tracked["loss"], at_checkpoints["loss"], rtol=1e-5, atol=1e-7)
    assert tracked["correct"].isna().all() and tracked["label"].isna().all()
    result = run("renyi_per_instance_sum.py", "--res-name", "tokens")
    assert result.returncode == 0, result.stderr


def test_label_smoothing_instance_keeps_the_accuracy(run, tmp_path):
    model_file = write(tmp_path, "regression.py", REGRESSION)
    write(tmp_path, "losses.py", LOSSES)
    flags = ["--model", "regression.py:make", "--dataset", "regression.py:classes", "--loss", "losses.py:smoothed",
             "--batch-size", 12, "--epochs", 1, "--lr", 0.5, "--cn", CLIP, "--save-name", "smooth"]
    trained = run("train_dpsgd.py", *flags)
    assert trained.returncode == 0, trained.stderr
    assert re.search(r"; test accuracy [01]\.\d{4};", trained.stdout), trained.stdout  # class labels: accuracy
    measured = run("compute_sensitivity.py", "--run", "smooth", "--points", "all", "--stage", "all",
                   "--res-name", "smooth")
    assert measured.returncode == 0, measured.stderr
    sums = pd.read_csv(tmp_path / "res" / "smooth.csv")
    assert set(sums["correct"]) <= {0, 1} and sums["label"].notna().all()
    (inputs, targets), _ = import_file(model_file).classes()
    run_dir = tmp_path / "models" / "smooth"
    check_sensitivities(sums, model_file, "make", run_dir, inputs, targets,
                        lambda output, target: F.cross_entropy(output, target, label_smoothing=0.2, reduction="sum"))
    # Without the smoothing the norms differ: the comparison above sees which loss was differentiated.
    plain = plain_norms(model_file, "make", run_dir, 0, inputs, targets)
    first = sums[sums["step"] == 0].sort_values("point")["value"].to_numpy()
    assert np.abs(np.minimum(plain, CLIP) - first).max() > 1e-3


def test_changed_loss_file_is_refused_on_resume_and_measurement(run, tmp_path):
    write(tmp_path, "regression.py", REGRESSION)
    write(tmp_path, "losses.py", LOSSES)
    flags = ["--model", "regression.py:make", "--dataset", "regression.py:data", "--loss", "losses.py:mse",
             "--batch-size", 12, "--epochs", 1, "--save-name", "mine"]
    assert run("train_dpsgd.py", *flags).returncode == 0
    (tmp_path / "losses.py").write_text(LOSSES + "\n# edited\n")
    before = snapshot(tmp_path)
    for result in (run("train_dpsgd.py", *flags),
                   run("compute_sensitivity.py", "--run", "mine", "--points", "0", "--res-name", "x")):
        assert_usage_error(result, "--loss")
        assert str(tmp_path / "losses.py") in result.stderr and "changed" in result.stderr
        assert snapshot(tmp_path) == before
    (tmp_path / "losses.py").write_text(LOSSES)
    assert run("train_dpsgd.py", *flags).returncode == 0  # the restored file: the run is the same again


@pytest.mark.parametrize("loss, words", [
    ("mse", "is not PATH.py:NAME"),
    ("missing.py:mse", "no such file"),
    ("losses.py:missing", "has no 'missing'"),
    ("losses.py:Smoothed", "is a class"),
    ("losses.py:NUMBER", "is not callable"),
    ("losses.py:scalar", "returned shape () for 2 examples"),
    ("losses.py:raises", "losses.py:raises raised ValueError: no such target ("),
    ("losses.py:integers", "floating point"),
    ("losses.py:late", "losses.py:late raised ValueError: a batch larger than the check ("),
])
def test_bad_loss_is_one_line_and_writes_nothing(run, tmp_path, loss, words):
    write(tmp_path, "regression.py", REGRESSION)
    write(tmp_path, "losses.py", LOSSES)
    flags = ["--model", "regression.py:make", "--dataset", "regression.py:data", "--batch-size", 12, "--epochs", 1]
    before = snapshot(tmp_path)
    result = run("train_dpsgd.py", *flags, "--loss", loss)
    assert_usage_error(result, "--loss")
    assert words in result.stderr, result.stderr
    if loss != "losses.py:late":  # refused before any write; a loss failing mid-run leaves its checkpoints
        assert snapshot(tmp_path) == before


def test_other_targets_need_a_loss_and_the_default_run_json_is_unchanged(run, tmp_path):
    write(tmp_path, "regression.py", REGRESSION)
    result = run("train_dpsgd.py", "--model", "regression.py:make", "--dataset", "regression.py:data")
    assert_usage_error(result, "--dataset")
    assert "scalars of float32" in result.stderr and "--loss PATH.py:NAME" in result.stderr
    assert not (tmp_path / "models").exists()
    flags = options.parse_training_flags(["--dataset", "synthetic", "--model", "mlp", "--models-dir", str(tmp_path)])
    # The default loss: run.json as before --loss existed, and the same default run name.
    assert "loss" not in planned_run.plan(flags).config.to_json()

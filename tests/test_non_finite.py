"""NaN and inf from the user's own code (persample/finite.py, train/non_finite.py): a model's outputs, a --loss, a
loss_fn and their gradients planted with values that are not finite, through the trainer (with and without the
tracked points, with and without privacy), the measurement, the audit and the API. Each is refused in one line
naming the flag or argument, the example and the step; a refused new run leaves no file, a resumed one its earlier
checkpoints; the learning rate is named only where the suite's own code made the value."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_usage_error, snapshot
from opacus import PrivacyEngine
from test_user_code import write
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from perinstance import IndividualAccountant, sensitivities
from perinstance.files import fileio
from perinstance.persample import finite

warnings.filterwarnings("ignore", message="Secure RNG turned off")

# The planted value is chosen at call time by the environment (PLANT), so that one file, whose sha256 run.json
# records, trains cleanly and is then measured with a value that is not finite. MARK: the first input of the one
# training point (row 5) whose output the "one" plant makes NaN.
PLANTED = '''
import os

import torch
import torch.nn.functional as F
from torch import nn

MARK = 123.0


class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.first = nn.Linear(input_shape[0], 8)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x):
        plant = os.environ.get("PLANT", "")
        hidden = torch.tanh(self.first(x))
        if plant == "gradient":  # finite outputs whose gradient is NaN: d sqrt(h·0)/dh = 0/0
            hidden = hidden + torch.sqrt(hidden * 0)
        out = self.head(hidden)
        if plant in ("nan", "inf"):
            out = out + float(plant)
        if plant == "one":
            out = out + torch.where(x[:, :1] == MARK, float("nan"), 0.0)
        return out


def data():
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 5, generator=generator)
    y = (x.sum(dim=1) > 0).long()
    x[5, 0] = MARK
    return (x[:48], y[:48]), (x[48:], y[48:])


def loss(outputs, targets):
    plant = os.environ.get("PLANT", "")
    losses = F.cross_entropy(outputs, targets, reduction="none")
    if plant in ("loss-nan", "loss-inf"):
        return losses + float(plant[5:])
    if plant == "loss-gradient":
        return losses + torch.sqrt(outputs[:, 0] * 0)
    return losses


def broken_data():
    (train_x, train_y), test = data()
    train_x[7, 2] = float("inf")
    return (train_x, train_y), test
'''

TRAIN = ["--model", "planted.py:Net", "--dataset", "planted.py:data", "--batch-size", 12, "--epochs", 1, "--cn", 1,
         "--save-name", "x"]


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """The planted file in tmp_path; plant(value) sets what it plants."""
    write(tmp_path, "planted.py", PLANTED)
    return lambda value: monkeypatch.setenv("PLANT", value)


def shown(text):
    """The lines a terminal shows of `text`: each line's text after its last carriage return (a progress bar that
    the error erased is overwritten)."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n") if line.rsplit("\r", 1)[-1].strip()]


def refused(result, flag, *words):
    """Exit 2 and one line shown on stderr, naming `flag` and holding `words`, no traceback."""
    assert_usage_error(SimpleNamespace(returncode=result.returncode, stdout="",
                                      stderr="\n".join(shown(result.stderr))), flag)
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


@pytest.mark.parametrize("plant, flag, words", [
    ("nan", "--model", ["planted.py:Net gave an output that is not finite (nan)", "initial parameters θ_0"]),
    ("inf", "--model", ["planted.py:Net gave an output that is not finite (inf)", "initial parameters θ_0"]),
    ("loss-nan", "--loss", ["planted.py:loss gave a loss that is not finite (nan", "θ_0"]),
    ("loss-inf", "--loss", ["planted.py:loss gave a loss that is not finite (inf", "θ_0"]),
    ("gradient", "--model", ["gave a gradient that is not finite", "step 1 of 4"]),
    ("loss-gradient", "--loss", ["gave a gradient that is not finite", "step 1 of 4"]),
    ("one", "--model", ["gave an output that is not finite (nan) for training example 5 at step "]),
])
@pytest.mark.parametrize("tracked", [False, True])
def test_training_refuses_the_user_code_in_one_line_and_leaves_no_file(run, tmp_path, planted, plant, flag, words,
                                                                       tracked):
    planted(plant)
    loss = ["--loss", "planted.py:loss"] if plant.startswith("loss") else []
    before = snapshot(tmp_path)
    result = run("train_dpsgd.py", *TRAIN, *loss, *(["--track-points", "all"] if tracked else []))
    if tracked and plant == "one":  # the tracked points meet it at θ_0, before any step draws it
        words = ["gave an output that is not finite (nan) for tracked point 5 at step 1 of 4"]
    refused(result, flag, *words)
    assert "--lr" not in result.stderr
    assert snapshot(tmp_path) == before and not (tmp_path / "models").exists()


def test_without_privacy_a_gradient_that_is_not_finite_names_the_model(run, tmp_path, planted):
    planted("gradient")
    before = snapshot(tmp_path)
    refused(run("train_dpsgd.py", *TRAIN, "--no-dp"), "--model", "gave a gradient that is not finite",
            "for the batch at step 1 of 4")
    assert snapshot(tmp_path) == before


def test_a_resumed_run_keeps_its_earlier_checkpoints(run, tmp_path, planted):
    planted("")
    assert run("train_dpsgd.py", *TRAIN, "--save-freq", 1).returncode == 0
    run_dir = tmp_path / "models" / "x"
    for step in (3, 4):  # as if killed after checkpoint 2
        (run_dir / f"step_{step:07d}.pt").unlink()
    for name in ("tracked_norms.csv",):
        assert not (run_dir / name).exists()
    before = snapshot(tmp_path)
    planted("nan")
    refused(run("train_dpsgd.py", *TRAIN, "--save-freq", 1), "--model", "at step 3 of 4")
    assert snapshot(tmp_path) == before


def test_a_dataset_with_values_that_are_not_finite_is_refused_at_load(run, tmp_path, planted):
    planted("")
    before = snapshot(tmp_path)
    refused(run("train_dpsgd.py", *TRAIN[:2], "--dataset", "planted.py:broken_data", *TRAIN[4:]), "--dataset",
            "train input 7 holds inf")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("plant, flag, words", [
    ("nan", "--model", ["gave an output that is not finite (nan) for point 0 at checkpoint step 4 of run x"]),
    ("inf", "--model", ["gave an output that is not finite (inf) for point 0"]),
    ("loss-nan", "--loss", ["gave a loss that is not finite (nan"]),
    ("loss-inf", "--loss", ["gave a loss that is not finite (inf"]),
    ("gradient", "--model", ["so it is made by the backward through the model"]),
    ("loss-gradient", "--loss", ["so it is made by the loss's gradient in the outputs"]),
    ("one", "--model", ["for point 5 at checkpoint step 4"]),
])
@pytest.mark.parametrize("measurement", [["--reduction", "sum"], ["--reduction", "mean", "--num-batches", 4],
                                         ["--reduction", "mean", "--num-batches", 0]])
def test_the_measurement_refuses_the_user_code_in_one_line_and_writes_nothing(run, tmp_path, planted, plant, flag,
                                                                              words, measurement):
    planted("")
    loss = ["--loss", "planted.py:loss"] if plant.startswith("loss") else []
    assert run("train_dpsgd.py", *TRAIN, *loss).returncode == 0
    before = snapshot(tmp_path)
    planted(plant)
    points = "5" if plant == "one" else "0-3"
    result = run("compute_sensitivity.py", "--run", "x", "--points", points, "--stage", "final", *measurement,
                 "--res-name", "r")
    refused(result, flag, *words)
    assert snapshot(tmp_path) == before


def test_the_audit_refuses_the_user_code(run, tmp_path, planted):
    planted("")
    assert run("train_dpsgd.py", *TRAIN).returncode == 0
    before = snapshot(tmp_path)
    planted("nan")
    result = run("audit.py", "--run", "x", "--points", "0", "1", "--stage", "final", "--trials", 1000)
    refused(result, "--model", "gave an output that is not finite (nan)")
    assert snapshot(tmp_path) == before


# --- the API ---------------------------------------------------------------------------------------------------

MARK = 123.0  # the first input of point 3 of `data`


class Shifted(nn.Module):
    """A linear classifier whose outputs for point 3 of `data` are shifted by `shift` (NaN, inf: not finite)."""

    def __init__(self, shift):
        super().__init__()
        self.linear = nn.Linear(5, 2)
        self.shift = shift

    def forward(self, x):
        return self.linear(x) + torch.where(x[:, :1] == MARK, self.shift, 0.0)


class GradientNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 2)

    def forward(self, x):
        return self.linear(x) + 0 * torch.sqrt(self.linear.bias[0] * 0)


def data(count=20):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(count, 5, generator=generator)
    labels = (inputs.sum(dim=1) > 0).long()
    inputs[3, 0] = MARK
    return inputs, labels


def api_refused(call, name, *words):
    with pytest.raises(ValueError) as raised:
        call()
    message = str(raised.value)
    assert message.startswith(f"{name}: ") and "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sensitivities_refuse_a_model_output_that_is_not_finite(value):
    api_refused(lambda: sensitivities(Shifted(value), data(), 1.0), "model",
                f"its output is not finite ({value:g}) for point 3")
    # Among chosen points, the point's index into data.
    api_refused(lambda: sensitivities(Shifted(value), data(), 1.0, points=[0, 3]), "model", "for point 3")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sensitivities_refuse_a_loss_fn_that_is_not_finite(value):
    def loss_fn(outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="none") + value

    api_refused(lambda: sensitivities(Shifted(0.0), data(), 1.0, loss_fn=loss_fn), "loss_fn",
                f"the loss is not finite ({value:g}", "for point 0")


def test_sensitivities_name_where_a_gradient_stops_being_finite():
    def loss_fn(outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="none") + torch.sqrt(outputs[:, 0] * 0)

    api_refused(lambda: sensitivities(Shifted(0.0), data(), 1.0, loss_fn=loss_fn), "loss_fn",
                "its gradient in the model's outputs is not finite")
    api_refused(lambda: sensitivities(GradientNaN(), data(), 1.0), "model", "the gradient of the loss through it")


def test_sensitivities_refuse_data_that_is_not_finite():
    inputs, targets = data()
    inputs[7, 2] = float("nan")
    api_refused(lambda: sensitivities(Shifted(0.0), (inputs, targets), 1.0), "data",
                "point 7 holds a value that is not finite (nan)")


def test_attach_refuses_a_step_whose_model_is_not_finite_before_the_update():
    torch.manual_seed(0)
    inputs, labels = data(48)
    model = Shifted(0.0)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(TensorDataset(inputs, labels), batch_size=12), noise_multiplier=1.0,
        max_grad_norm=1.0, poisson_sampling=True, noise_generator=torch.Generator().manual_seed(0))
    accountant = IndividualAccountant(48)
    accountant.attach(optimizer, model, loader)
    steps = iter(loader)
    for step in range(2):
        batch_inputs, batch_labels = next(steps)
        if step == 1:
            model._module.shift = float("nan")
            weights = [param.detach().clone() for param in model.parameters()]
        optimizer.zero_grad()
        F.cross_entropy(model(batch_inputs), batch_labels).backward()
        if step == 0:
            optimizer.step()
            continue
        api_refused(optimizer.step, "model", "for point 3 at step 2 since attach")
        assert all(torch.equal(before, after) for before, after in zip(weights, model.parameters()))
    assert accountant.num_steps == 1


# --- the pieces ------------------------------------------------------------------------------------------------

def test_first_non_finite_names_the_first_example_and_the_first_value_made():
    losses = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    norms = torch.tensor([1.0, float("nan"), 1.0, float("inf")])
    outputs = {"logits": torch.tensor([[0.0], [0.0], [0.0], [0.0]]),
               "extra": (torch.tensor([[1.0, 2.0], [float("-inf"), 0.0], [0.0, 0.0], [0.0, 0.0]]),)}
    assert finite.first_non_finite(losses[:1], norms[:1], outputs={"x": torch.zeros(1, 2)}) is None
    found = finite.first_non_finite(losses, norms, outputs)
    assert (found.position, found.kind, found.value) == (1, finite.OUTPUT, float("-inf"))
    found = finite.first_non_finite(losses, norms)
    assert (found.position, found.kind) == (1, finite.LOSS) and np.isnan(found.value)
    found = finite.first_non_finite(losses[2:], norms[2:], inputs=torch.tensor([[0.0], [float("nan")]]))
    assert (found.position, found.kind, found.value) == (0, finite.LOSS, float("inf"))
    found = finite.first_non_finite(torch.ones(4), norms)
    assert (found.position, found.kind) == (1, finite.GRADIENT)
    # Integer outputs are finite; a tensor without the examples along its first dimension counts for each.
    assert finite.finite_examples((torch.arange(3), torch.tensor(float("nan"))), 3).tolist() == [False] * 3


def test_removing_new_files_removes_what_the_block_made_and_nothing_else(tmp_path):
    kept, replaced = tmp_path / "run" / "kept.txt", tmp_path / "run" / "replaced.txt"
    kept.parent.mkdir()
    kept.write_text("before")
    replaced.write_text("before")
    with pytest.raises(KeyError), fileio.removing_new_files(str(tmp_path / "run"), KeyError):
        (tmp_path / "run" / "new" / "deeper").mkdir(parents=True)
        (tmp_path / "run" / "new" / "deeper" / "file").write_text("x")
        fileio.write_text(str(replaced), "after")
        raise KeyError("stop")
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["kept.txt"]
    with pytest.raises(KeyError), fileio.removing_new_files(str(tmp_path / "a" / "b" / "c"), KeyError):
        (tmp_path / "a" / "b" / "c").mkdir(parents=True)
        raise KeyError("stop")
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError), fileio.removing_new_files(str(tmp_path / "run"), KeyError):
        (tmp_path / "run" / "other").write_text("x")
        raise ValueError("another error")
    assert (tmp_path / "run" / "other").exists()


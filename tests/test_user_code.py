"""Your own model and data from the command line (issue 25 item 1): --model / --dataset specs, written to temp
files here, through train_dpsgd.py, compute_sensitivity.py and every accountant; Δ* of the torch.func fallback
against one plain backward per example; bad specs; a changed file under a resumed or measured run."""

import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, assert_usage_error, snapshot
from opacus.accountants.analysis.rdp import _compute_rdp

from perinstance.cli import options
from perinstance.measure.gradient_rows import transformed_gradient_chunks
from perinstance.persample import fallback_norms, gradients
from perinstance.train import run_plan, user_code
from perinstance.train.clipping import Transform

TRANSFORMER = '''
from torch import nn


class Classifier(nn.Module):
    """Token ids -> embedding + position -> one Transformer encoder layer -> mean -> linear head."""

    def __init__(self, num_classes, input_shape, vocabulary=8, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(input_shape[0], width)
        layer = nn.TransformerEncoderLayer(width, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.position.weight).mean(dim=1))
'''

TOKENS = '''
import torch


def tokens(data_root):
    """Sequences of 6 token ids out of 8; the label: is token 0 more frequent than token 1."""
    ids = torch.randint(0, 8, (96, 6))
    labels = ((ids == 0).sum(dim=1) > (ids == 1).sum(dim=1)).long()
    return (ids[:64], labels[:64]), (ids[64:], labels[64:])
'''

# A layer with no Opacus per-sample rule and no closed form in the norms engine: x * weight, elementwise.
CUSTOM = '''
import torch
from torch import nn


class Scale(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x):
        return x * self.weight


def make(in_features=5, num_classes=2):
    return nn.Sequential(Scale(in_features), nn.Tanh(), nn.Linear(in_features, num_classes))
'''

VECTORS = '''
import torch


class Points(torch.utils.data.Dataset):
    """A Dataset of (input, label) pairs: 5-dimensional Gaussian points, the label is the sign of their sum."""

    def __init__(self, count, generator):
        self.x = torch.randn(count, 5, generator=generator)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], int(self.y[index])


def points():
    generator = torch.Generator().manual_seed(3)
    return Points(48, generator), Points(16, generator)
'''

CLIP = 2.0


def write(folder, name, text):
    path = folder / name
    path.write_text(text)
    return str(path)


def import_file(path):
    spec = importlib.util.spec_from_file_location(f"test_user_code_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def end_to_end(run, folder, model, dataset, batch_size, *training_flags):
    """train (with `training_flags` besides) → Δ* (sum rule) → eps_delta, renyi_per_instance_sum,
    renyi_per_instance_sum_compo; the mean rule's coupling rows → renyi_per_instance_mean. Returns the Δ* rows, the
    run's folder, the accountants' outputs and what training printed (stdout, then stderr)."""
    flags = ["--model", model, "--dataset", dataset, "--batch-size", batch_size, "--epochs", 1, "--lr", 0.5,
             "--cn", CLIP, "--save-name", "mine", *training_flags]
    trained = run("train_dpsgd.py", *flags)
    assert trained.returncode == 0, trained.stderr
    # The engine's choice, printed once where it falls back for some layers (none for the layers it covers).
    assert trained.stderr.count("per-sample gradients:") <= 1, trained.stderr
    measured = run("compute_sensitivity.py", "--run", "mine", "--reduction", "sum", "--points", "all", "--stage",
                   "all", "--res-name", "mine_sum")
    assert measured.returncode == 0, measured.stderr
    for script in ("eps_delta.py", "renyi_per_instance_sum.py", "renyi_per_instance_sum_compo.py"):
        result = run(script, "--res-name", "mine_sum")
        assert result.returncode == 0, (script, result.stderr)
    mean = run("compute_sensitivity.py", "--run", "mine", "--reduction", "mean", "--points", "0-3", "--stage",
               "final", "--num-batches", 8, "--res-name", "mine_mean")
    assert mean.returncode == 0, mean.stderr
    result = run("renyi_per_instance_mean.py", "--res-name", "mine_mean")
    assert result.returncode == 0, result.stderr
    outputs = {name: pd.read_csv(folder / "res" / f"{name}.csv") for name in (
        "mine_sum_eps_delta", "mine_sum_renyi_per_instance_sum", "mine_sum_renyi_per_instance_sum_compo",
        "mine_mean_renyi_per_instance_mean")}
    for name, frame in outputs.items():
        value = frame["eps" if "eps" in frame.columns else "rdp"]
        assert len(frame) and np.isfinite(value).all() and (value >= 0).all(), name
    sums = pd.read_csv(folder / "res" / "mine_sum.csv")
    run_dir = folder / "models" / "mine"
    check_renyi_against_opacus(outputs["mine_sum_renyi_per_instance_sum"], sums, run_dir)
    return sums, run_dir, outputs, trained.stdout + trained.stderr


def check_renyi_against_opacus(renyi, sums, run_dir):
    """The sum rule's certified RDP of a step at Δ* is the subsampled Gaussian's at noise multiplier σΓ/Δ*
    (accounting.md §3.1): Opacus's own formula, independent of the suite's."""
    config = json.loads((run_dir / "run.json").read_text())
    certified = renyi[renyi["kind"] == "certified"].merge(sums[["point", "step", "value"]], on=["point", "step"])
    assert len(certified) == len(sums)
    expected = [_compute_rdp(config["sample_rate"], config["noise_multiplier"] * config["clip_bound"] / value, alpha)
                if value > 0 else 0.0 for value, alpha in zip(certified["value"], certified["alpha"], strict=True)]
    np.testing.assert_allclose(certified["rdp"], expected, rtol=1e-8, atol=1e-12)


def plain_gradients(model_file, attribute, run_dir, step, inputs, labels, loss_of_one=None):
    """g_i at checkpoint `step` (one float64 row per example), by one backward per example of `loss_of_one(output,
    target)` on a batch of one (the cross-entropy when None) through a model built here from the file."""
    config = json.loads((run_dir / "run.json").read_text())
    arguments = user_code.model_arguments(tuple(config["input_shape"]), config["num_classes"])
    target = getattr(import_file(model_file), attribute)
    model = target(**{key: value for key, value in arguments.items() if key in inspect.signature(target).parameters})
    model.load_state_dict(torch.load(run_dir / f"step_{step:07d}.pt", weights_only=True)["model"])
    model.eval()
    rows = []
    for example, label in zip(inputs, labels, strict=True):
        model.zero_grad()
        output = model(example[None])
        (F.cross_entropy(output, label[None]) if loss_of_one is None else loss_of_one(output, label[None])).backward()
        rows.append(torch.cat([param.grad.flatten() for param in model.parameters()]).double().numpy())
    return np.array(rows)


def plain_norms(*args):
    """||g_i|| of plain_gradients(*args)."""
    return np.linalg.norm(plain_gradients(*args), axis=1)


def check_sensitivities(sums, model_file, attribute, run_dir, inputs, labels, loss_of_one=None, clip=CLIP):
    """Every checkpoint's Δ* rows equal min(||g_i||, C) of the plain backward (flat clipping, accounting.md §2)."""
    steps = sorted(sums["step"].unique())
    assert len(steps) >= 2
    unclipped = 0
    for step in steps:
        rows = sums[sums["step"] == step].sort_values("point")
        expected = np.minimum(plain_norms(model_file, attribute, run_dir, step, inputs, labels, loss_of_one), clip)
        np.testing.assert_allclose(rows["value"].to_numpy(), expected, rtol=2e-5, atol=1e-6)
        unclipped += int((expected < clip).sum())
    assert unclipped > 0, "every point clipped: the comparison would not see a wrong norm"


def test_transformer_on_integer_tokens_end_to_end(run, tmp_path):
    model_file = write(tmp_path, "transformer.py", TRANSFORMER)
    data_file = write(tmp_path, "tokens.py", TOKENS)
    sums, run_dir, _, printed = end_to_end(run, tmp_path, "transformer.py:Classifier", "tokens.py:tokens", 16)
    config = json.loads((run_dir / "run.json").read_text())
    assert config["input_shape"] == [6] and config["num_classes"] == 2
    assert config["user_code"]["model"]["sha256"] == user_code.load_object(
        f"{model_file}:Classifier", "--model")[1].sha256
    assert config["user_code"]["dataset"]["path"] == data_file
    # The data as the test builds it: the function under the seed the suite documents (DATASET_SEED).
    torch.manual_seed(user_code.DATASET_SEED)
    (inputs, labels), _ = import_file(data_file).tokens(".")
    assert inputs.dtype == torch.int64
    check_sensitivities(sums, model_file, "Classifier", run_dir, inputs, labels)
    # A layer whose weight is used without calling it (the position table) falls back; the engine takes the rest:
    # the token embedding, attention, its output projection, the Linear layers on tokens and LayerNorm.
    assert "for 1 it does not cover: position (Embedding)" in printed, printed


class _Reused(torch.nn.Module):
    """A Linear called once through its forward and once more by its parent through its weight: no hook sees the
    second use, so the engine's closed form of the layer alone would miss half its gradient."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        hidden = torch.tanh(self.inner(x))
        return self.head(F.linear(hidden, self.inner.weight))


def test_a_weight_used_outside_its_layer_falls_back(capsys):
    torch.manual_seed(2)
    model = _Reused()
    setattr(model, fallback_norms.USER_MODEL_MARK, True)
    inputs, labels = torch.randn(6, 4), torch.arange(6) % 3
    norms, _, _ = gradients.per_sample_norms(model, inputs, labels)
    expected = []
    for example, label in zip(inputs, labels, strict=True):
        model.zero_grad()
        F.cross_entropy(model(example[None]), label[None]).backward()
        expected.append(torch.cat([param.grad.flatten() for param in model.parameters()]).norm().item())
    np.testing.assert_allclose(norms.numpy(), expected, rtol=1e-5)
    assert "inner (Linear)" in capsys.readouterr().err


def test_rows_of_the_mean_rule_are_one_backward_per_example(tmp_path):
    """gradient_rows' h_i = w(||g_i||)·g_i of a spec's model (torch.func for every layer) against a plain backward."""
    write(tmp_path, "transformer.py", TRANSFORMER)
    torch.manual_seed(1)
    model = user_code.build_model(f"{tmp_path / 'transformer.py'}:Classifier", (6,), 2).eval()
    inputs, labels = torch.randint(0, 8, (5, 6)), torch.tensor([0, 1, 1, 0, 1])
    transform = Transform("flat", 0.5, None, None)
    (_, rows, _), = list(transformed_gradient_chunks(model, inputs, labels, transform))
    for row, example, label in zip(rows, inputs, labels, strict=True):
        model.zero_grad()
        F.cross_entropy(model(example[None]), label[None]).backward()
        gradient = torch.cat([param.grad.flatten() for param in model.parameters()])
        torch.testing.assert_close(row, gradient * min(1.0, 0.5 / gradient.norm().item()), rtol=1e-4, atol=1e-6)


def test_custom_layer_without_opacus_rule_end_to_end(run, tmp_path):
    model_file = write(tmp_path, "custom.py", CUSTOM)
    write(tmp_path, "vectors.py", VECTORS)
    sums, run_dir, outputs, printed = end_to_end(run, tmp_path, "custom.py:make", "vectors.py:points", 12)
    assert printed.count("per-sample gradients:") == 1, printed  # the fallback's choice, printed once
    train, _ = import_file(str(tmp_path / "vectors.py")).points()
    check_sensitivities(sums, model_file, "make", run_dir, train.x, train.y)
    # Points whose Δ* stays below C at every step spend less than the worst case (Δ* = C throughout).
    compo = outputs["mine_sum_renyi_per_instance_sum_compo"]
    assert compo["eps"].min() < compo["eps"].max()


def test_package_module_spec_is_imported_and_recorded(run, tmp_path):
    (tmp_path / "my_models").mkdir()
    write(tmp_path / "my_models", "__init__.py", "")
    module_file = write(tmp_path / "my_models", "custom.py", CUSTOM)
    write(tmp_path, "vectors.py", VECTORS)
    result = run("train_dpsgd.py", "--model", "my_models.custom:make", "--dataset", "vectors.py:points",
                 "--batch-size", 12, "--epochs", 1, "--save-name", "mine")
    assert result.returncode == 0, result.stderr
    recorded = json.loads((tmp_path / "models" / "mine" / "run.json").read_text())["user_code"]["model"]
    assert recorded["spec"] == "my_models.custom:make" and recorded["path"] == module_file
    assert recorded["sha256"] == hashlib.sha256(CUSTOM.encode()).hexdigest()


def test_model_receives_the_documented_arguments(tmp_path):
    write(tmp_path, "spy.py", "import torch\nSEEN = []\n\ndef make(in_channels, image_size, num_classes, "
                              "input_shape, width=3):\n    SEEN.append((in_channels, image_size, num_classes, "
                              "input_shape, width))\n    return torch.nn.Linear(2, 2)\n\n"
                              "def tokens(num_classes, input_shape):\n    SEEN.append((num_classes, input_shape))\n"
                              "    return torch.nn.Linear(2, 2)\n")
    spec = str(tmp_path / "spy.py")
    user_code.build_model(f"{spec}:make", (3, 32, 32), 10)
    user_code.build_model(f"{spec}:tokens", (12,), 4)
    with pytest.raises(Exception, match="needs in_channels"):
        user_code.build_model(f"{spec}:make", (12,), 4)
    assert user_code.load_object(f"{spec}:make", "--model")[0].__globals__["SEEN"] == [(3, 32, 10, (3, 32, 32), 3),
                                                                                      (4, (12,))]


def test_default_run_name_follows_the_spec():
    first = run_plan.resolve_training_args(options.parse_training_flags(["--model", "a/my_model.py:Net", "--dataset", "d.py:data"]))
    second = run_plan.resolve_training_args(options.parse_training_flags(["--model", "b/my_model.py:Net", "--dataset",
                                                                  "d.py:data"]))
    assert run_plan.default_save_name(first) != run_plan.default_save_name(second)
    assert run_plan.default_save_name(first).startswith("d.data_my_model.Net_sum_")


# --- bad specs: one line naming the flag, exit 2, nothing written ------------------------------------

BAD = {
    "model.py": "import torch\nfrom torch import nn\nWIDTH = 3\n\ndef listing():\n    return [nn.Linear(5, 2)]\n\n"
                "def batchnorm():\n    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))\n\n"
                "def broken():\n    raise RuntimeError('no GPU here')\n\n"
                "class WrongWidth(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                "        self.layer = nn.Linear(7, 2)\n\n    def forward(self, x):\n        return self.layer(x.flatten(1))\n\n"
                "def recurrent():\n    return nn.Sequential(nn.Flatten(), nn.Unflatten(1, (8, 8)), nn.GRU(8, 4))\n",
    "broken.py": "def make(:\n",
    "data.py": "import torch\n\ndef single():\n    return torch.zeros(3, 5)\n\n"
               "def unlabelled():\n    return (torch.zeros(4, 5), torch.zeros(3)), (torch.zeros(2, 5), torch.zeros(2))\n",
}


@pytest.mark.parametrize("flags, flag, words", [
    (["--model", "missing.py:Net"], "--model", "no such file"),
    (["--model", "model.py:Net"], "--model", "has no 'Net'"),
    (["--model", "no_such_package.module:Net"], "--model", "no module named"),
    (["--model", "model.py:WIDTH"], "--model", "not a class or function"),
    (["--model", "model.py:listing"], "--model", "not a torch.nn.Module"),
    (["--model", "model.py:batchnorm"], "--model", "GroupNorm"),
    (["--model", "model.py:broken"], "--model", "RuntimeError: no GPU here"),
    (["--model", "model.py:WrongWidth"], "--model", "model.py:WrongWidth raised RuntimeError: mat1 and mat2 shapes"),
    (["--model", "model.py:recurrent"], "--model", "layer 2 (GRU)"),
    (["--model", "broken.py:make"], "--model", "SyntaxError"),
    (["--model", "vgg"], "--model", "PATH.py:NAME"),
    (["--dataset", "data.py:single"], "--dataset", "not a pair (train, test)"),
    (["--dataset", "data.py:unlabelled"], "--dataset", "one label per input"),
    (["--dataset", "data.py:missing"], "--dataset", "has no 'missing'"),
])
def test_bad_spec_is_one_line_and_writes_nothing(run, tmp_path, flags, flag, words):
    for name, text in BAD.items():
        write(tmp_path, name, text)
    if flag == "--model":
        flags = [*flags, "--dataset", "synthetic"]
    before = snapshot(tmp_path)
    result = run("train_dpsgd.py", *flags, "--epochs", 1)
    assert_usage_error(result, flag)
    assert words in result.stderr, result.stderr
    assert snapshot(tmp_path) == before


def test_built_in_network_on_token_data_is_refused(run, tmp_path):
    write(tmp_path, "tokens.py", TOKENS)
    result = run("train_dpsgd.py", "--model", "mlp", "--dataset", "tokens.py:tokens", "--batch-size", 16)
    assert_usage_error(result, "--model")
    assert "C×H×W" in result.stderr and not (tmp_path / "models").exists()


def test_batchnorm_is_refused_naming_the_layer(run, tmp_path):
    write(tmp_path, "model.py", BAD["model.py"])
    result = run("train_dpsgd.py", "--model", "model.py:batchnorm", "--dataset", "synthetic")
    assert_usage_error(result, "--model")
    assert re.search(r"layer 1 \(BatchNorm1d\).*GroupNorm", result.stderr), result.stderr


# --- a changed file under a resumed or measured run ---------------------------------------------------

def test_changed_file_is_refused_on_resume_and_measurement(run, tmp_path):
    write(tmp_path, "custom.py", CUSTOM)
    write(tmp_path, "vectors.py", VECTORS)
    flags = ["--model", "custom.py:make", "--dataset", "vectors.py:points", "--batch-size", 12, "--epochs", 1,
             "--save-name", "mine"]
    assert run("train_dpsgd.py", *flags).returncode == 0
    for name in ("custom.py", "vectors.py"):
        original = (tmp_path / name).read_text()
        (tmp_path / name).write_text(original + "\n# edited\n")
        before = snapshot(tmp_path)
        resumed = run("train_dpsgd.py", *flags)
        assert_usage_error(resumed, "--model" if name == "custom.py" else "--dataset")
        assert str(tmp_path / name) in resumed.stderr and "changed" in resumed.stderr
        assert snapshot(tmp_path) == before
        if name == "custom.py":
            measured = run("compute_sensitivity.py", "--run", "mine", "--points", "0", "--res-name", "x")
            assert_usage_error(measured, "--model")
            assert snapshot(tmp_path) == before
        (tmp_path / name).write_text(original)
    assert run("train_dpsgd.py", *flags).returncode == 0  # the restored files: the run is the same again


# --- the documented commands, as written (docs/commands.md, "Your own model") ------------------------------

def documented_commands():
    """The shell lines of docs/commands.md's block after "**Flags**"."""
    text = open(os.path.join(ROOT, "docs", "commands.md"), encoding="utf-8").read()
    after = text[text.index("- **Flags**"):]
    start = after.index("```\n") + len("```\n")
    return [line.strip() for line in after[start:after.index("```", start)].splitlines() if line.strip()]


def test_documented_commands_run_as_written(run, tmp_path):
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples")
    commands = documented_commands()
    assert [command.split()[1] for command in commands] == [
        "train_dpsgd.py", "compute_sensitivity.py", "eps_delta.py", "renyi_per_instance_sum.py",
        "renyi_per_instance_sum_compo.py", "compute_sensitivity.py", "renyi_per_instance_mean.py"]
    for command in commands:
        words = command.split()
        assert words[0] == "python"
        result = run(words[1], *words[2:])
        assert result.returncode == 0, (command, result.stderr)
    assert (tmp_path / "res").is_dir()

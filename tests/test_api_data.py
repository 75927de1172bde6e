"""sensitivities() on any loss and any batch (docs/api.md): a regression net, a token-level language-model loss
with mapping inputs, tuple inputs, label smoothing, each against one plain backward per example; a Dataset
streamed a chunk at a time (peak memory of 100,000 points, in a subprocess), each item as the dataset gives it;
every bad argument a one-line ValueError or TypeError naming it."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from reference import one_backward_per_example
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from perinstance import sensitivities
from perinstance.persample import batches

COUNT = 7


def clipped_backward_norms(model, inputs, targets, clip, loss_fn=None):
    """min(||g_i||, clip) of one plain backward per example."""
    return np.minimum(one_backward_per_example(model, inputs, targets, loss_fn).norm(dim=1).numpy(), clip)


class Items(Dataset):
    """A map-style Dataset of (input, target) items, as a user's own would be."""

    def __init__(self, inputs, targets):
        self.inputs, self.targets = inputs, targets

    def __len__(self):
        return batches.count(self.targets)

    def __getitem__(self, index):
        return batches.take(self.inputs, index), batches.take(self.targets, index)


def mse(outputs, targets):
    return F.mse_loss(outputs, targets, reduction="none")


def test_a_regression_net_in_every_form_of_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(inplace=True), nn.Linear(16, 3)).double()
    inputs, targets = torch.randn(COUNT, 4, dtype=torch.float64), torch.randn(COUNT, 3, dtype=torch.float64)
    unclipped = clipped_backward_norms(model, inputs, targets, np.inf, mse)
    clip = float(np.median(unclipped))
    expected = np.minimum(unclipped, clip)
    dataset = Items(inputs, targets)
    for data in [(inputs, targets), dataset, DataLoader(dataset, batch_size=3, shuffle=True)]:
        np.testing.assert_allclose(sensitivities(model, data, clip, loss_fn=mse).numpy(), expected, rtol=1e-10)
        np.testing.assert_allclose(sensitivities(model, data, clip, points=[5, 1], loss_fn=mse).numpy(),
                                   expected[[5, 1]], rtol=1e-10)


class TinyLanguageModel(nn.Module):
    """Keyword inputs (input_ids, attention_mask) as a tokenizer gives them; next-token logits."""

    def __init__(self, vocabulary=13, width=8):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        layer = nn.TransformerEncoderLayer(width, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.out = nn.Linear(width, vocabulary)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        return self.out(hidden)


def token_loss(logits, targets):
    """Cross-entropy of every next token, -100 ignored; (n, length), summed per example by the engine."""
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=-100)


def test_a_token_level_language_model_loss_on_mapping_inputs():
    torch.manual_seed(0)
    model = TinyLanguageModel().double()
    ids = torch.randint(0, 13, (COUNT, 6))
    mask = torch.ones(COUNT, 6, dtype=torch.long)
    mask[2, 4:] = 0
    targets = ids.roll(-1, dims=1).masked_fill(mask == 0, -100)
    inputs = {"input_ids": ids, "attention_mask": mask}
    expected = clipped_backward_norms(model, inputs, targets, 1e6, token_loss)
    items = Items(inputs, targets)
    for data in [(inputs, targets), items, DataLoader(items, batch_size=2)]:
        np.testing.assert_allclose(sensitivities(model, data, 1e6, loss_fn=token_loss).numpy(), expected, rtol=1e-9)


def test_tuple_inputs_and_label_smoothing():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.left, self.right = nn.Linear(3, 4), nn.Linear(2, 4)

        def forward(self, left, right):
            return torch.tanh(self.left(left)) * self.right(right)

    def smoothed(outputs, labels):
        return F.cross_entropy(outputs, labels, reduction="none", label_smoothing=0.2)

    torch.manual_seed(0)
    model = TwoInputs().double()
    inputs = (torch.randn(COUNT, 3, dtype=torch.float64), torch.randn(COUNT, 2, dtype=torch.float64))
    labels = torch.arange(COUNT) % 4
    np.testing.assert_allclose(sensitivities(model, (inputs, labels), 1e6, loss_fn=smoothed).numpy(),
                               clipped_backward_norms(model, inputs, labels, 1e6, smoothed), rtol=1e-10)
    np.testing.assert_allclose(sensitivities(model, Items(inputs, labels), 1e6).numpy(),
                               clipped_backward_norms(model, inputs, labels, 1e6), rtol=1e-10)


class Augmented(Dataset):
    """Each read of an item draws a fresh random shift (the dataset's own augmentation)."""

    def __init__(self, inputs, labels):
        self.inputs, self.labels, self.generator = inputs, labels, torch.Generator().manual_seed(5)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index] + torch.randn(self.inputs.shape[1:], generator=self.generator), int(self.labels[index])


def test_each_item_is_read_as_the_dataset_gives_it_and_the_global_generator_is_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    dataset = Augmented(torch.randn(COUNT, 4), torch.arange(COUNT) % 3)
    state = torch.get_rng_state()
    first, second = sensitivities(model, dataset, 1e6), sensitivities(model, dataset, 1e6)
    assert not torch.allclose(first, second)  # read afresh: not one augmentation applied once and frozen
    assert torch.equal(torch.get_rng_state(), state)


class Stream(IterableDataset):
    def __init__(self, inputs, labels):
        self.inputs, self.labels = inputs, labels

    def __iter__(self):
        return iter(zip(self.inputs, self.labels.tolist()))


def test_an_iterable_dataset_is_streamed_in_its_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    inputs, labels = torch.randn(COUNT, 4, dtype=torch.float64), torch.arange(COUNT) % 3
    np.testing.assert_allclose(sensitivities(model, Stream(inputs, labels), 1e6).numpy(),
                               clipped_backward_norms(model, inputs, labels, 1e6), rtol=1e-10)


STREAMED = """
import resource, sys
import torch
from torch import nn
from torch.utils.data import Dataset
from perinstance import sensitivities

class Generated(Dataset):
    '''100,000 CIFAR-shaped items (1.2 GB as one tensor), each made when read.'''
    def __len__(self):
        return 100_000
    def __getitem__(self, index):
        return torch.full((3, 32, 32), (index % 97) / 97.0), index % 10

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
sensitivities(model, (torch.zeros(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)), 1.0)  # warm up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
norms = sensitivities(model, Generated(), 1.0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert norms.shape == (100_000,) and bool(torch.isfinite(norms).all())
print((after - before) / 1024)
"""
# The peak resident memory a 100,000-point streamed measurement may add (ru_maxrss, MiB): the dataset as one
# tensor is 1,200 MiB; a chunk of 512 items is 6 MiB.
STREAMED_MIB = 150


def test_a_streamed_dataset_of_100000_points_holds_one_chunk():
    result = subprocess.run([sys.executable, "-c", STREAMED], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip()) < STREAMED_MIB, result.stdout


# --- bad arguments -------------------------------------------------------------------------------

def refused(call, name, kind=ValueError):
    with pytest.raises(kind) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and name in message, message


class Triples(Dataset):
    def __len__(self):
        return 3

    def __getitem__(self, index):
        return torch.zeros(4), 0, index


def test_bad_arguments_are_one_line_errors_naming_them():
    model = nn.Linear(4, 3)
    inputs, labels = torch.randn(COUNT, 4), torch.arange(COUNT) % 3
    refused(lambda: sensitivities(model, (inputs, labels + 1), 1.0), "outside the model's 3 classes")
    refused(lambda: sensitivities(model, (inputs, -labels - 1), 1.0), "label -1")
    refused(lambda: sensitivities(model, Items(inputs, labels + 3), 1.0), "data")
    refused(lambda: sensitivities(model, (inputs, labels.double()), 1.0), "loss_fn")
    refused(lambda: sensitivities(nn.Linear(4, 3), (inputs[:, :, None].expand(-1, -1, 2).transpose(1, 2), labels),
                                  1.0), "logits")
    refused(lambda: sensitivities(model, (inputs, labels), 1.0, loss_fn="mse"), "loss_fn", TypeError)
    refused(lambda: sensitivities(model, (inputs, labels), 1.0, loss_fn=lambda out, y: out.sum()), "loss_fn")
    refused(lambda: sensitivities("model", (inputs, labels), 1.0), "model", TypeError)
    refused(lambda: sensitivities(model, {"x": inputs}, 1.0), "data", TypeError)
    refused(lambda: sensitivities(model, (inputs, labels[:3]), 1.0), "data")
    refused(lambda: sensitivities(model, ([inputs, "text"], labels), 1.0), "inputs", TypeError)
    refused(lambda: sensitivities(model, Triples(), 1.0), "pair")
    refused(lambda: sensitivities(model, Items(inputs, labels), 1.0, points=[COUNT]), "points")
    refused(lambda: sensitivities(model, Items(inputs, labels), 1.0, points=["a"]), "points")
    refused(lambda: sensitivities(model, Stream(inputs, labels), 1.0, points=[0]), "points")
    for data in ((inputs, labels), Items(inputs, labels)):  # no point chosen: nothing measured
        assert sensitivities(model, data, 1.0, points=[]).shape == (0,)


def test_a_batch_norm_network_is_refused_as_the_command_line_refuses_it():
    """The same sentence as train_dpsgd.py --model gives (tests/test_user_code.py)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    refused(lambda: sensitivities(model, (torch.randn(COUNT, 4), torch.arange(COUNT) % 3), 1.0),
            "layer 1 (BatchNorm1d) mixes the examples of a batch")

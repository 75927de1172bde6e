"""The engine on the layers of the networks people use now (layer_forms.linear_parts on any leading dimensions,
Conv1d, sequence_forms.py: Embedding, LayerNorm, RMSNorm, self-attention; in-place activations): per-sample norms
and the clipped sum against one plain backward per example, float64, on fixed cases and on seeded sweeps of
shapes; and the engine's refusals."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference import one_backward_per_example
from torch import nn

from perinstance.persample import fallback_norms, gradients, layer_forms, layer_pass, sequence_forms
from perinstance.train import user_code

COUNT = 5


def assert_engine_is_one_backward_per_example(model, inputs, targets, loss_fn=None, rtol=1e-9, engine=True):
    """Norms and the weighted sum Σ w_i·g_i of the engine (engine=True: the engine alone covers every layer, no
    torch.func) and of the checked path (a --model network) against autograd."""
    expected = one_backward_per_example(model, inputs, targets, loss_fn)
    weights = torch.linspace(0.5, 2.0, len(expected), dtype=torch.float64)
    assert fallback_norms.engine_covers(layer_pass.parameter_owners(model)) == engine
    for checked in (False, True):
        if checked:
            setattr(model, user_code.USER_MODEL_MARK, True)
        try:
            norms, _, _ = gradients.per_sample_norms(model, inputs, targets, loss_fn)
            sums, _, sum_norms, _ = gradients.clipped_gradient_sum(model, inputs, targets, lambda _: weights, loss_fn)
        finally:
            if checked:
                delattr(model, user_code.USER_MODEL_MARK)
        torch.testing.assert_close(norms.double(), expected.norm(dim=1), rtol=rtol, atol=0)
        torch.testing.assert_close(sum_norms.double(), expected.norm(dim=1), rtol=rtol, atol=0)
        summed = torch.cat([part.flatten() for part in sums]).double()
        torch.testing.assert_close(summed, weights @ expected, rtol=rtol, atol=rtol * float(expected.abs().max()))


class Tokens(nn.Module):
    """Token ids -> Embedding (+ positions, per example) -> `body` -> mean over tokens -> Linear head."""

    def __init__(self, body, vocabulary=11, width=8, length=6, classes=3, padding_idx=None):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width, padding_idx=padding_idx)
        self.position = nn.Embedding(length, width)
        self.body, self.head = body, nn.Linear(width, classes)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.head(self.body(self.embed(tokens) + self.position(positions)).mean(dim=1))


def token_data(count=COUNT, length=6, vocabulary=11, classes=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocabulary, (count, length), generator=generator)
    tokens[0, :3] = tokens[0, 3]  # one example with a repeated id, whose rows add up
    return tokens, torch.randint(0, classes, (count,), generator=generator)


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_transformer_encoder_on_tokens_is_covered_by_the_engine(norm_first):
    """Embedding, self-attention (packed projection and output projection), LayerNorm and the feed-forward Linear
    layers on tokens: every layer by a closed form, none by torch.func."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first)
    model = Tokens(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)).double().eval()
    tokens, labels = token_data()
    assert_engine_is_one_backward_per_example(model, tokens, labels)
    forms = gradients.norm_forms(model, tokens[:1])
    assert forms["body.layers.0.self_attn"] in ("ghost", "materialised") and forms["embed"] == "rows by id"


def test_a_token_level_language_model_loss_summed_over_tokens():
    """Next-token logits (n, length, vocabulary) and a cross-entropy per token, summed per example, with a causal
    mask and padding ids."""
    torch.manual_seed(0)

    class LanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 8, padding_idx=0)
            self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
            self.norm, self.out = nn.RMSNorm(8), nn.Linear(8, 11)

        def forward(self, tokens):
            hidden = self.embed(tokens)
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=hidden.dtype)
            attended, _ = self.attention(hidden, hidden, hidden, attn_mask=mask, need_weights=False, is_causal=True)
            return self.out(self.norm(hidden + attended))

    def token_loss(logits, targets):
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=0)

    model = LanguageModel().double().eval()
    tokens, _ = token_data()
    tokens[1, -2:] = 0
    assert_engine_is_one_backward_per_example(model, tokens[:, :-1], tokens[:, 1:], token_loss)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool", "float", "padding", "both", "causal"])
def test_the_attention_forward_of_the_engine_is_torchs(batch_first, need_weights, masks):
    """sequence_forms.attention_projections's forward gives torch's outputs and weights, for every mask."""
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(8, 2, batch_first=batch_first).double().eval()
    length = 5
    query = torch.randn(3, length, 8, dtype=torch.float64)
    query = query if batch_first else query.transpose(0, 1)
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    padding = torch.zeros(3, length, dtype=torch.bool)
    padding[1, -2:] = True
    options = {"none": {}, "bool": {"attn_mask": causal},
               "float": {"attn_mask": torch.randn(3 * 2, length, length, dtype=torch.float64)},
               "padding": {"key_padding_mask": padding}, "both": {"attn_mask": causal, "key_padding_mask": padding},
               "causal": {"attn_mask": causal, "is_causal": True}}[masks]
    expected = layer(query, query, query, need_weights=need_weights, **options)
    recorded = []
    with sequence_forms.attention_projections(layer, [layer], lambda *application: recorded.append(application)):
        got = layer(query, query, query, need_weights=need_weights, **options)
    assert len(recorded) == 1 and recorded[0][2].shape == (3, length, 24)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-12, atol=1e-12)
    assert (got[1] is None) == (expected[1] is None)
    if expected[1] is not None:
        torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=1e-12)
    assert "forward" not in vars(layer)


def test_attention_with_a_frozen_input_projection():
    """Its output projection (trainable) is still applied as a module, so the engine sees it."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    layer.self_attn.in_proj_weight.requires_grad_(False)
    layer.self_attn.in_proj_bias.requires_grad_(False)
    model = Tokens(layer).double().eval()
    tokens, labels = token_data()
    assert_engine_is_one_backward_per_example(model, tokens, labels)


def test_cross_attention_falls_back_to_torch_func():
    """Queries that are not the keys: the packed projection reads two inputs, which the closed form does not take;
    in a checked model the layer falls back (the engine alone refuses it in one line)."""
    torch.manual_seed(0)

    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.head = nn.MultiheadAttention(4, 2, batch_first=True), nn.Linear(4, 3)

        def forward(self, inputs):
            return self.head(self.attention(inputs, inputs.flip(1), inputs.flip(1))[0].mean(dim=1))

    model = Cross().double()
    inputs, labels = torch.randn(COUNT, 3, 4, dtype=torch.float64), torch.arange(COUNT) % 3
    with pytest.raises(ValueError, match="closed form does not take"):
        gradients.per_sample_norms(model, inputs, labels)
    setattr(model, user_code.USER_MODEL_MARK, True)
    norms, _, _ = gradients.per_sample_norms(model, inputs, labels)
    torch.testing.assert_close(norms.double(), one_backward_per_example(model, inputs, labels).norm(dim=1),
                               rtol=1e-9, atol=0)


def test_layer_norm_and_rms_norm_on_several_normalised_dimensions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Unflatten(2, (2, 3)), nn.LayerNorm((2, 3)), nn.Flatten(2),
                          nn.RMSNorm(6), nn.LayerNorm(6, bias=False), nn.Flatten(), nn.Linear(24, 3)).double()
    with torch.no_grad():
        for norm in (model[2], model[4], model[5]):
            norm.weight.uniform_(0.5, 2.0)
        model[2].bias.uniform_(-1.0, 1.0)
    inputs, labels = torch.randn(COUNT, 4, 6, dtype=torch.float64), torch.arange(COUNT) % 3
    assert_engine_is_one_backward_per_example(model, inputs, labels)


@pytest.mark.parametrize("form", ["ghost", "materialised"])
def test_linear_on_tokens_in_both_forms(form, monkeypatch):
    """Both forms of linear_parts (the cost model picks one per layer), with examples taken a few at a time."""
    monkeypatch.setattr(layer_forms, "linear_norm_form", lambda *shape: form)
    monkeypatch.setattr(layer_forms, "BLOCK_BYTES", 200)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3, bias=False), nn.Flatten(),
                          nn.Linear(3 * 2 * 7, 3)).double()
    inputs, labels = torch.randn(COUNT, 2, 7, 4, dtype=torch.float64), torch.arange(COUNT) % 3
    assert_engine_is_one_backward_per_example(model, inputs, labels)


def test_an_in_place_activation_after_a_layer():
    """ReLU(inplace=True) on a convolution's and a Linear layer's output: the gradient of the layer's own output
    (taken at its gradient edge), not of the activation's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 4 * 4, 6),
                          nn.ReLU(inplace=True), nn.Linear(6, 3)).double()
    inputs, labels = torch.randn(COUNT, 2, 6, 6, dtype=torch.float64), torch.arange(COUNT) % 3
    assert_engine_is_one_backward_per_example(model, inputs, labels)


class ChangesItsInput(nn.Module):
    """A layer's input changed in place after the layer read it: autograd itself refuses the weight's gradient
    then; the engine, which takes no weight gradient from autograd, says so in one line."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, inputs):
        hidden = inputs * 1.0
        output = self.first(hidden)
        hidden.mul_(2.0)
        return self.second(output + hidden)


def test_an_input_changed_in_place_after_its_layer_read_it_is_refused():
    model = ChangesItsInput().double()
    inputs, labels = torch.randn(COUNT, 4, dtype=torch.float64), torch.arange(COUNT) % 3
    with pytest.raises(ValueError, match="changed in place"):
        gradients.per_sample_norms(model, inputs, labels)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        one_backward_per_example(model, inputs, labels)


def test_inputs_as_a_tuple_and_as_a_mapping():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.dense, self.head = nn.Embedding(11, 4), nn.Linear(3, 4), nn.Linear(4, 3)

        def forward(self, tokens, features):
            return self.head(torch.tanh(self.embed(tokens).mean(dim=1) + self.dense(features)))

    class Keywords(TwoInputs):
        def forward(self, input_ids, features):
            return super().forward(input_ids, features)

    torch.manual_seed(0)
    tokens, labels = token_data()
    features = torch.randn(COUNT, 3, dtype=torch.float64)
    assert_engine_is_one_backward_per_example(TwoInputs().double(), (tokens, features), labels)
    assert_engine_is_one_backward_per_example(Keywords().double(), {"input_ids": tokens, "features": features}, labels)


def test_a_regression_loss_with_label_smoothing_and_a_vector_target():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).double()
    inputs, targets = torch.randn(COUNT, 4, dtype=torch.float64), torch.randn(COUNT, 2, dtype=torch.float64)
    assert_engine_is_one_backward_per_example(model, inputs, targets,
                                              lambda outputs, target: F.mse_loss(outputs, target, reduction="none"))
    labels = torch.arange(COUNT) % 2
    assert_engine_is_one_backward_per_example(model, inputs, labels, lambda outputs, target: F.cross_entropy(
        outputs, target, reduction="none", label_smoothing=0.1))


@pytest.mark.parametrize("loss_fn, words", [(lambda outputs, targets: F.cross_entropy(outputs, targets), "not ()"),
                                            (lambda outputs, targets: outputs.sum(dim=0), "one loss per example")])
def test_a_loss_that_does_not_give_one_loss_per_example_is_refused(loss_fn, words):
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=words):
        gradients.per_sample_norms(model, torch.randn(COUNT, 4), torch.arange(COUNT) % 3, loss_fn)


@pytest.mark.parametrize("recurrent, replacement", [(nn.GRU(4, 4, batch_first=True, bidirectional=True), "DPGRU"),
                                                    (nn.RNN(4, 4, batch_first=True), "DPRNN"),
                                                    (nn.LSTM(4, 4, batch_first=True), "DPLSTM")])
def test_recurrent_layers_torch_func_cannot_take_are_refused_naming_opacus_layers(recurrent, replacement):
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = recurrent, nn.Linear(recurrent.hidden_size * (1 + recurrent.bidirectional), 3)

        def forward(self, inputs):
            return self.head(self.rnn(inputs)[0].mean(dim=1))

    with pytest.raises(ValueError) as error:
        gradients.per_sample_norms(Recurrent(), torch.randn(COUNT, 3, 4), torch.arange(COUNT) % 3)
    message = str(error.value)
    assert "\n" not in message and "layer rnn" in message and replacement in message, message


class LastStep(nn.Module):
    """A recurrent layer, then a Linear head on its last step's output."""

    def __init__(self, recurrent):
        super().__init__()
        self.rnn, self.head = recurrent, nn.Linear(recurrent.hidden_size, 3)

    def forward(self, inputs):
        return self.head(self.rnn(inputs)[0][:, -1])


def test_opacus_recurrent_layers_by_torch_func():
    """opacus.layers.DPLSTM and DPGRU (Linear cells applied at every step) fall back to torch.func, exactly."""
    from opacus.layers import DPGRU, DPLSTM

    for recurrent in (DPLSTM(4, 4, batch_first=True), DPGRU(4, 4, batch_first=True)):
        torch.manual_seed(0)
        model = LastStep(recurrent).double()
        inputs, labels = torch.randn(COUNT, 3, 4, dtype=torch.float64), torch.arange(COUNT) % 3
        setattr(model, user_code.USER_MODEL_MARK, True)
        norms, _, _ = gradients.per_sample_norms(model, inputs, labels)
        torch.testing.assert_close(norms.double(), one_backward_per_example(model, inputs, labels).norm(dim=1),
                                   rtol=1e-9, atol=0)


# --- seeded sweeps of shapes (hypothesis-style: random cases, the same on every run, each small) ---------

@pytest.mark.parametrize("case", range(12))
def test_sweep_linear_on_any_leading_dimensions(case):
    draw = np.random.default_rng([7, case])
    leading = tuple(int(size) for size in draw.integers(1, 5, size=draw.integers(0, 3)))
    features, outputs = int(draw.integers(1, 7)), int(draw.integers(1, 7))
    torch.manual_seed(case)
    model = nn.Sequential(nn.Linear(features, outputs, bias=bool(draw.integers(2))), nn.Tanh(), nn.Flatten(),
                          nn.Linear(int(np.prod(leading, dtype=int)) * outputs, 3)).double()
    inputs = torch.randn(COUNT, *leading, features, dtype=torch.float64)
    assert_engine_is_one_backward_per_example(model, inputs, torch.arange(COUNT) % 3)


@pytest.mark.parametrize("case", range(12))
def test_sweep_conv1d(case):
    draw = np.random.default_rng([11, case])
    groups = int(draw.choice([1, 2]))
    conv = nn.Conv1d(2 * groups, 2 * int(draw.integers(1, 4)), int(draw.integers(1, 4)), stride=int(draw.integers(1, 3)),
                     padding=int(draw.integers(0, 3)), dilation=int(draw.integers(1, 3)), groups=groups,
                     bias=bool(draw.integers(2)))
    length = int(draw.integers(6, 12))
    torch.manual_seed(case)
    with torch.no_grad():
        size = conv(torch.zeros(1, conv.in_channels, length)).numel()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(size, 3)).double()
    inputs = torch.randn(COUNT, conv.in_channels, length, dtype=torch.float64)
    assert_engine_is_one_backward_per_example(model, inputs, torch.arange(COUNT) % 3)


@pytest.mark.parametrize("case", range(12))
def test_sweep_embedding(case):
    draw = np.random.default_rng([13, case])
    vocabulary, length = int(draw.integers(2, 9)), int(draw.integers(1, 7))
    padding_idx = int(draw.integers(vocabulary)) if draw.integers(2) else None
    torch.manual_seed(case)
    model = nn.Sequential(nn.Embedding(vocabulary, 3, padding_idx=padding_idx, sparse=bool(draw.integers(2))),
                          nn.Flatten(), nn.Linear(3 * length, 3)).double()
    tokens = torch.as_tensor(draw.integers(0, vocabulary, size=(COUNT, length)))
    assert_engine_is_one_backward_per_example(model, tokens, torch.arange(COUNT) % 3)

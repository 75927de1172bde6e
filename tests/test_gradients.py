"""Per-sample norms and the clipped gradient sum (gradients.py) against Opacus GradSampleModule's
materialised per-sample gradients, for every layer type of nets.py and each form of conv2d_squared_norms."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from perinstance.measure import gradient_rows
from perinstance.persample import fallback_norms, gradients, layer_forms, layer_pass
from perinstance.train.clipping import Transform
from perinstance.train.nets import build_model

COUNT = 6


def materialised(model, inputs, labels):
    """Opacus's per-sample gradients of the cross-entropy: the independent reference."""
    module = gradients.wrap_per_sample(model)
    try:
        grad_samples, losses, logits = gradients.per_sample_gradients(module, inputs, labels)
    finally:
        module._close()
    return grad_samples, losses, logits


def conv_model(conv, image_size, norm=None):
    """`conv` (float64), optionally a norm layer, then a Linear classifier over 3 classes."""
    torch.manual_seed(0)
    with torch.no_grad():
        size = conv(torch.zeros(1, conv.in_channels, image_size, image_size)).numel()
    layers = [conv, *([norm] if norm is not None else []), nn.Tanh(), nn.Flatten(), nn.Linear(size, 3)]
    return nn.Sequential(*layers).double()


def data(channels, image_size, dtype=torch.float64, count=COUNT):
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(count, channels, image_size, image_size, generator=generator, dtype=dtype)
    return inputs, torch.randint(0, 3, (count,), generator=generator)


def conv_form(conv, image_size):
    """The form conv2d_squared_norms takes for `conv` on image_size² inputs."""
    output_size = conv(torch.zeros(1, conv.in_channels, image_size, image_size)).shape[2:]
    return layer_forms.conv2d_norm_form(conv, (image_size, image_size), output_size)


# (layer, image size, the form it must take): every branch, with padding, stride, dilation, groups, no bias.
CONVS = [
    (lambda: nn.Conv2d(2, 3, 3), 6, "patches"),
    (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2, bias=False), 9, "patches"),
    (lambda: nn.Conv2d(16, 4, 3, stride=2, padding=1), 6, "grouped"),
    (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), 5, "grouped"),
    (lambda: nn.Conv2d(16, 40, 3, padding=1, stride=2), 4, "ghost"),
    (lambda: nn.Conv2d(8, 30, (3, 2), padding=(1, 0), stride=(2, 1), dilation=(1, 2), bias=False), 4, "ghost"),
    (lambda: nn.Conv2d(16, 40, 3, stride=3, padding=2), 2, "ghost"),  # the middle kernel offset reads only padding
    (lambda: nn.Conv2d(4, 120, 5), 5, "single"),  # LeNet-5's third convolution: one output position
    (lambda: nn.Conv2d(3, 7, 3, stride=2, padding=1), 2, "single"),  # one position, its patch partly padding
]


@pytest.mark.parametrize("make_conv,image_size,form", CONVS)
def test_conv2d_norms_and_clipped_sum_match_materialised_gradients(make_conv, image_size, form):
    conv = make_conv()
    assert conv_form(conv, image_size) == form
    model = conv_model(conv, image_size)
    inputs, labels = data(conv.in_channels, image_size)
    assert_matches_materialised(model, inputs, labels, rtol=1e-10)


def test_group_norm_norms_match_materialised_gradients():
    model = conv_model(nn.Conv2d(3, 8, 3), 5, norm=nn.GroupNorm(4, 8))
    with torch.no_grad():  # away from γ = 1, β = 0, so a swapped or missing term shows
        model[1].weight.uniform_(0.5, 2.0)
        model[1].bias.uniform_(-1.0, 1.0)
    inputs, labels = data(3, 5)
    assert_matches_materialised(model, inputs * 3 + 1, labels, rtol=1e-10)
    # Without its rows (a caller of layer_norms that did not run the pass under group_norm_rows), the layer
    # takes the separate form from its input and its output gradient: the same norms.
    recorded = {}

    def record(layer, layer_inputs, output):
        recorded[layer] = (layer_inputs[0], output)

    logits = layer_pass.forward_with_hook(model, [model[0], model[1], model[4]], record, inputs * 3 + 1)
    layers = list(recorded)
    _, norms = layer_pass.layer_norms(layers, [recorded[layer][0] for layer in layers],
                                     [recorded[layer][1] for layer in layers],
                                     F.cross_entropy(logits, labels, reduction="none"))
    with torch.no_grad():
        separate = [layer_norm.squared for layer_norm in norms][1]
    grad_samples, _, _ = materialised(model, inputs * 3 + 1, labels)
    expected = sum(grad.reshape(COUNT, -1).square().sum(dim=1) for grad in grad_samples[2:4])  # γ and β
    torch.testing.assert_close(separate, expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("make_conv,kept", [(lambda: nn.Conv2d(3, 8, 3), [False, False, True]),
                                             (lambda: nn.Conv2d(16, 40, 3, padding=1, stride=2), [True, False, True])])
def test_output_gradients_the_clipped_sum_does_not_read_are_not_kept(make_conv, kept):
    """A materialised convolution's b_i is dropped once its norms are taken, a GroupNorm's (whose per-sample
    gradients come from its rows) is never kept; a ghost convolution's and a Linear layer's stay for the
    clipped sum, which still matches the materialised gradients."""
    conv = make_conv()
    model = conv_model(conv, 6, norm=nn.GroupNorm(4, conv.out_channels))
    inputs, labels = data(conv.in_channels, 6)
    forward = gradients._forward(model, inputs, labels)
    grad_outputs, norms = layer_pass.layer_norms(forward.layers, forward.inputs, forward.outputs, forward.losses,
                                                forward.group_norm_rows)
    with torch.no_grad():
        list(norms)
    assert [grad is not None for grad in grad_outputs] == kept
    assert_matches_materialised(model, inputs, labels, rtol=1e-10)


def test_frozen_parameters_are_left_out():
    model = conv_model(nn.Conv2d(3, 8, 3), 5, norm=nn.GroupNorm(2, 8))
    model[0].bias.requires_grad_(False)
    model[1].weight.requires_grad_(False)
    inputs, labels = data(3, 5)
    assert_matches_materialised(model, inputs, labels, rtol=1e-10)


@pytest.mark.parametrize("frozen", ["bias", "weight"])
def test_group_norm_with_one_trainable_parameter(frozen):
    model = conv_model(nn.Conv2d(3, 8, 3), 5, norm=nn.GroupNorm(4, 8))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2.0)
        model[1].bias.uniform_(-1.0, 1.0)
    getattr(model[1], frozen).requires_grad_(False)
    inputs, labels = data(3, 5)
    assert_matches_materialised(model, inputs, labels, rtol=1e-10)


class Unflatten(nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.shape = shape

    def forward(self, inputs):
        return inputs.reshape(len(inputs), *self.shape)


@pytest.mark.parametrize("shape", [(8,), (6, 2), (4, 3, 2, 2)])
def test_group_norm_of_inputs_of_any_rank(shape):
    """GroupNorm on (n, C), (n, C, L) and (n, C, D, H, W) inputs, after a Linear layer shaped into them."""
    torch.manual_seed(0)
    size = int(np.prod(shape))
    model = nn.Sequential(nn.Linear(5, size), Unflatten(*shape), nn.GroupNorm(2, shape[0]), nn.Tanh(), nn.Flatten(),
                          nn.Linear(size, 3)).double()
    with torch.no_grad():
        model[2].weight.uniform_(0.5, 2.0)
        model[2].bias.uniform_(-1.0, 1.0)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(COUNT, 5, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (COUNT,), generator=generator)
    assert_matches_materialised(model, inputs, labels, rtol=1e-10)


def test_group_norm_pass_keeps_the_layer_and_its_input_gradient():
    """The engine's pass runs GroupNorm with per-sample parameter rows: the same outputs and the same gradient
    for the layers below it as the layer's own forward and backward, and it keeps neither the layer's input
    nor its output (its rows give its gradients); afterwards, and after a forward that fails, the layer is its
    own again."""
    model = conv_model(nn.Conv2d(3, 8, 3), 5, norm=nn.GroupNorm(4, 8))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2.0)
        model[1].bias.uniform_(-1.0, 1.0)
    inputs, labels = data(3, 5)
    conv_output = model[0](inputs)
    expected_output = model[1](conv_output)
    expected_grad, = torch.autograd.grad(F.cross_entropy(model[2:](expected_output), labels, reduction="sum"),
                                         conv_output)
    forward = gradients._forward(model, inputs, labels)
    assert "forward" not in vars(model[1])
    torch.testing.assert_close(forward.inputs[2], model[2:4](expected_output), rtol=0, atol=0)
    assert forward.inputs[1] is None and forward.outputs[1] is None
    grad_outputs, _ = layer_pass.layer_norms(forward.layers, forward.inputs, forward.outputs, forward.losses,
                                            forward.group_norm_rows)
    torch.testing.assert_close(grad_outputs[0], expected_grad, rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError):
        gradients._forward(model, inputs[:, :2], labels)
    assert "forward" not in vars(model[1])


@pytest.mark.parametrize("name,shape", [("lenet5", (1, 32, 32)), ("resnet20", (3, 32, 32)), ("mlp", (1, 8, 8))])
def test_every_model_of_nets_matches_materialised_gradients(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape[0], shape[1], 10)
    inputs, labels = data(shape[0], shape[1], dtype=torch.float32, count=4)
    assert_matches_materialised(model, inputs, labels, rtol=2e-4)


def assert_matches_materialised(model, inputs, labels, rtol):
    grad_samples, losses, logits = materialised(model, inputs, labels)
    expected_norms = gradients.grad_norms(grad_samples)
    weights = torch.linspace(0.2, 1.5, len(labels), dtype=inputs.dtype)
    expected_sums = layer_pass.weighted_sum(grad_samples, weights)

    norms, own_losses, own_logits = gradients.per_sample_norms(model, inputs, labels)
    torch.testing.assert_close(norms, expected_norms, rtol=rtol, atol=0)
    torch.testing.assert_close(own_losses, losses, rtol=rtol, atol=0)
    torch.testing.assert_close(own_logits, logits, rtol=rtol, atol=0)

    seen = []

    def weights_of_norms(given):
        seen.append(given)
        return weights

    sums, sum_losses, sum_norms, _ = gradients.clipped_gradient_sum(model, inputs, labels, weights_of_norms)
    torch.testing.assert_close(seen[0], expected_norms, rtol=rtol, atol=0)
    torch.testing.assert_close(sum_norms, expected_norms, rtol=rtol, atol=0)
    torch.testing.assert_close(sum_losses, losses, rtol=rtol, atol=0)
    assert len(sums) == len(expected_sums)
    for summed, expected in zip(sums, expected_sums):
        torch.testing.assert_close(summed, expected, rtol=rtol, atol=rtol * expected.abs().max().item())
    assert all(param.grad is None for param in model.parameters()), "no side effect on .grad"


def test_clipped_sum_is_bitwise_reproducible():
    torch.manual_seed(0)
    model = build_model("lenet5", 1, 32, 10)
    inputs, labels = data(1, 32, dtype=torch.float32)

    def clipped(norms):
        return 1.0 / torch.clamp(norms, min=1.0)

    first, _, first_norms, _ = gradients.clipped_gradient_sum(model, inputs, labels, clipped)
    second, _, second_norms, _ = gradients.clipped_gradient_sum(model, inputs, labels, clipped)
    assert torch.equal(first_norms, second_norms)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_unused_and_unapplied_layers_have_zero_gradient():
    class WithUnusedBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused, self.unapplied = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            return self.used(x) + 0 * self.unused(x).detach()

    model = WithUnusedBranch().double()
    inputs, labels = torch.randn(COUNT, 4, dtype=torch.float64), torch.arange(COUNT) % 3
    sums, _, norms, _ = gradients.clipped_gradient_sum(model, inputs, labels, torch.ones_like)
    expected = F.cross_entropy(model.used(inputs), labels, reduction="none")
    rows = [torch.autograd.grad(loss, list(model.used.parameters()), retain_graph=True) for loss in expected]
    by_hand = torch.stack([torch.cat([part.flatten() for part in row]).norm() for row in rows])
    torch.testing.assert_close(norms, by_hand, rtol=1e-10, atol=0)
    assert all(torch.equal(summed, torch.zeros_like(summed)) for summed in sums[2:])


class ElementwiseAffine(nn.Module):
    """x·w + b, elementwise: a layer of the caller's own, which no closed form of the engine covers."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.3, features))

    def forward(self, inputs):
        return inputs * self.weight + self.bias


class TiedLinear(nn.Module):
    """A Linear layer without bias whose weight is the first layer's: it holds no parameter of its own."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = nn.Linear(4, 4), nn.Linear(4, 4, bias=False), nn.Linear(4, 3)
        self.second.weight = self.first.weight

    def forward(self, inputs):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(inputs)))))


def assert_clipped_sum_is_one_backward_per_example(model, inputs, labels):
    """clipped_gradient_sum's norms and Σ w_i·g_i (weights 0.5 to 2) against one plain backward per example;
    returns the norms."""
    weights = torch.linspace(0.5, 2.0, COUNT, dtype=torch.float64)
    sums, _, norms, _ = gradients.clipped_gradient_sum(model, inputs, labels, lambda _: weights)
    rows = [torch.autograd.grad(F.cross_entropy(model(inputs[i:i + 1]), labels[i:i + 1]), list(model.parameters()))
            for i in range(COUNT)]
    torch.testing.assert_close(norms, torch.stack([torch.cat([part.flatten() for part in row]).norm() for row in rows]),
                               rtol=1e-10, atol=0)
    for index, summed in enumerate(sums):
        torch.testing.assert_close(summed, sum(weight * row[index] for weight, row in zip(weights, rows)),
                                   rtol=1e-10, atol=1e-12)
    return norms


@pytest.mark.parametrize("model", [
    nn.Sequential(nn.Linear(4, 4), ElementwiseAffine(4), nn.Linear(4, 3)),
    nn.Sequential(nn.Unflatten(1, (1, 2, 2)), nn.Conv2d(1, 2, 2, padding=1, padding_mode="reflect"), nn.Flatten(),
                  nn.Linear(18, 3)),
    TiedLinear(),  # the engine would add the two layers' squared norms, not square their summed gradient
])
def test_layers_without_a_closed_form_fall_back_to_torch_func(model):
    """perinstance/persample/fallback_norms.py: the norms and the clipped sum equal one backward per example."""
    model = model.double()
    inputs, labels = torch.randn(COUNT, 4, dtype=torch.float64), torch.arange(COUNT) % 3
    norms, _, _ = gradients.per_sample_norms(model, inputs, labels)
    torch.testing.assert_close(assert_clipped_sum_is_one_backward_per_example(model, inputs, labels), norms,
                               rtol=1e-12, atol=0)


class GroupNormTwiceAndOutside(nn.Module):
    """One GroupNorm layer applied twice, another whose γ the model also adds itself: both fall back when the
    model is checked (a --model network), and the covered GroupNorm layer takes its rows."""

    def __init__(self):
        super().__init__()
        self.conv, self.twice = nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)
        self.covered, self.outside = nn.GroupNorm(2, 4), nn.GroupNorm(1, 4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, inputs):
        hidden = self.covered(torch.tanh(self.twice(self.twice(self.conv(inputs)))))
        hidden = self.outside(hidden) + self.outside.weight[:, None, None]
        return self.head(torch.tanh(hidden).flatten(1))


def test_a_checked_model_takes_group_norm_rows_where_covered():
    torch.manual_seed(0)
    model = GroupNormTwiceAndOutside().double()
    setattr(model, fallback_norms.USER_MODEL_MARK, True)
    inputs, labels = data(2, 6)
    assert_clipped_sum_is_one_backward_per_example(model, inputs, labels)
    split = fallback_norms._split_forward(model, inputs, labels)
    assert split.layers == [model.conv, model.covered, model.head] and list(split.group_norm_rows) == [model.covered]
    assert split.inputs[1] is None and split.outputs[1] is None


def test_a_frozen_parameter_of_a_fallback_layer_counts_in_no_norm():
    """A layer of the caller's own (torch.func) whose weight is frozen: ||g_i|| is over the trainable parameters
    only."""
    model = nn.Sequential(nn.Linear(4, 4), ElementwiseAffine(4), nn.Linear(4, 3)).double()
    model[1].weight.requires_grad_(False)
    trainable = [param for param in model.parameters() if param.requires_grad]
    inputs, labels = torch.randn(COUNT, 4, dtype=torch.float64), torch.arange(COUNT) % 3
    norms, _, _ = gradients.per_sample_norms(model, inputs, labels)
    rows = [torch.autograd.grad(F.cross_entropy(model(inputs[i:i + 1]), labels[i:i + 1]), trainable)
            for i in range(COUNT)]
    torch.testing.assert_close(norms, torch.stack([torch.cat([part.flatten() for part in row]).norm() for row in rows]),
                               rtol=1e-10, atol=0)


@pytest.mark.parametrize("name, shape", [("lenet5", (1, 32, 32)), ("resnet20", (3, 32, 32))])
def test_parameter_owners_hold_the_trainable_parameters_in_order(name, shape):
    """The one walk of a pass lists trainable_parameters(model), in order: a frozen parameter left out, a parameter
    registered twice in one module or shared by two modules listed once, where model.parameters() lists it."""
    model = build_model(name, shape[0], shape[1], 10, dp=True)
    model.get_submodule(next(name for name, _ in model.named_modules() if name)).weight.requires_grad_(False)
    tied = TiedLinear()
    tied.head.again = tied.head.weight
    for network in (model, tied):
        owners = layer_pass.parameter_owners(network)
        assert [param for _, params in owners for param in params] == layer_pass.trainable_parameters(network)
    assert [module for module, _ in layer_pass.parameter_owners(tied)] == [tied.first, tied.second, tied.head]
    assert layer_pass.parameter_owners(tied)[1][1] == []


def test_a_layer_applied_twice_is_refused():
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer, nn.Tanh(), layer)
    with pytest.raises(ValueError, match="twice"):
        gradients.per_sample_norms(model, torch.randn(COUNT, 3), torch.arange(COUNT) % 3)


def test_resnet20_layers_take_the_forms_of_the_cost_model():
    """By hand from conv2d_norm_costs (docs/sensitivity.md): the 3-channel first convolution is unfolded, the
    32×32 and 16×16 stages (T = 1,024 and 256 positions, T² far above p·o) are materialised, the 8×8 stage
    (T = 64) takes the ghost form, as do Linear layers; GroupNorm's per-channel gradients are formed per sample."""
    torch.manual_seed(0)
    model = build_model("resnet20", 3, 32, 10)
    forms = gradients.norm_forms(model, torch.zeros(1, 3, 32, 32))
    expected = {"conv": "patches", "fc": "ghost"}
    for block in range(9):
        expected[f"blocks.{block}.norm1"] = expected[f"blocks.{block}.norm2"] = "per-sample"
        # Block 6 opens the 8×8 stage: its first convolution reads the 16×16 maps (stride 2).
        expected[f"blocks.{block}.conv1"] = "grouped" if block <= 6 else "ghost"
        expected[f"blocks.{block}.conv2"] = "grouped" if block < 6 else "ghost"
    expected["norm"] = "per-sample"
    assert forms == expected


def test_lenet5_layers_take_the_forms_of_the_cost_model():
    """The one-channel first convolution (25-value patches) is unfolded, the second (150 values) runs in the
    grouped kernel, the third has one output position (a Linear layer on its patch)."""
    torch.manual_seed(0)
    model = build_model("lenet5", 1, 32, 10)
    forms = gradients.norm_forms(model, torch.zeros(1, 1, 32, 32))
    assert forms == {"0": "patches", "3": "grouped", "6": "single", "9": "ghost", "11": "ghost"}


@pytest.mark.parametrize("name,shape,chunk", [("resnet20", (3, 32, 32), 128), ("lenet5", (1, 32, 32), 512),
                                              ("mlp", (1, 8, 8), 512)])
def test_examples_per_pass_keep_the_largest_layer_output_under_its_budget(name, shape, chunk):
    """ResNet-20's largest output is 16×32×32 float32 = 64 KiB per example: 128 of them fit a CPU's 10 MiB,
    256 would not; LeNet-5's is 6×28×28 (18.4 KiB): 512, the largest chunk; the MLP's are small."""
    torch.manual_seed(0)
    model = build_model(name, shape[0], shape[1], 10)
    assert gradients.examples_per_pass(model, torch.zeros(2, *shape)) == chunk


def test_a_checked_model_takes_the_engine_chunk_within_its_largest_layer_budget():
    """A --model network (or one given to sensitivities()) of covered layers only: the engine's chunk, unless
    materialising its largest layer, should the check send that layer to torch.func, would exceed
    CHECKED_LAYER_BYTES; with a layer torch.func takes, FALLBACK_PASS_EXAMPLES."""
    torch.manual_seed(0)
    lenet = build_model("lenet5", 1, 32, 10)  # largest layer 48,120 parameters: 697 examples within 128 MiB
    wide = nn.Sequential(nn.Flatten(), nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Linear(2048, 10))
    with_own_layer = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), ElementwiseAffine(8), nn.Linear(8, 10))
    for model in (lenet, wide, with_own_layer):
        setattr(model, fallback_norms.USER_MODEL_MARK, True)
    assert gradients.examples_per_pass(lenet, torch.zeros(2, 1, 32, 32)) == 512
    assert gradients.CHECKED_LAYER_BYTES // (2048 * 2049 * 4) == 7  # under FALLBACK_PASS_EXAMPLES
    assert gradients.examples_per_pass(wide, torch.zeros(2, 1, 8, 8)) == gradients.FALLBACK_PASS_EXAMPLES
    assert gradients.examples_per_pass(with_own_layer, torch.zeros(2, 1, 8, 8)) == gradients.FALLBACK_PASS_EXAMPLES
    delattr(wide, fallback_norms.USER_MODEL_MARK)
    assert gradients.examples_per_pass(wide, torch.zeros(2, 1, 8, 8)) == 512  # the engine's own: nothing to check


def test_a_gpu_takes_four_times_the_examples_per_pass():
    """A GPU's budget is 64 MiB: 1,024 ResNet-20 examples, and at most 2,048; another kind of device is a CPU."""
    resnet_output, lenet_output = 16 * 32 * 32 * 4, 6 * 28 * 28 * 4
    assert gradients.pass_examples(resnet_output, "cuda") == 1024
    assert gradients.pass_examples(lenet_output, "cuda") == 2048
    assert gradients.pass_examples(resnet_output, "mps") == gradients.pass_examples(resnet_output, "cpu") == 128
    assert gradients.pass_examples(1 << 30, "cpu") == gradients.MIN_PASS_EXAMPLES


@pytest.mark.parametrize("per_pass", [1, 2, 4, 128, 512])
def test_batch_passes_are_the_fewest_equal_passes_of_at_most_one_and_a_half_chunks(per_pass):
    """Every example in exactly one pass, in order; each pass at most 1.5·per_pass examples; one pass fewer
    would need a larger one; sizes differ by at most one, the larger first. Checked for every batch size up
    to 8 chunks."""
    limit = per_pass + per_pass // 2
    for count in range(0, 8 * per_pass + 1):
        sizes = [part.stop - part.start for part in gradients.batch_passes(count, per_pass)]
        starts = [part.start for part in gradients.batch_passes(count, per_pass)]
        assert sum(sizes) == count and starts == [sum(sizes[:index]) for index in range(len(sizes))]
        assert all(0 < size <= limit for size in sizes)
        assert len(sizes) == 0 or (len(sizes) - 1) * limit < count
        assert sizes == sorted(sizes, reverse=True) and (not sizes or sizes[0] - sizes[-1] <= 1)


def test_a_poisson_batch_a_little_over_the_chunk_is_one_pass():
    """ResNet-20 on a CPU (128 per pass): a batch of 140 is one pass, not 128 and 12; 193 is two of 97 and 96."""
    assert [(part.start, part.stop) for part in gradients.batch_passes(140, 128)] == [(0, 140)]
    assert [(part.start, part.stop) for part in gradients.batch_passes(193, 128)] == [(0, 97), (97, 193)]
    assert gradients.batch_passes(0, 128) == []


def test_norms_do_not_depend_on_the_chunk(monkeypatch):
    torch.manual_seed(0)
    model = build_model("lenet5", 1, 32, 10).double()
    inputs, labels = data(1, 32, count=10)
    transform = Transform("flat", 0.1)
    whole, _ = gradient_rows.transformed_norms(model, inputs, labels, transform)
    monkeypatch.setattr(gradients, "MIN_PASS_EXAMPLES", 4)
    monkeypatch.setattr(gradients, "PASS_OUTPUT_BYTES", {"cpu": 4 * 6 * 28 * 28 * 8})
    assert gradients.examples_per_pass(model, inputs) == 4
    monkeypatch.setattr(layer_forms, "PATCH_CHUNK", 3)
    chunked, _ = gradient_rows.transformed_norms(model, inputs, labels, transform)
    np.testing.assert_allclose(chunked, whole, rtol=1e-12)

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn
from torch.func import functional_call, grad, vmap

from perinstance.errors import UsageError
from perinstance.train import nets
from perinstance.train.nets import build_model, scatter_features

# (name, in_channels, image_size, num_classes) of the models the experiments use.
SHAPES = {
    "lenet5": ("lenet5", 1, 32, 10),
    "resnet20": ("resnet20", 3, 32, 10),
    "mlp": ("mlp", 1, 8, 4),
    "linear": ("linear", 243, 4, 10),  # the head on ScatterNet features of 16×16 colour images
}


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny batches gain nothing from intra-op threads, and on a busy 2-core machine the
    threads' synchronisation makes these tests ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seeded_model(*args, seed=0, **kwargs):
    torch.manual_seed(seed)
    return build_model(*args, **kwargs)


def parameter_count(model):
    return sum(parameter.numel() for parameter in model.parameters())


def tiny_batch(in_channels, image_size, num_classes, size=3):
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(size, in_channels, image_size, image_size, generator=generator),
            torch.randint(num_classes, (size,), generator=generator))


def looped_per_sample_grads(model, x, y):
    """Reference: one backward pass per sample, gradients stacked along a new first dim."""
    grads = []
    for sample, label in zip(x, y, strict=True):
        model.zero_grad()
        F.cross_entropy(model(sample[None]), label[None]).backward()
        grads.append([parameter.grad.clone() for parameter in model.parameters()])
    return [torch.stack(per_parameter) for per_parameter in zip(*grads, strict=True)]


def test_parameter_counts_match_the_papers():
    assert parameter_count(seeded_model(*SHAPES["lenet5"])) == 61_706  # LeNet-5: ~61.7k
    assert parameter_count(seeded_model(*SHAPES["resnet20"])) == 269_722  # ResNet-20: ~0.27M
    assert parameter_count(seeded_model(*SHAPES["mlp"])) == 64 * 32 + 32 + 32 * 4 + 4
    # The head on CIFAR-10's ScatterNet features (243 channels × 8 × 8, pooled to 4 × 4), 10 classes;
    # norm and pooling have no parameters.
    assert parameter_count(seeded_model("linear", 243, 8, 10)) == 243 * 4 * 4 * 10 + 10 == 38_890


@pytest.mark.parametrize("shape", [*SHAPES.values(), ("resnet20", 1, 8, 4), ("mlp", 3, 32, 10)])
def test_output_shape(shape):
    name, in_channels, image_size, num_classes = shape
    x, _ = tiny_batch(in_channels, image_size, num_classes)
    assert seeded_model(*shape)(x).shape == (3, num_classes)


def test_initialisation_is_determined_by_the_callers_seed():
    first, second = seeded_model(*SHAPES["resnet20"]), seeded_model(*SHAPES["resnet20"])
    other = seeded_model(*SHAPES["resnet20"], seed=1)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(first.conv.weight, other.conv.weight)


def test_resnet20_norm_layers():
    group = seeded_model(*SHAPES["resnet20"], norm_type="group")
    assert {(m.num_groups, m.num_channels) for m in group.modules() if isinstance(m, nn.GroupNorm)} == {
        (16, 16), (32, 32), (32, 64)}
    none = seeded_model(*SHAPES["resnet20"], norm_type="none")
    assert not any(isinstance(m, (nn.GroupNorm, nn.BatchNorm2d)) for m in none.modules())
    batch = seeded_model(*SHAPES["resnet20"], norm_type="batch", dp=False)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in batch.modules()) == 19


def test_batchnorm_with_dp_is_refused():
    with pytest.raises(UsageError) as error:
        build_model(*SHAPES["resnet20"], norm_type="batch", dp=True)
    assert error.value.flag == "--norm-type"


@pytest.mark.parametrize("args, kwargs, flag", [
    (("vgg", 3, 32, 10), {}, "--model"),
    (("lenet5", 1, 28, 10), {}, "--model"),
    (("resnet20", 3, 32, 10), {"norm_type": "layer"}, "--norm-type"),
])
def test_bad_choices_raise_usage_error(args, kwargs, flag):
    with pytest.raises(UsageError) as error:
        build_model(*args, **kwargs)
    assert error.value.flag == flag
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", SHAPES)
def test_opacus_validator_accepts_dp_models(name):
    assert ModuleValidator.validate(seeded_model(*SHAPES[name]), strict=False) == []


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # inputs need no grad; expected
@pytest.mark.parametrize("name", SHAPES)
def test_opacus_per_sample_grads_match_a_loop(name):
    model = seeded_model(*SHAPES[name])
    x, y = tiny_batch(*SHAPES[name][1:])
    expected = looped_per_sample_grads(model, x, y)
    sample_module = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(sample_module(x), y, reduction="sum").backward()
    for parameter, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad_sample, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", SHAPES)
def test_vmap_per_sample_grads_match_a_loop(name):
    model = seeded_model(*SHAPES[name])
    x, y = tiny_batch(*SHAPES[name][1:])
    expected = looped_per_sample_grads(model, x, y)
    params = {key: value.detach() for key, value in model.named_parameters()}

    def sample_loss(params, sample, label):
        return F.cross_entropy(functional_call(model, params, (sample[None],)), label[None])

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    for (key, got), want in zip(per_sample.items(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=key)


# --- the fixed ScatterNet front end: against direct 2-D convolutions --------------------------------

def direct_morlet(side, sigma, xi, theta):
    """The full side×side Morlet kernel from its definition (no separable factors, no matrices)."""
    offsets = np.arange(side) - side // 2
    rows, cols = np.meshgrid(offsets, offsets, indexing="ij")
    envelope = np.exp(-(rows ** 2 + cols ** 2) / (2 * sigma ** 2)) / (2 * math.pi * sigma ** 2)
    wave = envelope * np.exp(1j * xi * (rows * math.cos(theta) + cols * math.sin(theta)))
    return wave - wave.sum() / envelope.sum() * envelope


def direct_filter(planes, kernel, stride):
    """Correlation of N×1×H×W planes with a complex kernel, reflected borders, every `stride` pixels:
    the modulus of the response. (The kernels are symmetric under rotation by π up to conjugation,
    so correlation and convolution give the same modulus.)"""
    pad = kernel.shape[-1] // 2
    padded = F.pad(planes.double(), (pad, pad, pad, pad), mode="reflect")
    weights = torch.tensor(np.stack([kernel.real, kernel.imag]))[:, None]
    response = F.conv2d(padded, weights, stride=stride)
    return response.square().sum(dim=1, keepdim=True).sqrt()


def direct_lowpass(planes, sigma, side, stride):
    offsets = np.arange(side) - side // 2
    taps = np.exp(-offsets ** 2 / (2 * sigma ** 2))
    kernel = torch.tensor(np.outer(taps, taps) / taps.sum() ** 2)[None, None]
    pad = side // 2
    return F.conv2d(F.pad(planes, (pad, pad, pad, pad), mode="reflect"), kernel, stride=stride)


def test_scatternet_matches_direct_convolutions():
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    features = scatter_features(images).double().view(2, 3, 81, 8, 8)
    planes = images.reshape(6, 1, 32, 32).double()
    thetas = [math.pi * orientation / 8 for orientation in range(8)]
    wavelets = [[direct_morlet(side, 0.8 * 2 ** scale, 0.75 * math.pi / 2 ** scale, theta) for theta in thetas]
                for scale, side in enumerate(nets.SCATTER_KERNELS)]
    full_lowpass, half_lowpass = nets.LOWPASS_KERNELS

    def expect(channel, maps, sigma, side, stride):
        got = features[:, :, channel].reshape(6, 8, 8)
        want = direct_lowpass(maps, sigma, side, stride)[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"channel {channel}")

    expect(0, planes, 1.6, full_lowpass, 4)  # S0
    fine = []
    for theta in range(8):
        fine.append(direct_filter(planes, wavelets[0][theta], 1))
        expect(1 + theta, fine[-1], 1.6, full_lowpass, 4)  # S1, scale 0
        coarse = direct_filter(planes, wavelets[1][theta], 2)
        expect(9 + theta, coarse, 0.8, half_lowpass, 2)  # S1, scale 1
    for first, second in ((0, 0), (2, 5), (7, 3)):
        # S2: the scale-1 wavelet on |x∗ψ_{0,θ}| sampled every 2 pixels is the scale-0 wavelet there.
        path = direct_filter(fine[first][:, :, ::2, ::2], wavelets[0][second], 1)
        expect(17 + 8 * first + second, path, 0.8, half_lowpass, 2)


def test_scatternet_features_of_an_image_depend_on_that_image_only():
    images = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    together = scatter_features(images)
    alone = torch.cat([scatter_features(images[index:index + 1]) for index in range(5)])
    torch.testing.assert_close(together, alone)
    assert together.shape == (5, 243, 4, 4)
    assert not any(isinstance(value, torch.nn.Parameter) for value in vars(nets.ScatterNet(16, 16)).values())


@pytest.mark.parametrize("side", [8, 18])
def test_scatternet_refuses_unsupported_sizes(side):
    with pytest.raises(UsageError) as error:
        scatter_features(torch.zeros(1, 1, side, side))
    assert error.value.flag == "--dataset" and f"{side}×{side}" in str(error.value)

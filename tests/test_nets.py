import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.validators import ModuleValidator
from torch import nn
from torch.func import functional_call, grad, vmap

from perinstance.errors import UsageError
from perinstance.nets import build_model

# (name, in_channels, image_size, num_classes) of the models the experiments use.
SHAPES = {
    "lenet5": ("lenet5", 1, 32, 10),
    "resnet20": ("resnet20", 3, 32, 10),
    "mlp": ("mlp", 1, 8, 4),
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

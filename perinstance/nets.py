"""The networks of the experiments, built so that per-sample gradients are exact.

Every model works with Opacus' GradSampleModule and with torch.func (functional_call +
vmap): only Conv2d / Linear / GroupNorm carry parameters, and there are no in-place ops.
Initialisation draws from torch's global generator: the caller seeds it (torch.manual_seed).
"""

import math

import torch.nn.functional as F
from torch import nn

from perinstance.errors import UsageError

MODEL_CHOICES = ("lenet5", "resnet20", "mlp")
NORM_CHOICES = ("group", "batch", "none")

LENET_IMAGE_SIZE = 32
MLP_HIDDEN = 32
RESNET20_STAGE_CHANNELS = (16, 32, 64)
RESNET20_BLOCKS_PER_STAGE = 3
# Same group count as Opacus' ModuleValidator.fix uses when it swaps BatchNorm for GroupNorm,
# so resnet20 with norm "group" equals the "batch" model after that fix: 16, 32, 32 groups.
MAX_NORM_GROUPS = 32


def build_model(name: str, in_channels: int, image_size: int, num_classes: int, norm_type: str = "group",
                dp: bool = True) -> nn.Module:
    """A fresh, randomly initialised `name` model for `in_channels`×`image_size`² inputs."""
    if norm_type not in NORM_CHOICES:
        raise UsageError("--norm-type", f"unknown norm type '{norm_type}' (allowed: {', '.join(NORM_CHOICES)})")
    if name == "lenet5":
        return _lenet5(in_channels, image_size, num_classes)
    if name == "resnet20":
        if dp and norm_type == "batch":
            raise UsageError("--norm-type", "BatchNorm mixes samples in a batch and breaks per-sample privacy; "
                                            "use group or none")
        return ResNet20(in_channels, num_classes, norm_type)
    if name == "mlp":
        return _mlp(in_channels * image_size * image_size, num_classes)
    raise UsageError("--model", f"unknown model '{name}' (allowed: {', '.join(MODEL_CHOICES)})")


def _lenet5(in_channels, image_size, num_classes):
    """LeNet-5 (LeCun et al. 1998) with tanh and average pooling; ~61.7k parameters on MNIST."""
    if image_size != LENET_IMAGE_SIZE:
        raise UsageError("--model", f"lenet5 needs {LENET_IMAGE_SIZE}×{LENET_IMAGE_SIZE} images, "
                                    f"dataset has {image_size}×{image_size}")
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, kernel_size=5), nn.Tanh(), nn.AvgPool2d(2),
        nn.Conv2d(6, 16, kernel_size=5), nn.Tanh(), nn.AvgPool2d(2),
        nn.Conv2d(16, 120, kernel_size=5), nn.Tanh(),
        nn.Flatten(),
        nn.Linear(120, 84), nn.Tanh(),
        nn.Linear(84, num_classes),
    )


def _mlp(in_features, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, MLP_HIDDEN), nn.Tanh(),
                         nn.Linear(MLP_HIDDEN, num_classes))


def _norm(norm_type, channels):
    if norm_type == "group":
        return nn.GroupNorm(math.gcd(MAX_NORM_GROUPS, channels), channels)
    if norm_type == "batch":
        return nn.BatchNorm2d(channels)
    return nn.Identity()


def _conv3x3(in_channels, out_channels, stride=1):
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


class _PadShortcut(nn.Module):
    """Option-A shortcut of He et al. (2016): subsample by 2 and zero-pad the new channels.

    Parameter-free, as in the paper's CIFAR ResNets, so it needs no per-sample gradient.
    """

    def __init__(self, extra_channels):
        super().__init__()
        self.extra_channels = extra_channels

    def forward(self, x):
        half = self.extra_channels // 2
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, half, self.extra_channels - half))


class _BasicBlock(nn.Module):
    def __init__(self, in_channels, out_channels, stride, norm_type):
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels, stride)
        self.norm1 = _norm(norm_type, out_channels)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.norm2 = _norm(norm_type, out_channels)
        downsamples = stride != 1 or in_channels != out_channels
        self.shortcut = _PadShortcut(out_channels - in_channels) if downsamples else nn.Identity()

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2016, §4.2): 3 stages × 3 basic blocks, 16/32/64 channels.

    Convolutions have no bias (the norm layer that follows has one; with norm "none" the
    architecture is kept the same). ~0.27M parameters for 3×32×32 inputs and 10 classes.
    """

    def __init__(self, in_channels, num_classes, norm_type="group"):
        super().__init__()
        first_channels = RESNET20_STAGE_CHANNELS[0]
        self.conv = _conv3x3(in_channels, first_channels)
        self.norm = _norm(norm_type, first_channels)
        blocks = []
        channels = first_channels
        for stage, stage_channels in enumerate(RESNET20_STAGE_CHANNELS):
            for block in range(RESNET20_BLOCKS_PER_STAGE):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(_BasicBlock(channels, stage_channels, stride, norm_type))
                channels = stage_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")  # as torchvision ResNets

    def forward(self, x):
        out = self.blocks(F.relu(self.norm(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))

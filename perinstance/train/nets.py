"""The networks of the experiments, built so that per-sample gradients are exact.

Every model works with Opacus' GradSampleModule and with torch.func (functional_call +
vmap): only Conv2d / Linear / GroupNorm carry parameters, and there are no in-place ops.
Initialisation draws from torch's global generator: the caller seeds it (torch.manual_seed).
"""

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from perinstance.errors import UsageError

MODEL_CHOICES = ("lenet5", "resnet20", "mlp", "linear")
NORM_CHOICES = ("group", "batch", "none")

LENET_IMAGE_SIZE = 32
MLP_HIDDEN = 32
RESNET20_STAGE_CHANNELS = (16, 32, 64)
RESNET20_BLOCKS_PER_STAGE = 3
# Same group count as Opacus' ModuleValidator.fix uses when it swaps BatchNorm for GroupNorm,
# so resnet20 with norm "group" equals the "batch" model after that fix: 16, 32, 32 groups.
MAX_NORM_GROUPS = 32
# The ScatterNet+linear head of Tramèr & Boneh ("Differentially Private Learning Needs Better
# Features (or Much More Data)", ICLR 2021): GroupNorm with 27 groups over the 3 × 81 scattering
# channels of a colour image (9 per group).
LINEAR_NORM_GROUPS = 27
LINEAR_POOLING = 2
# The scattering transform: J = 2 scales, L = 8 orientations, so 1 + J·L + L²·J(J−1)/2 = 81
# channels per input channel at a quarter of the resolution (Oyallon & Mallat, "Deep Roto-Translation
# Scattering for Object Classification", CVPR 2015; the ScatterNet of Tramèr & Boneh).
SCATTER_ORIENTATIONS = 8
SCATTER_DOWNSAMPLING = 4  # 2^J
# Morlet wavelet of scale j: σ = 0.8·2^j, centre frequency ξ = (3π/4)/2^j; low-pass σ = 0.8·2^(J−1).
# Kernel sides keep the Gaussian envelope out to about 3σ, so truncation changes little.
SCATTER_SIGMA = 0.8
SCATTER_XI = 3 * math.pi / 4
SCATTER_KERNELS = (7, 11)  # wavelets of scale 0 and 1
LOWPASS_KERNELS = (11, 7)  # the low-pass at full and at half resolution
# Reflection needs every filter's half-width below the side of the planes it filters (16 at 32).
MIN_SCATTER_SIDE = 16
SCATTER_CHUNK = 256  # images per pass: bounds the memory of the 64 second-order maps


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
    if name == "linear":
        return _linear(in_channels, image_size, num_classes)
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


def _linear(in_channels, image_size, num_classes):
    """Per-sample GroupNorm without parameters, 2×2 average pooling, then one Linear layer: the
    trained head on `scatternet:` datasets, or a linear model on pixels.

    Tramèr & Boneh's ScatterNet+linear head has no pooling; pooling the 8×8 grid of CIFAR-10's
    features to 4×4 cuts the trained parameters from 155,530 to 38,890, so DP-SGD's per-sample
    gradients cost 4× less on a CPU. Norm and pooling have no parameters and mix no samples: only the
    Linear layer is trained (and accounted for).
    """
    pooled_side = image_size // LINEAR_POOLING
    return nn.Sequential(nn.GroupNorm(math.gcd(LINEAR_NORM_GROUPS, in_channels), in_channels, affine=False),
                         nn.AvgPool2d(LINEAR_POOLING), nn.Flatten(),
                         nn.Linear(in_channels * pooled_side * pooled_side, num_classes))


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

    def __init__(self, in_channels: int, num_classes: int, norm_type: str = "group") -> None:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(F.relu(self.norm(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


# --- the fixed ScatterNet front end --------------------------------------------------------------
#
# Every filter is separable: a Morlet wavelet with an isotropic envelope g is
# ψ_θ(r, c) = a_θ(r)·b_θ(c) − κ_θ·g(r)·g(c) with a_θ(r) = g(r)·e^{iξ r cosθ}, b_θ(c) = g(c)·e^{iξ c sinθ}
# and κ_θ = Σψ-part / Σenvelope (real: the kernel is symmetric). Filtering a plane X (with reflected
# borders, sampled every `stride` pixels) is then A X Bᵀ with banded matrices A, B: a few large matrix
# products instead of many single-channel convolutions, which run far below a CPU's matrix speed.

def gaussian_taps(half_width: int, sigma: float) -> np.ndarray:
    """Taps −half_width..half_width of the Gaussian exp(−u²/2σ²)."""
    offsets = np.arange(-half_width, half_width + 1, dtype=np.float64)
    return np.exp(-offsets ** 2 / (2 * sigma ** 2))


def reflected(index: int, size: int) -> int:
    """The index that reflection about the borders (no edge repeat, as F.pad's "reflect") maps to."""
    period = 2 * (size - 1)
    index = abs(index) % period if period else 0
    return period - index if index >= size else index


def filter_matrix(taps: np.ndarray, size: int, stride: int) -> np.ndarray:
    """The (⌈size/stride⌉ × size) matrix of 1-D filtering by `taps` (centred) with reflected borders,
    sampled every `stride` samples: row o is the filter around sample o·stride."""
    half_width = len(taps) // 2
    matrix = np.zeros((-(-size // stride), size), dtype=taps.dtype)
    for row in range(matrix.shape[0]):
        for offset, tap in enumerate(taps):
            matrix[row, reflected(row * stride + offset - half_width, size)] += tap
    return matrix


def morlet_factors(half_width: int, sigma: float, xi: float, theta: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(a_θ, b_θ, κ_θ): the separable factors of the Morlet wavelet, normalised by 1/(2πσ²)."""
    envelope = gaussian_taps(half_width, sigma) / math.sqrt(2 * math.pi * sigma ** 2)
    offsets = np.arange(-half_width, half_width + 1, dtype=np.float64)
    row_factor = envelope * np.exp(1j * xi * offsets * math.cos(theta))
    column_factor = envelope * np.exp(1j * xi * offsets * math.sin(theta))
    kappa = (row_factor.sum() * column_factor.sum()).real / envelope.sum() ** 2
    return row_factor, column_factor, kappa


class _WaveletBank:
    """Filtering of N×H×W planes by the L wavelets of one scale, sampled every `stride` pixels, and
    the modulus of the complex responses: N×L×H'×W', computed with matrices for one plane size."""

    def __init__(self, scale, height, width, stride):
        half_width = SCATTER_KERNELS[scale] // 2
        sigma, xi = SCATTER_SIGMA * 2 ** scale, SCATTER_XI / 2 ** scale
        thetas = [math.pi * orientation / SCATTER_ORIENTATIONS for orientation in range(SCATTER_ORIENTATIONS)]
        factors = [morlet_factors(half_width, sigma, xi, theta) for theta in thetas]
        envelope = gaussian_taps(half_width, sigma) / math.sqrt(2 * math.pi * sigma ** 2)
        # Columns first, for every θ (real and imaginary part) and the envelope: B·Xᵀ in one product.
        columns = [filter_matrix(column_factor, width, stride) for _, column_factor, _ in factors]
        self.columns = _tensor(np.concatenate([part for matrix in columns for part in (matrix.real, matrix.imag)]
                                              + [filter_matrix(envelope, width, stride)]))
        # Rows next: Aᵀ per θ, real and imaginary part, applied from the right to the rows of Xᵀ.
        rows = np.stack([filter_matrix(row_factor, height, stride).T for row_factor, _, _ in factors])
        self.rows_real, self.rows_imag = _tensor(rows.real), _tensor(rows.imag)
        self.envelope_rows = _tensor(filter_matrix(envelope, height, stride).T)
        self.kappas = _tensor(np.array([kappa for _, _, kappa in factors])).view(-1, 1, 1)
        self.out_height, self.out_width = self.envelope_rows.shape[1], columns[0].shape[0]

    def moduli(self, planes):
        """|planes ∗ ψ_θ| for every θ: N×L×H'×W'."""
        count, height, width = planes.shape
        orientations, out_width = SCATTER_ORIENTATIONS, self.out_width
        across = self.columns @ planes.permute(2, 0, 1).reshape(width, count * height)  # ((2L+1)·W')×(N·H)
        filtered = across[:2 * orientations * out_width].view(orientations, 2, out_width * count, height)
        envelope = across[2 * orientations * out_width:].view(out_width * count, height) @ self.envelope_rows
        real = filtered[:, 0] @ self.rows_real - filtered[:, 1] @ self.rows_imag - self.kappas * envelope
        imag = filtered[:, 0] @ self.rows_imag + filtered[:, 1] @ self.rows_real
        moduli = (real.square() + imag.square()).sqrt()  # L×(W'·N)×H'
        return moduli.view(orientations, out_width, count, self.out_height).permute(2, 0, 3, 1)


def _tensor(array):
    return torch.tensor(array, dtype=torch.float32)


class _Lowpass:
    """The Gaussian low-pass of σ = 0.8·2^(J−1) pixels of the full resolution, sampled at 1/4 of it."""

    def __init__(self, height, width, stride, sigma):
        half_width = LOWPASS_KERNELS[0 if stride == SCATTER_DOWNSAMPLING else 1] // 2
        taps = gaussian_taps(half_width, sigma)
        taps /= taps.sum()
        self.rows = _tensor(filter_matrix(taps, height, stride))
        self.columns = _tensor(filter_matrix(taps, width, stride).T)

    def __call__(self, maps):
        return self.rows @ (maps @ self.columns)


class ScatterNet:
    """Second-order scattering transform with J = 2, L = 8, applied to each input channel.

    S0 = x∗φ, S1 = |x∗ψ_{j,θ}|∗φ, S2 = ||x∗ψ_{0,θ}|∗ψ_{1,θ'}|∗φ, sampled every 4 pixels: 81
    channels per input channel, at H/4 × W/4. Every filter is fixed by the constants above (no
    parameter, nothing learned, nothing taken from data), so features of a dataset are a fixed
    function of each image alone and DP-SGD on a head over them is DP for the images. The
    wavelets have an isotropic envelope and the borders are reflected (kymatio's Scattering2D
    uses an elongated envelope and works in Fourier space): a cheaper variant of the same transform.
    """

    def __init__(self, height: int, width: int) -> None:
        if height % SCATTER_DOWNSAMPLING or width % SCATTER_DOWNSAMPLING or min(height, width) < MIN_SCATTER_SIDE:
            raise UsageError("--dataset", f"scatternet: needs image sides divisible by {SCATTER_DOWNSAMPLING} "
                                          f"and at least {MIN_SCATTER_SIDE} pixels, got {height}×{width}")
        self.fine = _WaveletBank(0, height, width, stride=1)
        self.coarse = _WaveletBank(1, height, width, stride=2)
        # The second layer's scale-1 wavelets act on |x∗ψ_{0,θ}| sampled every 2 pixels, where they
        # are scale-0 wavelets: 2.7× fewer operations than at full resolution, for a little aliasing.
        self.second = _WaveletBank(0, height // 2, width // 2, stride=1)
        self.lowpass_full = _Lowpass(height, width, SCATTER_DOWNSAMPLING, SCATTER_SIGMA * 2)
        self.lowpass_half = _Lowpass(height // 2, width // 2, SCATTER_DOWNSAMPLING // 2, SCATTER_SIGMA)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        count, channels, height, width = images.shape
        planes = images.reshape(count * channels, height, width)
        first_fine = self.fine.moduli(planes)  # |x∗ψ_{0,θ}|, full resolution
        first_coarse = self.coarse.moduli(planes)  # |x∗ψ_{1,θ}|, half resolution
        second = self.second.moduli(first_fine[..., ::2, ::2].reshape(-1, height // 2, width // 2))
        second = second.reshape(count * channels, -1, height // 2, width // 2)
        full = self.lowpass_full(torch.cat([planes[:, None], first_fine], dim=1))
        half = self.lowpass_half(torch.cat([first_coarse, second], dim=1))
        features = torch.cat([full, half], dim=1)
        return features.reshape(count, channels * features.shape[1], *features.shape[2:])


@torch.no_grad()
def scatter_features(images: torch.Tensor, progress: Callable[[int], object] | None = None) -> torch.Tensor:
    """ScatterNet features of `images` (N×C×H×W float32), SCATTER_CHUNK images at a time;
    `progress(n)` is called after each chunk with its size."""
    transform = ScatterNet(*images.shape[2:])
    parts = []
    for start in range(0, len(images), SCATTER_CHUNK):
        parts.append(transform(images[start:start + SCATTER_CHUNK]))
        if progress is not None:
            progress(len(parts[-1]))
    return torch.cat(parts) if parts else transform(images)

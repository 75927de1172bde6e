"""The workloads the speed benchmarks time side by side: LeNet-5 on MNIST, ResNet-20 (GroupNorm) on
CIFAR-10-shaped inputs, and (bench_sensitivity.py) a two-layer Transformer encoder on token sequences.
ResNet-20's and the Transformer's inputs are random: timings do not depend on the data."""

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from _smoke import synthetic_lenet_dataset
from torch import nn

from perinstance.cli.options import add_device_argument
from perinstance.train.data import Dataset, load_dataset
from perinstance.train.nets import build_model

CIFAR_SHAPE = (3, 32, 32)
CIFAR_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Workload:
    model_name: str
    dataset: Dataset
    build: Callable[[], nn.Module] | None = None  # a network not of nets.py

    def model(self, dp: bool = True, device: str = "cpu") -> torch.nn.Module:
        """The model at its seeded initialisation on `device` (timings do not depend on the weights)."""
        torch.manual_seed(0)
        if self.build is not None:
            return self.build().to(device)
        channels, size, _ = self.dataset.train_x.shape[1:]
        return build_model(self.model_name, channels, size, self.dataset.num_classes, dp=dp).to(device)

    @property
    def label(self):
        return f"{self.model_name}, {self.dataset.name} ({len(self.dataset.train_y)} points)"


def random_cifar_dataset(train_size, test_size=16):
    """Normal random 3×32×32 images with uniform labels, seeded."""
    generator = torch.Generator().manual_seed(0)

    def images(count):
        return torch.randn(count, *CIFAR_SHAPE, generator=generator)

    def labels(count):
        return torch.randint(0, CIFAR_CLASSES, (count,), generator=generator)

    return Dataset(f"random-cifar-shape-{train_size}", images(train_size), labels(train_size), images(test_size),
                   labels(test_size), CIFAR_CLASSES, [str(label) for label in range(CIFAR_CLASSES)],
                   fingerprint=f"random-cifar-shape-{train_size}")


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A Transformer encoder classifier on token sequences: its sizes."""

    vocabulary: int
    length: int
    width: int
    heads: int
    feed_forward: int
    layers: int
    classes: int = 2


TRANSFORMER = TransformerShape(vocabulary=1000, length=64, width=128, heads=4, feed_forward=256, layers=2)
SMOKE_TRANSFORMER = TransformerShape(vocabulary=50, length=8, width=16, heads=2, feed_forward=32, layers=2)


class TokenTransformer(nn.Module):
    """Token and position embeddings (each an nn.Embedding on batch-first ids), `layers` Transformer encoder
    layers (self-attention, LayerNorm, feed-forward Linear layers on tokens), mean over tokens, a Linear head."""

    def __init__(self, shape: TransformerShape):
        super().__init__()
        self.embed = nn.Embedding(shape.vocabulary, shape.width)
        self.position = nn.Embedding(shape.length, shape.width)
        layer = nn.TransformerEncoderLayer(shape.width, shape.heads, shape.feed_forward, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, shape.layers, enable_nested_tensor=False)
        self.head = nn.Linear(shape.width, shape.classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.head(self.encoder(self.embed(tokens) + self.position(positions)).mean(dim=1))


def transformer_workload(smoke: bool, points: int) -> Workload:
    """The Transformer encoder on `points` random token sequences with random labels, seeded."""
    shape = SMOKE_TRANSFORMER if smoke else TRANSFORMER
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocabulary, (points + 16, shape.length), generator=generator)
    labels = torch.randint(0, shape.classes, (points + 16,), generator=generator)
    name = f"random-tokens-{shape.length}-{points}"
    dataset = Dataset(name, tokens[:points], labels[:points], tokens[points:], labels[points:], shape.classes,
                      [str(label) for label in range(shape.classes)], fingerprint=name)
    return Workload("transformer", dataset, build=lambda: TokenTransformer(shape))


def workloads(smoke, resnet_points):
    """LeNet-5 on the embedded MNIST subset (smoke: the synthetic one) and ResNet-20 on `resnet_points`
    random CIFAR-shaped points."""
    lenet_data = synthetic_lenet_dataset() if smoke else load_dataset("mnist-embedded")
    return [Workload("lenet5", lenet_data), Workload("resnet20", random_cifar_dataset(resnet_points))]


# How a benchmark times its methods: wall seconds, or this process's CPU seconds (with one thread
# the same on an idle machine, and far less disturbed by other processes).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def add_timing_arguments(parser):
    """--device, --threads and --clock, the same in every side-by-side benchmark."""
    add_device_argument(parser)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads; under load, one thread per process times the methods more fairly, "
                             "as a thread waiting for a descheduled one at every operation slows small ones many-fold")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall seconds, or this process's CPU seconds (with --threads 1: the same on an idle "
                             "machine, and far less disturbed by other processes); on CUDA always wall seconds "
                             "read after torch.cuda.synchronize()")


def parse_timed(parser: argparse.ArgumentParser, smoke_sizes: dict) -> argparse.Namespace:
    """The arguments of a side-by-side benchmark: its own, add_timing_arguments', and --smoke, which replaces
    `smoke_sizes` for CI; the device checked and torch's threads set."""
    add_timing_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help=f"tiny data, {smoke_sizes}, for CI")
    args = parser.parse_args()
    require_device(parser, args.device)
    if args.smoke:
        vars(args).update(smoke_sizes)
    torch.set_num_threads(args.threads)
    return args


def timer(clock: str, device: str) -> Callable[[], float]:
    """The clock a benchmark reads for `--clock` on `device`. On CUDA, wall seconds once the device has
    finished its queued work: kernels run asynchronously, so neither the CPU seconds of this process nor
    an unsynchronised wall clock see them."""
    if torch.device(device).type != "cuda":
        return CLOCKS[clock]

    def synchronised_wall() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronised_wall


def same_round_ratios(mine: list[float], theirs: list[float]) -> str:
    """The ratios of two methods' rates measured in the same interleaved rounds, as their median and range.
    A round's ratio compares two timings taken moments apart, so a load that shifts between rounds moves both;
    the ratio of the best rounds can pair one method's quiet round with the other's disturbed one."""
    ratios = [first / second for first, second in zip(mine, theirs, strict=True)]
    return f"same-round ratio median {statistics.median(ratios):.2f}×, range {min(ratios):.2f}–{max(ratios):.2f}×"


def require_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Stop with a usage error when --device names a GPU this machine does not have."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: {device} requested but no CUDA device is available (allowed: cpu, auto)")


def device_name(device: str) -> str:
    """The device the benchmark ran on, for its header line."""
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "CPU"

"""The two workloads the speed benchmarks time side by side: LeNet-5 on MNIST and ResNet-20 (GroupNorm)
on CIFAR-10-shaped inputs. ResNet-20's inputs are random: timings do not depend on the data."""

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from _smoke import synthetic_lenet_dataset

from perinstance.cli.options import add_device_argument
from perinstance.train.data import Dataset, load_dataset
from perinstance.train.nets import build_model

CIFAR_SHAPE = (3, 32, 32)
CIFAR_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Workload:
    model_name: str
    dataset: Dataset

    def model(self, dp: bool = True, device: str = "cpu") -> torch.nn.Module:
        """The model at its seeded initialisation on `device` (timings do not depend on the weights)."""
        torch.manual_seed(0)
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

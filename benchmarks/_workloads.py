"""The two workloads the speed benchmarks time side by side: LeNet-5 on MNIST and ResNet-20 (GroupNorm)
on CIFAR-10-shaped inputs. ResNet-20's inputs are random: timings do not depend on the data."""

import dataclasses
import time

import torch
from _smoke import synthetic_lenet_dataset

from perinstance.train.data import Dataset, load_dataset
from perinstance.train.nets import build_model

CIFAR_SHAPE = (3, 32, 32)
CIFAR_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class Workload:
    model_name: str
    dataset: Dataset

    def model(self, dp=True):
        """The model at its seeded initialisation (timings do not depend on the weights)."""
        torch.manual_seed(0)
        channels, size, _ = self.dataset.train_x.shape[1:]
        return build_model(self.model_name, channels, size, self.dataset.num_classes, dp=dp)

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
    """--threads and --clock, the same in every side-by-side benchmark."""
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads; under load, one thread per process times the methods more fairly, "
                             "as a thread waiting for a descheduled one at every operation slows small ones many-fold")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall seconds, or this process's CPU seconds (with --threads 1: the same on an idle "
                             "machine, and far less disturbed by other processes)")

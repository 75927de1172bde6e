"""Training throughput: this trainer vs Opacus's make_private (hooks, and ghost clipping) vs non-private SGD.

For LeNet-5 on the embedded MNIST subset and ResNet-20 (GroupNorm) on random CIFAR-10-shaped
inputs: same model, data, expected batch size and number of steps for every method, measured
side by side (one untimed round of every method, then interleaved repeats) in one process on --device;
printed as samples/s and ratios (of the best round of each, and of each round). On
CUDA the clock is the wall clock read after torch.cuda.synchronize(). Opacus and non-private SGD
draw their batches from their DataLoader and move them to the device before the clock starts, so
the DataLoader's per-example indexing is not timed; this trainer's timed step includes its own
Poisson draw from data already on the device. Rates count the examples each method's batches held (Poisson
batches vary in size around the expected batch size; non-private SGD's hold exactly that many).

    python benchmarks/bench_training.py [--steps 30] [--batch-size 256] [--resnet-steps 8]
                                        [--resnet-batch-size 128] [--repeats 5] [--threads 1] [--clock cpu]
                                        [--device cpu|cuda|auto]
    python benchmarks/bench_training.py --smoke     # seconds: tiny data, a few small steps
"""

import argparse
import itertools
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _workloads import device_name, parse_timed, same_round_ratios, timer, workloads  # noqa: E402

from perinstance.cli import options
from perinstance.train import run_plan, sampling, training

warnings.filterwarnings("ignore")
SMOKE_SIZES = {"steps": 2, "batch_size": 32, "resnet_steps": 1, "resnet_batch_size": 8, "repeats": 1, "threads": 1}
# Enough points for the expected batches (sampling rate at most 1/RESNET_BATCHES_PER_EPOCH); ResNet-20's are
# random, so no more are made than needed.
RESNET_POINTS = 1024
RESNET_BATCHES_PER_EPOCH = 8
SMOKE_RESNET_POINTS = 32
NOISE_MULTIPLIER, CLIP_NORM, LEARNING_RATE = 1.0, 1.0, 0.5
# The target (27): this trainer's throughput over non-private SGD's, on both models.
NON_PRIVATE_TARGET = 0.8


def time_this_trainer(workload, steps, batch_size, clock, device):
    args = run_plan.resolve_training_args(options.parse_training_flags([
        "--model", workload.model_name, "--sigma", str(NOISE_MULTIPLIER), "--cn", str(CLIP_NORM),
        "--batch-size", str(batch_size), "--lr", str(LEARNING_RATE), "--models-dir", "/tmp/bench",
        "--device", device]))
    run = run_plan.plan_run(args, workload.dataset)
    trainer = training.Trainer(run, workload.dataset, args.device)
    trainer.step(1)  # warm-up
    started = clock()
    for step in range(2, steps + 2):
        trainer.step(step)
    seconds = clock() - started
    return sum(len(sampling.poisson_batch(run.seed, step, run.dataset_size, run.sample_rate))
               for step in range(2, steps + 2)) / seconds


def time_opacus(workload, steps, batch_size, clock, device, mode):
    """Opacus's own DP-SGD loop: per-sample gradients by hooks, or ghost clipping (two backwards)."""
    model = workload.model(device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    loader = DataLoader(TensorDataset(workload.dataset.train_x, workload.dataset.train_y), batch_size=batch_size)
    private = PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                           criterion=nn.CrossEntropyLoss(), noise_multiplier=NOISE_MULTIPLIER,
                                           max_grad_norm=CLIP_NORM, poisson_sampling=True, grad_sample_mode=mode)
    if mode == "ghost":
        model, optimizer, criterion, loader = private
    else:
        (model, optimizer, loader), criterion = private, nn.CrossEntropyLoss()
    return _time_loop(model, optimizer, criterion, loader, steps, clock, device)


def time_non_private(workload, steps, batch_size, clock, device):
    model = workload.model(dp=False, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(workload.dataset.train_x, workload.dataset.train_y), batch_size=batch_size,
                        shuffle=True)
    return _time_loop(model, optimizer, F.cross_entropy, loader, steps, clock, device)


def _time_loop(model, optimizer, criterion, loader, steps, clock, device):
    # On a GPU a step of a small model takes about as long as the DataLoader's indexing of a batch, one
    # example at a time: timed, it would weigh on these methods and not on this trainer.
    batches = [(inputs.to(device), labels.to(device)) for inputs, labels in itertools.islice(_forever(loader), steps + 1)]
    _train_step(model, optimizer, criterion, *batches[0])  # warm-up step
    started = clock()
    for inputs, labels in batches[1:]:
        _train_step(model, optimizer, criterion, inputs, labels)
    return sum(len(labels) for _, labels in batches[1:]) / (clock() - started)


def _forever(loader):
    while True:
        yield from loader


def _train_step(model, optimizer, criterion, inputs, labels):
    optimizer.zero_grad()
    criterion(model(inputs), labels).backward()
    optimizer.step()


METHODS = {
    "this trainer": time_this_trainer,
    "Opacus make_private (hooks)": lambda *sizes_and_clock: time_opacus(*sizes_and_clock, mode="hooks"),
    "Opacus make_private (ghost)": lambda *sizes_and_clock: time_opacus(*sizes_and_clock, mode="ghost"),
    "non-private SGD": time_non_private,
}


def bench(workload, steps, batch_size, repeats, clock, device):
    # One untimed round first, every method alike: a process's first pass over a batch shape pays one-off costs
    # (the convolution library builds its kernels for each shape; Poisson batches take a new size at most
    # steps of a short run, a fixed batch only once), which a training run pays in its first steps only.
    for method in METHODS.values():
        method(workload, steps, batch_size, clock, device)
    results = {name: [] for name in METHODS}
    for _ in range(repeats):  # interleaved, so load changes hit every method alike
        for name, method in METHODS.items():
            results[name].append(method(workload, steps, batch_size, clock, device))
    mine = results["this trainer"]
    print(f"\n{workload.label}, batch {batch_size}, {steps} steps, {repeats} interleaved rounds on {device} "
          f"({clock.__name__}). Best round (least disturbed by other processes), and the ratios of the same round:")
    for name, rates in results.items():
        ratio = max(mine) / max(rates)
        target = f"   target ≥ {NON_PRIVATE_TARGET}×: {'met' if ratio >= NON_PRIVATE_TARGET else 'NOT met'}" \
            if name == "non-private SGD" else ""
        spread = "" if rates is mine else f" ({same_round_ratios(mine, rates)})"
        print(f"  {name:30s} {max(rates):9.1f} samples/s   this trainer is {ratio:5.2f}× this{spread}{target}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--resnet-steps", type=int, default=8)
    parser.add_argument("--resnet-batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse_timed(parser, SMOKE_SIZES)
    resnet_points = max(RESNET_POINTS, RESNET_BATCHES_PER_EPOCH * args.resnet_batch_size)
    lenet, resnet = workloads(args.smoke, SMOKE_RESNET_POINTS if args.smoke else resnet_points)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {device_name(args.device)}, load average before: "
          f"{os.getloadavg()[0]:.2f}")
    clock = timer(args.clock, args.device)
    bench(lenet, args.steps, args.batch_size, args.repeats, clock, args.device)
    bench(resnet, args.resnet_steps, args.resnet_batch_size, args.repeats, clock, args.device)
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (other processes on the machine slow every method alike)")


if __name__ == "__main__":
    main()

"""Training throughput: this trainer vs Opacus's own make_private loop vs non-private SGD.

Same model (LeNet-5), data (the embedded MNIST subset), expected batch size and number
of steps, measured side by side in one process; printed as samples/s and ratios.

    python benchmarks/bench_training.py [--steps 60] [--batch-size 256] [--repeats 3]
    python benchmarks/bench_training.py --smoke     # seconds: 128 synthetic points, 3 steps of 32
"""

import argparse
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _smoke import synthetic_lenet_dataset  # noqa: E402

from perinstance import training  # noqa: E402
from perinstance.data import load_dataset  # noqa: E402
from perinstance.nets import build_model  # noqa: E402
from perinstance.options import Parser, add_training_args  # noqa: E402

warnings.filterwarnings("ignore")
SMOKE_SIZES = {"steps": 3, "batch_size": 32, "repeats": 1}


def time_this_trainer(dataset, steps, batch_size):
    parser = Parser()
    add_training_args(parser)
    args = training.resolve_training_args(parser.parse_args(["--sigma", "1.0", "--batch-size", str(batch_size),
                                                             "--lr", "0.5", "--models-dir", "/tmp/bench"]))
    metadata = training.plan_run(args, dataset)
    trainer = training.Trainer(args, metadata, dataset)
    trainer.step(1)  # warm-up
    started = time.perf_counter()
    for step in range(2, steps + 2):
        trainer.step(step)
    return steps * batch_size / (time.perf_counter() - started)


def lenet(dataset, dp=True):
    torch.manual_seed(0)
    channels, size, _ = dataset.train_x.shape[1:]
    return build_model("lenet5", channels, size, dataset.num_classes, dp=dp)


def time_opacus(dataset, steps, batch_size):
    model = lenet(dataset)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(dataset.train_x, dataset.train_y), batch_size=batch_size)
    model, optimizer, loader = PrivacyEngine().make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                            noise_multiplier=1.0, max_grad_norm=1.0,
                                                            poisson_sampling=True)
    return _time_loop(model, optimizer, loader, steps, batch_size)


def time_non_private(dataset, steps, batch_size):
    model = lenet(dataset, dp=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(dataset.train_x, dataset.train_y), batch_size=batch_size, shuffle=True)
    return _time_loop(model, optimizer, loader, steps, batch_size)


def _time_loop(model, optimizer, loader, steps, batch_size):
    batches = iter(_forever(loader))
    inputs, labels = next(batches)  # warm-up step
    _train_step(model, optimizer, inputs, labels)
    started = time.perf_counter()
    for _ in range(steps):
        inputs, labels = next(batches)
        _train_step(model, optimizer, inputs, labels)
    return steps * batch_size / (time.perf_counter() - started)


def _forever(loader):
    while True:
        yield from loader


def _train_step(model, optimizer, inputs, labels):
    optimizer.zero_grad()
    F.cross_entropy(model(inputs), labels).backward()
    optimizer.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help=f"synthetic data, {SMOKE_SIZES}, for CI")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE_SIZES)
    dataset = synthetic_lenet_dataset() if args.smoke else load_dataset("mnist-embedded")
    results = {"this trainer": [], "opacus make_private": [], "non-private SGD": []}
    for _ in range(args.repeats):  # interleaved, so load changes hit all three alike
        results["this trainer"].append(time_this_trainer(dataset, args.steps, args.batch_size))
        results["opacus make_private"].append(time_opacus(dataset, args.steps, args.batch_size))
        results["non-private SGD"].append(time_non_private(dataset, args.steps, args.batch_size))
    best = {name: max(values) for name, values in results.items()}
    print(f"LeNet-5, {dataset.name} ({len(dataset.train_y)} points), batch {args.batch_size}, {args.steps} steps, "
          f"best of {args.repeats}, {torch.get_num_threads()} threads")
    for name, rate in best.items():
        print(f"  {name:22s} {rate:9.0f} samples/s")
    print(f"  ratio this trainer / opacus:      {best['this trainer'] / best['opacus make_private']:.2f}x")
    print(f"  ratio this trainer / non-private: {best['this trainer'] / best['non-private SGD']:.2f}x")


if __name__ == "__main__":
    main()

"""Per-point privacy of your own Opacus training loop (docs/api.md).

    python examples/opacus_individual_accounting.py --smoke          # seconds: 128 synthetic points (CI)
    python examples/opacus_individual_accounting.py --data mnist --epochs 3 --every 50

A model defined below is trained by Opacus's PrivacyEngine (Poisson sampling, flat clipping, the sum
rule of docs/accounting.md §1). Every --every steps, perinstance.sensitivities measures Δ* of every
training point at the current parameters (§2); each step is recorded in a perinstance.IndividualAccountant
with the Δ*/C of the latest measurement, as renyi_per_instance_sum_compo.py composes checkpoints (§4).
Each epoch prints the per-point ε (median, 10%-90%, max) beside Opacus's own worst-case ε.
--save writes the accountant's state, the run's settings and the ε per point as JSON.
"""

import argparse
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# Run from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perinstance import IndividualAccountant, sensitivities  # noqa: E402
from perinstance.cli.options import HELP_FORMAT, Parser, non_negative_int, positive_float, probability  # noqa: E402
from perinstance.console import progress_bar  # noqa: E402
from perinstance.errors import UsageError, run_main  # noqa: E402
from perinstance.files.fileio import write_json  # noqa: E402
from perinstance.train.data import load_dataset  # noqa: E402

DATASETS = {"mnist": "mnist-embedded", "synthetic": "synthetic"}
SMOKE = dict(data="synthetic", train_size=128, epochs=2, batch_size=32, every=2, max_grad_norm=20.0)
# A point counts as better off than the worst case when its ε is this much below Opacus's.
MARGIN = 0.9

# Opacus warns that its default generator is not a cryptographic one; an example seeds it on purpose.
warnings.filterwarnings("ignore", message="Secure RNG turned off")


class SmallConvNet(nn.Module):
    """Any network without BatchNorm works with Opacus; this one has only layers of the fast norms engine."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(4))
        self.classifier = nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1, not 0")
    return value


def build_parser() -> Parser:
    parser = Parser(description=__doc__, formatter_class=HELP_FORMAT)
    parser.add_argument("--data", choices=sorted(DATASETS), default="mnist",
                        help="the MNIST digits shipped in perinstance/embedded (default) or synthetic clusters")
    parser.add_argument("--train-size", type=positive_int, default=None,
                        help="train on the first N training points (default: all)")
    parser.add_argument("--epochs", type=positive_int, default=3, help="epochs (default 3)")
    parser.add_argument("--batch-size", type=positive_int, default=256,
                        help="expected Poisson batch size; sample rate = batch size / N (default 256)")
    parser.add_argument("--noise-multiplier", type=positive_float, default=1.1, help="σ (default 1.1)")
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="clip bound C (default 1)")
    parser.add_argument("--lr", type=positive_float, default=2.0, help="SGD learning rate (default 2)")
    parser.add_argument("--every", type=positive_int, default=50,
                        help="measure Δ* of every point every K steps, from step 0 (default 50)")
    parser.add_argument("--delta", type=probability, default=1e-5, help="δ (default 1e-5)")
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp",
                        help="compose by Rényi DP (§4, default) or privacy loss distributions (§8)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the model, the batches and the noise")
    parser.add_argument("--save", help="write the accountant's state, the settings and the ε per point here (JSON)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run for CI: " + ", ".join(f"--{key.replace('_', '-')} {value}"
                                                               for key, value in SMOKE.items()))
    return parser


def parse_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    return args


def accuracy(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(inputs).argmax(dim=1) == labels).float().mean().item()
    model.train()
    return correct


def spread(eps: np.ndarray) -> str:
    low, median, high = np.quantile(eps, [0.1, 0.5, 0.9])
    return f"median {median:.3f}, 10-90% {low:.3f}-{high:.3f}, max {eps.max():.3f}"


def main(argv=None):
    args = parse_args(argv)
    dataset = load_dataset(DATASETS[args.data])
    size = len(dataset.train_y) if args.train_size is None else args.train_size
    if size > len(dataset.train_y):
        raise UsageError("--train-size", f"at most {len(dataset.train_y)} for --data {args.data}, not {size}")
    if args.batch_size > size:
        raise UsageError("--batch-size", f"at most the {size} training points, not {args.batch_size}")
    train_x, train_y = dataset.train_x[:size], dataset.train_y[:size]
    torch.manual_seed(args.seed)
    model = SmallConvNet(dataset.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size)
    engine = PrivacyEngine(accountant="rdp")
    generator = torch.Generator().manual_seed(args.seed)
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=args.noise_multiplier,
                                                   max_grad_norm=args.max_grad_norm, poisson_sampling=True,
                                                   noise_generator=generator)
    clip_bound = args.max_grad_norm
    accountant = IndividualAccountant(size)
    sensitivity_ratios = sensitivities(model, (train_x, train_y), clip_bound) / clip_bound
    steps = 0
    print(f"{size} {args.data} points, expected batch {args.batch_size}, σ={args.noise_multiplier:g}, "
          f"C={clip_bound:g}, Δ* of every point every {args.every} steps, δ={args.delta:g}, {args.accountant}")
    for epoch in range(1, args.epochs + 1):
        with progress_bar(len(loader), f"epoch {epoch}") as bar:
            for inputs, labels in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), labels).backward()
                optimizer.step()
                # The (σ, q) Opacus's own accountant recorded for this step.
                noise_multiplier, sample_rate, _ = engine.accountant.history[-1]
                accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                                sensitivity_ratios=sensitivity_ratios)
                steps += 1
                if steps % args.every == 0:
                    sensitivity_ratios = sensitivities(model, (train_x, train_y), clip_bound) / clip_bound
                bar.update(1)
        eps = accountant.get_epsilon(args.delta, accountant=args.accountant)
        print(f"epoch {epoch}: {steps} steps, test accuracy {accuracy(model, dataset.test_x, dataset.test_y):.3f}, "
              f"per-point eps {spread(eps)}; Opacus worst case {engine.get_epsilon(args.delta):.3f}")
    worst_case = engine.get_epsilon(args.delta)
    if args.save:
        write_json(args.save, {"accountant": accountant.state_dict(), "eps": eps.tolist(), "delta": args.delta,
                               "accountant_kind": args.accountant, "clip_bound": clip_bound,
                               "noise_multiplier": args.noise_multiplier, "sample_rate": sample_rate,
                               "batch_size": args.batch_size, "dataset_size": size, "total_steps": steps,
                               "every": args.every, "opacus_eps": worst_case}, "--save")
    below = np.mean(eps < MARGIN * worst_case)
    print(f"done: {steps} steps; {below:.0%} of the points have eps below {MARGIN:g} x Opacus's worst case "
          f"{worst_case:.3f}"
          + (f"; saved {args.save}" if args.save else ""))


if __name__ == "__main__":
    run_main(main)

"""Per-point privacy of your own Opacus training loop (docs/api.md).

    python examples/opacus_individual_accounting.py --smoke          # seconds: 128 synthetic points (CI)
    python examples/opacus_individual_accounting.py --epochs 3       # the shipped MNIST, 8,000 points

with perinstance installed (`pip install -e .`), or from the repository root with `PYTHONPATH=.` in front.
A model defined below is trained by Opacus's PrivacyEngine (Poisson sampling, flat clipping, the sum rule of
docs/accounting.md §1) in physical batches of at most --max-physical-batch-size (Opacus's BatchMemoryManager).
perinstance.IndividualAccountant.attach records every real step (not BatchMemoryManager's skipped ones) with
Δ* of every training point measured at the step's parameters every --every steps (§2, §4). Each epoch prints
the per-point ε (median, 10%-90%, max) beside Opacus's own ε, which attach leaves as it is; with --every 1 the
per-point ε are bounds along the observed run, otherwise held-Δ* estimates (Δ* held between measurements).
--save writes the accountant's state_dict, the run's settings and the ε per point (torch.save; loads with
torch.load(weights_only=True)).
"""

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from perinstance import IndividualAccountant
from perinstance.cli.options import HELP_FORMAT, Parser, non_negative_int, positive_float, positive_int, probability
from perinstance.console import progress_bar
from perinstance.errors import UsageError, run_main
from perinstance.files.fileio import save_torch
from perinstance.train.data import load_dataset

DATASETS = {"mnist": "mnist-embedded", "synthetic": "synthetic"}
SMOKE = dict(data="synthetic", train_size=128, epochs=2, batch_size=32, every=2, max_grad_norm=20.0,
             max_physical_batch_size=8)
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
    parser.add_argument("--max-physical-batch-size", type=positive_int, default=64,
                        help="the most examples of a Poisson batch per forward/backward (Opacus's BatchMemoryManager; "
                             "default 64)")
    parser.add_argument("--every", type=positive_int, default=1,
                        help="measure Δ* of every point every K steps, from the first (default 1: every step, so that "
                             "the per-point ε are bounds; K > 1 holds Δ* between measurements: held-Δ* estimates)")
    parser.add_argument("--delta", type=probability, default=1e-5, help="δ (default 1e-5)")
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp",
                        help="compose by Rényi DP (§4, default) or privacy loss distributions (§8)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the model, the batches and the noise")
    parser.add_argument("--save", help="write the accountant's state_dict, the settings and the ε per point here "
                                       "(torch.save)")
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


def what(accountant: IndividualAccountant, every: int) -> str:
    """What the per-point ε are: bounds along the observed run, or held-Δ* estimates (docs/accounting.md §4)."""
    if accountant.kind == "certified":
        return "bounds along the observed run (Δ* measured at every step)"
    return f"held-Δ* estimates (Δ* measured every {every} steps, held between measurements)"


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
    accountant = IndividualAccountant(size)
    # Every real step from here on is recorded, Δ* of every point measured every --every steps; Opacus's own
    # accountant is chained, not replaced.
    accountant.attach(optimizer, model, loader, every=args.every)
    print(f"{size} {args.data} points, expected batch {args.batch_size} (physical at most "
          f"{args.max_physical_batch_size}), σ={args.noise_multiplier:g}, C={args.max_grad_norm:g}, Δ* of every "
          f"point every {args.every} step(s), δ={args.delta:g}, {args.accountant}")
    for epoch in range(1, args.epochs + 1):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.max_physical_batch_size,
                                optimizer=optimizer) as batches, progress_bar(len(loader), f"epoch {epoch}") as bar:
            for inputs, labels in batches:
                steps = accountant.num_steps
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), labels).backward()
                optimizer.step()  # a real step (recorded) only at the end of a Poisson batch
                bar.update(accountant.num_steps - steps)
        eps = accountant.get_epsilon(args.delta, accountant=args.accountant)
        print(f"epoch {epoch}: {accountant.num_steps} steps, test accuracy "
              f"{accuracy(model, dataset.test_x, dataset.test_y):.3f}, per-point eps {spread(eps)} "
              f"({accountant.kind}); Opacus's eps {engine.get_epsilon(args.delta):.3f}")
    opacus_eps = engine.get_epsilon(args.delta)
    if args.save:
        save_torch(args.save, {"accountant": accountant.state_dict(), "eps": torch.from_numpy(eps),
                               "kind": accountant.kind, "delta": args.delta, "accountant_kind": args.accountant,
                               "clip_bound": args.max_grad_norm, "noise_multiplier": args.noise_multiplier,
                               "batch_size": args.batch_size, "dataset_size": size, "every": args.every,
                               "total_steps": accountant.num_steps, "opacus_eps": opacus_eps}, "--save")
    below = np.mean(eps < MARGIN * opacus_eps)
    print(f"done: {accountant.num_steps} steps; per-point eps are {what(accountant, args.every)}; {below:.0%} of "
          f"the points are below {MARGIN:g} x Opacus's eps {opacus_eps:.3f} (δ={args.delta:g})"
          + (f"; saved {args.save}" if args.save else ""))


if __name__ == "__main__":
    run_main(main)

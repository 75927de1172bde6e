"""An Opacus training loop with an individual Rényi filter: every point keeps a budget (docs/api.md).

    python examples/opacus_filter.py --smoke                             # seconds: 128 synthetic points (CI)
    python examples/opacus_filter.py --train-size 2000 --batch-size 64  # the shipped MNIST, 2,000 points

with perinstance installed (`pip install -e .`), or from the repository root with `PYTHONPATH=.` in front.
A model defined below is trained by Opacus's PrivacyEngine (Poisson sampling, flat clipping, the sum rule of
docs/accounting.md §1) in physical batches of at most --max-physical-batch-size (Opacus's BatchMemoryManager),
on the DataLoader that perinstance.IndividualFilter.attach returns: before each step it measures Δ* of every point
still in training, charges each its Rényi DP of the step at the filter's order, and drops from the step's Poisson
batch the points whose budget the charge would pass, for good (docs/accounting.md §12). Every point's guarantee
is then its target ε at δ, over every trajectory the run could have released (kind "guarantee"); each epoch prints
it beside the per-point ε composed along this run (§4, "certified", never above the guarantee), how many points
left, and Opacus's own ε, which attach leaves as it is: the bound of every point at the worst case for every step,
which does not know that points left. --save writes the filter's state_dict, the settings and both ε per point
(torch.save; loads with torch.load(weights_only=True)).
"""

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from perinstance import IndividualFilter
from perinstance.cli.options import (
    HELP_FORMAT,
    Parser,
    non_negative_int,
    order_float,
    positive_float,
    positive_int,
    probability,
)
from perinstance.console import progress_bar
from perinstance.errors import UsageError, run_main
from perinstance.files.fileio import save_torch
from perinstance.train.data import load_dataset

DATASETS = {"mnist": "mnist-embedded", "synthetic": "synthetic"}
SMOKE = dict(data="synthetic", train_size=128, epochs=3, batch_size=32, max_grad_norm=5.0, target_epsilon=5.0,
             max_physical_batch_size=8)

# Opacus warns that its default generator is not a cryptographic one; an example seeds it on purpose. Its
# per-sample hooks on the first layer, whose input needs no gradient, make torch warn at each backward: harmless.
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def network(in_channels: int, num_classes: int) -> nn.Module:
    """Any network without BatchNorm works with Opacus; this one has only layers of the fast norms engine."""
    return nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 4 * 4, num_classes))


def build_parser() -> Parser:
    parser = Parser(description=__doc__, formatter_class=HELP_FORMAT)
    parser.add_argument("--data", choices=sorted(DATASETS), default="mnist",
                        help="the MNIST digits shipped in perinstance/embedded (default) or synthetic clusters")
    parser.add_argument("--train-size", type=positive_int, default=None,
                        help="train on the first N training points (default: all)")
    parser.add_argument("--epochs", type=positive_int, default=6, help="epochs (default 6)")
    parser.add_argument("--batch-size", type=positive_int, default=256,
                        help="expected Poisson batch size; sample rate = batch size / N (default 256)")
    parser.add_argument("--noise-multiplier", type=positive_float, default=1.1, help="σ (default 1.1)")
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="clip bound C (default 1)")
    parser.add_argument("--lr", type=positive_float, default=2.0, help="SGD learning rate (default 2)")
    parser.add_argument("--max-physical-batch-size", type=positive_int, default=64,
                        help="the most examples of a Poisson batch per forward/backward (Opacus's BatchMemoryManager; "
                             "default 64)")
    parser.add_argument("--target-epsilon", type=positive_float, default=2.0,
                        help="every point's budget: its target ε at --delta (default 2)")
    parser.add_argument("--order", type=order_float, default=None,
                        help="the filter's Rényi order λ_f > 1 (default: the order at which uniform DP-SGD at this σ "
                             "and sample rate takes the most steps within the target)")
    parser.add_argument("--delta", type=probability, default=1e-5, help="δ (default 1e-5)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the model, the batches and the noise")
    parser.add_argument("--save", help="write the filter's state_dict, the settings and the ε per point here "
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
    model = network(train_x.shape[1], dataset.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size,
                        generator=torch.Generator().manual_seed(args.seed))
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=args.noise_multiplier,
                                                   max_grad_norm=args.max_grad_norm, poisson_sampling=True,
                                                   noise_generator=torch.Generator().manual_seed(args.seed))
    try:
        individual_filter = IndividualFilter(size, args.target_epsilon, args.delta, order=args.order)
        # Train on the loader attach returns: Opacus's draws over every point, less the points that left.
        loader = individual_filter.attach(optimizer, model, loader)
    except ValueError as error:  # a target that the order cannot give (the API's message names target_epsilon)
        raise UsageError("--target-epsilon", str(error).removeprefix("target_epsilon: ")) from None
    print(f"{size} {args.data} points, expected batch {args.batch_size} (physical at most "
          f"{args.max_physical_batch_size}), σ={args.noise_multiplier:g}, C={args.max_grad_norm:g}; every point's "
          f"budget ε={args.target_epsilon:g} at δ={args.delta:g}, Rényi order {individual_filter.order:g}")
    for epoch in range(1, args.epochs + 1):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=args.max_physical_batch_size,
                                optimizer=optimizer) as batches, progress_bar(len(loader), f"epoch {epoch}") as bar:
            for inputs, labels in batches:
                steps = individual_filter.num_steps
                optimizer.zero_grad()
                F.cross_entropy(model(inputs), labels).backward()
                optimizer.step()  # a real step only at the end of a Poisson batch
                bar.update(individual_filter.num_steps - steps)
        guarantee, composed = individual_filter.get_epsilon(), individual_filter.composed_epsilon()
        print(f"epoch {epoch}: {individual_filter.num_steps} steps, test accuracy "
              f"{accuracy(model, dataset.test_x, dataset.test_y):.3f}, {individual_filter.active.sum()} of {size} "
              f"points still training; per point ε at δ: {guarantee.max():.3f} ({individual_filter.kind}, over "
              f"every trajectory), composed along this run {spread(composed)} ({individual_filter.composed_kind}); "
              f"Opacus's ε {engine.get_epsilon(args.delta):.3f}")
    opacus_eps = engine.get_epsilon(args.delta)
    left = individual_filter.left_at[individual_filter.left_at > 0]
    if args.save:
        save_torch(args.save, {"filter": individual_filter.state_dict(), "guarantee": torch.from_numpy(guarantee),
                               "composed": torch.from_numpy(composed), "delta": args.delta,
                               "clip_bound": args.max_grad_norm, "noise_multiplier": args.noise_multiplier,
                               "batch_size": args.batch_size, "dataset_size": size,
                               "total_steps": individual_filter.num_steps, "opacus_eps": opacus_eps}, "--save")
    print(f"done: {individual_filter.num_steps} steps; {len(left)} of {size} points left the training set"
          + (f" (at steps {left.min()}-{left.max()})" if len(left) else "")
          + f"; every point's guarantee is ε={args.target_epsilon:g} at δ={args.delta:g} over every trajectory, its "
          f"ε composed along this run at most that (median {np.median(composed):.3f}); Opacus's ε {opacus_eps:.3f} "
          "counts every point at the worst case for every step" + (f"; saved {args.save}" if args.save else ""))


if __name__ == "__main__":
    run_main(main)

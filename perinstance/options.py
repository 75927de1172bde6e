"""Argument parsing shared by every script, so flags cannot drift apart between them."""

import argparse

import numpy as np

from perinstance.errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as a one-line UsageError instead of usage + exit."""

    def error(self, message):
        raise UsageError(None, message)


# --- numbers: argparse `type=` functions, so NaN, ±inf and out-of-domain values are one-line errors -----

def _number(text):
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def finite_float(text):
    """Any finite number (NaN and ±inf are refused)."""
    value = _number(text)
    if not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def positive_float(text):
    """A finite number > 0 (σ, ε, C, lr, epochs, γ, r, s)."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def non_negative_float(text):
    """A finite number >= 0 (an epoch of the learning-rate schedule)."""
    value = finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def probability(text):
    """A probability strictly between 0 and 1 (δ)."""
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), not {text}")
    return value


def momentum_float(text):
    """Heavy-ball momentum in [0, 1): 1 or more never forgets a step and diverges."""
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def non_negative_int(text):
    """An integer >= 0 (a seed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def parse_points(specs, dataset_size, seed=0, flag="--points"):
    """Point indices from `--points` tokens: `3`, `0-99`, `all`, `random:N` (seeded).

    Returns a sorted array of unique indices in [0, dataset_size).
    """
    if isinstance(specs, str):
        specs = [specs]
    chosen = []
    for spec in specs:
        for token in str(spec).replace(",", " ").split():
            chosen.extend(_parse_point_token(token, dataset_size, seed, flag))
    if not chosen:
        raise UsageError(flag, "no points given (use indices like 0 1 2, ranges like 0-99, all, or random:N)")
    return np.unique(np.asarray(chosen, dtype=np.int64))


def _parse_point_token(token, dataset_size, seed, flag):
    allowed = "allowed: indices like 3, ranges like 0-99, all, random:N"
    if token == "all":
        return range(dataset_size)
    if token.startswith("random:"):
        count = _parse_int(token[len("random:"):], flag, token, allowed)
        if count <= 0 or count > dataset_size:
            raise UsageError(flag, f"{token}: N must be in 1..{dataset_size}")
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x9017]))
        return rng.choice(dataset_size, size=count, replace=False).tolist()
    if "-" in token[1:]:
        start_text, end_text = token.split("-", 1) if not token.startswith("-") else (token, "")
        start = _parse_int(start_text, flag, token, allowed)
        end = _parse_int(end_text, flag, token, allowed)
        if start > end:
            raise UsageError(flag, f"{token}: range start is after its end")
        _check_index(start, dataset_size, flag)
        _check_index(end, dataset_size, flag)
        return range(start, end + 1)
    index = _parse_int(token, flag, token, allowed)
    _check_index(index, dataset_size, flag)
    return [index]


def _parse_int(text, flag, token, allowed):
    try:
        return int(text)
    except ValueError:
        raise UsageError(flag, f"{token!r} is not a point index ({allowed})") from None


def _check_index(index, dataset_size, flag):
    if not 0 <= index < dataset_size:
        raise UsageError(flag, f"point {index} is out of range 0..{dataset_size - 1}")


# A bound on one --seeds range, so a typo cannot ask for billions of runs.
MAX_SEEDS = 100_000


def parse_seeds(specs, flag="--seeds"):
    """Training seeds from tokens like `0-15`, `3`, `0,4,8`: a sorted list of unique integers >= 0."""
    seeds = set()
    for token in " ".join(map(str, specs)).replace(",", " ").split():
        first_text, dash, last_text = token.partition("-")
        try:
            first = int(first_text)
            last = int(last_text) if dash else first
        except ValueError:
            raise UsageError(flag, f"{token!r} is not a seed >= 0 or a range like 0-15") from None
        if first > last:
            raise UsageError(flag, f"{token}: range start is after its end")
        if last - first >= MAX_SEEDS:
            raise UsageError(flag, f"{token}: more than {MAX_SEEDS:,} seeds in one range")
        seeds.update(range(first, last + 1))
    if not seeds:
        raise UsageError(flag, "no seeds given (use seeds like 0 1 2 or ranges like 0-15)")
    return sorted(seeds)


def add_training_args(parser):
    """Every flag that defines a training run. Shared by train_dpsgd.py and compute_sensitivity.py."""
    from perinstance.clipping import CLIPPING_CHOICES
    from perinstance.distributed import device_flag

    group = parser.add_argument_group("training run")
    group.add_argument("--dataset", default="mnist-embedded",
                       help="mnist-embedded (shipped, offline), MNIST, FashionMNIST, CIFAR10, synthetic, imagefolder:PATH")
    group.add_argument("--data-root", default="./data", help="where torchvision datasets live")
    group.add_argument("--model", default="lenet5", help="lenet5, resnet20 or mlp")
    group.add_argument("--norm-type", default="group", choices=("group", "batch", "none"),
                       help="normalisation layers of resnet20 (batch is refused with DP)")
    group.add_argument("--batch-size", type=int, default=256, help="expected batch size B_exp; q = B_exp/N")
    group.add_argument("--lr", type=positive_float, default=2.0, help="learning rate")
    group.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    group.add_argument("--momentum", type=momentum_float, default=0.0, help="heavy-ball momentum on the privatised update")
    group.add_argument("--gamma", type=positive_float, default=0.1, help="learning-rate decay factor at each --dec-lr epoch")
    group.add_argument("--dec-lr", type=non_negative_float, nargs="*", default=[], help="epochs at which the learning rate decays")
    group.add_argument("--epochs", type=positive_float, default=8, help="training length in epochs (T = round(epochs·N/B_exp))")
    group.add_argument("--dp", type=int, default=1, choices=(0, 1), help="1: DP-SGD, 0: non-private SGD")
    group.add_argument("--eps", type=positive_float, default=None, help="target ε; σ is calibrated by Opacus (default 10 unless --sigma)")
    group.add_argument("--sigma", type=positive_float, default=None, help="noise multiplier σ, instead of --eps")
    group.add_argument("--delta", type=probability, default=1e-5, help="target δ of the training guarantee")
    group.add_argument("--cn", type=positive_float, default=1.0, help="clipping norm C")
    group.add_argument("--clipping", default="flat", choices=CLIPPING_CHOICES,
                       help="per-sample transform: flat clipping, psac or psasc scaling")
    group.add_argument("--scale-r", type=positive_float, default=None, help="r of psac/psasc (default 0.1)")
    group.add_argument("--scale-s", type=positive_float, default=None, help="s of psasc (default 0.9)")
    group.add_argument("--reduction", default="sum", choices=("sum", "mean"), help="update rule of training")
    group.add_argument("--seed", type=non_negative_int, default=0)
    group.add_argument("--less-point", type=int, default=None, help="train without this training point")
    group.add_argument("--save-freq", type=int, default=None,
                       help="checkpoint every this many steps (default: about 10 checkpoints); step 0 and T always")
    group.add_argument("--save-name", default=None, help="checkpoints go to <models-dir>/<save-name>/ (default: from the flags)")
    group.add_argument("--id", default=None, help="tag appended to the default save name, for repeated runs")
    group.add_argument("--models-dir", default="models")
    group.add_argument("--overwrite", type=int, default=0, choices=(0, 1))
    group.add_argument("--device", default="cpu", type=device_flag,
                       help="cpu, cuda, cuda:N, or auto (CUDA when present, else CPU); under torchrun, "
                            "cuda and auto mean the rank's own GPU cuda:LOCAL_RANK")
    group.add_argument("--eval-freq", type=int, default=None, help="test accuracy every this many steps (default: at checkpoints)")
    group.add_argument("--track-points", nargs="*", default=None,
                       help="record ||h(g)|| of these points (as --points) at every step, for exact composition")
    return group

"""Argument parsing shared by every script, so flags cannot drift apart between them."""

import argparse
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn

import numpy as np
from numpy.typing import ArrayLike

import perinstance
from perinstance.analysis.reading import Source
from perinstance.errors import UsageError

# Keeps the example commands at the top of each script's docstring as written in --help.
HELP_FORMAT = argparse.RawDescriptionHelpFormatter
# What the add_*_argument helpers add flags to: a parser or one of its groups (argparse names no public common type).
Arguments = argparse.ArgumentParser | argparse._ArgumentGroup


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as a one-line UsageError instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(None, message)


# --- numbers: argparse `type=` functions, so NaN, ±inf and out-of-domain values are one-line errors -----

def _number(text):
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def finite_float(text: str) -> float:
    """Any finite number (NaN and ±inf are refused)."""
    value = _number(text)
    if not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (σ, ε, C, lr, epochs, γ, r, s)."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (an epoch of the learning-rate schedule)."""
    value = finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def probability(text: str) -> float:
    """A probability strictly between 0 and 1 (δ)."""
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), not {text}")
    return value


def momentum_float(text: str) -> float:
    """Heavy-ball momentum in [0, 1): 1 or more never forgets a step and diverges."""
    value = finite_float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a seed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a number of steps)."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text}")
    return value


def order_float(text: str) -> float:
    """A Rényi order: a finite number > 1."""
    value = finite_float(text)
    if not value > 1:
        raise argparse.ArgumentTypeError(f"must be a Rényi order > 1, not {text}")
    return value


def zero_or_one(text: str) -> int:
    """The explicit value of a switch, the paper repository's spelling: 0 (off) or 1 (on)."""
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"must be 0 or 1 (or no value: the switch alone means 1), not {text!r}")
    return int(text)


class Switch(argparse.Action):
    """A boolean switch (`--overwrite`) that also accepts an explicit 0 or 1 (`--overwrite 1`, the
    paper repository's spelling). It stores the integers 0 and 1, as `type=int` did before, so that
    run.json and the identity of existing runs do not change."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: int = 0, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs="?", const=1, default=default, type=zero_or_one,
                         metavar="0|1", help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: int | None,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const if values is None else values)


def add_overwrite_argument(parser: Arguments, what: str) -> None:
    """--overwrite, one meaning in every script: replace what this script would otherwise refuse to replace."""
    parser.add_argument("--overwrite", action=Switch,
                        help=f"replace {what} (a switch; --overwrite 1 and --overwrite 0 are accepted too)")


def add_alpha_argument(parser: Arguments, default: Sequence[float] | None, help: str) -> None:
    """--alpha, one meaning in every script: Rényi orders α (the output column `alpha`)."""
    parser.add_argument("--alpha", type=finite_float, nargs="+", default=default, metavar="ORDER", help=help)


def training_flag(dest: str) -> str:
    """The flag that sets the training destination `dest`, spelled as --help shows it (delta: --target-delta)."""
    parser = Parser()
    add_training_args(parser)
    return next((action.option_strings[0] for action in parser._actions if action.dest == dest),
                "--" + dest.replace("_", "-"))


def add_device_argument(parser: Arguments) -> None:
    """--device, the same in every script that computes with torch."""
    from perinstance.train.distributed import device_flag

    parser.add_argument("--device", default="cpu", type=device_flag, metavar="{cpu,cuda,cuda:N,auto}",
                        help="cpu, cuda, cuda:N, or auto (CUDA when present, else CPU); under torchrun, "
                             "cuda and auto mean the rank's own GPU cuda:LOCAL_RANK")


def parse_stages(tokens: Sequence[str]) -> list[str | float]:
    """`--stage` tokens as stage names or fractions in [0, 1]."""
    from perinstance.train.runs import STAGE_NAMES

    stages = []
    for token in tokens:
        if token in STAGE_NAMES:
            stages.append(token)
            continue
        try:
            fraction = float(token)
        except ValueError:
            raise UsageError("--stage", f"unknown stage {token!r} (allowed: fractions in [0, 1], "
                                        f"{', '.join(STAGE_NAMES)})") from None
        if not 0 <= fraction <= 1:
            raise UsageError("--stage", f"{token} is outside [0, 1]")
        stages.append(fraction)
    return stages


# A bound on one --seeds range, so a typo cannot ask for billions of runs.
MAX_SEEDS = 100_000


def parse_seeds(specs: Sequence[str | int], flag: str = "--seeds") -> list[int]:
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


def model_flag(text: str) -> str:
    """argparse type of --model: a built-in network's name or a spec."""
    from perinstance.train.nets import MODEL_CHOICES
    from perinstance.train.user_code import SPEC_FORMS, is_spec

    if text in MODEL_CHOICES or is_spec(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a built-in network ({', '.join(MODEL_CHOICES)}) "
                                     f"nor {SPEC_FORMS}")


def loss_flag(text: str) -> str:
    """argparse type of --loss: a spec (the default loss, cross-entropy, is the flag left out)."""
    from perinstance.train.user_code import SPEC_FORMS, is_spec

    if is_spec(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not {SPEC_FORMS} (leave --loss out for the default, "
                                     "cross-entropy on class indices)")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Every flag that defines a training run. Shared by train_dpsgd.py and compute_sensitivity.py."""
    from perinstance.train.clipping import CLIPPING_CHOICES

    group = parser.add_argument_group("training run")
    group.add_argument("--dataset", default="mnist-embedded",
                       help="mnist-embedded (shipped, offline), MNIST, FashionMNIST, CIFAR10, synthetic, imagefolder:PATH; "
                            "scatternet:DATASET: fixed ScatterNet features of DATASET's images; first:N:DATASET: the "
                            "first N training points of DATASET; holdout:M:DATASET: DATASET's training points but M "
                            "drawn at random, which become the test set (never trained on); your own: PATH.py:NAME or "
                            "package.module:NAME (a function returning (train, test))")
    group.add_argument("--data-root", default="./data", help="where torchvision datasets live, and cache/ with scatternet: features")
    group.add_argument("--model", default="lenet5", type=model_flag, metavar="{lenet5,resnet20,mlp,linear,PATH.py:NAME}",
                       help="the network: lenet5, resnet20, mlp, linear, or your own, PATH.py:NAME or "
                            "package.module:NAME (a class or function returning an nn.Module)")
    group.add_argument("--loss", default=None, type=loss_flag, metavar="PATH.py:NAME",
                       help="the per-example loss that training and every measurement differentiate: cross-entropy "
                            "on class indices when left out, or your own, PATH.py:NAME or package.module:NAME (a "
                            "function of (outputs, targets) returning one loss per example: regression, label "
                            "smoothing, a sequence loss summed over tokens)")
    group.add_argument("--norm-type", default="group", choices=("group", "batch", "none"),
                       help="normalisation layers of resnet20 (batch is refused with DP)")
    group.add_argument("--batch-size", type=int, default=256, help="expected batch size B_exp; q = B_exp/N")
    group.add_argument("--lr", type=positive_float, default=2.0, help="learning rate")
    group.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="applied to the privatised update")
    group.add_argument("--momentum", type=momentum_float, default=0.0, help="heavy-ball momentum on the privatised update")
    group.add_argument("--gamma", type=positive_float, default=0.1, help="learning-rate decay factor at each --dec-lr epoch")
    group.add_argument("--dec-lr", type=non_negative_float, nargs="*", default=[], help="epochs at which the learning rate decays")
    group.add_argument("--epochs", type=positive_float, default=8, help="training length in epochs (T = round(epochs·N/B_exp))")
    group.add_argument("--dp", type=int, default=1, choices=(0, 1), help="1: DP-SGD (default), 0: non-private SGD")
    group.add_argument("--no-dp", dest="dp", action="store_const", const=0, help="non-private SGD: the same as --dp 0")
    group.add_argument("--eps", type=positive_float, default=None,
                       help="target ε of the training guarantee; sigma is calibrated by Opacus (default 10 unless --sigma)")
    group.add_argument("--sigma", type=positive_float, default=None,
                       help="the noise multiplier sigma (noise std sigma·Γ), instead of --eps")
    # --delta is the paper repository's spelling; the destination (and run.json's key) stays `delta`.
    group.add_argument("--target-delta", "--delta", dest="delta", type=probability, default=1e-5,
                       help="δ of the training guarantee, with --eps the target ε (default 1e-5)")
    group.add_argument("--cn", type=positive_float, default=1.0, help="clipping norm C")
    group.add_argument("--clipping", default="flat", choices=CLIPPING_CHOICES,
                       help="per-sample transform: flat clipping, psac or psasc scaling")
    group.add_argument("--scale-r", type=positive_float, default=None, help="r of psac/psasc (default 0.1)")
    group.add_argument("--scale-s", type=positive_float, default=None, help="s of psasc (default 0.9)")
    group.add_argument("--reduction", default="sum", choices=("sum", "mean"),
                       help="update rule: sum or mean of the transformed gradients (compute_sensitivity.py: the rule "
                            "analysed, with --run the run's by default)")
    group.add_argument("--seed", type=non_negative_int, default=0,
                       help="seed of the run: initialisation, batches and noise")
    group.add_argument("--less-point", type=int, default=None, help="train without this training point")
    group.add_argument("--save-freq", type=int, default=None,
                       help="checkpoint every this many steps (default: about 10 checkpoints, unless --save-steps); "
                            "step 0 and T always")
    group.add_argument("--save-steps", nargs="+", default=None, metavar="STEP",
                       help="checkpoint at these steps (as --points: 1 2 4, ranges 1-8), besides every --save-freq "
                            "steps when that is given; step 0 and T always")
    group.add_argument("--save-name", default=None, help="checkpoints go to <models-dir>/<save-name>/ (default: from the flags)")
    group.add_argument("--id", default=None, help="tag appended to the default save name, for repeated runs")
    group.add_argument("--models-dir", default="models", help="folder that holds the run folders")
    add_overwrite_argument(group, "an existing output: the run folder (train_dpsgd.py), or the result file "
                                  "(compute_sensitivity.py, which never retrains a run because of it)")
    add_device_argument(group)
    group.add_argument("--eval-freq", type=int, default=None, help="test accuracy every this many steps (default: at checkpoints)")
    group.add_argument("--track-points", nargs="*", default=None,
                       help="record Δ* = ||h(g)||, loss and correctness of these points (as --points; all: every "
                            "point) at every step (every --track-every K steps) and at the end, into models/<run>/tracked_norms.csv (.parquet past "
                            "100,000 rows): composed, a bound along the run (accounting.md §4)")
    group.add_argument("--total-steps", type=positive_int, default=None, metavar="T",
                       help="the run's number of steps T, instead of --epochs (fixed before training: a filtered "
                            "run's cap)")
    group.add_argument("--track-every", type=positive_int, default=None, metavar="K",
                       help="measure the --track-points every K steps instead of every step, each clipped at (1 + "
                            "--filter-margin) times its last measured Δ* in between: composed, still a bound along "
                            "the run (accounting.md §12.4, §13)")
    group.add_argument("--canaries", type=non_negative_int, default=None, metavar="M",
                       help="white-box gradient canaries for the one-run audit: M insertions into the noisy gradient "
                            "sum (not examples of the model), drawn by the run's sampler, each in the run with "
                            "probability 1/2 (docs/audit.md)")
    group.add_argument("--canary-norms", default=None, metavar="C1,C2,...",
                       help="the canaries' norms as multiples of the bound Γ, one equal group each (default 1)")
    group.add_argument("--input-canaries", type=non_negative_int, default=None, metavar="M",
                       help="crafted input canaries for the one-run audit's implementation check: M examples that go "
                            "through the sampler, per-sample gradients and clipping, each in the run with "
                            "probability 1/2 (docs/audit.md)")
    filtering = parser.add_argument_group("individual Rényi filter (accounting.md §12: sum rule, flat clipping)")
    filtering.add_argument("--budget-eps", type=positive_float, default=None, metavar="EPS",
                           help="every point's guarantee ε at --target-delta: each point is charged its own Rényi "
                                "cost at every step and leaves training for good once its next charge would pass "
                                "its budget")
    filtering.add_argument("--budgets", default=None, metavar="PATH.csv",
                           help="per-point or per-group budgets: a CSV with columns point (training-set index) and "
                                "eps; points it does not list take --budget-eps, and without --budget-eps it must "
                                "list every point")
    filtering.add_argument("--filter-order", type=order_float, default=None, metavar="LAMBDA",
                           help="the filter's Rényi order λ_f > 1, fixed before training (default: of the orders "
                                "1.25..64, the one at which uniform DP-SGD at the run's sigma and q takes the most "
                                "steps within the smallest budget)")
    filtering.add_argument("--filter-every", type=positive_int, default=None, metavar="K",
                           help="measure Δ* of every point every K steps (default 1) and clip each point at (1 + "
                                "--filter-margin) times its last measured Δ* in between, so that every charge stays "
                                "a bound (accounting.md §12.4)")
    filtering.add_argument("--filter-margin", type=non_negative_float, default=None, metavar="M",
                           help="per-point clipping between measurements (--filter-every or --track-every K > 1): "
                                "each point clipped at min(Γ, (1 + M)·Δ* of its last measurement) (default "
                                "0.25, accounting.md §13)")
    return group


def training_flags(flags: Mapping[str, object]) -> "perinstance.train.run_plan.TrainingFlags":
    """The training flags (run_plan.TrainingFlags) among parsed flags (a mapping of destination to value)."""
    from perinstance.train.run_plan import TrainingFlags

    return TrainingFlags(**{field.name: flags[field.name] for field in dataclasses.fields(TrainingFlags)})


def parse_training_flags(argv: Iterable[str] = ()) -> "perinstance.train.run_plan.TrainingFlags":
    """The training flags of a command line of training flags only (their defaults when empty)."""
    parser = Parser()
    add_training_args(parser)
    return training_flags(vars(parser.parse_args(list(argv))))


# --- the accountants' input and output (eps_delta.py, renyi_per_instance_*.py) -----------------------------

def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--res-name", help="read <res-dir>/<res-name>.csv, or .parquet, whichever exists (written "
                                           "by compute_sensitivity.py); an extension names one")
    source.add_argument("--res-file", help="read this sensitivity CSV (or Parquet file, by its extension)")
    parser.add_argument("--res-dir", default="res", help="folder of the result files (default res)")
    parser.add_argument("--out", help="output CSV (default: <res-dir>/<res-name>_<script>.csv, next to --res-file)")
    parser.add_argument("--filter", action="append", default=[], metavar="COLUMN=VALUE",
                        help="keep only rows with this value (repeatable), e.g. --filter sigma=1.0")
    parser.add_argument("--points", nargs="+", help="points to keep: indices, ranges 0-99, all, random:N")
    parser.add_argument("--steps", nargs="+", metavar="STEP",
                        help="keep only rows at these steps (as --points: 0 16 32, ranges 0-99), e.g. a run's "
                             "checkpoints out of norms recorded at every step")
    add_overwrite_argument(parser, "an existing --out even if it is not this script's earlier output for this input")


def add_delta_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--delta", type=probability, default=1e-5, help="δ of the reported guarantee (default 1e-5)")


def add_groups_argument(parser: argparse.ArgumentParser) -> None:
    """--groups, the same in `report` and `reproduce`: the points' groups for the per-group breakdown."""
    parser.add_argument("--groups", default=None, metavar="PATH.csv",
                        help="a CSV with columns point and group: the composed ε of each group (median with its 95%% "
                             "interval, and a figure) beside the per-class breakdown, and each point's group in "
                             "points.csv")


def add_failure_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--failure", type=probability, default=None,
                        help="mean rule: β of the certified event (default δ_size, or the training δ/(10·T) when "
                             "k_min = 0)")


def check_orders(orders: ArrayLike) -> np.ndarray:
    """--alpha: finite orders > 1; returned sorted and without repeats."""
    orders = np.asarray(orders, dtype=float)
    bad = orders[~(orders > 1) | ~np.isfinite(orders)]
    if bad.size:
        raise UsageError("--alpha", f"Rényi orders must be finite and > 1, not {bad[0]:g}")
    return np.unique(orders)


def source_of(flags: Mapping) -> Source:
    """The accountant's Source from the parsed flags of add_input_arguments (a mapping of destination to value)."""
    return Source(res_name=flags["res_name"], res_file=flags["res_file"], res_dir=flags["res_dir"], out=flags["out"],
                  filters=tuple(flags["filter"]), points=None if flags["points"] is None else tuple(flags["points"]),
                  overwrite=bool(flags["overwrite"]), steps=None if flags["steps"] is None else tuple(flags["steps"]))

"""The typed configuration of a reproduction: ReproduceConfig, the presets, `--set FIELD=VALUE` parsing,
the fields that name the runs (`variant_tag`), the training flags of the main run, and the checks of a
configuration (a field's domain, a dataset other than the preset's).
"""

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass

from perinstance.errors import UsageError
from perinstance.train.data import load_dataset

DATA_ROOT = "./data"


@dataclass(frozen=True)
class ReproduceConfig:
    """Everything a reproduction does. A preset is one instance; `--set FIELD=VALUE` replaces a field."""

    # The main run (sum rule): figures 1, 2, 4, 5, 6.
    dataset: str
    model: str
    batch_size: int
    lr: float
    epochs: float
    eps: float
    save_freq: int
    # Points whose Δ* is recorded at every step, as --points. "all": the composed ε of every point is a bound along
    # the run (accounting.md §4), and Δ* at the checkpoints comes from the same record; a subset: every point is
    # measured at the checkpoints too, its composition a held-Δ* estimate, the bound the tracked points' (figures 4-6).
    track_points: str
    # GLA's sampling-rate claim for the mean rule (figure 3), in two controlled designs. Fixed checkpoint:
    # the main run's final checkpoint and the one nearest `early_stage`·T, each analysed as one mean-rule
    # step at every q of `fixed_sample_rates`, σ calibrated per q so that the worst case over epochs/q steps
    # is the target ε. Matched steps: one mean-rule run per batch size, each trained for the main run's T
    # steps to the same target ε (σ per q), checkpointed `mean_checkpoints` times. `mean_points` get
    # `num_batches` Monte-Carlo draws of Δ_B (the estimate); the certified bound needs no draws.
    mean_batch_sizes: tuple[int, ...]
    mean_points: str
    num_batches: int
    fixed_sample_rates: tuple[float, ...] = (0.008, 0.032, 0.128, 0.5)
    early_stage: float = 0.125
    mean_checkpoints: int = 4
    renyi_order: float = 8.0
    save_steps: str = ""  # the main run's checkpoints besides every save_freq steps, as --save-steps
    # The audit (points spanning the ε range, simulated steps per law) and the membership attack
    # against a non-private run of the same configuration, trained at its own best learning rate: the one of
    # `nodp_lrs` whose run on the training points less the last `nodp_holdout` share of them is most accurate on
    # that held-out share (never the test set), then trained on every training point (nonprivate_run.py).
    audit_points: int = 50
    audit_trials: int = 300_000
    nodp_lrs: tuple[float, ...] = (0.2, 0.4, 0.8, 1.6)
    nodp_holdout: float = 0.2
    # The realised-size mean rule against the sum rule's accounting (docs/audit.md §1): a run on the first
    # `gap_points` training points with expected batch `gap_batch_size` and noise multiplier `gap_sigma`,
    # audited at its last checkpoint, every point, `gap_trials` simulated steps per law (figure 9).
    gap_points: int = 64
    gap_batch_size: int = 4
    gap_sigma: float = 1.0
    gap_epochs: float = 2.0
    gap_lr: float = 0.1
    gap_trials: int = 1_000_000
    # The one-run audit (docs/audit.md §1b): the main run carries `canaries` white-box gradient canaries in equal
    # groups, one per norm of `canary_norms` (multiples of Γ), audited group by group at `audit_significance`
    # split over the groups; 0 trains it without canaries and skips that audit and its figure. 10,000 a group: the
    # c = 1 group's bound on the idealised quick run is then at least 0.3 of its upper bound in 16 of 16
    # simulations, against 14 of 16 with 5,000 and 7 of 16 with 3,000 (accounting.md §11.12).
    # `gap_canaries` > 0 also trains the gap run's realised-size mean rule with that many canaries of norm Γ
    # and audits them against the sum rule's accounting (docs/audit.md §1c); 0 skips it.
    canaries: int = 30000
    canary_norms: tuple[float, ...] = (0.1, 0.3, 1.0)
    audit_significance: float = 0.05
    gap_canaries: int = 16
    # The individual Rényi filter (docs/accounting.md §12-§13; filtered_run.py): the main run's configuration at its
    # σ and q, every point's budget its target ε, trained to a cap of `filter_cap` × the main run's T steps (fixed
    # before training), Δ* of every point measured every `filter_every` steps; against uniform DP-SGD at the same
    # σ, q and ε (the main run, trained again without its canaries where it has them). 0 skips it: a filtered run
    # measures every point, which the paper-scale presets (1,000 tracked points) do not afford.
    filter_cap: float = 2.0
    filter_every: int = 10
    # The accountants.
    delta: float = 1e-5  # δ of every reported (ε, δ) guarantee
    per_step_method: typing.Literal["exact", "holder"] = "exact"  # eps_delta.py --method of the sum rule (§3.3)


PRESETS = {
    "tiny": ReproduceConfig(  # for CI: a few hundred synthetic points, seconds
        dataset="synthetic", model="mlp", batch_size=32, lr=0.5, epochs=2.0, eps=10.0, save_freq=8, save_steps="1,2,4",
        track_points="all", mean_batch_sizes=(16, 64, 128), mean_points="random:4", num_batches=64,
        fixed_sample_rates=(0.03125, 0.125, 0.5), audit_points=6, audit_trials=5_000, nodp_lrs=(0.1, 0.5), gap_points=32,
        gap_lr=0.5, gap_trials=20_000, canaries=300, gap_canaries=8),
    "quick": ReproduceConfig(  # the README's main job: embedded MNIST, LeNet-5, 2 CPU cores
        dataset="mnist-embedded", model="lenet5", batch_size=256, lr=2.0, epochs=4.0, eps=10.0, save_freq=16,
        save_steps="1,2,4,8,12,20,24,40", track_points="all", mean_batch_sizes=(64, 256, 1024),
        mean_points="random:100", num_batches=1024),
    "mnist": ReproduceConfig(  # paper scale, meant for a GPU
        dataset="MNIST", model="lenet5", batch_size=256, lr=2.0, epochs=20.0, eps=10.0, save_freq=100,
        track_points="random:1000", mean_batch_sizes=(64, 256, 1024, 4096), mean_points="random:1000",
        num_batches=10_000, filter_cap=0.0),
    "cifar10": ReproduceConfig(  # paper scale, meant for a GPU
        dataset="CIFAR10", model="resnet20", batch_size=512, lr=2.0, epochs=40.0, eps=10.0, save_freq=200,
        track_points="random:1000", mean_batch_sizes=(128, 512, 2048), mean_points="random:1000",
        num_batches=10_000, filter_cap=0.0),
    # CIFAR-10 on 2 CPU cores: a linear head trained with DP-SGD on fixed ScatterNet features (Tramèr &
    # Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)", ICLR 2021).
    # For the JPEGs: --dataset scatternet:imagefolder:PATH. docs/paper-scale.md: "CIFAR-10 on a CPU".
    "cifar10-cpu": ReproduceConfig(
        dataset="scatternet:CIFAR10", model="linear", batch_size=4096, lr=4.0, epochs=6.0, eps=10.0,
        save_freq=15, track_points="all", mean_batch_sizes=(1024, 4096, 16384), mean_points="random:100",
        num_batches=1024, nodp_lrs=(0.3, 1.0, 3.0)),
}
# Fields that define the main run, and those that define the mean-rule runs and measurements: a
# change of one of them gives the runs and result files new names (see `variant_tag`). The dataset
# is not among them: every name starts with it.
MAIN_RUN_FIELDS = ("model", "batch_size", "lr", "epochs", "eps", "save_freq", "save_steps", "track_points",
                   "canaries", "canary_norms")
MEAN_RULE_FIELDS = ("mean_points", "num_batches", "renyi_order", "fixed_sample_rates", "early_stage", "mean_checkpoints")
GAP_RUN_FIELDS = ("model", "gap_points", "gap_batch_size", "gap_sigma", "gap_epochs", "gap_lr")
GAP_CANARY_RUN_FIELDS = (*GAP_RUN_FIELDS, "gap_canaries")
# The non-private runs are named by their learning rate (and the selection's by the held-out points) besides these.
NODP_RUN_FIELDS = ("model", "batch_size", "epochs")
# The filtered run and its uniform reference (the main run without canaries): σ comes from eps and epochs.
FILTER_RUN_FIELDS = ("model", "batch_size", "lr", "epochs", "eps", "save_freq", "filter_cap", "filter_every")


def field_types() -> dict[str, type]:
    return {field.name: field.type for field in dataclasses.fields(ReproduceConfig)}


def parse_field(name: str, text: str) -> object:
    """The value of field `name` from its command-line text; ValueError when it does not fit the type."""
    kind = field_types()[name]
    if typing.get_origin(kind) is tuple:
        (item, _) = typing.get_args(kind)
        values = tuple(item(part) for part in text.split(",") if part.strip())
        if not values:
            raise ValueError("an empty list")
        return values
    if typing.get_origin(kind) is typing.Literal:
        if text not in typing.get_args(kind):
            raise ValueError(f"{text!r} is not among them")
        return text
    value = kind(text)
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def type_name(kind: type) -> str:
    if typing.get_origin(kind) is tuple:
        return f"comma-separated {typing.get_args(kind)[0].__name__}s"
    if typing.get_origin(kind) is typing.Literal:
        return f"one of {', '.join(typing.get_args(kind))}"
    return kind.__name__


def apply_overrides(config: ReproduceConfig, assignments: list[str]) -> ReproduceConfig:
    """`config` with each `FIELD=VALUE` of --set applied in order, every value checked against its field's type."""
    types = field_types()
    allowed = f"fields: {', '.join(types)}"
    changes = {}
    for assignment in assignments:
        name, equals, text = assignment.partition("=")
        name = name.strip()
        if not equals:
            raise UsageError("--set", f"{assignment!r} is not FIELD=VALUE ({allowed})")
        if name not in types:
            raise UsageError("--set", f"unknown field {name!r} ({allowed})")
        try:
            changes[name] = parse_field(name, text.strip())
        except ValueError as error:
            raise UsageError("--set", f"{name}={text}: not {type_name(types[name])} ({error}; {allowed})") from None
    return dataclasses.replace(config, **changes)


def field_text(value: object) -> str:
    """A field's value as --set and the scripts' flags take it."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def overridden(config: ReproduceConfig, preset: str) -> dict[str, object]:
    """{field: value} of the fields where `config` differs from the preset's configuration."""
    base = PRESETS[preset]
    return {name: getattr(config, name) for name in field_types() if getattr(config, name) != getattr(base, name)}


def variant_tag(config: ReproduceConfig, preset: str, fields: tuple[str, ...]) -> str:
    """'' when `fields` keep the preset's values, else '-' and a hash of the changed ones, so that a run
    or result file of another configuration never shares a name with the preset's."""
    changed = {name: field_text(value) for name, value in overridden(config, preset).items() if name in fields}
    if not changed:
        return ""
    return "-" + hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]


def training_flags(config: ReproduceConfig, device: str) -> list[str]:
    """The flags of train_dpsgd.py (and compute_sensitivity.py) for the run `config` describes."""
    save_steps = ["--save-steps", config.save_steps] if config.save_steps else []
    return ["--dataset", config.dataset, "--model", config.model, "--batch-size", str(config.batch_size),
            "--lr", str(config.lr), "--epochs", str(config.epochs), "--eps", str(config.eps),
            "--save-freq", str(config.save_freq), *save_steps, "--device", device]


def canary_flags(canaries: int, norms: tuple[float, ...]) -> list[str]:
    """The flags of train_dpsgd.py that train `canaries` canaries in one equal group per norm."""
    return ["--canaries", str(canaries), "--canary-norms", field_text(norms)]


def gap_run_flags(config: ReproduceConfig, name: str, device: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The flags of train_dpsgd.py for a gap run (docs/audit.md §1): the realised-size mean rule on the first
    gap_points training points, one checkpoint at its last step; `extra` flags (canaries) before --device."""
    return ["--dataset", f"first:{config.gap_points}:{config.dataset}", "--model", config.model, "--reduction", "mean",
            "--batch-size", str(config.gap_batch_size), "--sigma", str(config.gap_sigma),
            "--epochs", str(config.gap_epochs), "--lr", str(config.gap_lr), "--save-freq", str(1_000_000),
            "--save-name", name, *extra, "--device", device]


def check_dataset(config: ReproduceConfig, preset: str, flag: str) -> None:
    """Load a dataset other than the preset's once, so that a bad one fails before any work."""
    if config.dataset == PRESETS[preset].dataset:
        return
    try:
        load_dataset(config.dataset, DATA_ROOT)
    except UsageError as error:
        message = error.message if flag == "--dataset" else f"dataset={config.dataset}: {error.message}"
        raise UsageError(flag, message) from None


def check_config(config: ReproduceConfig) -> None:
    """Fields whose domain their type does not say, refused with the field named (--set)."""
    checks = [(all(0 < rate <= 1 for rate in config.fixed_sample_rates),
               f"fixed_sample_rates={field_text(config.fixed_sample_rates)}: every rate must be in (0, 1]"),
              (0 <= config.early_stage <= 1, f"early_stage={config.early_stage:g}: a fraction of training in [0, 1]"),
              (config.gap_batch_size <= config.gap_points,
               f"gap_batch_size={config.gap_batch_size}: must be at most gap_points={config.gap_points}"),
              (all(0 < norm <= 1 for norm in config.canary_norms),
               f"canary_norms={field_text(config.canary_norms)}: every norm must be in (0, 1] (a multiple of Γ)"),
              (config.canaries == 0 or (config.canaries % len(config.canary_norms) == 0
                                        and config.canaries >= 2 * len(config.canary_norms)),
               f"canaries={config.canaries}: 0 (no one-run audit) or a multiple of the {len(config.canary_norms)} "
               "canary_norms, at least 2 per group"),
              (all(rate > 0 for rate in config.nodp_lrs),
               f"nodp_lrs={field_text(config.nodp_lrs)}: every learning rate must be > 0"),
              (0 < config.nodp_holdout < 1,
               f"nodp_holdout={config.nodp_holdout:g}: a share of the training points in (0, 1)"),
              (0 < config.audit_significance < 1,
               f"audit_significance={config.audit_significance:g}: must be in (0, 1)"),
              (config.gap_canaries == 0 or config.gap_canaries >= 2,
               f"gap_canaries={config.gap_canaries}: 0 (no gap run with canaries) or at least 2"),
              (config.filter_cap == 0 or config.filter_cap >= 1,
               f"filter_cap={config.filter_cap:g}: 0 (no filtered run) or at least 1 (a multiple of the main run's T)")]
    checks += [(getattr(config, name) >= 1, f"{name}={getattr(config, name)}: must be >= 1")
               for name in ("mean_checkpoints", "gap_points", "gap_batch_size", "num_batches", "audit_points",
                            "filter_every")]
    for holds, problem in checks:
        if not holds:
            raise UsageError("--set", problem)

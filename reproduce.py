"""Reproduce the papers' findings on your own run: train, measure, account, draw, report.

    python reproduce.py                      # quick preset: embedded MNIST, LeNet-5, CPU
    python reproduce.py --preset mnist --device cuda
    python reproduce.py --dataset imagefolder:/data/my-images
    python reproduce.py --set mean_batch_sizes=64,256 --set num_batches=100

A preset is a typed configuration (ReproduceConfig); `--set FIELD=VALUE` overrides any of its
fields, checked against the field's type (`--dataset X` is `--set dataset=X`). Runs
train_dpsgd.py, compute_sensitivity.py and the accountant scripts exactly as a user would (same
code, same files under models/ and res/), skips what a previous run finished, and writes six
figures and report.md to --out-dir (default figures/). report.md lists the configuration and
every command that produced its numbers.
"""

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import re
import resource
import shlex
import sys
import time
import typing
from dataclasses import dataclass

import numpy as np
import pandas as pd

from perinstance import (
    accountants,
    accounting,
    audit_plots,
    audit_simulation,
    checkpoints,
    composition,
    fileio,
    measurement,
    membership,
    plots,
    results,
    runs,
    storage,
    training,
)
from perinstance.data import load_dataset
from perinstance.errors import UsageError, run_main
from perinstance.guarantees import Kind
from perinstance.mechanism import Mechanism
from perinstance.memory import release_freed_memory
from perinstance.options import HELP_FORMAT, Parser, add_device_argument, parse_points

ROOT = os.path.dirname(os.path.abspath(__file__))
DATA_ROOT = "./data"
RES_DIR = "res"
# Composition along the run uses Hölder b = ∞: plain composition along the one observed trajectory
# (accounting.md §4), in the accountant and in the curves of figure 4 alike.
COMPOSITION_HOLDER_B = math.inf
# The designs of the sampling-rate experiment, as figure 3 and the report name them.
DESIGN_EARLY, DESIGN_FINAL = "(a) fixed early checkpoint", "(a) fixed final checkpoint"
DESIGN_MATCHED = "(b) matched steps"
# What "the whole run" means in the report line of a fixed-checkpoint design and of the matched-steps design.
FIXED_WHOLE_RUN = "T steps at q, each charged at this one checkpoint: a what-if, not a trained run"
MATCHED_WHOLE_RUN = "the run's own checkpoints; no estimate, its Δ_B are drawn at the final checkpoint only"
# Every figure the run writes; the last two are drawn by audit.py itself (its own figure of the bounds).
FIGURES = ["1_per_step_eps_histogram.png", "2_correct_vs_misclassified.png", "3_mean_rule_sampling_rates.png",
           "4_composed_eps_over_training.png", "5_individual_accounting.png", "6_estimate_accuracy.png",
           "7_audit.png", "8_membership_inference.png", "9_mean_rule_gap_audit.png", "7_audit_mean.png",
           "9_gap_audit_bounds.png"]
# The mean rule's whole-run ε are often tens to hundreds, converted best at orders close to 1: its compositions
# take three orders below the composition grid's lowest.
MEAN_RULE_ORDERS = (1.02, 1.05, 1.1, *accounting.COMPOSITION_ORDERS)
# The fixed-checkpoint design's Δ_B draws: Monte-Carlo blocks and grid sizes, compute_sensitivity.py's defaults.
FIXED_MC_BLOCKS, FIXED_MAX_SIZES = 4, 32


# --- configuration ------------------------------------------------------------------------------

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
    track_points: str  # points whose ||h(g)|| is recorded at every step (figure 6), as --points
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
    # against a non-private run of the same configuration (its own learning rate: lr 2 diverges).
    audit_points: int = 50
    audit_trials: int = 300_000
    nodp_lr: float = 0.1
    # The realised-size mean rule against the sum rule's accounting (docs/audit.md §1): a run on the first
    # `gap_points` training points with expected batch `gap_batch_size` and noise multiplier `gap_sigma`,
    # audited at its last checkpoint, every point, `gap_trials` simulated steps per law (figure 9).
    gap_points: int = 64
    gap_batch_size: int = 4
    gap_sigma: float = 1.0
    gap_epochs: float = 2.0
    gap_lr: float = 0.1
    gap_trials: int = 1_000_000
    # The accountants.
    delta: float = 1e-5  # δ of every reported (ε, δ) guarantee
    per_step_method: typing.Literal["exact", "holder"] = "exact"  # eps_delta.py --method of the sum rule (§3.3)


PRESETS = {
    "tiny": ReproduceConfig(  # for CI: a few hundred synthetic points, seconds
        dataset="synthetic", model="mlp", batch_size=32, lr=0.5, epochs=2.0, eps=10.0, save_freq=8, save_steps="1,2,4",
        track_points="random:64", mean_batch_sizes=(16, 64, 128), mean_points="random:4", num_batches=64,
        fixed_sample_rates=(0.03125, 0.125, 0.5), audit_points=6, audit_trials=5_000, nodp_lr=0.5, gap_points=32,
        gap_lr=0.5, gap_trials=20_000),
    "quick": ReproduceConfig(  # the README's main command: embedded MNIST, LeNet-5, 2 CPU cores
        dataset="mnist-embedded", model="lenet5", batch_size=256, lr=2.0, epochs=4.0, eps=10.0, save_freq=16,
        save_steps="1,2,4,8,12,20,24,40", track_points="random:200", mean_batch_sizes=(64, 256, 1024),
        mean_points="random:100", num_batches=1024),
    "mnist": ReproduceConfig(  # paper scale, meant for a GPU
        dataset="MNIST", model="lenet5", batch_size=256, lr=2.0, epochs=20.0, eps=10.0, save_freq=100,
        track_points="random:1000", mean_batch_sizes=(64, 256, 1024, 4096), mean_points="random:1000",
        num_batches=10_000),
    "cifar10": ReproduceConfig(  # paper scale, meant for a GPU
        dataset="CIFAR10", model="resnet20", batch_size=512, lr=2.0, epochs=40.0, eps=10.0, save_freq=200,
        track_points="random:1000", mean_batch_sizes=(128, 512, 2048), mean_points="random:1000",
        num_batches=10_000),
    # CIFAR-10 on 2 CPU cores: a linear head trained with DP-SGD on fixed ScatterNet features (Tramèr &
    # Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)", ICLR 2021).
    # For the JPEGs: --dataset scatternet:imagefolder:PATH. README: "CIFAR-10 on a CPU".
    "cifar10-cpu": ReproduceConfig(
        dataset="scatternet:CIFAR10", model="linear", batch_size=4096, lr=4.0, epochs=6.0, eps=10.0,
        save_freq=15, track_points="random:200", mean_batch_sizes=(1024, 4096, 16384), mean_points="random:100",
        num_batches=1024, nodp_lr=1.0),
}
# Fields that define the main run, and those that define the mean-rule runs and measurements: a
# change of one of them gives the runs and result files new names (see `variant_tag`). The dataset
# is not among them: every name starts with it.
MAIN_RUN_FIELDS = ("model", "batch_size", "lr", "epochs", "eps", "save_freq", "save_steps", "track_points")
MEAN_RULE_FIELDS = ("mean_points", "num_batches", "renyi_order", "fixed_sample_rates", "early_stage", "mean_checkpoints")
GAP_RUN_FIELDS = ("model", "gap_points", "gap_batch_size", "gap_sigma", "gap_epochs", "gap_lr")
NODP_RUN_FIELDS = ("model", "batch_size", "epochs", "nodp_lr")


def field_types():
    return {field.name: field.type for field in dataclasses.fields(ReproduceConfig)}


def parse_field(name, text):
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


def type_name(kind):
    if typing.get_origin(kind) is tuple:
        return f"comma-separated {typing.get_args(kind)[0].__name__}s"
    if typing.get_origin(kind) is typing.Literal:
        return f"one of {', '.join(typing.get_args(kind))}"
    return kind.__name__


def apply_overrides(config, assignments):
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


def field_text(value):
    """A field's value as --set and the scripts' flags take it."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def overridden(config, preset):
    """{field: value} of the fields where `config` differs from the preset's configuration."""
    base = PRESETS[preset]
    return {name: getattr(config, name) for name in field_types() if getattr(config, name) != getattr(base, name)}


def variant_tag(config, preset, fields):
    """'' when `fields` keep the preset's values, else '-' and a hash of the changed ones, so that a run
    or result file of another configuration never shares a name with the preset's."""
    changed = {name: field_text(value) for name, value in overridden(config, preset).items() if name in fields}
    if not changed:
        return ""
    return "-" + hashlib.sha256(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:8]


def training_flags(config, device):
    """The flags of train_dpsgd.py (and compute_sensitivity.py) for the run `config` describes."""
    save_steps = ["--save-steps", config.save_steps] if config.save_steps else []
    return ["--dataset", config.dataset, "--model", config.model, "--batch-size", str(config.batch_size),
            "--lr", str(config.lr), "--epochs", str(config.epochs), "--eps", str(config.eps),
            "--save-freq", str(config.save_freq), *save_steps, "--device", device]


# --- commands and the cache of the accountants' outputs -----------------------------------------

def call_script(script, argv):
    """Run a top-level script's main(argv) in this process, as its command line would."""
    print(f"\n$ python {script} {shlex.join(argv)}", flush=True)
    spec = importlib.util.spec_from_file_location(os.path.splitext(script)[0], os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def command_key(script, argv, inputs):
    """What an output depends on: the script's code, its full argv, and each input file's size and hash."""
    return {"script": script, "script_sha256": fileio.sha256_of(os.path.join(ROOT, script)), "argv": list(argv),
            "inputs": [{"path": path, "size": os.path.getsize(path), "sha256": fileio.sha256_of(path)}
                       for path in inputs]}


def key_path(out):
    """The sidecar of an accountant's output that holds the command_key it was computed with."""
    return out + ".cmd"


def is_cached(out, key):
    """True when `out` exists and was computed by exactly this command on exactly these inputs."""
    if not (os.path.exists(out) and os.path.exists(key_path(out))):
        return False
    with open(key_path(out), encoding="utf-8") as handle:
        try:
            return json.load(handle) == key
        except json.JSONDecodeError:
            return False


class Commands:
    """Runs the scripts of one reproduction and remembers each command, for the report, and what each step of
    the reproduction cost, for the timing table at its end."""

    def __init__(self):
        self.lines = []  # (command line, whether a cached output was reused)
        self.timings = []  # (step, wall seconds, CPU seconds, peak resident bytes so far)

    @contextlib.contextmanager
    def timed(self, step):
        """Time the work inside the block as one row of the timing table; then hand what it freed back to the
        system, so that the next step's peak does not stand on this one's leftovers."""
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        release_freed_memory()
        self.timings.append((step, time.perf_counter() - wall, time.process_time() - cpu, peak_resident_bytes()))
        print(f"[{step}: {self.timings[-1][1]:.1f}s wall, {self.timings[-1][2]:.1f}s CPU, peak resident memory "
              f"so far {self.timings[-1][3] / 1e9:.2f} GB]", flush=True)

    def note(self, line, cached=False):
        """A step done in this process by a package function, listed with the commands; `cached` when its result
        was found on disk and the step did not run."""
        self.lines.append((f"# in-process: {line}", cached))

    def run(self, script, argv):
        self.lines.append((f"python {script} {shlex.join(argv)}", False))
        with self.timed(step_label(script, argv)):
            call_script(script, argv)

    def account(self, script, argv, out, source):
        """Run an accountant on `source` into `out` unless `out` holds this very command's output; its rows."""
        argv = [*argv, "--out", out]
        key = command_key(script, argv, [source])
        cached = is_cached(out, key)
        self.lines.append((f"python {script} {shlex.join(argv)}", cached))
        if cached:
            print(f"\n(skipping {script}: {out} was computed by this command on this input)")
        else:
            with self.timed(step_label(script, argv)):
                call_script(script, argv)
            fileio.write_json(key_path(out), key)
        return pd.read_csv(out)

    def timing_lines(self, total_seconds):
        """The timing table (markdown): every timed step, and the whole reproduction."""
        lines = ["| step | wall s | CPU s | peak RSS so far |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {step} | {wall:.1f} | {cpu:.1f} | {rss / 1e9:.2f} GB |" for step, wall, cpu, rss in self.timings]
        timed = sum(wall for _, wall, _, _ in self.timings)
        lines.append(f"| everything else (imports, reading results, the report) | {total_seconds - timed:.1f} | | |")
        lines.append(f"| **total** | **{total_seconds:.1f}** | **{time.process_time():.1f}** | "
                     f"**{peak_resident_bytes() / 1e9:.2f} GB** |")
        return lines


def step_label(script, argv):
    """A short name of a command for the timing table: the script and its main arguments."""
    words = [script]
    for flag in ("--run", "--save-name", "--res-name", "--res-file", "--reduction", "--points", "--stage",
                 "--num-batches", "--rule", "--kind", "--accountant"):
        if flag in argv:
            value = argv[argv.index(flag) + 1]
            words.append(f"{flag.lstrip('-')}={os.path.basename(value)}")
    return " ".join(words)


def result_file(res_name):
    """The result file compute_sensitivity.py wrote for --res-name `res_name`: CSV, or Parquet once it holds more
    than storage.AUTO_PARQUET_ROWS rows. Every result path here comes from this resolver (results.results_path,
    the one the accountants use), never from a name built by hand."""
    return results.results_path(res_name, RES_DIR)


def check_out_dir(out_dir):
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError("--out-dir", f"{out_dir} is a file, not a folder")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        raise UsageError("--out-dir", f"cannot create {out_dir}: {error.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise UsageError("--out-dir", f"{out_dir} is not writable")


def check_dataset(config, preset, flag):
    """Load a dataset other than the preset's once, so that a bad one fails before any work."""
    if config.dataset == PRESETS[preset].dataset:
        return
    try:
        load_dataset(config.dataset, DATA_ROOT)
    except UsageError as error:
        message = error.message if flag == "--dataset" else f"dataset={config.dataset}: {error.message}"
        raise UsageError(flag, message) from None


def check_config(config):
    """Fields whose domain their type does not say, refused with the field named (--set)."""
    checks = [(all(0 < rate <= 1 for rate in config.fixed_sample_rates),
               f"fixed_sample_rates={field_text(config.fixed_sample_rates)}: every rate must be in (0, 1]"),
              (0 <= config.early_stage <= 1, f"early_stage={config.early_stage:g}: a fraction of training in [0, 1]"),
              (config.gap_batch_size <= config.gap_points,
               f"gap_batch_size={config.gap_batch_size}: must be at most gap_points={config.gap_points}")]
    checks += [(getattr(config, name) >= 1, f"{name}={getattr(config, name)}: must be >= 1")
               for name in ("mean_checkpoints", "gap_points", "gap_batch_size", "num_batches", "audit_points")]
    for holds, problem in checks:
        if not holds:
            raise UsageError("--set", problem)


def slug(text):
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def build_parser():
    parser = Parser(description=__doc__, formatter_class=HELP_FORMAT)
    parser.add_argument("--preset", default="quick", choices=list(PRESETS), help="the configuration reproduced")
    parser.add_argument("--dataset", default=None, help="override the preset's dataset (e.g. imagefolder:PATH); "
                                                        "the same as --set dataset=...")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"override a field of the preset (repeatable); fields: {', '.join(field_types())}")
    parser.add_argument("--out-dir", default="figures", help="where the figures and report.md go")
    add_device_argument(parser)
    return parser


def parse_args(argv):
    """(preset name, configuration with every override applied, device, out_dir)."""
    args = build_parser().parse_args(argv)
    assignments = ([f"dataset={args.dataset}"] if args.dataset is not None else []) + args.set
    config = apply_overrides(PRESETS[args.preset], assignments)
    check_config(config)
    check_dataset(config, args.preset, "--dataset" if args.dataset is not None else "--set")
    check_out_dir(args.out_dir)
    return args.preset, config, args.device, args.out_dir


# --- the reproduction ---------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    preset, config, device, out_dir = parse_args(argv)
    name = f"{preset}-{slug(config.dataset)}"
    commands = Commands()
    started = time.time()

    # 1. The main run (sum rule), with per-step norms of the tracked points (figure 6).
    main_name = f"{name}{variant_tag(config, preset, MAIN_RUN_FIELDS)}-sum"
    main_flags = [*training_flags(config, device), "--save-name", main_name, "--track-points", config.track_points]
    commands.run("train_dpsgd.py", main_flags)
    run_dir = os.path.join("models", main_name)
    main_run = runs.load_run(run_dir)

    # 2. Δ* of every training point at every checkpoint.
    commands.run("compute_sensitivity.py", [*main_flags, "--exp", "eps_delta", "--reduction", "sum", "--points", "all",
                                            "--stage", "all", "--res-name", main_name, "--no-train"])
    sensitivities = storage.read_frame(result_file(main_name))

    # 3. Accountants on it: per-step (ε, δ) at the final checkpoint, composition along the run by RDP and PLD.
    accounted = account_main_run(commands, config, main_name, run_dir, main_run.total_steps)

    # 4. The mean update rule at several sampling rates, in two controlled designs (figure 3).
    mean_name = f"{name}{variant_tag(config, preset, MAIN_RUN_FIELDS + MEAN_RULE_FIELDS)}-mean"
    mean_results = {"fixed": fixed_checkpoint_design(commands, config, main_name, mean_name, main_run, sensitivities,
                                                     device),
                    "matched": matched_steps_design(commands, config, mean_name, main_run, device)}

    # 5. The bounds held against attacks: the per-instance audit (sum rule on the main run, mean rule on the
    # matched-steps run at the main batch size), the realised-size mean rule's gap to the sum rule's
    # accounting on a small run, and the membership attack per class.
    gap_name = f"{name}{variant_tag(config, preset, GAP_RUN_FIELDS)}-gap"
    attack_findings = attack_experiment(commands, config, preset, name, main_name, mean_name, gap_name, out_dir, device)

    # 6. Figures and report.
    with commands.timed("figures 1-6 and their numbers"):
        findings = draw_figures(out_dir, config, main_run, run_dir, sensitivities, *accounted, mean_results, device)
    findings.update(attack_findings)
    findings["headlines"] = finding_lines(config, findings)
    report = write_report(out_dir, preset, config, argv, commands, main_run, findings, time.time() - started)
    print("\n" + "\n".join(commands.timing_lines(time.time() - started)))
    print(f"\nreproduce.py --preset {preset}: {len(FIGURES)} figures and {report} written in {time.time() - started:.0f}s; "
          f"peak resident memory {peak_resident_bytes() / 1e9:.2f} GB")
    for line in findings["headlines"]:
        print(f"  - {line}")


def peak_resident_bytes():
    """This process's peak resident set size: every step runs in it (call_script), so this is the run's."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB


def account_main_run(commands, config, main_name, run_dir, total_steps):
    """(per-step (ε, δ) at the final checkpoint, composed ε from checkpoints by RDP and by PLD, composed ε from the
    tracked points' every-step norms)."""
    source = result_file(main_name)
    delta = ["--delta", str(config.delta)]
    per_step = commands.account("eps_delta.py", ["--res-name", main_name, *delta, "--method", config.per_step_method,
                                                 "--filter", f"step={total_steps}"],
                                os.path.join(RES_DIR, f"{main_name}_eps_delta.csv"), source)
    compose = ["--holder-b", holder_text(COMPOSITION_HOLDER_B).replace("∞", "inf"), *delta]
    composed = commands.account("renyi_per_instance_sum_compo.py", ["--res-name", main_name, *compose],
                                os.path.join(RES_DIR, f"{main_name}_compo.csv"), source)
    composed_pld = commands.account("renyi_per_instance_sum_compo.py", ["--res-name", main_name, *compose,
                                                                        "--accountant", "pld"],
                                    os.path.join(RES_DIR, f"{main_name}_compo_pld.csv"), source)
    tracked_source = os.path.join(run_dir, "tracked_norms.csv")
    tracked = commands.account("renyi_per_instance_sum_compo.py", ["--res-file", tracked_source, *compose],
                               os.path.join(RES_DIR, f"{main_name}-tracked_compo.csv"), tracked_source)
    return (guarantees(per_step, ["step", "point"]), guarantees(composed, ["point"]),
            guarantees(composed_pld, ["point"]), guarantees(tracked, ["point"]))


def guarantees(rows, index):
    """An accountant's long output (one row per `kind`) as one row per `index`: `eps` the certified
    guarantee (the max over directions where rows have one), `baseline_eps` the baseline, and `delta`."""
    if "direction" in rows:
        rows = rows[rows["direction"] == "max"]
    table = rows.pivot_table(index=index, columns="kind", values="eps", aggfunc="first")
    table = table.rename(columns={"certified": "eps", "baseline": "baseline_eps"})[["eps", "baseline_eps"]]
    return table.join(rows.groupby(index)["delta"].first()).reset_index()


def account(commands, script, res_name, flags, suffix):
    """An accountant on the result file of `res_name` into res/<res_name>_<suffix>.csv (cached by its command)."""
    return commands.account(script, ["--res-name", res_name, *flags], os.path.join(RES_DIR, f"{res_name}_{suffix}.csv"),
                            result_file(res_name))


def rdp_table(rows, kind):
    """The direction-max Rényi DP of `kind` from renyi_per_instance_mean.py's rows as a (points, orders) frame."""
    chosen = rows[(rows["kind"] == kind) & (rows["direction"] == "max")]
    return chosen.pivot_table(index="point", columns="alpha", values="rdp", aggfunc="first")


def at_order(table, alpha):
    return table[alpha].to_numpy()


def fixed_checkpoint_design(commands, config, main_name, mean_name, main_run, sensitivities, device):
    """Design (a) of the sampling-rate experiment: {checkpoint label: {q: (per-step series, whole-run series,
    facts)}}. One trained model, its final checkpoint and an early one, each analysed as one step of the mean
    rule at every q of fixed_sample_rates, σ_q calibrated so that the sum rule's worst case over the
    epochs/q steps of a run at q is the target ε: what changes with q is only the batches' concentration
    (§3.2), not how far training got. Whole run: epochs/q steps, each charged at this checkpoint (§4)."""
    run = runs.open_run(main_name, "models", DATA_ROOT)
    saved = run.saved_steps()
    total = main_run.total_steps
    checkpoint_of = {"early": min(saved, key=lambda step: (abs(step - config.early_stage * total), step)),
                     "final": total}
    size = main_run.dataset_size
    # A run at rate q lasts epochs/q steps; its σ_q and δ_size = δ/(10·T_q) (§3.4) are that run's.
    run_steps = [max(1, round(config.epochs / rate)) for rate in config.fixed_sample_rates]
    analysed = [runs.analysed_config(main_run, max(1, round(rate * size)), steps_at_rate, config.eps)
                for rate, steps_at_rate in zip(config.fixed_sample_rates, run_steps)]
    size_deltas = [main_run.delta / (10 * steps_at_rate) for steps_at_rate in run_steps]
    points = parse_points(config.mean_points, size, main_run.seed)
    by_rate = {}
    for label, step in checkpoint_of.items():
        # Named by the main run and the mean-rule fields (mean_name), so that other draws never reuse these files.
        names = [f"{mean_name}-fixed-step{step}-bs{mechanism.batch_size}" for mechanism in analysed]
        measured = all(os.path.exists(result_file(res_name)) for res_name in names)
        if not measured:
            with commands.timed(f"measurement.measure_at_rates, step {step}, q = "
                                f"{', '.join(f'{rate:g}' for rate in config.fixed_sample_rates)}"):
                frames = measurement.measure_at_rates(run, step, points, analysed, size_deltas,
                                                      num_batches=config.num_batches, mc_blocks=FIXED_MC_BLOCKS,
                                                      max_sizes=FIXED_MAX_SIZES, mc_seed=main_run.seed, device=device)
                # Parquet: ~100,000 rows each, written in a third of a CSV's time, and each before the next pass.
                for res_name, frame in zip(names, frames):
                    storage.write_frame(os.path.join(RES_DIR, res_name + storage.PARQUET), frame)
        commands.note(f"measurement.measure_at_rates(run {main_name}, step {step}, {len(points)} points {config.mean_points}, "
                      f"batch sizes {', '.join(str(mechanism.batch_size) for mechanism in analysed)}, "
                      f"{config.num_batches} draws) -> {', '.join(result_file(res_name) for res_name in names)}",
                      cached=measured)
        norms = sensitivities[(sensitivities["step"] == step) & sensitivities["point"].isin(points)]
        norms = norms.set_index("point").loc[points, "value"].to_numpy()
        by_rate[label] = {}
        for mechanism, steps_at_rate, size_delta, res_name in zip(analysed, run_steps, size_deltas, names):
            # β of the certified event is the run at q's δ/(10·T_q), like δ_size (k_min = 0 leaves δ_size at 0).
            rows = account(commands, "renyi_per_instance_mean.py", res_name,
                           ["--alpha", f"{config.renyi_order:g}", "--failure", f"{size_delta!r}"], "renyi")
            loaded = accountants.load(accountants.Source(res_name=res_name, res_file=None, res_dir=RES_DIR),
                                      list(results.COUPLING_QUANTITIES), one_run=True,
                                      integer_columns={"sample": 0})
            with commands.timed(f"composition.mean_rule_repeated {res_name}"):
                whole = {kind: composition.mean_rule_repeated(loaded, steps=steps_at_rate, delta=config.delta,
                                                              orders=MEAN_RULE_ORDERS, kind=kind, failure=size_delta)
                         for kind in (Kind.CERTIFIED, Kind.ESTIMATE)}
            commands.note(f"composition.mean_rule_repeated({result_file(res_name)}, steps={steps_at_rate}, "
                          f"delta={config.delta:g},"
                          f" failure={size_delta:.4g}, kinds certified and estimate): ε over the whole run at q")
            by_rate[label][mechanism.sample_rate] = fixed_series(mechanism, steps_at_rate, rows, whole, norms, config,
                                                                 step)
    return by_rate


def fixed_series(mechanism, steps, rows, whole, norms, config, step):
    """One rate of design (a): per-step Rényi DP at config.renyi_order and ε over the T_q steps of a run at q
    (each charged at this checkpoint), per series; the sum rule from the points' Δ* at the same σ_q (§3.1)."""
    alpha, orders = config.renyi_order, accounting.COMPOSITION_ORDERS
    sum_rdp = accounting.rdp_sum_rule(norms, mechanism.clip_bound, mechanism.noise_multiplier, mechanism.sample_rate,
                                      orders)
    sum_mechanism = dataclasses.replace(Mechanism.of_run(mechanism, "sum"), total_steps=steps)
    per_step = {kind: at_order(rdp_table(rows, kind), alpha) for kind in ("certified", "estimate", "baseline")}
    per_step["baseline"] = float(per_step["baseline"][0])
    per_step["sum_rule"] = sum_rdp[:, orders.index(alpha)]
    per_step["sum_baseline"] = float(sum_mechanism.baseline_rdp([alpha], steps=1)[0])
    whole_run = {"certified": whole[Kind.CERTIFIED][1], "estimate": whole[Kind.ESTIMATE][1],
                 "baseline": whole[Kind.CERTIFIED][2],
                 "sum_rule": composition.repeated_step_eps(sum_rdp, steps, orders, config.delta)[0],
                 "sum_baseline": float(sum_mechanism.baseline_eps(config.delta)[0])}
    certified = rows[(rows["kind"] == "certified") & (rows["direction"] == "max")]
    facts = {"sigma": mechanism.noise_multiplier, "steps": steps, "batch_size": mechanism.batch_size,
             "checkpoint": step, "k_min": int(certified["k_min"].iloc[0]), "points": len(norms),
             "estimate_samples": int(rows.loc[rows["kind"] == "estimate", "samples"].median()),
             "dominated_by_k_min": float(certified["k_star_at_k_min"].mean())}
    return per_step, whole_run, facts


def matched_steps_design(commands, config, mean_name, main_run, device):
    """Design (b) of the sampling-rate experiment: {q: (per-step series, whole-run series, facts)}. One mean-rule
    run per batch size, each trained for the main run's T steps (not its epochs) to the same target ε (σ per q)
    and checkpointed mean_checkpoints times: d*, v_X, b_X of every point at every checkpoint (certified bound,
    composition), Δ_B draws of `mean_points` at the final checkpoint (estimate), and Δ* of every point there
    (the sum rule at the same θ and σ)."""
    by_rate = {}
    alpha = ["--alpha", f"{config.renyi_order:g}"]
    total = main_run.total_steps
    for batch_size in config.mean_batch_sizes:
        epochs = total * batch_size / main_run.dataset_size
        run = dataclasses.replace(config, batch_size=batch_size, epochs=epochs, save_steps="",
                                  save_freq=max(1, math.ceil(total / config.mean_checkpoints)))
        run_name = f"{mean_name}-bs{batch_size}"
        commands.run("train_dpsgd.py", [*training_flags(run, device), "--reduction", "mean", "--save-name", run_name])
        measure = ["--run", run_name, "--no-train", "--device", device]
        names = {part: f"{run_name}-{part}" for part in ("stats", "samples", "norms")}
        commands.run("compute_sensitivity.py", [*measure, "--reduction", "mean", "--points", "all", "--stage", "all",
                                                "--num-batches", "0", "--res-name", names["stats"]])
        commands.run("compute_sensitivity.py", [*measure, "--reduction", "mean", "--points", config.mean_points,
                                                "--stage", "final", "--num-batches", str(config.num_batches),
                                                "--res-name", names["samples"]])
        commands.run("compute_sensitivity.py", [*measure, "--reduction", "sum", "--points", "all", "--stage", "final",
                                                "--res-name", names["norms"]])
        certified = account(commands, "renyi_per_instance_mean.py", names["stats"],
                            [*alpha, "--filter", f"step={total}"], "renyi")
        estimate = account(commands, "renyi_per_instance_mean.py", names["samples"], alpha, "renyi")
        sum_rule = account(commands, "renyi_per_instance_sum.py", names["norms"], alpha, "renyi")
        # Over the whole run, the points that also have draws: the same points as the fixed-checkpoint design.
        composed = account(commands, "renyi_per_instance_sum_compo.py", names["stats"],
                           ["--delta", str(config.delta), "--alpha", *map(str, MEAN_RULE_ORDERS), "--points",
                            config.mean_points], "compo")
        run = runs.load_run(os.path.join("models", run_name))
        by_rate[run.sample_rate] = matched_series(run, config, certified, estimate, sum_rule, composed)
    return by_rate


def matched_series(run, config, certified, estimate, sum_rule, composed):
    """The numbers figure 3 draws for one rate of design (b), from the accountants' labelled outputs."""
    final_step = run.total_steps
    sum_mechanism = Mechanism.of_run(run, "sum")

    def per_step(rows, kind):
        chosen = rows[(rows["kind"] == kind) & (rows["direction"] == "max") & (rows["step"] == final_step)]
        return chosen["rdp"].to_numpy()

    at_end = certified[(certified["step"] == final_step) & (certified["direction"] == "max")]
    facts = {"sigma": run.noise_multiplier, "steps": run.total_steps, "batch_size": run.batch_size,
             "checkpoint": final_step, "k_min": int(at_end["k_min"].iloc[0]),
             "points": int(at_end.loc[at_end["kind"] == "certified", "point"].nunique()),
             "estimate_points": int(estimate["point"].nunique()),
             "estimate_samples": int(estimate.loc[estimate["kind"] == "estimate", "samples"].median()),
             "dominated_by_k_min": float(at_end.loc[at_end["kind"] == "certified", "k_star_at_k_min"].mean()),
             "estimate_spread": (estimate.loc[estimate["kind"] == "estimate", "rdp_max"]
                                 / estimate.loc[estimate["kind"] == "estimate", "rdp_min"]).median()}
    step_series = {"certified": per_step(certified, "certified"), "estimate": per_step(estimate, "estimate"),
                   "baseline": float(per_step(certified, "baseline")[0]), "sum_rule": per_step(sum_rule, "certified"),
                   "sum_baseline": float(sum_mechanism.baseline_rdp([config.renyi_order], steps=1)[0])}
    composed_series = {"certified": composed.loc[composed["kind"] == "certified", "eps"].to_numpy(),
                       "baseline": float(composed.loc[composed["kind"] == "baseline", "eps"].iloc[0]),
                       "sum_baseline": float(sum_mechanism.baseline_eps(config.delta)[0])}
    return step_series, composed_series, facts


def attack_experiment(commands, config, preset, name, main_name, mean_name, gap_name, out_dir, device):
    """Findings 8-10: audit summaries per rule, the mean rule's gap audit, and the membership attack per model
    (DP, non-private)."""
    audits = {}
    mean_batch = min(config.mean_batch_sizes, key=lambda size: abs(size - config.batch_size))
    for rule, run_name, points in (("sum", main_name, config.audit_points),
                                   ("mean", f"{mean_name}-bs{mean_batch}", max(2, config.audit_points // 2))):
        out = os.path.join(RES_DIR, f"{run_name}_audit_{rule}.csv")
        figure = os.path.join(out_dir, FIGURES[6] if rule == "sum" else FIGURES[9])
        audited = commands.account("audit.py", ["--run", run_name, "--spread", str(points), "--rule", rule,
                                                "--trials", str(config.audit_trials), "--delta", str(config.delta),
                                                "--figure", figure, "--device", device], out,
                                   runs.run_file(os.path.join("models", run_name)))
        audits[rule] = audit_simulation.audit_summary(audited)
    gap = gap_audit(commands, config, gap_name, out_dir, device)
    nodp_name = f"{name}{variant_tag(config, preset, NODP_RUN_FIELDS)}-nodp"
    nodp = dataclasses.replace(config, lr=config.nodp_lr, save_steps="")
    commands.run("train_dpsgd.py", [*training_flags(nodp, device), "--no-dp", "--save-name", nodp_name])
    eps_csv = os.path.join(RES_DIR, f"{main_name}_compo.csv")
    membership_rows = commands.account("membership_inference.py", ["--run", main_name, "--nondp-run", nodp_name,
                                                                   "--eps-csv", eps_csv, "--figure",
                                                                   os.path.join(out_dir, FIGURES[7]), "--device", device],
                                       os.path.join(RES_DIR, f"{main_name}_membership.csv"), eps_csv)
    return {"audit": audits, "gap": gap, "membership": membership.membership_summary(membership_rows)}


def gap_audit(commands, config, gap_name, out_dir, device):
    """Finding 10 and figure 9 (docs/audit.md §1): a realised-size mean-rule run on the first gap_points training
    points, audited at its last checkpoint; every point's empirical lower bound against the sum rule's per-step
    ε at the same σ and q and the mean rule's own baseline (audit_simulation.gap_summary)."""
    dataset = f"first:{config.gap_points}:{config.dataset}"
    commands.run("train_dpsgd.py", ["--dataset", dataset, "--model", config.model, "--reduction", "mean",
                                    "--batch-size", str(config.gap_batch_size), "--sigma", str(config.gap_sigma),
                                    "--epochs", str(config.gap_epochs), "--lr", str(config.gap_lr),
                                    "--save-freq", str(1_000_000), "--save-name", gap_name, "--device", device])
    run_dir = os.path.join("models", gap_name)
    out = os.path.join(RES_DIR, f"{gap_name}_audit_mean.csv")
    rows = commands.account("audit.py", ["--run", gap_name, "--points", "all", "--stage", "final", "--rule", "mean",
                                         "--trials", str(config.gap_trials), "--delta", str(config.delta),
                                         "--figure", os.path.join(out_dir, FIGURES[10]), "--device", device],
                            out, runs.run_file(run_dir))
    mechanism = Mechanism.of_run(runs.load_run(run_dir))
    summary = audit_simulation.gap_summary(rows, mechanism)
    step = max(summary)
    last = rows[rows["step"] == step]
    audit_plots.plot_audit_gap(last["eps_lower"].to_numpy(), last["eps_upper"].to_numpy(),
                               last["correct"].to_numpy().astype(bool), summary[step]["sum_rule_eps"],
                               summary[step]["mean_baseline_eps"], os.path.join(out_dir, FIGURES[8]),
                               title=f"Audit of {gap_name}, step {step}:\nthe realised-size mean rule against the sum "
                                     "rule's accounting")
    return {**summary[step], "step": step, "run": gap_name}


def attack_lines(findings):
    """The audits, the mean rule's gap audit and the membership attack as report lines."""
    lines = []
    for rule, summary in findings["audit"].items():
        for step, result in summary.items():
            groups = ", ".join(f"{group} {values['median_lower']:.3g}/{values['median_upper']:.3g} "
                               f"(ratio {values['median_ratio']:.3g}, {values['points']} points)"
                               for group, values in result["groups"].items() if group != "all")
            lines.append(f"audit, {rule} rule, step {step}, {result['trials']:,} simulated steps per law, "
                         f"δ={result['delta']:g}: eps_lower/eps_upper medians ({result['upper_kind']} upper bound) "
                         f"{groups}; violated: {result['violated']} of {result['points']}")
    gap = findings["gap"]
    lines.append(
        f"the realised-size mean rule against the sum rule's accounting (run {gap['run']}: N={gap['dataset_size']}, "
        f"B={gap['batch_size']}, σ={gap['noise_multiplier']:g}, audited at step {gap['step']}, {gap['trials']:,} "
        f"simulated steps per law, δ={gap['delta']:g}): eps_lower (95%) median {gap['median_lower']:.3g}, max "
        f"{gap['max_lower']:.3g}; above the sum rule's per-step ε {gap['sum_rule_eps']:.4g} for {gap['above_sum_rule']} "
        f"of {gap['points']} points ({gap['above_sum_rule_jointly']} with all bounds holding together), above the mean "
        f"rule's own baseline {gap['mean_baseline_eps']:.4g} (k_min={gap['k_min']}) for {gap['above_baseline']}"
        + (" — the sum rule's accounting does NOT cover the realised-size mean rule" if gap["above_sum_rule_jointly"]
           else " — no gap shown at this size"))
    attack = findings["membership"]
    lines.append("membership inference (loss threshold, per class): " + "; ".join(
        f"{model}: mean attack accuracy {values['mean_attack_accuracy']:.3f}, Pearson r(attack, class ε) = "
        f"{values['pearson_attack']:.2f}, r(test accuracy, class ε) = {values['pearson_test']:.2f} "
        f"({values['classes']} classes)" for model, values in attack.items()))
    return lines


# --- figures -------------------------------------------------------------------------------------

def final_rows(frame, step):
    return frame[frame["step"] == step]


def draw_figures(out_dir, config, main_run, run_dir, sensitivities, per_step, composed, composed_pld, tracked,
                 mean_results, device):
    final_step = max(checkpoints.saved_steps(run_dir))
    at_end = final_rows(sensitivities, final_step).set_index("point")
    findings = {}

    def path(name):
        return os.path.join(out_dir, name)

    # Figure 1: per-step ε of every point at the final checkpoint.
    step_eps = final_rows(per_step, final_step).set_index("point")
    baseline_step = float(step_eps["baseline_eps"].iloc[0])
    findings["histogram"] = plots.plot_per_step_histogram(
        step_eps["eps"].to_numpy(), baseline_step, path(FIGURES[0]),
        title=f"Per-instance per-step ε at step {final_step} (sum rule, δ={step_eps['delta'].iloc[0]:g})")

    # Figure 2: correct vs misclassified.
    correct = at_end.loc[step_eps.index, "correct"].astype(bool).to_numpy()
    findings["correctness"] = plots.plot_correct_vs_misclassified(
        step_eps["eps"].to_numpy(), correct, baseline_step, path(FIGURES[1]), "per-instance per-step ε")

    # Figure 3: mean rule at several sampling rates.
    findings["rates"] = draw_mean_rule(mean_results, config, path(FIGURES[2]))

    # Figure 4: composed ε over training for an easy, a hard and a misclassified point.
    composed = composed.set_index("point")
    chosen = pick_points(composed["eps"], at_end.loc[composed.index, "correct"].astype(bool))
    curves, baseline_curve, checkpoint_steps = composition_curves(main_run, sensitivities, chosen, config.delta)
    findings["curves"] = plots.plot_composed_over_training(curves, baseline_curve, path(FIGURES[3]), config.delta,
                                                           checkpoint_steps)

    # Figure 5: individual accounting of every point vs its final loss; classes.
    model, payload = training.load_model(main_run, run_dir, final_step, device)
    findings["test_accuracy"] = payload["test_accuracy"]
    dataset = load_dataset(main_run.dataset, DATA_ROOT, main_run.less_point)
    class_accuracy = training.per_class_accuracy(model, dataset.test_x, dataset.test_y, dataset.num_classes, device)
    composed_pld = composed_pld.set_index("point").loc[composed.index]
    by_accountant = {"RDP": (composed["eps"].to_numpy(), float(composed["baseline_eps"].iloc[0])),
                     "PLD": (composed_pld["eps"].to_numpy(), float(composed_pld["baseline_eps"].iloc[0]))}
    findings["individual"] = plots.plot_individual_accounting(
        composed["eps"].to_numpy(), at_end.loc[composed.index, "loss"].to_numpy(),
        at_end.loc[composed.index, "label"].to_numpy(), dataset.class_names, class_accuracy,
        float(composed["baseline_eps"].iloc[0]), path(FIGURES[4]), by_accountant)
    findings["individual"]["lowest_class"] = int(np.argmin(class_accuracy))
    findings["individual"]["highest_class"] = int(np.argmax(class_accuracy))

    # Figure 6: ε from norms at checkpoints only vs from norms at every step.
    exact = tracked.set_index("point")["eps"]
    findings["estimate"] = plots.plot_estimate_accuracy(
        composed.loc[exact.index, "eps"].to_numpy(), exact.to_numpy(), path(FIGURES[5]),
        float(composed["baseline_eps"].iloc[0]))
    findings["estimate"]["points"] = len(exact)
    findings["composed_median"] = float(composed["eps"].median())
    findings["composed_baseline"] = float(composed["baseline_eps"].iloc[0])
    findings["total_steps"] = main_run.total_steps
    return findings


def draw_mean_rule(mean_results, config, path):
    """Figure 3 and its numbers: both designs' per-step and whole-run guarantees of the mean rule by sampling rate."""
    designs, facts = {}, {}
    for label, step in ((DESIGN_EARLY, "early"), (DESIGN_FINAL, "final")):
        by_rate = mean_results["fixed"][step]
        facts[label] = {rate: series[2] for rate, series in by_rate.items()}
        checkpoint = next(iter(facts[label].values()))["checkpoint"]
        label_at = f"{label} (step {checkpoint})"
        designs[label_at] = ({rate: series[0] for rate, series in by_rate.items()},
                             {rate: series[1] for rate, series in by_rate.items()})
        facts[label_at] = facts.pop(label)
    matched = mean_results["matched"]
    designs[DESIGN_MATCHED] = ({rate: series[0] for rate, series in matched.items()},
                               {rate: series[1] for rate, series in matched.items()})
    facts[DESIGN_MATCHED] = {rate: series[2] for rate, series in matched.items()}
    drawn = plots.plot_sampling_rate_designs(designs, config.renyi_order, config.delta, path)
    return {design: {**values, "facts": facts[design]} for design, values in drawn.items()}


def pick_points(eps, correct):
    """An easy (lowest ε), a hard (highest ε) correctly classified point, and a misclassified one."""
    chosen = {}
    right = eps[correct.to_numpy()]
    if len(right):
        chosen[f"easy (point {right.idxmin()})"] = int(right.idxmin())
        chosen[f"hard (point {right.idxmax()})"] = int(right.idxmax())
    wrong = eps[~correct.to_numpy()]
    if len(wrong):
        point = int((wrong - wrong.median()).abs().idxmin())
        chosen[f"misclassified (point {point})"] = point
    return chosen


def composition_curves(run, sensitivities, chosen, delta):
    """Composed ε after every step t = 0..T (accounting.md §4, b = COMPOSITION_HOLDER_B = ∞) for the chosen
    points, by the accountant's own composition (composition.compose_sum_rule, its default rounding), and
    the worst case; also the checkpoint steps whose Δ* charge the steps after them."""
    rows = sensitivities[sensitivities["point"].isin(list(chosen.values()))]
    table_of = rows.pivot_table(index="step", columns="point", values="value", aggfunc="first")
    steps = table_of.index.to_numpy()
    ratio = (table_of[list(chosen.values())].to_numpy() / run.clip_bound)[None]
    mechanism = Mechanism.of_run(run, "sum")
    # Every horizon from step 0 (no privacy spent) to T: the early steps, where every point is often still
    # clipped at Γ, are where the curves rise fastest.
    horizon = np.arange(run.total_steps + 1)
    eps, _ = composition.compose_sum_rule(ratio, steps, mechanism, orders=accounting.COMPOSITION_ORDERS, delta=delta,
                                          holder_b=COMPOSITION_HOLDER_B, rounding=composition.SUM_RULE_ROUNDING,
                                          horizons=horizon[1:])
    curves = {label: (horizon, np.concatenate([[0.0], eps[:, index]])) for index, label in enumerate(chosen)}
    baseline = [0.0] + [mechanism.baseline_eps(delta, end, accounting.COMPOSITION_ORDERS)[0] for end in horizon[1:]]
    return curves, (horizon, np.asarray(baseline)), steps


# --- report --------------------------------------------------------------------------------------

def finding_lines(config, findings):
    """The numbered findings of the report, every setting quoted from `config` and the constants."""
    hist, corr, rates = findings["histogram"], findings["correctness"], findings["rates"]
    individual, estimate = findings["individual"], findings["estimate"]
    misclassified_more = corr["count_misclassified"] > 0 and corr["median_misclassified"] > corr["median_correct"]
    class_eps = list(individual["class_mean_eps"].values())
    return [
        f"median per-instance per-step ε is {hist['median']:.4g}, baseline {hist['baseline']:.4g}; "
        f"{100 * hist['share_2x_below']:.1f}% of points are at least 2× below the baseline",
        (f"misclassified median / correct median = {corr['ratio']:.3g} "
         f"({corr['count_misclassified']} misclassified, {corr['count_correct']} correct points)"
         + ("" if misclassified_more else " — NOT borne out by this run: misclassified points do not pay more")),
        *mean_rule_lines(config, rates),
        (f"composed ε over {findings['total_steps']} steps (b={holder_text(COMPOSITION_HOLDER_B)}, "
         f"δ={config.delta:g}): median {findings['composed_median']:.4g}, "
         f"baseline {findings['composed_baseline']:.4g}; "
         + ", ".join(f"{label}: {value:.4g}" for label, value in findings["curves"]["final"].items())),
        "composed ε by accountant (every point, b=∞): " + "; ".join(
            f"{name}: median {values['median']:.4g} (10-90%: {values['q10']:.4g}-{values['q90']:.4g}), worst case "
            f"{values['worst']:.4g}, {100 * values['share_below_half']:.1f}% of points below half the worst case"
            for name, values in individual["accountants"].items()),
        (f"Pearson r between composed ε and log final loss = {individual['pearson_log_loss']:.3f}; "
         f"class with the lowest test accuracy ({individual['lowest_class']}) has mean ε "
         f"{class_eps[individual['lowest_class']]:.4g}, the highest ({individual['highest_class']}) "
         f"{class_eps[individual['highest_class']]:.4g}"),
        (f"ε from norms at checkpoints only vs at every step, {estimate['points']} points: Pearson r = "
         f"{estimate['pearson']:.3f}, mean |error| {estimate['mean_abs_error']:.3g}, max |error| "
         f"{estimate['max_abs_error']:.3g}"),
        *attack_lines(findings),
    ]


def mean_rule_lines(config, rates):
    """Findings 3 and 4: the mean rule per sampling rate in both designs, per step and over the whole run, and
    GLA's sampling-rate claim judged on the per-step data-dependent values relative to the mean rule's baseline."""
    lines, verdicts, spans = [], {}, {}
    for design, drawn in rates.items():
        facts, step, whole = drawn["facts"], drawn["per_step"], drawn["composed"]
        ordered = sorted(facts)
        per_rate = "; ".join(
            f"q={rate:.4g} (B={facts[rate]['batch_size']}, σ={facts[rate]['sigma']:.3g}, T={facts[rate]['steps']}, "
            f"k_min={facts[rate]['k_min']}): certified {step['certified'][rate]:.4g} (k*=k_min for "
            f"{100 * facts[rate]['dominated_by_k_min']:.0f}% of {facts[rate]['points']} points), estimate "
            f"{step['estimate'][rate]:.4g} (Monte Carlo, {facts[rate]['estimate_samples']} batches per point), "
            f"mean-rule baseline {step['baseline'][rate]:.4g}, sum rule at the same θ and σ {step['sum_rule'][rate]:.4g} "
            f"(worst case {step['sum_baseline'][rate]:.4g}); whole run: certified {whole['certified'][rate]:.4g}, "
            + (f"estimate {whole['estimate'][rate]:.4g}, " if "estimate" in whole else "")
            + f"mean-rule baseline {whole['baseline'][rate]:.4g}, sum rule worst case {whole['sum_baseline'][rate]:.4g}"
            for rate in ordered)
        ratios = drawn["ratios"]
        falls = {kind: decreasing([ratios[kind][rate] for rate in ordered]) for kind in ("certified", "estimate")}
        verdicts[design] = falls["certified"] and falls["estimate"]
        spans[design] = (f"{design}: certified/baseline " + " → ".join(f"{ratios['certified'][rate]:.3g}" for rate in ordered)
                         + ", estimate/baseline " + " → ".join(f"{ratios['estimate'][rate]:.3g}" for rate in ordered)
                         + f" over q = {', '.join(f'{rate:.4g}' for rate in ordered)}")
        ratio_text = ", ".join(f"q={rate:.4g}: certified/baseline {ratios['certified'][rate]:.3g}, estimate/baseline "
                               f"{ratios['estimate'][rate]:.3g}" for rate in ordered)
        whole_run_meaning = MATCHED_WHOLE_RUN if design == DESIGN_MATCHED else FIXED_WHOLE_RUN
        lines.append(f"mean rule, {design}: per-step Rényi DP at α={config.renyi_order:g} (medians) and ε over the "
                     f"whole run (δ={config.delta:g}, b=∞; {whole_run_meaning}): {per_rate}. Relative to the mean "
                     "rule's baseline: "
                     f"{ratio_text} — " + ("both fall as q grows" if verdicts[design] else
                                          "certified " + ("falls" if falls["certified"] else "does not fall")
                                          + ", estimate " + ("falls" if falls["estimate"] else "does not fall")
                                          + " as q grows"))
    reproduced = [design for design, held in verdicts.items() if held]
    verdict = ("GLA's claim that a higher sampling rate gives the mean rule better data-dependent privacy (relative "
               "to its own baseline, per step) is " + (
                   "REPRODUCED in every controlled design" if len(reproduced) == len(verdicts) else
                   f"REPRODUCED only in {', '.join(reproduced)} and NOT in the others" if reproduced else
                   "NOT reproduced in any controlled design")
               + "; judged on the per-step estimate and certified bound, each divided by the mean rule's baseline "
                 "at the same q, since the whole-run values also change with T and σ (medians: "
               + "; ".join(spans.values()) + ")")
    return [*lines, verdict]


def decreasing(values):
    return all(first > second for first, second in zip(values, values[1:]))


def holder_text(exponent):
    return "∞" if exponent == math.inf else f"{exponent:g}"


def configuration_lines(preset, config):
    """A table of every field of the configuration; the ones overridden on the command line are marked."""
    changed = overridden(config, preset)
    lines = ["| field | value |", "| --- | --- |"]
    lines += [f"| `{name}` | `{field_text(getattr(config, name))}`{' (overridden)' if name in changed else ''} |"
              for name in field_types()]
    return lines


def write_report(out_dir, preset, config, argv, commands, main_run, findings, seconds):
    text = [f"# Per-instance privacy of DP-SGD: preset `{preset}`", "",
            f"`{shlex.join(['python', 'reproduce.py', *argv])}` took {seconds:.0f} s. Main run `{main_run.run}` "
            f"on `{main_run.dataset}`: sigma = {main_run.noise_multiplier:.4g}, q = {main_run.sample_rate:.4g}, "
            f"T = {main_run.total_steps}, Γ = {main_run.clip_bound:g}, N = {main_run.dataset_size}; "
            f"test accuracy at the end {findings['test_accuracy']:.4f}.", "", "## Findings", ""]
    text += [f"{index}. {line}" for index, line in enumerate(findings["headlines"], 1)]
    text += ["", "## Configuration", "", *configuration_lines(preset, config)]
    text += ["", "## Commands", "", "Every number above comes from these commands, in this order "
             "(\"cached\": the output of the same command on the same input was reused).", "", "```"]
    text += [f"{line}{'  # cached' if cached else ''}" for line, cached in commands.lines]
    text += ["```", "", "## Time and memory", "", *commands.timing_lines(seconds)]
    text += ["", "## Figures", ""] + [f"![{figure}]({figure})" for figure in sorted(FIGURES)]
    path = os.path.join(out_dir, "report.md")
    fileio.write_text(path, "\n".join(text) + "\n")
    return path


if __name__ == "__main__":
    run_main(main)

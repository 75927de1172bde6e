"""Does the individual Rényi filter help? Uniform DP-SGD against the filtered run (train_dpsgd.py --budget-eps) at the
same worst-case (ε, δ), the same σ and the same q, over several seeds (docs/filter.md).

Each workload trains on a holdout:M: split of its training set: M training points drawn at random are held out, never
trained on, and every choice is made on them; the dataset's own test set is looked at only to report. Per seed:

- uniform DP-SGD for T_u = round(epochs·N/B) steps, σ Opacus's calibration of (ε, δ) over T_u steps at q = B/N; it
  picks its best checkpoint of T_u·{0.5, 0.75, 1} on the held-out split (plain DP-SGD's T_u is reported too);
- the filter measuring Δ* at every step (K = 1, every point clipped at Γ as in DP-SGD) and every --filter-every
  steps (K = 10, each point clipped at 1.25·Δ* of its last measurement in between, accounting.md §12.4): budget ε
  for every point at the default order, the same σ, one run to the largest cap T_u·{1, 1.5, 2, 3} with a checkpoint
  at each; the cap is picked on the held-out split. A filtered run's first t steps do not depend on its cap (batches
  and noise come from (seed, step), the filter's rule from the past, no learning-rate schedule): each variant is
  trained again capped at T_u on every seed, and at the second cap on seed 0 (--check-prefix), and the checkpoint's
  bytes compared with the long run's at the same step.

Reported: test accuracy of the selected models on the real test set, mean and 95% t-interval over seeds, the paired
difference filtered − uniform with its interval, steps, who left the filter (when, and by class), each class's test
accuracy, what the every-step filter trains on past T_u, and what the filter costs, measured side by side (the same
seed's runs one after the other in this process): the run capped at T_u (uniform DP-SGD's steps on the same points,
plus the measurements and charges) and the whole run to the largest cap, each against the uniform run.

    python benchmarks/bench_filter.py --cifar-data /work/data --seeds 3 --threads 1 --clock cpu --out DIR
    python benchmarks/bench_filter.py --workloads mnist --seeds 5 --k1-seeds 3   # K = 1 on the first 3 seeds only
    python benchmarks/bench_filter.py --smoke     # seconds: 384 synthetic points, an MLP, two seeds (K = 1 on one)

Writes, under --out: checkpoints.csv (every candidate checkpoint's held-out and test accuracy, and which was
selected), runs.csv (per run: steps, times, who left), classes.csv (per run and class: points, left, test accuracy of
the selected model), prefix.csv (the capped runs' checkpoints against the long runs'), summary.md (the printed
tables). The runs go to --work (default <out>/models) and resume there; each run's time is kept in <out>/timings.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _filter_tables as tables  # noqa: E402
from _filter_tables import UNIFORM, every_of, filter_method  # noqa: E402
from _workloads import device_name, parse_timed, timer  # noqa: E402

from perinstance.accounting import individual_filter  # noqa: E402
from perinstance.cli import options  # noqa: E402
from perinstance.experiments import filter_findings  # noqa: E402
from perinstance.experiments.config import PRESETS  # noqa: E402
from perinstance.files import checkpoints, fileio, storage, tracked_rows  # noqa: E402
from perinstance.train import distributed, evaluation, run_plan, training  # noqa: E402
from perinstance.train.data import load_dataset  # noqa: E402

warnings.filterwarnings("ignore")


@dataclasses.dataclass(frozen=True)
class FilterWorkload:
    """A preset's main run, trained on its training set less `holdout` points held out at random (holdout:M:)."""

    name: str
    dataset: str  # the base dataset (its test set is the real one)
    holdout: int  # M of holdout:M:dataset
    model: str
    batch_size: int
    lr: float
    epochs: float

    @property
    def selection_dataset(self) -> str:
        return f"holdout:{self.holdout}:{self.dataset}"


def preset_workload(name: str, preset: str, dataset: str, holdout: int) -> FilterWorkload:
    config = PRESETS[preset]
    return FilterWorkload(name, dataset, holdout, config.model, config.batch_size, config.lr, config.epochs)


# The quick preset's main run on the embedded MNIST (8,000 training points: 1,000 held out) and the cifar10-cpu preset
# (ScatterNet features of CIFAR-10's JPEGs, 50,000 training points: 5,000 held out).
CIFAR_DATASET = "scatternet:imagefolder:{path}"
SMOKE_WORKLOAD = FilterWorkload("smoke", "synthetic", 128, "mlp", 32, 0.5, 1.0)
SMOKE_SIZES = {"workloads": ["smoke"], "seeds": ["2"], "k1_seeds": ["1"]}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One workload's mechanism, shared by its methods and seeds."""

    workload: FilterWorkload
    size: int  # N, the training points (the held-out ones excluded)
    sample_rate: float  # q = B/N
    uniform_steps: int  # T_u
    sigma: float  # Opacus's calibration of (ε, δ) over T_u steps at q
    order: float  # the filter's λ_f (individual_filter.default_order)
    full_charge_steps: int  # steps a point charged at Γ stays in the filter
    uniform_candidates: tuple[int, ...]
    caps: tuple[int, ...]

    def candidates(self, method: str) -> tuple[int, ...]:
        return self.uniform_candidates if method == UNIFORM else self.caps


def scaled_steps(steps: int, factors: list[float]) -> tuple[int, ...]:
    """T·factor rounded half up, each at least 1."""
    return tuple(sorted({max(1, math.floor(steps * factor + 0.5)) for factor in factors}))


def plan_workload(workload: FilterWorkload, size: int, args: argparse.Namespace) -> Plan:
    sample_rate = workload.batch_size / size
    uniform_steps = max(1, round(workload.epochs * size / workload.batch_size))
    sigma = run_plan.calibrated_noise_multiplier(args.eps, args.delta, sample_rate, uniform_steps)
    order = individual_filter.default_order(sample_rate, sigma, args.eps, args.delta)
    budget = float(individual_filter.budget_rdp([args.eps], args.delta, order)[0])
    return Plan(workload, size, sample_rate, uniform_steps, sigma, order,
                individual_filter.uniform_steps(sample_rate, sigma, budget, order),
                scaled_steps(uniform_steps, args.uniform_factors), scaled_steps(uniform_steps, args.cap_factors))


def training_args(plan: Plan, method: str, seed: int, args: argparse.Namespace, cap: int | None = None,
                  tag: str | None = None) -> run_plan.TrainingFlags:
    """The training flags of one run: uniform DP-SGD to T_u, or a filter (K of its method's name) to `cap` (default
    the largest), each saving a checkpoint at its candidates."""
    workload = plan.workload
    flags = ["--dataset", workload.selection_dataset, "--data-root", args.data_root, "--model", workload.model,
             "--batch-size", str(workload.batch_size), "--lr", repr(workload.lr), "--sigma", repr(plan.sigma),
             "--target-delta", repr(args.delta), "--seed", str(seed), "--models-dir", args.work,
             "--device", args.device]
    if method == UNIFORM:
        steps = plan.uniform_steps
    else:
        steps = cap or plan.caps[-1]
        every = every_of(method)
        flags += ["--budget-eps", repr(args.eps), *(["--filter-every", str(every)] if every > 1 else [])]
    saved = [step for step in plan.candidates(method) if step <= steps]
    flags += ["--total-steps", str(steps), "--save-steps", *map(str, saved)]
    if tag is not None:
        flags += ["--id", tag]
    return options.parse_training_flags(flags)


def timed_run(flags: run_plan.TrainingFlags, args: argparse.Namespace) -> tuple[training.Outcome, dict]:
    """Train (or find trained) one run; its timing, kept in <out>/timings/<run>.json so that a benchmark resumed
    later reports the run's own times (NaN for a run this call resumed midway: only part of it was timed)."""
    clock = timer(args.clock, args.device)
    started = clock()
    outcome = training.train(flags, quiet=args.smoke)
    seconds = clock() - started
    path = os.path.join(args.out, "timings", f"{outcome.run.run}.json")
    if outcome.resumed_from == 0:
        timing = {"seconds": seconds, "clock": args.clock, "steps_seconds": outcome.steps_seconds,
                  "tracking_seconds": outcome.tracking_seconds, "threads": torch.get_num_threads(),
                  "load_average": os.getloadavg()[0]}
        fileio.write_json(path, timing)
    elif os.path.exists(path) and not outcome.trained:
        with open(path, encoding="utf-8") as handle:
            timing = json.load(handle)
    else:
        timing = {"seconds": math.nan, "clock": args.clock, "steps_seconds": math.nan, "tracking_seconds": math.nan}
    return outcome, timing


@torch.no_grad()
def evaluate_checkpoints(outcome: training.Outcome, steps: tuple[int, ...], held_out, test, device: str
                         ) -> list[dict]:
    """Held-out and test accuracy, and each class's test accuracy, of the run's checkpoints `steps`."""
    rows = []
    for step in steps:
        model, _ = training.load_model(outcome.run, outcome.run_dir, step, device)
        held_out_accuracy, _ = evaluation.evaluate(model, *held_out, device)
        _, losses, correct = evaluation.example_outputs(model, *test, device)
        rows.append({"step": step, "heldout_accuracy": held_out_accuracy, "test_accuracy": float(correct.mean()),
                     "test_loss": float(losses.mean()),
                     "class_accuracy": evaluation.class_accuracy(correct, test[1], outcome.run.num_classes)})
    return rows


def weights_gap(first: training.Outcome, second: training.Outcome, step: int) -> float:
    """max |θ_first − θ_second| over every parameter at checkpoint `step` of both runs."""
    (one, _), (two, _) = (training.load_model(outcome.run, outcome.run_dir, step) for outcome in (first, second))
    return max(float((a - b).abs().max()) for a, b in zip(one.parameters(), two.parameters(), strict=True))


def capped_run(plan: Plan, method: str, seed: int, long_run: training.Outcome, cap: int, tag: str,
               args: argparse.Namespace) -> tuple[dict, dict]:
    """Train `method` again, capped at `cap`: (its checkpoint at `cap` against the long run's, its timing)."""
    short, timing = timed_run(training_args(plan, method, seed, args, cap=cap, tag=tag), args)
    paths = [checkpoints.checkpoint_path(outcome.run_dir, cap) for outcome in (short, long_run)]
    identical = fileio.sha256_of(paths[0]) == fileio.sha256_of(paths[1])
    return {"workload": plan.workload.name, "method": method, "seed": seed, "step": cap, "run": tag,
            "long_cap": long_run.run.total_steps, "identical_bytes": identical,
            "max_weight_gap": 0.0 if identical else weights_gap(short, long_run, cap)}, timing


def stayers(plan: Plan, outcome: training.Outcome, record: pd.DataFrame) -> dict:
    """From an every-step filter's tracked table: the gradient mass in training, Σ Δ*_i(θ_{t−1})/(N·Γ) over the points
    in training at step t, at t = T_u (uniform DP-SGD's last step: every point is in), T_u + 1 (the first step past
    it) and the largest cap; and, at θ_{T_u}, the training loss and accuracy of the points that stay past T_u against
    those that leave there."""
    table = storage.read_frame(tracked_rows.table_path(outcome.run_dir),
                               columns=["step", "point", "value", "loss", "correct", "quantity"])
    norms = table[table["quantity"] == "grad_norm"]
    left = record.set_index("point")["left_step"]

    def in_training(rows: pd.DataFrame, step: int) -> np.ndarray:
        leaving = left.reindex(rows["point"]).to_numpy(dtype=float)
        return np.isnan(leaving) | (leaving > step)

    def mass(step: int) -> float:
        rows = norms[norms["step"] == step - 1]
        return float(rows["value"].to_numpy()[in_training(rows, step)].sum() / (plan.size * outcome.run.clip_bound))

    at_stop = norms[norms["step"] == plan.uniform_steps]
    stay = in_training(at_stop, plan.uniform_steps + 1)
    return {"mass_at_uniform_stop": mass(plan.uniform_steps), "mass_after_uniform_stop": mass(plan.uniform_steps + 1),
            "mass_at_cap": mass(plan.caps[-1]), "stay_past_uniform_stop": int(stay.sum()),
            "stayer_train_loss": float(at_stop["loss"][stay].mean()),
            "leaver_train_loss": float(at_stop["loss"][~stay].mean()),
            "stayer_train_accuracy": float(at_stop["correct"][stay].mean()),
            "leaver_train_accuracy": float(at_stop["correct"][~stay].mean())}


def run_seed(plan: Plan, seed: int, methods: list[str], data: dict, args: argparse.Namespace) -> dict:
    """The runs of one seed, side by side; their checkpoints evaluated, the selections made on the held-out split."""
    outcomes, found = {}, {"checkpoints": [], "runs": [], "classes": [], "prefix": []}
    for method in methods:
        outcome, timing = timed_run(training_args(plan, method, seed, args), args)
        outcomes[method] = outcome
        rows = evaluate_checkpoints(outcome, plan.candidates(method), data["held_out"], data["test"], args.device)
        chosen = tables.select(rows)
        for row in rows:
            found["checkpoints"].append({
                "workload": plan.workload.name, "seed": seed, "method": method, "step": row["step"],
                "factor": row["step"] / plan.uniform_steps, "heldout_accuracy": row["heldout_accuracy"],
                "test_accuracy": row["test_accuracy"], "test_loss": row["test_loss"],
                "selected": row["step"] == chosen["step"]})
        record = filter_findings.read_record(outcome.run_dir) if method != UNIFORM else None
        found["runs"].append(tables.run_row(plan, seed, method, outcome, timing, record, chosen["step"]))
        if method == filter_method(1):
            found["runs"][-1].update(stayers(plan, outcome, record))
        found["classes"] += tables.class_rows(plan, seed, method, data["labels"], data["class_names"], record,
                                              chosen)
        if method != UNIFORM and UNIFORM in outcomes:
            found["runs"][-1]["weights_gap_at_uniform_steps"] = weights_gap(outcome, outcomes[UNIFORM],
                                                                            plan.uniform_steps)
        if method != UNIFORM:
            # The filter's own cost: the same run capped at T_u does uniform DP-SGD's steps on the same points (none
            # leaves before T_u), plus the measurements and the charges.
            check, at_stop = capped_run(plan, method, seed, outcome, plan.uniform_steps, "timing", args)
            found["prefix"].append(check)
            found["runs"][-1]["seconds_to_uniform_steps"] = at_stop["seconds"]
            if seed == 0 and every_of(method) in args.check_prefix[plan.workload.name]:
                found["prefix"].append(capped_run(plan, method, seed, outcome, plan.caps[min(1, len(plan.caps) - 1)],
                                                  "prefix", args)[0])
        print(f"  {plan.workload.name} seed {seed} {method}: {found['runs'][-1]['summary']}", flush=True)
    return found


def per_workload(parser: argparse.ArgumentParser, flag: str, tokens: list[str], workloads: list[str],
                 value: Callable[[str], object]) -> dict:
    """{workload: value} from tokens V (every workload) and WORKLOAD=V (that one, over a plain V); `value` turns a V
    into its value, a ValueError for a bad one."""
    values = {}
    for token in sorted(tokens, key=lambda text: "=" in text):
        name, _, text = token.rpartition("=")
        try:
            if "=" in token and name not in workloads:
                raise ValueError
            values.update({name: value(text)} if name else dict.fromkeys(workloads, value(text)))
        except ValueError:
            parser.error(f"{flag}: {token!r} is neither a value nor WORKLOAD=value with WORKLOAD among {workloads}")
    if any(name not in values for name in workloads):
        parser.error(f"{flag}: give a value for every workload ({workloads}), or one for all")
    return values


def count(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise ValueError(text)
    return int(text)


def variants(text: str) -> list[int]:
    """--check-prefix's value: K,K,... or none."""
    return [] if text == "none" else [count(part) for part in text.split(",")]


def workload_list(args: argparse.Namespace) -> list[FilterWorkload]:
    chosen = []
    for name in args.workloads:
        if name == "smoke":
            chosen.append(SMOKE_WORKLOAD)
        elif name == "mnist":
            chosen.append(preset_workload("mnist", "quick", PRESETS["quick"].dataset, args.mnist_holdout))
        elif args.cifar_data is None or not os.path.isdir(os.path.join(args.cifar_data, "train")):
            print(f"cifar10-cpu skipped: no CIFAR-10 images at --cifar-data {args.cifar_data} (expected "
                  "train/<class>/*.jpg and test/<class>/*.jpg)", flush=True)
        else:
            dataset = CIFAR_DATASET.format(path=os.path.abspath(args.cifar_data))
            chosen.append(preset_workload("cifar10-cpu", "cifar10-cpu", dataset, args.cifar_holdout))
    return chosen


def benchmark(args: argparse.Namespace) -> None:
    found = {"checkpoints": [], "runs": [], "classes": [], "prefix": []}
    plans = []
    for workload in workload_list(args):
        # What the evaluation needs, kept apart from the training inputs (ScatterNet features of CIFAR-10: 3 GB), which
        # each run loads again.
        selection = load_dataset(workload.selection_dataset, args.data_root)
        base = load_dataset(workload.dataset, args.data_root)
        data = {"held_out": (selection.test_x, selection.test_y), "test": (base.test_x, base.test_y),
                "labels": selection.train_y.numpy(), "class_names": selection.class_names}
        plan = plan_workload(workload, len(selection.train_y), args)
        plans.append(plan)
        del selection, base
        print(f"\n{workload.name}: {workload.model} on {workload.selection_dataset} (N = {plan.size}, "
              f"{workload.holdout} held out; test set {len(data['test'][1])}), B = {workload.batch_size}, "
              f"lr {workload.lr:g}: q = {plan.sample_rate:.4g}, T_u = {plan.uniform_steps}, sigma = {plan.sigma:.6g} "
              f"(Opacus, ε = {args.eps:g} at δ = {args.delta:g}); the filter at order {plan.order:g} keeps a point at "
              f"Γ for {plan.full_charge_steps} steps; caps {list(plan.caps)}, uniform's candidates "
              f"{list(plan.uniform_candidates)}", flush=True)
        for seed in range(args.seeds[workload.name]):
            every = [1] if seed < args.k1_seeds[workload.name] else []
            methods = [UNIFORM, *(filter_method(k) for k in [*every, args.filter_every])]
            for key, rows in run_seed(plan, seed, methods, data, args).items():
                found[key] += rows
    frames = {key: pd.DataFrame(rows) for key, rows in found.items()}
    for key in ("checkpoints", "runs", "classes", "prefix"):
        if len(frames[key]):
            fileio.write_csv(os.path.join(args.out, f"{key}.csv"), frames[key])
    text = tables.report(plans, frames, args)
    fileio.write_text(os.path.join(args.out, "summary.md"), text)
    print("\n" + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["mnist", "cifar10-cpu"],
                        choices=["mnist", "cifar10-cpu", "smoke"], help="default: both")
    parser.add_argument("--cifar-data", default=None, metavar="PATH",
                        help="CIFAR-10's JPEGs, PATH/train/<class>/*.jpg and PATH/test/<class>/*.jpg; without it "
                             "cifar10-cpu is skipped")
    parser.add_argument("--data-root", default="./data", help="where the ScatterNet features are cached (cache/)")
    parser.add_argument("--seeds", nargs="+", default=["3"], metavar="[WORKLOAD=]N",
                        help="seeds 0..N-1 of every method, for every workload or one (default 3)")
    parser.add_argument("--k1-seeds", nargs="+", default=None, metavar="[WORKLOAD=]N",
                        help="the every-step filter (K = 1) on the first N seeds only (default: every seed), e.g. "
                             "3 cifar10-cpu=1")
    parser.add_argument("--filter-every", type=int, default=10, help="K of the second filter variant (default 10)")
    parser.add_argument("--check-prefix", nargs="+", default=None, metavar="[WORKLOAD=]K,K|none",
                        help="the filter variants (K) whose independence of the cap is checked on seed 0, by training "
                             "them again to the second cap (default: both), e.g. 1,10 cifar10-cpu=10")
    parser.add_argument("--eps", type=float, default=8.0, help="ε of uniform DP-SGD and of every point's budget")
    parser.add_argument("--delta", type=float, default=1e-5, help="δ of both (default 1e-5)")
    parser.add_argument("--cap-factors", type=float, nargs="+", default=[1, 1.5, 2, 3],
                        help="the filtered run's candidate caps, as multiples of T_u (the largest is trained)")
    parser.add_argument("--uniform-factors", type=float, nargs="+", default=[0.5, 0.75, 1],
                        help="uniform DP-SGD's candidate checkpoints, as multiples of T_u (at most 1)")
    parser.add_argument("--mnist-holdout", type=int, default=1000, help="MNIST's held-out points (default 1000)")
    parser.add_argument("--cifar-holdout", type=int, default=5000, help="CIFAR-10's held-out points (default 5000)")
    parser.add_argument("--out", default="bench_filter", help="results folder (default ./bench_filter)")
    parser.add_argument("--work", default=None, help="run folders (default <out>/models)")
    args = parse_timed(parser, SMOKE_SIZES)
    if max(args.uniform_factors) != 1 or min(args.uniform_factors) <= 0:
        parser.error("--uniform-factors: each in (0, 1], 1 among them (uniform DP-SGD stops at T_u)")
    if 1 not in args.cap_factors or min(args.cap_factors) <= 0:
        parser.error("--cap-factors: each > 0, 1 among them (at T_u the filtered runs are compared with uniform "
                     "DP-SGD's)")
    if args.filter_every < 2:
        parser.error("--filter-every: K >= 2 (K = 1 is always measured beside it)")
    seed_tokens = args.seeds
    args.seeds = per_workload(parser, "--seeds", seed_tokens, args.workloads, count)
    args.k1_seeds = per_workload(parser, "--k1-seeds", args.k1_seeds or seed_tokens, args.workloads, count)
    args.check_prefix = per_workload(parser, "--check-prefix", args.check_prefix or [f"1,{args.filter_every}"],
                                     args.workloads, variants)
    distributed.make_deterministic(args.device)
    scratch = tempfile.TemporaryDirectory(prefix="bench_filter_") if args.smoke else None
    if scratch:
        args.out, args.data_root = scratch.name, os.path.join(scratch.name, "data")
    args.work = args.work or os.path.join(args.out, "models")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"{device_name(args.device)}, {args.clock} clock; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    started = time.time()
    try:
        benchmark(args)
    finally:
        if scratch:
            scratch.cleanup()
    print(f"\n{time.time() - started:.0f} s in all; load average after: {os.getloadavg()[0]:.2f}; results in "
          f"{'a temporary folder (removed: --smoke)' if scratch else args.out}")


if __name__ == "__main__":
    main()

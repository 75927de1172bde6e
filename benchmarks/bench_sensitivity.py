"""Benchmark of the sensitivity engine (not a test).

    python benchmarks/bench_sensitivity.py [--rounds 3] [--resnet-points 512] [--transformer-points 1024]
                                           [--reference-sets 5] [--threads 1] [--clock cpu] [--device cpu|cuda|auto]
                                           [--part 1|2]
    python benchmarks/bench_sensitivity.py --smoke   # seconds: synthetic data, one round, small Monte Carlo

1. Δ* of every training point at one checkpoint, for LeNet-5 on the embedded MNIST subset (8,000
   points), ResNet-20 (GroupNorm) on random CIFAR-10-shaped inputs and a two-layer Transformer encoder
   on random sequences of 64 tokens: samples/s of the engine's norms (gradients.per_sample_norms),
   side by side (interleaved rounds) with Opacus GradSampleModule's materialised per-sample gradients,
   torch.func (vmap of grad), Opacus's stock ghost clipping, and a plain non-private forward+backward
   (the Transformer: torch.func and the plain pass; Opacus's hooks have no rule for
   nn.MultiheadAttention).
2. The Rényi mean experiment with the paper's defaults (α = 8, 20 target batches × 100 sets
   of α batches, batches of 128) for 10 points, both directions: the engine's seconds (the checkpoint's
   Gram, perinstance/measure/gram.py, and GLA's statistic from it), and the reference (one forward/backward
   per batch) timed on a slice and extrapolated.

Timings do not depend on the weights, so the checkpoint is each model at its initialisation. Every
method runs on --device; on CUDA the clock is the wall clock read after torch.cuda.synchronize().
"""

import argparse
import dataclasses
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from torch.func import functional_call, grad, vmap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the reference is the tests' oracle

from _workloads import (  # noqa: E402
    device_name,
    parse_timed,
    same_round_ratios,
    timer,
    transformer_workload,
    workloads,
)
from reference import reference_batch_means, reference_renyi_statistics  # noqa: E402

from perinstance.measure import gradient_rows, poisson_batches  # noqa: E402
from perinstance.measure.gram import checkpoint_gram  # noqa: E402
from perinstance.measure.poisson_batches import Pool  # noqa: E402
from perinstance.persample import fallback_norms, gradients  # noqa: E402
from perinstance.train.clipping import Transform  # noqa: E402
from perinstance.train.sampling import RENYI_SET_KEY, RENYI_TARGET_KEY  # noqa: E402

TRANSFORM = Transform("flat", clip_norm=1.0)
CHUNK = gradient_rows.ROW_CHUNK
WARM_UP_POINTS = 8


@dataclasses.dataclass(frozen=True)
class RenyiSetting:
    """Sizes of the Rényi mean experiment: batches of `batch_size`, order `alpha`, `num_iters` target
    batches × `num_batches` sets of α batches, for `num_points` points."""

    batch_size: int
    alpha: int
    num_iters: int
    num_batches: int
    num_points: int


PAPER_SETTING = RenyiSetting(batch_size=128, alpha=8, num_iters=20, num_batches=100, num_points=10)
SMOKE_SETTING = RenyiSetting(batch_size=16, alpha=4, num_iters=2, num_batches=3, num_points=2)
SMOKE_RESNET_POINTS = 8
SMOKE_TRANSFORMER_POINTS = 32


# --- 1. Δ* of every point ---------------------------------------------------------------------

def engine_norms(model, x, y):
    gradient_rows.transformed_norms(model, x, y, TRANSFORM, x.device)


def opacus_materialised_norms(model, x, y):
    module = gradients.wrap_per_sample(model)
    model.train()
    for start in range(0, len(y), CHUNK):
        grad_samples, _, _ = gradients.per_sample_gradients(module, x[start:start + CHUNK], y[start:start + CHUNK])
        norms = gradients.grad_norms(grad_samples)
        TRANSFORM.weights(norms) * norms
    module.cleanup()


def opacus_ghost_norms(model, x, y):
    module = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum")
    model.train()
    for start in range(0, len(y), CHUNK):
        F.cross_entropy(module(x[start:start + CHUNK]), y[start:start + CHUNK], reduction="sum").backward()
        norms = module.get_norm_sample()
        TRANSFORM.weights(norms) * norms
        for param in model.parameters():
            param.grad = None
    module.cleanup()


def torch_func_norms(model, x, y):
    params = {name: param.detach() for name, param in model.named_parameters()}

    def loss(params, example, label):
        return F.cross_entropy(functional_call(model, params, (example[None],)), label[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    for start in range(0, len(y), CHUNK):
        with warnings.catch_warnings():  # CPU attention has no batching rule: torch.func loops over the examples
            warnings.filterwarnings("ignore", message=fallback_norms.NO_BATCHING_RULE)
            grads = per_sample(params, x[start:start + CHUNK], y[start:start + CHUNK])
        norms = sum(part.reshape(len(part), -1).pow(2).sum(dim=1) for part in grads.values()).sqrt()
        TRANSFORM.weights(norms) * norms


def engine_without_norms(model, x, y):
    """The engine's passes with no per-layer norm: the forward and the engine's own backward (to the layer
    outputs and GroupNorm's parameter rows), its norms left untaken; a floor under the engine's time (its norms
    pass replaces the weight gradients of a plain backward)."""
    for _, inputs, labels in gradient_rows.example_chunks(x, y, x.device, gradients.examples_per_pass(model, x, x.device)):
        gradients._forward(model, inputs, labels).layer_norms()


def plain_forward_backward(model, x, y):
    for start in range(0, len(y), CHUNK):
        F.cross_entropy(model(x[start:start + CHUNK]), y[start:start + CHUNK]).backward()
        model.zero_grad(set_to_none=True)


NORM_METHODS = {
    "engine (per_sample_norms)": engine_norms,
    "Opacus GradSampleModule (materialised)": opacus_materialised_norms,
    "torch.func vmap(grad)": torch_func_norms,
    "Opacus ghost clipping (stock)": opacus_ghost_norms,
    "engine without the norms (its floor)": engine_without_norms,
    "plain forward+backward (non-private)": plain_forward_backward,
}
# The issues' targets (27, 39): the engine's throughput over each method's, per model.
NORM_TARGETS = {"resnet20": {"torch.func vmap(grad)": 1.2, "plain forward+backward (non-private)": 0.7},
                "lenet5": {"plain forward+backward (non-private)": 0.9},
                "transformer": {"plain forward+backward (non-private)": 0.7}}
# The methods that can take each model (Opacus's hooks have no rule for nn.MultiheadAttention).
TRANSFORMER_METHODS = ("engine (per_sample_norms)", "torch.func vmap(grad)", "engine without the norms (its floor)",
                       "plain forward+backward (non-private)")


def bench_norms(workload, rounds, clock, device):
    x, y = workload.dataset.train_x.to(device), workload.dataset.train_y.to(device)
    methods = {name: method for name, method in NORM_METHODS.items()
               if workload.model_name != "transformer" or name in TRANSFORMER_METHODS}
    # Each method once on a few points, untimed: a first call pays for loading kernels (on a GPU, the CUDA
    # context and the kernels' first launch: the first method timed in a cold process ran 100× slower).
    for method in methods.values():
        method(workload.model(device=device), x[:WARM_UP_POINTS], y[:WARM_UP_POINTS])
    rates = {name: [] for name in methods}
    for _ in range(rounds):
        for name, method in methods.items():
            model = workload.model(device=device)
            started = clock()
            method(model, x, y)
            rates[name].append(len(y) / (clock() - started))
    engine = rates["engine (per_sample_norms)"]
    model = workload.model(device=device)
    forms = gradients.norm_forms(model, x[:1])
    print(f"\n1. Δ* of all {workload.label}, {gradient_rows.parameter_count(model)} parameters, engine chunks of "
          f"{gradients.examples_per_pass(model, x, device)}, others {CHUNK}, {rounds} interleaved rounds on {device} "
          f"({clock.__name__}). "
          "Best round (least disturbed by other processes), and the ratios of the same round:")
    print("   layer forms of the engine: " + ", ".join(f"{form} {list(forms.values()).count(form)}"
                                                     for form in sorted(set(forms.values()))))
    targets = NORM_TARGETS.get(workload.model_name, {})
    for name, rate in rates.items():
        best_ratio = max(engine) / max(rate)
        target = f"   target ≥ {targets[name]}×: {'met' if best_ratio >= targets[name] else 'NOT met'}" \
            if name in targets else ""
        spread = "" if rate is engine else f" ({same_round_ratios(engine, rate)})"
        print(f"   {name:42s} {max(rate):8.0f} samples/s   engine is {best_ratio:5.2f}× this{spread}{target}")


# --- 2. the Rényi mean experiment --------------------------------------------------------------

def time_reference(model, dataset, pool, point, reference_sets, alpha, device):
    """Seconds of the reference for one target batch and for one set of α batches (the fastest of
    `reference_sets` timings: the least disturbed by other processes), and its S values."""
    x, y = dataset.train_x, dataset.train_y
    target = np.flatnonzero(pool.draw(1, RENYI_TARGET_KEY, 0)[0])
    target = target[target != point]
    clock = timer("wall", device)
    target_seconds, set_seconds, values = [], [], []
    for key in range(reference_sets):
        started = clock()
        reference_batch_means(model, x, y, TRANSFORM, [target], device)
        target_seconds.append(clock() - started)
        batches = [np.flatnonzero(mask) for mask in pool.draw(alpha, RENYI_SET_KEY, 0, key)]
        started = clock()
        values.append(reference_renyi_statistics(model, x, y, TRANSFORM, target, [batches], device)[0])
        set_seconds.append(clock() - started - target_seconds[-1])
    return min(target_seconds), min(set_seconds), np.asarray(values)


def bench_renyi(workload, reference_sets, setting, device):
    dataset = workload.dataset
    x, y = dataset.train_x, dataset.train_y
    size = len(y)
    alpha, num_iters, num_batches = setting.alpha, setting.num_iters, setting.num_batches
    num_points = setting.num_points
    points = np.sort(np.random.default_rng(0).choice(size, num_points, replace=False))
    pool = Pool(seed=0, step=0, universe=size, sample_rate=setting.batch_size / size, train_columns=np.arange(size))
    model = workload.model(device=device)
    clock = timer("wall", device)

    # The reference is timed before and after the engine; the fastest timing counts, which keeps
    # the extrapolated reference (and the speed-up) on the low side.
    before = time_reference(model, dataset, pool, points[0], reference_sets, alpha, device)
    started = clock()
    workload = poisson_batches.renyi_workload(num_points, pool, alpha, num_iters, num_batches)
    gram, point_gradients = checkpoint_gram(model, x, y, x[points], y[points], points, TRANSFORM, workload, device)
    gradient_seconds = clock() - started
    gram_columns = gram.row_width or None
    engine = poisson_batches.renyi_statistics(gram, point_gradients, points, pool, alpha, num_iters, num_batches)
    engine_seconds = clock() - started
    del gram, point_gradients
    after = time_reference(model, dataset, pool, points[0], reference_sets, alpha, device)
    target_seconds, set_seconds = min(before[0], after[0]), min(before[1], after[1])
    per_direction = num_iters * (target_seconds + num_batches * set_seconds)
    reference_seconds = num_points * len(poisson_batches.DIRECTIONS) * per_direction
    difference = np.max(np.abs(engine["remove"][0, 0, :reference_sets] - before[2]) / np.abs(before[2]))

    sets = num_iters * num_batches
    print(f"\n2. Rényi mean experiment: α = {alpha}, {num_iters} target batches × {num_batches} sets, batches of "
          f"{setting.batch_size} (q = {setting.batch_size}/{size}), {num_points} points, both directions:")
    kept = "no layer" if gram_columns is None else f"{gram_columns} columns"
    print(f"   engine: {engine_seconds:.1f} s ({gradient_seconds:.1f} s for the checkpoint's Gram of all {size} points: "
          f"the engine's pass and its products, {kept} kept as rows; {engine_seconds - gradient_seconds:.1f} s for "
          f"{sets * alpha + num_iters} batch sums over it and the quadratic forms)")
    print(f"   reference, fastest of {2 * reference_sets} timings for one point: {target_seconds:.2f} s per target "
          f"batch, {set_seconds:.2f} s per set of {alpha} batches")
    print(f"   reference extrapolated: {num_points} points × 2 directions × {num_iters} × ({target_seconds:.2f} + "
          f"{num_batches} × {set_seconds:.2f}) s = {reference_seconds:.0f} s ({reference_seconds / 3600:.1f} h), "
          f"i.e. {per_direction / 60:.1f} min per point and direction")
    print(f"   speed-up: {reference_seconds / engine_seconds:.3g}×   (engine vs reference on the timed sets: "
          f"max relative difference {difference:.1e})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resnet-points", type=int, default=512)
    parser.add_argument("--transformer-points", type=int, default=1024)
    parser.add_argument("--reference-sets", type=int, default=5)
    parser.add_argument("--part", type=int, choices=(1, 2), help="only part 1 (Δ*) or part 2 (the Rényi mean "
                                                                   "experiment); both by default")
    args = parse_timed(parser, {"rounds": 1, "reference_sets": 1, "resnet_points": SMOKE_RESNET_POINTS, "threads": 1,
                                "transformer_points": SMOKE_TRANSFORMER_POINTS})
    lenet, resnet = workloads(args.smoke, args.resnet_points)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, {device_name(args.device)}, "
          f"load average before: {os.getloadavg()[0]:.2f}")
    clock = timer(args.clock, args.device)
    if args.part != 2:
        bench_norms(lenet, args.rounds, clock, args.device)
        bench_norms(resnet, args.rounds, clock, args.device)
        bench_norms(transformer_workload(args.smoke, args.transformer_points), args.rounds, clock, args.device)
    if args.part != 1:
        bench_renyi(lenet, args.reference_sets, SMOKE_SETTING if args.smoke else PAPER_SETTING, args.device)
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (other processes on the machine slow every method alike)")


if __name__ == "__main__":
    main()

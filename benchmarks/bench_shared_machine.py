"""Speed on a shared machine: training and Δ* measurement with the CPU idle and with one core kept busy
by another process, under libgomp's default wait policy, under this suite's setting
(perinstance/openmp_settings.py) and with one thread, side by side in one run.

Each setting runs in its own process, because libgomp reads its variables once when torch is imported.
The busy core is a child process that spins for the duration of a run.

    python benchmarks/bench_shared_machine.py [--steps 16] [--batch-size 256] [--points 1024] [--repeats 2]
    python benchmarks/bench_shared_machine.py --smoke    # seconds: synthetic data, a few small steps
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _workloads import workloads  # noqa: E402

from perinstance import openmp_settings  # noqa: E402
from perinstance.cli import options  # noqa: E402
from perinstance.measure import gradient_rows  # noqa: E402
from perinstance.train import run_plan, training  # noqa: E402
from perinstance.train.clipping import Transform  # noqa: E402

SMOKE_SIZES = {"steps": 2, "batch_size": 32, "points": 64, "repeats": 1}
# The settings compared: what each adds to the environment, the variables it removes first.
SETTINGS = {
    "libgomp default": {},
    "this suite (" + ", ".join(f"{k}={v}" for k, v in openmp_settings.SHARED_MACHINE_SETTINGS.items()) + ")":
        openmp_settings.SHARED_MACHINE_SETTINGS,
    "one thread (OMP_NUM_THREADS=1)": {"OMP_NUM_THREADS": "1"},
}
CONTROLLED = (*openmp_settings.WAIT_VARIABLES, "OMP_NUM_THREADS")
SPIN = "while True: pass"


def time_work(smoke, steps, batch_size, points):
    """Training steps/s and Δ* norms points/s of LeNet-5 in this process (after one warm-up of each)."""
    workload = workloads(smoke, resnet_points=1)[0]
    args = run_plan.resolve_training_args(options.parse_training_flags([
        "--model", workload.model_name, "--sigma", "1", "--cn", "1", "--batch-size", str(batch_size),
        "--lr", "0.5", "--models-dir", "/tmp/bench"]))
    trainer = training.Trainer(run_plan.plan_run(args, workload.dataset), workload.dataset)
    trainer.step(1)
    started = time.perf_counter()
    for step in range(2, steps + 2):
        trainer.step(step)
    steps_per_second = steps / (time.perf_counter() - started)
    x, y = workload.dataset.train_x[:points], workload.dataset.train_y[:points]
    model, transform = workload.model(), Transform("flat", clip_norm=1.0)
    gradient_rows.transformed_norms(model, x, y, transform)
    started = time.perf_counter()
    gradient_rows.transformed_norms(model, x, y, transform)
    return {"training": steps_per_second, "measurement": points / (time.perf_counter() - started),
            "threads": torch.get_num_threads()}


def run_setting(added, busy, args):
    """One worker process under `added` (the controlled variables removed first), one core busy or not."""
    environ = {name: value for name, value in os.environ.items() if name not in CONTROLLED}
    environ.update(added)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
                   "--batch-size", str(args.batch_size), "--points", str(args.points)]
        output = subprocess.run(command + (["--smoke"] if args.smoke else []), env=environ, check=True,
                                capture_output=True, text=True).stdout
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return json.loads(output.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16, help="timed training steps (LeNet-5, MNIST subset)")
    parser.add_argument("--batch-size", type=int, default=256, help="expected batch size of training")
    parser.add_argument("--points", type=int, default=1024, help="points whose Δ* norms are timed")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds; the median is printed")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on synthetic data (seconds)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        for name, value in SMOKE_SIZES.items():
            setattr(args, name, value)
    if args.worker:
        print(json.dumps(time_work(args.smoke, args.steps, args.batch_size, args.points)))
        return
    cases = [(name, busy) for busy in (False, True) for name in SETTINGS]
    rates = {case: [] for case in cases}
    for _ in range(args.repeats):
        for name, busy in cases:
            rates[name, busy].append(run_setting(SETTINGS[name], busy, args))
    medians = {case: {kind: statistics.median(run[kind] for run in runs_) for kind in ("training", "measurement")}
               for case, runs_ in rates.items()}
    print(f"LeNet-5, {os.cpu_count()} cores; training: {args.steps} steps at B = {args.batch_size} (steps/s); "
          f"Δ* norms of {args.points} points (points/s); median of {args.repeats} round(s)")
    print(f"{'setting':<42} {'kind':<12} {'idle':>9} {'1 busy':>9} {'busy/idle':>10}")
    for name in SETTINGS:
        for kind in ("training", "measurement"):
            idle, busy = medians[name, False][kind], medians[name, True][kind]
            print(f"{name:<42} {kind:<12} {idle:>9.2f} {busy:>9.2f} {busy / idle:>9.2f}×")
    default, suite, single = SETTINGS
    for kind in ("training", "measurement"):
        print(f"{kind}: this suite vs libgomp default, idle {medians[suite, False][kind] / medians[default, False][kind]:.2f}×,"
              f" one core busy {medians[suite, True][kind] / medians[default, True][kind]:.2f}×; this suite busy vs one "
              f"thread busy {medians[suite, True][kind] / medians[single, True][kind]:.2f}×")


if __name__ == "__main__":
    main()

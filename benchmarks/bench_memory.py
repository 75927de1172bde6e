"""Peak resident memory of the heavy steps of `python reproduce.py`, at the quick preset's sizes (not a test).

    python benchmarks/bench_memory.py           # embedded MNIST (8,000 points), LeNet-5: minutes
    python benchmarks/bench_memory.py --smoke   # seconds: the synthetic dataset and an MLP (CI)

Each step is the command reproduce.py runs, in a process of its own in a temporary folder; its peak
is that process's peak resident set size as the kernel counts it (ru_maxrss of os.wait4). One
short run is trained (the steps' memory does not grow with the epochs) and measured as the quick
preset measures its runs: the mean rule's dataset statistics of every point (what holds the
per-sample gradients of the whole training set), Δ_B draws of 100 points, Δ* of every point, and
the audit of both rules (300,000 simulated steps per law).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_BYTES = 2 * 10**9  # issue 10: the quick preset under 2 GB resident
RUN_NAME = "bench-memory"

# The quick preset's sizes (perinstance/experiments/config.py: PRESETS["quick"]), and the tiny preset's for --smoke.
FULL = {"training": ["--dataset", "mnist-embedded", "--model", "lenet5", "--batch-size", "256", "--lr", "2.0",
                     "--epochs", "0.1", "--track-points", "random:200"],
        "mean_points": "random:100", "num_batches": "1024", "audit_points": 50, "audit_trials": "300000"}
SMOKE = {"training": ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5",
                      "--epochs", "0.25", "--track-points", "random:64"],
         "mean_points": "random:4", "num_batches": "64", "audit_points": 6, "audit_trials": "5000"}


def steps(sizes):
    """(name, script, arguments) of each measured step, in reproduce.py's order."""
    measure = ["--run", RUN_NAME, "--no-train", "--stage", "final"]
    audit = ["--run", RUN_NAME, "--trials", sizes["audit_trials"], "--out", "audit.csv", "--figure", "audit.png"]
    return [
        ("training", "train_dpsgd.py", [*sizes["training"], "--sigma", "1.0", "--save-name", RUN_NAME]),
        ("mean rule: statistics of every point", "compute_sensitivity.py",
         [*measure, "--reduction", "mean", "--points", "all", "--num-batches", "0", "--res-name", "stats"]),
        (f"mean rule: Δ_B of {sizes['mean_points']} points", "compute_sensitivity.py",
         [*measure, "--reduction", "mean", "--points", sizes["mean_points"], "--num-batches", sizes["num_batches"],
          "--res-name", "samples"]),
        ("sum rule: Δ* of every point", "compute_sensitivity.py",
         [*measure, "--reduction", "sum", "--points", "all", "--res-name", "norms"]),
        ("audit, sum rule", "audit.py", [*audit, "--rule", "sum", "--spread", str(sizes["audit_points"])]),
        ("audit, mean rule", "audit.py", [*audit, "--rule", "mean", "--spread", str(sizes["audit_points"] // 2)]),
    ]


def peak_of(script, arguments, folder):
    """(peak RSS in bytes, seconds) of `python script arguments` run in `folder`; exits on failure."""
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen([sys.executable, os.path.join(ROOT, script), *arguments], cwd=folder,
                                   stdout=subprocess.DEVNULL, stderr=errors)
        # wait4 reaps the process itself and gives its own resource usage, not all children's.
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            errors.seek(0)
            sys.exit(f"{script} {' '.join(arguments)} failed:\n{errors.read()[-3000:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="seconds: synthetic data, tiny sizes")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    print(f"load average before: {os.getloadavg()[0]:.2f}; goal: every step under {GOAL_BYTES / 1e9:g} GB")
    peaks = []
    with tempfile.TemporaryDirectory() as folder:
        # --smoke: one process per kind of step (each start-up costs seconds).
        for name, script, arguments in steps(sizes)[::2] if args.smoke else steps(sizes):
            peak, seconds = peak_of(script, arguments, folder)
            peaks.append(peak)
            print(f"{name:<40} peak RSS {peak / 1e6:7,.0f} MB = {peak / GOAL_BYTES:.2f}× the goal  ({seconds:.0f} s)",
                  flush=True)
    verdict = "met" if max(peaks) < GOAL_BYTES else "NOT met"
    print(f"largest peak {max(peaks) / 1e6:,.0f} MB = {max(peaks) / GOAL_BYTES:.2f}× the goal: {verdict}"
          + (" (smoke sizes)" if args.smoke else ""))


if __name__ == "__main__":
    main()

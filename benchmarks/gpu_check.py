"""The prepared device check (issue 40): the GPU benchmarks and the cifar10 preset at a smaller stated size in one
run of at most --budget seconds (default 480), every number printed at once with the card, torch version and date,
and the full preset's time extrapolated from its own timing table (docs/paper-scale-gpu.md).

    bash benchmarks/gpu_check.sh PATH/TO/cifar10-jpg.tar.gz                    # on a lent GPU; outputs under $OUT
    python benchmarks/gpu_check.py --device cuda --data PATH [--budget 480] [--out DIR]
    python benchmarks/gpu_check.py --smoke    # CPU: the same driver on a generated image folder, tiny sizes (CI)

PATH is the CIFAR-10 JPEGs as a .tar.gz or a folder, train/<class>/*.jpg and test/<class>/*.jpg (the machine may
have no internet: nothing is downloaded). Parts, in order, each a subprocess with its share of the budget (a part
cut short keeps what it printed, and the preset's finished steps keep their times):

0. the Gram route's CUDA test (tests/test_gram.py -k cuda: its values on the GPU equal the CPU's);
1. bench_paper_scale.py: the preset's fixed-checkpoint design at its full size at one checkpoint (N = 50,000,
   1,000 points × 4 rates × 10,000 draws);
2. reproduce.py --preset cifar10 at a reduced size (REDUCED: 1 epoch instead of 40, 100 points × 1,000 draws
   instead of 1,000 × 10,000), its timing table extrapolated to the preset, each step by its stated factor;
3. bench_training.py, 4. bench_sensitivity.py, 5. bench_mean_rule.py with --device, at the README's GPU sizes.

Outputs (under --out, default $OUT, else a new folder in the system's temporary directory): one log per part,
the preset's report.md, summary.md (everything printed) and summary.json; the extracted images and the preset's
runs and result files stay in a working folder outside it (--work, default a new temporary folder). --smoke (CPU,
CI): part 1 at its own smoke size, a generated archive extracted as --data would be, the preset's command built
and its fields checked but not run (the extrapolation runs on canned timing lines); parts 0, 3, 4 and 5 are left
out (the speed benchmarks' own --smoke runs are tests of their own).
"""

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _workloads import device_name  # noqa: E402

from perinstance.experiments.config import PRESETS, apply_overrides, check_config  # noqa: E402
from perinstance.train.run_plan import checkpoint_schedule  # noqa: E402

PRESET = PRESETS["cifar10"]
TRAIN_SIZE = 50_000
# The preset's reduced size for part 2: what the timing table is measured at.
REDUCED = {"epochs": 1.0, "mean_points": "random:100", "num_batches": 1000}
# Seconds of the budget each part may take at most, in order.
SHARES = {"cuda_tests": 30, "paper_scale": 150, "preset": 140, "training": 55, "sensitivity": 65, "mean_rule": 40}
# --smoke: a generated .tar.gz of a few small JPEGs (extracted as --data would be), and the reduced preset's
# timing table replaced by these lines, one per kind of step, to exercise the extrapolation.
SMOKE_CLASSES, SMOKE_IMAGES, SMOKE_SIDE = 2, 3, 8
SMOKE_TIMINGS = """[train_dpsgd.py save-name=cifar10-x-sum: 20.0s wall, 19.0s CPU, peak resident memory so far 3.10 GB]
[compute_sensitivity.py save-name=cifar10-x-sum res-name=s reduction=sum points=all stage=all: 6.0s wall, 5.0s CPU, \
peak resident memory so far 3.20 GB]
[measurement.measure_at_rates, step 98, q = 0.008, 0.032, 0.128, 0.5: 40.0s wall, 30.0s CPU, peak resident memory \
so far 9.00 GB]
[renyi_per_instance_mean.py res-name=cifar10-x-mean-fixed-step98-bs400: 1.0s wall, 1.0s CPU, peak resident memory \
so far 9.00 GB]
[audit.py run=cifar10-x-sum rule=sum: 9.0s wall, 8.0s CPU, peak resident memory so far 9.00 GB]""".replace("\\\n", "")
TIMING = re.compile(r"^\[(.+): ([\d.]+)s wall, ([\d.]+)s CPU, peak resident memory so far ([\d.]+) GB\]$")


@dataclasses.dataclass
class Part:
    name: str
    argv: list
    cwd: str
    seconds: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    stdout: str = ""

    @property
    def state(self) -> str:
        return "cut short by its time share" if self.timed_out else f"exit {self.returncode}"


def run_part(part: Part, timeout: float, out: str) -> Part:
    """Run one part in a subprocess within `timeout` seconds; its output goes to out/<name>.log."""
    started = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, *part.argv], cwd=part.cwd, capture_output=True, text=True,
                                timeout=max(1.0, timeout))
        part.returncode, part.stdout, stderr = result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as expired:
        part.timed_out = True
        part.stdout = _text(expired.stdout)
        stderr = _text(expired.stderr)
    part.seconds = time.perf_counter() - started
    with open(os.path.join(out, f"{part.name}.log"), "w", encoding="utf-8") as handle:
        handle.write(f"$ {' '.join(part.argv)}\n{part.stdout}\n--- stderr ---\n{stderr}")
    return part


def _text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def image_folder(data: str, work: str) -> str:
    """The image folder from --data: a folder as it is, a .tar.gz extracted under `work`."""
    if os.path.isdir(data):
        folder = data
    else:
        folder = os.path.join(work, "cifar10-images")
        with tarfile.open(data) as archive:
            archive.extractall(folder, filter="data")
    if not all(os.path.isdir(os.path.join(folder, split)) for split in ("train", "test")):
        raise SystemExit(f"gpu_check.py: --data: {data} has no train/ and test/ folders of class folders")
    return folder


def write_smoke_archive(root: str) -> str:
    """A .tar.gz of train/<class>/*.jpg and test/<class>/*.jpg: small colour images, as the CIFAR-10 archive is."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = os.path.join(root, "images")
    for split in ("train", "test"):
        for label in range(SMOKE_CLASSES):
            folder = os.path.join(images, split, f"class{label}")
            os.makedirs(folder)
            for index in range(SMOKE_IMAGES):
                pixels = rng.integers(0, 256, (SMOKE_SIDE, SMOKE_SIDE, 3), dtype=np.uint8)
                Image.fromarray(pixels, "RGB").save(os.path.join(folder, f"{index}.jpg"))
    archive = os.path.join(root, "images.tar.gz")
    with tarfile.open(archive, "w:gz") as handle:
        for split in ("train", "test"):
            handle.add(os.path.join(images, split), arcname=split)
    return archive


def reduced_preset_flags() -> list[str]:
    """The --set flags of the reduced preset, checked as reproduce.py checks them (a bad field fails here, before
    any device time is spent)."""
    flags = [f"{name}={value}" for name, value in REDUCED.items()]
    check_config(apply_overrides(PRESET, flags))
    return [item for flag in flags for item in ("--set", flag)]


# --- the extrapolation of the preset's timing table ----------------------------------------------------------

def checkpoints(epochs: float, train_size: int) -> int:
    """Checkpoints the preset's main run saves in `epochs` epochs."""
    total = max(1, round(epochs * train_size / PRESET.batch_size))
    return len(checkpoint_schedule(PRESET.save_freq, PRESET.save_steps or None, total))


def step_factor(step: str, sets: dict, draw_base: float | None) -> tuple[float, str]:
    """How a step of the reduced preset's timing table grows to the full preset: (factor, why). draw_base: the
    seconds of one Gram build at the preset's N (part 1), which a measurement of Δ_B draws pays whatever its
    points and draws; the rest of such a step grows with points × draws."""
    epochs = PRESET.epochs / sets["epochs"]
    points = int(PRESET.mean_points.split(":")[1]) / int(str(sets["mean_points"]).split(":")[1])
    draws = points * PRESET.num_batches / sets["num_batches"]
    if step.startswith("train_dpsgd.py"):
        if "-gap" in step:
            return 1.0, "gap runs keep their own epochs"
        return epochs, f"steps: {PRESET.epochs:g}/{sets['epochs']:g} epochs"
    if step.startswith("compute_sensitivity.py") and "reduction=sum" in step and "stage=all" in step:
        full, reduced = checkpoints(PRESET.epochs, TRAIN_SIZE), checkpoints(sets["epochs"], TRAIN_SIZE)
        return full / reduced, f"checkpoints: {full}/{reduced}"
    if "num-batches=0" in step or "reduction=sum" in step:
        return 1.0, "the mean-rule runs' checkpoints and points do not change"
    if step.startswith(("compute_sensitivity.py", "measurement.measure_at_rates")):
        return draws, (f"Δ_B draws: points × draws {draws:g}, the Gram build ({draw_base:.0f} s) once"
                       if draw_base is not None else f"Δ_B draws: points × draws {draws:g} (an upper estimate: "
                       "no Gram build measured)")
    if step.startswith(("renyi_per_instance_mean.py", "composition.mean_rule_repeated")) and (
            "-samples" in step or "-fixed-" in step):
        return draws, f"rows read: points × draws {draws:g}"
    if step.startswith(("renyi_per_instance_sum_compo.py", "eps_delta.py", "renyi_per_instance_sum.py",
                        "composition.")) and "-mean-" not in step:
        full, reduced = checkpoints(PRESET.epochs, TRAIN_SIZE), checkpoints(sets["epochs"], TRAIN_SIZE)
        return full / reduced, f"checkpoints: {full}/{reduced}"
    return 1.0, "assumed not to grow"


def extrapolate(timings: list[tuple[str, float]], sets: dict, draw_base: float | None,
                checkpoint: float | None = None) -> tuple[list, float]:
    """Each (step, seconds) of the reduced preset with its factor and the seconds it is expected to take at the
    preset's size. A draws step: draw_base + (seconds − draw_base)·factor (the build is paid once, as measured
    at the preset's N in part 1), never below its own seconds; a checkpoint of the fixed-checkpoint design:
    `checkpoint`, part 1's measurement of it at the preset's size, where there is one."""
    rows, total = [], 0.0
    for step, seconds in timings:
        factor, why = step_factor(step, sets, draw_base)
        if step.startswith("measurement.measure_at_rates") and checkpoint is not None:
            factor, why, expected = checkpoint / seconds, "measured at the preset's size in part 1", checkpoint
        elif why.startswith("Δ_B draws") and draw_base is not None:
            expected = max(seconds, draw_base + max(0.0, seconds - draw_base) * factor)
        else:
            expected = seconds * factor
        rows.append((step, seconds, factor, why, expected))
        total += expected
    return rows, total


def gram_build_seconds(stdout: str) -> float | None:
    """The Gram build at the preset's N from bench_paper_scale.py's lines: its passes and its products."""
    parts = re.findall(r"^\[the (?:engine's passes|Gram's products)[^\]]*: ([\d.]+) s\]$", stdout, re.MULTILINE)
    return sum(map(float, parts)) if len(parts) == 2 else None


def checkpoint_seconds(stdout: str) -> float | None:
    """bench_paper_scale.py's whole checkpoint of the fixed-checkpoint design, when run at the preset's sizes."""
    found = re.search(r"^\| \*\*one checkpoint\*\* \| \*\*([\d.]+)\*\* \| \| $", stdout, re.MULTILINE)
    return float(found.group(1)) if found else None


# --- the run -----------------------------------------------------------------------------------------------

def header(device: str) -> list[str]:
    cuda = f", CUDA {torch.version.cuda}" if torch.device(device).type == "cuda" else ""
    return [f"device check: {device_name(device)}, torch {torch.__version__}{cuda}, {os.cpu_count()} CPU cores, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load average "
            f"{os.getloadavg()[0]:.2f}"]


def parts_to_run(args, folder: str, out: str, work: str) -> list[Part]:
    """The parts, in order. --smoke: only bench_paper_scale.py, at its own smoke size (the preset's command is
    built and its fields checked; the speed benchmarks' own --smoke runs are tests of their own)."""
    bench = os.path.join(ROOT, "benchmarks")
    preset_dir = os.path.join(work, "preset")
    reproduce = [os.path.join(ROOT, "reproduce.py"), "--preset", "cifar10", "--dataset", f"imagefolder:{folder}",
                 "--device", args.device, "--out-dir", os.path.join(preset_dir, "figures"), *reduced_preset_flags()]
    speed = ["--device", args.device]
    parts = [
        Part("cuda_tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "test_gram.py"),
                            "-k", "cuda"], out),
        Part("paper_scale", [os.path.join(bench, "bench_paper_scale.py"), "--device", args.device,
                             *(["--smoke"] if args.smoke else [])], out),
        Part("preset", reproduce, preset_dir),
        Part("training", [os.path.join(bench, "bench_training.py"), *speed, "--steps", "40", "--batch-size", "1024",
                          "--resnet-steps", "10", "--resnet-batch-size", "512", "--repeats", "3"], out),
        Part("sensitivity", [os.path.join(bench, "bench_sensitivity.py"), *speed, "--rounds", "3", "--resnet-points",
                             "4096", "--reference-sets", "5"], out),
        Part("mean_rule", [os.path.join(bench, "bench_mean_rule.py"), *speed], out),
    ]
    return [part for part in parts if not args.smoke or part.name == "paper_scale"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--data", help="the CIFAR-10 JPEGs: a .tar.gz or a folder with train/ and test/")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for every part together")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default $OUT, else a new "
                                                                        "temporary folder)")
    parser.add_argument("--work", help="working folder for the images and the preset's runs (default: a new "
                                       "temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, a generated image folder (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.device = "cpu"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: {args.device} requested but no CUDA device is available (allowed: cpu)")
    if not args.smoke and not args.data:
        parser.error("--data: the CIFAR-10 JPEGs are needed (a .tar.gz or a folder with train/ and test/)")
    scratch = tempfile.TemporaryDirectory(prefix="gpu_check-") if args.smoke and not args.out else None
    out = args.out or (scratch.name if scratch else tempfile.mkdtemp(prefix="gpu_check-"))
    os.makedirs(out, exist_ok=True)
    deadline = time.perf_counter() + args.budget  # the extraction of the images counts
    work = args.work or (out if scratch else tempfile.mkdtemp(prefix="gpu_check-work-"))
    lines = header(args.device)
    print(lines[0], flush=True)
    folder = image_folder(write_smoke_archive(work) if args.smoke else args.data, work)
    os.makedirs(os.path.join(work, "preset"), exist_ok=True)

    done = []
    for part in parts_to_run(args, folder, out, work):
        left = deadline - time.perf_counter()
        if left < 5:
            print(f"{part.name}: not run, the budget is spent", flush=True)
            continue
        share = left if args.smoke else SHARES[part.name] * args.budget / sum(SHARES.values())
        run_part(part, min(share, left), out)
        print(f"{part.name}: {part.seconds:.0f} s, {part.state}", flush=True)
        done.append(part)

    lines += [f"\n## {part.name}: {part.seconds:.0f} s, {part.state}\n$ {' '.join(part.argv)}\n" + part.stdout.strip()
              for part in done]
    lines += extrapolation_lines(done, SMOKE_TIMINGS if args.smoke else None)
    report = os.path.join(work, "preset", "figures", "report.md")
    if os.path.exists(report):
        shutil.copy(report, os.path.join(out, "preset_report.md"))
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as handle:
        handle.write(text)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump({"header": lines[0], "parts": [dataclasses.asdict(part) for part in done]}, handle, indent=1)
    print(f"gpu_check.py: {len(done)} parts in {sum(part.seconds for part in done):.0f} s; outputs in "
          + (f"{out} (removed: a smoke run without --out)" if scratch else f"{out}; working folder {work}"))
    if scratch:
        scratch.cleanup()


def extrapolation_lines(done: list[Part], smoke_timings: str | None = None) -> list[str]:
    """The reduced preset's timing table (steps finished, also when cut short), each step's factor to the full
    preset, and the total. smoke_timings: timing lines to use instead of a preset run's (--smoke)."""
    by_name = {part.name: part for part in done}
    preset = by_name.get("preset")
    if preset is None and smoke_timings is None:
        return ["\n## the cifar10 preset: not run"]
    printed = smoke_timings if smoke_timings is not None else preset.stdout
    timings = [(match.group(1), float(match.group(2))) for match in map(TIMING.match, printed.splitlines()) if match]
    scale = by_name["paper_scale"].stdout if "paper_scale" in by_name and smoke_timings is None else ""
    rows, total = extrapolate(timings, REDUCED, gram_build_seconds(scale), checkpoint_seconds(scale))
    measured = sum(seconds for _, seconds, _, _, _ in rows)
    source = "SMOKE: canned timing lines, not a run" if smoke_timings is not None else "measured"
    lines = [f"\n## the cifar10 preset: {source} at {REDUCED}, extrapolated to the preset (epochs {PRESET.epochs:g}, "
             f"{PRESET.mean_points} points × {PRESET.num_batches} draws), step by step",
             "", "| step | seconds, measured | × factor (why) | seconds, extrapolated |", "| --- | ---: | --- | ---: |"]
    lines += [f"| {step} | {seconds:.1f} | {factor:.4g} ({why}) | {expected:.0f} |"
              for step, seconds, factor, why, expected in rows]
    cut = (" (cut short: the steps after the last one above are missing from both totals)"
           if preset is not None and preset.timed_out else "")
    lines += [f"| **timed steps** | **{measured:.0f}** | | **{total:.0f}** ({total / 60:.1f} min){cut} |"]
    return lines


if __name__ == "__main__":
    main()

"""Every benchmark's --smoke mode (tiny sizes, synthetic data, seconds) runs its code paths side by
side to the end and prints its ratios, so that no benchmark rots unseen between full runs."""

import math
import os
import re

import pytest
import torch
from conftest import ROOT, run_script

# Every script in benchmarks/ (helpers start with "_"), so a new benchmark is covered when added.
BENCHMARKS = sorted(name for name in os.listdir(os.path.join(ROOT, "benchmarks"))
                    if name.endswith(".py") and not name.startswith("_"))
# The benchmarks that time their methods on --device.
DEVICE_BENCHMARKS = ["bench_mean_rule.py", "bench_paper_scale.py", "bench_sensitivity.py", "bench_training.py"]
# A ratio as the benchmarks print it: a number followed by × or x, e.g. "1.48×", "speed-up 285x".
RATIO = re.compile(r"(\d+(?:\.\d+)?|nan|inf)\s?[×x](?!\w)")


def test_every_benchmark_is_found():
    expected = {"bench_accounting.py", "bench_pld.py", "bench_sensitivity.py", "bench_shared_machine.py", "bench_training.py",
                "bench_tracking.py", "compare_clipping.py", "bench_mean_rule.py", "bench_paper_scale.py",
                "gpu_check.py", "bench_filter.py"}
    assert expected <= set(BENCHMARKS)


@pytest.mark.parametrize("script", BENCHMARKS)
def test_smoke_mode_runs_and_prints_finite_ratios(script, tmp_path):
    result = run_script(os.path.join("benchmarks", script), "--smoke", cwd=tmp_path)
    assert_finite_ratios(result)
    assert not os.listdir(tmp_path), "a smoke run writes nothing where it is started"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("script", DEVICE_BENCHMARKS)
def test_smoke_mode_runs_every_method_on_cuda(script, tmp_path):
    # A tensor left on the CPU while the model is on the GPU (or the reverse) stops the run with an error.
    result = run_script(os.path.join("benchmarks", script), "--smoke", "--device", "cuda", cwd=tmp_path)
    assert_finite_ratios(result)
    assert "on cuda" in result.stdout and "on cpu" not in result.stdout, result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
@pytest.mark.parametrize("script", DEVICE_BENCHMARKS)
def test_cuda_without_a_gpu_is_a_usage_error(script, tmp_path):
    result = run_script(os.path.join("benchmarks", script), "--smoke", "--device", "cuda", cwd=tmp_path)
    assert result.returncode == 2
    assert "--device" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not result.stdout


def assert_finite_ratios(result):
    assert result.returncode == 0, result.stderr[-3000:]
    ratios = RATIO.findall(result.stdout)
    assert ratios, result.stdout
    assert all(math.isfinite(float(ratio)) and float(ratio) > 0 for ratio in ratios), (ratios, result.stdout)


def test_the_device_check_needs_its_data_and_names_the_flag(tmp_path):
    result = run_script(os.path.join("benchmarks", "gpu_check.py"), "--device", "cpu", "--out", tmp_path / "out",
                        cwd=tmp_path)
    assert result.returncode == 2 and "--data" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_device_check_extrapolates_each_kind_of_step():
    """The preset's timing table at the reduced size, scaled step by step: training by the epochs, the main run's
    Δ* by its checkpoints, Δ_B draws by points × draws past the Gram build, a fixed-design checkpoint by its own
    measurement at full size, the rest not at all."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check

    timings = [(match.group(1), float(match.group(2)))
               for match in map(gpu_check.TIMING.match, gpu_check.SMOKE_TIMINGS.splitlines()) if match]
    assert len(timings) == 5
    rows, total = gpu_check.extrapolate(timings, gpu_check.REDUCED, draw_base=10.0, checkpoint=70.0)
    expected = {"train": 20 * 40, "compute": 6 * gpu_check.checkpoints(40, 50_000) / gpu_check.checkpoints(1, 50_000),
                "measurement": 70.0, "renyi": 1.0 * 100, "audit": 9.0}
    for step, _, _, _, seconds in rows:
        assert math.isclose(seconds, next(value for key, value in expected.items() if step.startswith(key)))
    assert math.isclose(total, sum(expected.values()))
    draws = gpu_check.extrapolate([("compute_sensitivity.py run=x points=random:100 num-batches=1000", 30.0)],
                                  gpu_check.REDUCED, draw_base=10.0)[1]
    assert math.isclose(draws, 10.0 + 20.0 * 100)

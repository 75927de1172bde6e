"""Every benchmark's --smoke mode (tiny sizes, synthetic data, seconds) runs its code paths side by
side to the end and prints its ratios, so that no benchmark rots unseen between full runs."""

import math
import os
import re

import pytest
from conftest import ROOT, run_script

# Every script in benchmarks/ (helpers start with "_"), so a new benchmark is covered when added.
BENCHMARKS = sorted(name for name in os.listdir(os.path.join(ROOT, "benchmarks"))
                    if name.endswith(".py") and not name.startswith("_"))
# A ratio as the benchmarks print it: a number followed by × or x, e.g. "1.48×", "speed-up 285x".
RATIO = re.compile(r"(\d+(?:\.\d+)?|nan|inf)\s?[×x](?!\w)")


def test_every_benchmark_is_found():
    expected = {"bench_accounting.py", "bench_pld.py", "bench_sensitivity.py", "bench_shared_machine.py", "bench_training.py",
                "compare_clipping.py"}
    assert expected <= set(BENCHMARKS)


@pytest.mark.parametrize("script", BENCHMARKS)
def test_smoke_mode_runs_and_prints_finite_ratios(script, tmp_path):
    result = run_script(os.path.join("benchmarks", script), "--smoke", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    ratios = RATIO.findall(result.stdout)
    assert ratios, result.stdout
    assert all(math.isfinite(float(ratio)) and float(ratio) > 0 for ratio in ratios), (ratios, result.stdout)
    assert not os.listdir(tmp_path), "a smoke run writes nothing where it is started"

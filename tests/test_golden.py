"""Golden outputs: every accountant, in every mode, on fixed result files, byte for byte; and the
result files themselves, as compute_sensitivity.py and train_dpsgd.py write them for a tiny run.

The inputs under tests/golden/inputs are what the measurement wrote for two tiny synthetic runs
(sum and mean rule, MLP, T = 16, checkpoints 0, 8, 16): Δ* rows, coupling rows (statistics and
Δ_B samples with k and block), GLA's statistic S, and the tracked norms of training. The outputs
under tests/golden/outputs are each accountant's CSV and its printed text (stdout, then stderr)
on them. A change that alters any byte fails here; a change meant to alter numbers regenerates
them with `python3 tests/test_golden.py` and shows the difference in review.
"""

import os
import shutil
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # regenerating: the package and conftest as pytest would find them
    sys.path[:0] = [TESTS, os.path.dirname(TESTS)]
from conftest import run_in_process  # noqa: E402

GOLDEN = os.path.join(TESTS, "golden")
INPUTS = os.path.join(GOLDEN, "inputs")
OUTPUTS = os.path.join(GOLDEN, "outputs")

# The two tiny runs: psac, so that every point's Δ* differs.
RUN = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "1",
       "--save-freq", "8", "--clipping", "psac", "--scale-r", "1", "--sigma", "1.5"]
# Result file -> (run name, compute_sensitivity.py flags).
MEASUREMENTS = {
    "sum.csv": ("gold_sum", ["--track-points", "0-3", "--reduction", "sum", "--points", "0-5", "--stage", "all"]),
    "mean.csv": ("gold_mean", ["--reduction", "mean", "--points", "0-1", "--stage", "all", "--num-batches", "64",
                               "--mc-blocks", "2"]),
    "mean_histogram.csv": ("gold_mean", ["--reduction", "mean", "--points", "0-1", "--stage", "final",
                                         "--num-batches", "64", "--mc-blocks", "2", "--histogram-precision", "0.05"]),
    "mean_statistics.csv": ("gold_mean", ["--reduction", "mean", "--points", "0-5", "--stage", "all",
                                          "--num-batches", "0"]),
    "jensen.csv": ("gold_mean", ["--reduction", "mean", "--exp", "renyi", "--estimator", "jensen", "--alpha", "2",
                                 "--num-iters", "2", "--num-batches", "4", "--points", "0-1", "--stage", "final"]),
}
# The sum-rule run's training writes the norms of its tracked points at every step.
TRACKED = ("gold_sum", "tracked_norms.csv")

# Case name -> (script, flags); every case reads the inputs from res/ and writes res/<case>.csv.
CASES = {
    "eps_delta_sum_exact": ("eps_delta.py", ["--res-name", "sum"]),
    "eps_delta_sum_points": ("eps_delta.py", ["--res-name", "sum", "--points", "1-3", "--delta", "1e-6"]),
    "eps_delta_sum_holder": ("eps_delta.py", ["--res-name", "sum", "--method", "holder"]),
    "eps_delta_sum_holder_classic": ("eps_delta.py", ["--res-name", "sum", "--method", "holder", "--holder-p", "3T",
                                                      "--gaussian", "classic"]),
    "eps_delta_mean": ("eps_delta.py", ["--res-name", "mean"]),
    "eps_delta_mean_failure": ("eps_delta.py", ["--res-name", "mean", "--failure", "1e-6", "--delta", "1e-4",
                                                "--filter", "step=16"]),
    "eps_delta_mean_histogram": ("eps_delta.py", ["--res-name", "mean_histogram"]),
    "renyi_sum": ("renyi_per_instance_sum.py", ["--res-name", "sum", "--alpha", "2", "8.5", "32"]),
    "renyi_mean_coupling": ("renyi_per_instance_mean.py", ["--res-name", "mean", "--alpha", "2", "8"]),
    "renyi_mean_coupling_failure": ("renyi_per_instance_mean.py", ["--res-name", "mean", "--failure", "0.01"]),
    "renyi_mean_histogram": ("renyi_per_instance_mean.py", ["--res-name", "mean_histogram", "--alpha", "4"]),
    "renyi_mean_jensen_joint": ("renyi_per_instance_mean.py", ["--res-name", "jensen", "--estimator", "jensen",
                                                               "--alpha", "2"]),
    "renyi_mean_jensen_per_target": ("renyi_per_instance_mean.py", ["--res-name", "jensen", "--estimator", "jensen",
                                                                    "--alpha", "2", "--aggregate", "per-target"]),
    "compo_sum_inf": ("renyi_per_instance_sum_compo.py", ["--res-name", "sum", "--holder-b", "inf"]),
    "compo_sum_3T": ("renyi_per_instance_sum_compo.py", ["--res-name", "sum"]),
    "compo_sum_exact_levels": ("renyi_per_instance_sum_compo.py", ["--res-name", "sum", "--holder-b", "inf",
                                                                   "--rounding", "0", "--alpha", "2", "4", "8"]),
    "compo_mean_certified": ("renyi_per_instance_sum_compo.py", ["--res-name", "mean"]),
    "compo_mean_estimate": ("renyi_per_instance_sum_compo.py", ["--res-name", "mean", "--kind", "estimate"]),
    "compo_mean_statistics": ("renyi_per_instance_sum_compo.py", ["--res-name", "mean_statistics"]),
    "compo_tracked_inf": ("renyi_per_instance_sum_compo.py", ["--res-file", "res/tracked_norms.csv",
                                                              "--holder-b", "inf"]),
    "compo_tracked_3T": ("renyi_per_instance_sum_compo.py", ["--res-file", "res/tracked_norms.csv"]),
}


def read(path):
    with open(path, "rb") as handle:
        return handle.read()


def account(case, folder):
    """Run one accountant case in `folder` (the inputs copied to res/): (output CSV bytes, printed text)."""
    res = os.path.join(folder, "res")
    os.makedirs(res, exist_ok=True)
    for name in os.listdir(INPUTS):
        shutil.copyfile(os.path.join(INPUTS, name), os.path.join(res, name))
    script, flags = CASES[case]
    result = run_in_process(script, *flags, "--out", f"res/{case}.csv", cwd=folder)
    assert result.returncode == 0, result.stderr
    return read(os.path.join(res, f"{case}.csv")), (result.stdout + result.stderr).encode("utf-8")


def measure(folder):
    """Train the two runs and measure them in `folder`: {input name: bytes} as written."""
    models = os.path.join(folder, "models")
    os.makedirs(folder, exist_ok=True)
    for name, (run, flags) in MEASUREMENTS.items():
        result = run_in_process("compute_sensitivity.py", *RUN, "--save-name", run, "--models-dir", models, *flags,
                                "--res-name", name, cwd=folder)
        assert result.returncode == 0, result.stderr
    written = {name: read(os.path.join(folder, "res", name)) for name in MEASUREMENTS}
    written[TRACKED[1]] = read(os.path.join(models, *TRACKED))
    return written


@pytest.mark.parametrize("case", sorted(CASES))
def test_accountant_output_is_byte_identical(case, tmp_path):
    table, text = account(case, tmp_path)
    assert table == read(os.path.join(OUTPUTS, f"{case}.csv"))
    assert text.decode() == read(os.path.join(OUTPUTS, f"{case}.txt")).decode()


def test_measured_result_files_are_byte_identical(tmp_path):
    for name, data in measure(tmp_path).items():
        assert data == read(os.path.join(INPUTS, name)), name


def regenerate(folder):
    """Write the inputs (measured afresh) and every case's outputs under tests/golden."""
    os.makedirs(INPUTS, exist_ok=True)
    os.makedirs(OUTPUTS, exist_ok=True)
    for name, data in measure(os.path.join(folder, "measure")).items():
        with open(os.path.join(INPUTS, name), "wb") as handle:
            handle.write(data)
    for case in CASES:
        table, text = account(case, os.path.join(folder, case))
        for ending, data in ((".csv", table), (".txt", text)):
            with open(os.path.join(OUTPUTS, case + ending), "wb") as handle:
                handle.write(data)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        regenerate(scratch)
    print(f"wrote {INPUTS} and {OUTPUTS}")

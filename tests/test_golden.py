"""Golden outputs: every accountant, in every mode, on fixed result files; and the result files
themselves, as compute_sensitivity.py and train_dpsgd.py write them for a tiny run.

The inputs under tests/golden/inputs are what the measurement wrote for two tiny synthetic runs
(sum and mean rule, MLP, T = 16, checkpoints 0, 8, 16): Δ* rows, coupling rows (statistics and
Δ_B samples with k and block), GLA's statistic S, and the tracked norms of training. The outputs
under tests/golden/outputs are each accountant's CSV and its printed text (stdout, then stderr)
on them. A change meant to alter numbers regenerates them with `python3 tests/test_golden.py` and
shows the difference in review.

What must hold on any machine where the program is right: the columns, the row order, every
non-numeric field and every word of the printed text exactly; the numbers at a tolerance per kind
(MEASURED, ACCOUNTED). The measurement is float32 work whose kernels (MKL, oneDNN) differ by CPU and
thread count, so it is compared at float32 precision, and once more with another torch thread count;
the accountants read the fixed inputs and compute in float64, so they are held much tighter.
"""

import csv
import io
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass

import pytest
import torch

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


@dataclass(frozen=True)
class Tolerance:
    """|actual − expected| <= atol + rtol·|expected| + the rounding of the expected number as written
    (two right values can round to neighbouring printed digits); integers are compared exactly."""

    rtol: float
    atol: float


# float32 training and Δ* measurement: a few float32 ulps after sums over hundreds of terms; atol for
# values near 0 (statistics that cancel), 1e-6 of the clip bound Γ = 1 that scales every measured value.
MEASURED = Tolerance(rtol=1e-5, atol=1e-6)
# float64 accountants on the fixed inputs: libm and BLAS differ in the last bits, the root finding and
# minimisations amplify that by far less than 1e3; the files print 10 significant digits.
ACCOUNTED = Tolerance(rtol=1e-9, atol=1e-15)
# A number inside a word or a line: signed decimal or scientific, or nan/inf standing alone.
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|(?<![A-Za-z])[-+]?(?:nan|inf)(?![A-Za-z])")


# Significant digits: the result files write %.10g (fileio.CSV_FLOAT_FORMAT); printed text at least 3.
TABLE_DIGITS = 10
TEXT_DIGITS = 3


def rounding_unit(written, digits):
    """One unit in the last digit of a decimal number as written, and at most in its `digits`-th
    significant digit (%g drops trailing zeros: "0.001" at 10 digits is known to 1e-12); 0 for an integer."""
    mantissa, _, exponent = written.lower().partition("e")
    if "." not in mantissa and not exponent:
        return 0.0
    value = abs(float(written))
    significant = 10.0 ** (math.floor(math.log10(value)) - digits + 1) if value > 0 else 0.0
    return min(10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2])), significant)


def numbers_agree(actual, expected, tolerance, digits):
    """Two numbers as written with `digits` significant digits agree at `tolerance` (nan with nan, ±inf
    with itself)."""
    got, want = float(actual), float(expected)
    if math.isnan(want) or math.isinf(want):
        return math.isnan(got) if math.isnan(want) else got == want
    return abs(got - want) <= tolerance.atol + tolerance.rtol * abs(want) + rounding_unit(expected, digits)


def is_number(field):
    try:
        float(field)
    except ValueError:
        return False
    return True


def table_differences(actual, expected, tolerance):
    """How a CSV text differs from the golden one: header, row count and order, every non-numeric field
    exactly; numeric fields at `tolerance`. Empty when they agree."""
    got, want = (list(csv.reader(io.StringIO(text))) for text in (actual, expected))
    if not want or got[:1] != want[:1]:
        return [f"columns {got[:1]} != {want[:1]}"]
    if len(got) != len(want):
        return [f"{len(got) - 1} rows != {len(want) - 1}"]
    differences = []
    for row, (got_row, want_row) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        if len(got_row) != len(want_row):
            differences.append(f"row {row}: {len(got_row)} fields != {len(want_row)}")
            continue
        for column, got_field, want_field in zip(want[0], got_row, want_row, strict=True):
            if is_number(want_field) and is_number(got_field):
                agree = numbers_agree(got_field, want_field, tolerance, TABLE_DIGITS)
            else:
                agree = got_field == want_field
            if not agree:
                differences.append(f"row {row}, {column}: {got_field} != {want_field}")
    return differences


def text_differences(actual, expected, tolerance):
    """How printed text differs from the golden text: the words of every line exactly, the numbers in
    them at `tolerance`. Empty when they agree."""
    got, want = actual.splitlines(), expected.splitlines()
    if len(got) != len(want):
        return [f"{len(got)} lines != {len(want)}"]
    differences = []
    for got_line, want_line in zip(got, want, strict=True):
        got_numbers, want_numbers = NUMBER.findall(got_line), NUMBER.findall(want_line)
        if (NUMBER.split(got_line) != NUMBER.split(want_line) or len(got_numbers) != len(want_numbers)
                or not all(numbers_agree(got, want, tolerance, TEXT_DIGITS)
                           for got, want in zip(got_numbers, want_numbers, strict=True))):
            differences.append(f"{got_line!r} != {want_line!r}")
    return differences


@pytest.mark.parametrize("case", sorted(CASES))
def test_accountant_output_agrees_with_the_golden_one(case, tmp_path):
    table, text = account(case, tmp_path)
    assert not table_differences(table.decode(), read(os.path.join(OUTPUTS, f"{case}.csv")).decode(), ACCOUNTED)
    assert not text_differences(text.decode(), read(os.path.join(OUTPUTS, f"{case}.txt")).decode(), ACCOUNTED)


# The suite runs torch with one thread (conftest.py); two threads split the same float32 sums
# differently, so a kernel or reduction-order change shows here rather than on a contributor's machine.
@pytest.mark.parametrize("threads", [1, 2])
def test_measured_result_files_agree_with_the_golden_ones(threads, tmp_path):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        written = measure(tmp_path)
    finally:
        torch.set_num_threads(previous)
    for name, data in written.items():
        assert not table_differences(data.decode(), read(os.path.join(INPUTS, name)).decode(), MEASURED), name


GOLDEN_TABLE = "point,step,kind,eps\n0,8,certified,1.743980408\n1,8,baseline,0.001\n"
GOLDEN_TEXT = "per-step eps of 2 points, q=0.0625\n     0     8     4.407  1.866\n"


def test_a_float32_rounding_difference_passes():
    table = GOLDEN_TABLE.replace("1.743980408", "1.743980289")
    text = GOLDEN_TEXT.replace("4.407", "4.406")
    assert not table_differences(table, GOLDEN_TABLE, MEASURED)
    assert not text_differences(text, GOLDEN_TEXT, MEASURED)


@pytest.mark.parametrize("changed", [
    ("1.743980408", "1.744000408"),  # beyond rtol 1e-5
    ("0.001", "0.001003"),  # beyond atol near zero and the last place written
    ("certified", "estimate"),
    ("0,8,", "0,9,"),  # an integer field is exact
    ("point,step", "step,point"),
    ("\n1,8,baseline,0.001", ""),
])
def test_a_table_difference_beyond_tolerance_is_caught(changed):
    assert table_differences(GOLDEN_TABLE.replace(*changed), GOLDEN_TABLE, MEASURED)


@pytest.mark.parametrize("changed", [("4.407", "4.409"), ("1.866", "1.869"), ("eps", "epsilon"),
                                     ("q=0.0625", "q=0.0628"), ("2 points", "3 points")])
def test_a_text_difference_beyond_tolerance_is_caught(changed):
    assert text_differences(GOLDEN_TEXT.replace(*changed), GOLDEN_TEXT, MEASURED)


def test_accountant_tolerance_catches_a_change_in_the_eighth_digit():
    table = GOLDEN_TABLE.replace("1.743980408", "1.743980508")
    assert table_differences(table, GOLDEN_TABLE, ACCOUNTED)
    assert not table_differences(GOLDEN_TABLE.replace("1.743980408", "1.743980409"), GOLDEN_TABLE, ACCOUNTED)


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

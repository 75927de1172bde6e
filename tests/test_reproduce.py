import re

import matplotlib.image
import pytest
from conftest import assert_usage_error, snapshot

FIGURES = ["1_per_step_eps_histogram.png", "2_correct_vs_misclassified.png", "3_mean_rule_sampling_rates.png",
           "4_composed_eps_over_training.png", "5_individual_accounting.png", "6_estimate_accuracy.png"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from conftest import run_in_process
    workdir = tmp_path_factory.mktemp("reproduce")
    first = run_in_process("reproduce.py", "--preset", "tiny", "--out-dir", "out", cwd=workdir)
    second = run_in_process("reproduce.py", "--preset", "tiny", "--out-dir", "out", cwd=workdir)
    return workdir, first, second


def test_tiny_preset_writes_six_figures(tiny_run):
    workdir, first, _ = tiny_run
    assert first.returncode == 0, first.stderr[-2000:]
    for name in FIGURES:
        data = (workdir / "out" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        image = matplotlib.image.imread(workdir / "out" / name)
        assert image.shape[0] > 200 and image.shape[1] > 200


def test_report_states_findings_with_numbers(tiny_run):
    workdir, _, _ = tiny_run
    report = (workdir / "out" / "report.md").read_text()
    findings = [line for line in report.splitlines() if re.match(r"^\d\. ", line)]
    assert len(findings) == 7
    for line in findings:
        assert re.search(r"\d", line[3:]), line
    assert "baseline" in findings[0] and "Pearson r" in report
    for name in FIGURES:
        assert f"({name})" in report


def test_rerun_skips_finished_steps(tiny_run):
    _, first, second = tiny_run
    assert second.returncode == 0
    assert "already trained" in second.stdout and "trained steps" not in second.stdout
    assert "skipping" in second.stdout
    assert "0 rows written" in second.stdout
    assert "trained steps" in first.stdout


@pytest.mark.parametrize("flags,flag", [
    (["--preset", "huge"], "--preset"),
    (["--dataset", "imagefolder:/nonexistent/images"], "--dataset"),
])
def test_bad_input(tmp_path, run, flags, flag):
    before = snapshot(tmp_path)
    assert_usage_error(run("reproduce.py", *flags), flag)
    assert snapshot(tmp_path) == before


def test_out_dir_that_is_a_file_is_refused(tmp_path, run):
    (tmp_path / "taken").write_text("x")
    before = snapshot(tmp_path)
    assert_usage_error(run("reproduce.py", "--preset", "tiny", "--out-dir", "taken"), "--out-dir")
    assert snapshot(tmp_path) == before

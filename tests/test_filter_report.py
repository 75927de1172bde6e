"""`perinstance report` on a filtered run (experiments/filter_findings.py, run_report.py, point_table.py): points.csv's
guarantee and leaving step against the filter's own record, the counts of points that left (in total, by step range,
per class and per group) against a count of filter_points.csv, every point's composed ε never above its guarantee
(the guarantee checked against Opacus's conversion), T_u against the trainer's points at Γ, the figures, and the
report's rules on the written report.md."""

import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import report_markdown
from conftest import run_in_process
from opacus.accountants.analysis.rdp import get_privacy_spent

from perinstance.accounting import individual_filter
from perinstance.cli import report as report_command
from perinstance.experiments import filter_findings, point_table, run_report
from perinstance.files import storage, tracked_rows
from perinstance.train import runs

# 512 synthetic points (4 classes), q = 1/16, σ = 1, Γ = 4 so that many points stay below Γ: at ε = 3.5 and order 4
# the points at Γ leave after 21 steps, about a third stay to the cap of 40; Δ* every 4 steps.
FILTERED = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--sigma", "1.0",
            "--cn", "4", "--total-steps", "40", "--save-freq", "8", "--budget-eps", "3.5", "--filter-order", "4",
            "--filter-every", "4"]
# The first 300 points in two groups by parity; the others in none.
GROUPED = 300


@pytest.fixture(scope="module")
def filtered(tmp_path_factory):
    """The filtered run's report with --groups: (workdir, the Report written, the filter's record, points.csv)."""
    workdir = tmp_path_factory.mktemp("filtered")
    trained = run_in_process("train_dpsgd.py", *FILTERED, "--save-name", "filt", cwd=workdir)
    assert trained.returncode == 0, trained.stderr
    pd.DataFrame({"point": range(GROUPED), "group": ["even" if point % 2 == 0 else "odd" for point in range(GROUPED)]}
                 ).to_csv(workdir / "groups.csv", index=False)
    written = []
    with pytest.MonkeyPatch.context() as patch:
        write = report_command.write_report_files
        patch.setattr(report_command, "write_report_files",
                      lambda folder, document: written.append(document) or write(folder, document))
        result = run_in_process("report.py", "--run", "filt", "--groups", "groups.csv", cwd=workdir)
    assert result.returncode == 0, result.stderr
    record = pd.read_csv(workdir / "models" / "filt" / "filter_points.csv")
    points = pd.read_csv(workdir / "figures" / "filt" / "points.csv")
    return workdir, written[0], record, points


def findings_by_key(document):
    return {finding.key: finding for finding in document.findings}


def test_points_csv_holds_the_guarantee_and_the_leaving_step_of_the_record(filtered):
    _, _, record, points = filtered
    assert list(points.columns) == [*point_table.COLUMNS, *point_table.FILTER_COLUMNS, "group"]
    assert list(points["point"]) == list(record["point"])
    np.testing.assert_array_equal(points["left_step"].to_numpy(), record["left_step"].to_numpy())
    assert 0 < points["left_step"].notna().sum() < len(points)
    assert set(points["eps_guarantee_kind"]) == {"guarantee"} and set(points["eps_rdp_kind"]) == {"certified"}
    # A filtered run's headline is a bound from the bounds it clipped at: no composition over checkpoints beside it.
    assert points["eps_held"].isna().all()
    # The guarantee is the budget at λ_f converted at δ, as Opacus converts an RDP value at one order (§12.1); the
    # record's CSV keeps 10 significant digits of the budget.
    delta = float(points["delta"].iloc[0])
    expected = [get_privacy_spent(orders=[order], rdp=[budget], delta=delta)[0]
                for order, budget in zip(record["order"], record["budget"], strict=True)]
    np.testing.assert_allclose(points["eps_guarantee"], expected, rtol=1e-9)
    np.testing.assert_allclose(points["eps_guarantee"], 3.5, rtol=1e-12)


def test_no_points_composed_eps_passes_its_guarantee(filtered):
    _, document, _, points = filtered
    assert np.all(points["eps_rdp"].to_numpy() <= points["eps_guarantee"].to_numpy())
    finding = findings_by_key(document)["filter-guarantee"]
    rows = {row[0]: row for row in finding.table.rows}
    assert rows["composed along the run, RDP (b = ∞)"][4] == f"0 of {len(points)}"
    assert rows["composed along the run, RDP (b = ∞)"][3] == f"{points['eps_rdp'].max():.4g}"
    assert finding.takeaway.startswith("No point's composed ε by RDP passes its guarantee of 3.5")


def test_the_counts_of_points_that_left_are_the_records(filtered):
    _, document, record, _ = filtered
    run = runs.load_run(str(filtered[0] / "models" / "filt"))
    trained, left = record["steps_active"].to_numpy(), record["left_step"].notna().to_numpy()
    uniform = filter_findings.uniform_stop(run)
    # T_u: every point charged at Γ from the start trains exactly T_u steps, and no point with the same budget fewer.
    assert trained.min() == uniform and np.sum(trained == uniform) > 0
    assert uniform == individual_filter.uniform_steps(run.sample_rate, run.noise_multiplier, record["budget"].iloc[0],
                                                      run.point_filter["order"])
    finding = findings_by_key(document)["filter-left"]
    assert finding.takeaway.startswith(f"{left.sum():,} of the {len(record):,} points left before the cap of 40 steps")
    counts = {row[0]: int(row[2].replace(",", "")) for row in finding.table.rows}
    assert sum(counts.values()) == len(record)
    assert counts["40 (stayed to the cap)"] == np.sum(~left)
    assert counts[f"{uniform} (T_u, where uniform DP-SGD stops)"] == np.sum(left & (trained == uniform))
    for label, count in counts.items():
        found = re.fullmatch(r"(\d+)–(\d+)", label)
        if found:
            first, last = map(int, found.groups())
            assert count == np.sum(left & (trained >= first) & (trained <= last)), label
    past = np.mean(trained > uniform)
    assert f"and {100 * past:.3g}% [" in finding.takeaway


@pytest.mark.parametrize("key, column", [("filter-left-per-class", "label"), ("filter-left-per-group", "group")])
def test_the_breakdowns_count_the_records_points(filtered, key, column):
    _, document, record, points = filtered
    run = runs.load_run(str(filtered[0] / "models" / "filt"))
    uniform = filter_findings.uniform_stop(run)
    joined = points[["point", column]].merge(record[["point", "steps_active", "left_step"]], on="point")
    finding = findings_by_key(document)[key]
    rows = {row[0]: row for row in finding.table.rows}
    names = {"label": lambda value: f"class{int(value)}", "group": str}[column]
    groups = joined.dropna(subset=[column]).groupby(column)
    assert set(rows) == {names(value) for value in groups.groups}
    for value, members in groups:
        row = rows[names(value)]
        assert int(row[1]) == len(members)
        assert row[2].startswith(f"{100 * np.mean(members['steps_active'] > uniform):.3g}% [")
        assert row[3].startswith(f"{100 * members['left_step'].isna().mean():.3g}% [")
    assert finding.figures and (filtered[0] / "figures" / "filt" / finding.figures[0]).read_bytes()[:4] == b"\x89PNG"


def test_points_still_training_are_counted_from_the_record(filtered):
    workdir, _, record, points = filtered
    run = runs.load_run(str(workdir / "models" / "filt"))
    composed = pd.DataFrame({"point": points["point"], "eps": points["eps_rdp"], "guarantee_eps": points["eps_guarantee"],
                             "delta": points["delta"]})
    counted = filter_findings.filter_run(run, record, composed)
    left = record["left_step"].fillna(np.inf).to_numpy()
    expected = [int(np.sum(left > step)) for step in range(run.total_steps + 1)]
    assert list(counted.still_training()) == expected
    odd = points["point"].to_numpy() % 2 == 1
    assert list(counted.still_training(odd)) == [int(np.sum(left[odd] > step)) for step in range(run.total_steps + 1)]


def test_the_points_that_left_first_are_the_earliest_then_highest_loss(filtered):
    _, document, _, points = filtered
    finding = findings_by_key(document)["filter-left-first"]
    left = points.dropna(subset=["left_step"])
    expected = left.sort_values(["left_step", "loss", "point"], ascending=[True, False, True], kind="stable")
    assert [int(row[0]) for row in finding.table.rows] == list(expected["point"].iloc[:run_report.GALLERY_SIZE])
    assert finding.table.columns[-2:] == (run_report.LEFT_AT, "ε")


def test_the_uniform_comparison_and_the_summary(filtered):
    workdir, document, record, points = filtered
    run = runs.load_run(str(workdir / "models" / "filt"))
    uniform = filter_findings.uniform_stop(run)
    rows = {row[0]: row for row in findings_by_key(document)["filter-uniform"].table.rows}
    assert rows["steps"][1:] == (str(uniform), "40 (the cap)")
    assert rows["ε of every point (data-independent)"][2] == "3.5"
    # Uniform DP-SGD's ε after T_u steps, at most the budget ε at λ_f (the order is among those converted from).
    uniform_eps = float(rows["ε of every point (data-independent)"][1])
    assert uniform_eps <= 3.5 + 5e-4
    summary = dict(document.summary.rows)
    assert summary["each point's guarantee ε (its filter budget at λ_f = 4; every trajectory)"] == "3.5"
    assert summary["uniform DP-SGD at this σ and q: steps T_u, ε of every point (RDP)"].startswith(f"{uniform}, ")
    share = record["left_step"].notna().mean()
    assert summary["points that left the training set before the cap [95% interval]"].startswith(f"{100 * share:.3g}% [")
    table = storage.read_frame(tracked_rows.table_path(str(workdir / "models" / "filt")))
    assert {"held_bound", "filter_budget"} <= set(table["quantity"])


def test_the_written_report_keeps_the_rules(filtered):
    workdir, document, _, _ = filtered
    text = (workdir / "figures" / "filt" / "report.md").read_text(encoding="utf-8")
    found = report_markdown.findings(text)
    assert [finding["key"] for finding in found] == [finding.key for finding in document.findings]
    assert {"filter-left", "filter-left-per-class", "filter-left-per-group", "filter-guarantee", "filter-uniform",
            "filter-left-first"} <= {finding["key"] for finding in found}
    for finding in found:
        assert report_markdown.prose_words(finding) <= report_markdown.MAX_PROSE_WORDS, finding["key"]
        assert len(report_markdown.SENTENCE_END.findall(finding["prose"][0])) == 1, finding["key"]
    for figure in document.figures:
        assert (workdir / "figures" / "filt" / figure.file).read_bytes()[:4] == b"\x89PNG", figure.file
    assert {filter_findings.FIGURES[key] for key in ("class", "group", "guarantee")} <= {
        figure.file for figure in document.figures}


@pytest.mark.parametrize("total, expected", [
    # T_u = 10, cap 30: the later leavers (11..29 steps) in four ranges.
    (30, [("fewer than 10", 1), ("10 (T_u, where uniform DP-SGD stops)", 2), ("11–15", 1), ("16–19", 0),
          ("20–24", 1), ("25–29", 1), ("30 (stayed to the cap)", 2)]),
    # A cap one step past T_u: no later range.
    (11, [("fewer than 10", 1), ("10 (T_u, where uniform DP-SGD stops)", 2), ("11 (stayed to the cap)", 2)]),
])
def test_the_table_of_leaving_steps_counts_each_range(total, expected):
    trained = np.array([7, 10, 10, 12, 22, 29, total, total]) if total == 30 else np.array([7, 10, 10, 11, 11])
    left = np.where(trained < total, trained + 1, np.nan)
    count = len(trained)
    filtered = filter_findings.FilterRun(SimpleNamespace(total_steps=total), 2.0, 1e-5, 10, 3.0, np.arange(count),
                                         trained, left, np.full(count, 3.0), np.full(count, 2.0), None)
    rows = filter_findings.leaving_rows(filtered)
    assert [(row[0], int(row[2])) for row in rows] == [pair for pair in expected if pair[1] or "fewer" not in pair[0]]
    assert sum(int(row[2]) for row in rows) == count
    assert rows[-1][1] == "–" and rows[1][1] == "11"

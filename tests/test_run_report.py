"""`perinstance report --run NAME` (perinstance/cli/report.py, experiments/run_report.py, experiments/point_table.py):
points.csv against independent computations (the API's IndividualAccountant fed the same Δ*/Γ, the tracked table's
losses, the dataset's labels), the galleries' points against a sort of points.csv, --groups and its refusals, the
tables that stand in for images on other data, the mean rule refused, and report.html in a real headless browser."""

import dataclasses
import html
import json
import os
import re
import shutil
import subprocess

import dp_accounting
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import assert_usage_error, run_in_process, snapshot
from dp_accounting.pld import pld_privacy_accountant

from perinstance import IndividualAccountant
from perinstance.accounting import rdp_composition
from perinstance.cli import report as report_command
from perinstance.experiments import point_table, run_report
from perinstance.files import storage, tracked_rows
from perinstance.plots.report_files import prose_words
from perinstance.train import runs
from perinstance.train.data import display_images, load_dataset

# LeNet-5 on 256 MNIST digits, T = 8 steps, checkpoints at 0, 3, 6 and 8, every point tracked at every step.
LENET = ["--dataset", "first:256:mnist-embedded", "--model", "lenet5", "--batch-size", "32", "--lr", "0.5", "--cn", "3",
         "--sigma", "1.0", "--epochs", "1", "--save-freq", "3"]
# The MLP on the synthetic points (not images), T = 16, 50 of the 512 points tracked.
SYNTHETIC = ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--sigma", "1.0", "--cn", "3",
             "--epochs", "1", "--save-freq", "4"]
PROSE_LIMIT = 60


def reported(workdir, *args, monkeypatch):
    """Run report.py in `workdir` in this process; returns (result, the Report it wrote)."""
    written = []

    def capture(folder, document):
        written.append(document)
        return write(folder, document)

    write = report_command.write_report_files
    monkeypatch.setattr(report_command, "write_report_files", capture)
    result = run_in_process("report.py", *args, cwd=workdir)
    monkeypatch.setattr(report_command, "write_report_files", write)
    return result, (written[0] if written else None)


@pytest.fixture(scope="module")
def lenet(tmp_path_factory):
    """The LeNet run's report with --groups (points 0-199 in groups by parity, the rest in none)."""
    workdir = tmp_path_factory.mktemp("lenet")
    trained = run_in_process("train_dpsgd.py", *LENET, "--track-points", "all", "--save-name", "lenet", cwd=workdir)
    assert trained.returncode == 0, trained.stderr
    pd.DataFrame({"point": range(200), "group": ["even" if point % 2 == 0 else "odd" for point in range(200)]}).to_csv(
        workdir / "groups.csv", index=False)
    with pytest.MonkeyPatch.context() as patch:
        result, document = reported(workdir, "--run", "lenet", "--groups", "groups.csv", monkeypatch=patch)
    assert result.returncode == 0, result.stderr
    return workdir, result, document


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """The synthetic run's report: 50 points tracked, Δ* of every point measured at the checkpoints by the report."""
    workdir = tmp_path_factory.mktemp("synthetic")
    trained = run_in_process("train_dpsgd.py", *SYNTHETIC, "--track-points", "0-49", "--save-name", "syn",
                             cwd=workdir)
    assert trained.returncode == 0, trained.stderr
    with pytest.MonkeyPatch.context() as patch:
        result, document = reported(workdir, "--run", "syn", monkeypatch=patch)
    assert result.returncode == 0, result.stderr
    return workdir, result, document


def points_of(workdir, run):
    return pd.read_csv(workdir / "figures" / run / "points.csv")


def accountant_eps(ratios, config, delta, accountant="rdp", measured=None):
    """ε of every point from perinstance.IndividualAccountant fed Δ*/Γ, (T, points), one step at a time."""
    accountant_of = IndividualAccountant(ratios.shape[1])
    for step, ratio in enumerate(ratios):
        accountant_of.step(noise_multiplier=config.noise_multiplier, sample_rate=config.sample_rate,
                           sensitivity_ratios=ratio, measured=None if measured is None else bool(measured[step]))
    if accountant == "pld":
        return accountant_of.get_epsilon(delta, accountant="pld")
    return accountant_of.get_epsilon(delta, orders=rdp_composition.COMPOSITION_ORDERS)


def test_points_csv_holds_the_accountants_eps_of_every_point(lenet):
    workdir, _, _ = lenet
    points = points_of(workdir, "lenet")
    config = runs.load_run(str(workdir / "models" / "lenet"))
    assert list(points.columns) == [*point_table.COLUMNS, "group"]
    assert list(points["point"]) == list(range(config.dataset_size))
    assert set(points["eps_rdp_kind"]) == {"certified"} and set(points["eps_pld_kind"]) == {"certified"}
    tracked = storage.read_frame(tracked_rows.table_path(str(workdir / "models" / "lenet")))
    values = tracked.pivot(index="step", columns="point", values="value").sort_index()
    ratios = values.loc[range(config.total_steps)].to_numpy() / config.clip_bound
    delta = float(points["delta"].iloc[0])
    np.testing.assert_allclose(points["eps_rdp"], accountant_eps(ratios, config, delta), rtol=1e-6)
    np.testing.assert_allclose(points["eps_pld"], accountant_eps(ratios, config, delta, "pld"), rtol=1e-6)
    # The held estimate: each step takes Δ* of the latest checkpoint at or before it.
    checkpoints = np.array(sorted(config.checkpoint_steps))
    latest = checkpoints[np.searchsorted(checkpoints, np.arange(config.total_steps), side="right") - 1]
    held = values.loc[latest].to_numpy() / config.clip_bound
    np.testing.assert_allclose(points["eps_held"], accountant_eps(held, config, delta,
                                                                  measured=latest == np.arange(config.total_steps)),
                               rtol=1e-6)
    final = tracked[tracked["step"] == config.total_steps].set_index("point").loc[points["point"]]
    np.testing.assert_allclose(points["grad_norm"], final["value"], rtol=1e-9)
    np.testing.assert_allclose(points["sensitivity_ratio"], final["value"] / config.clip_bound, rtol=1e-9)
    # The final model's loss and correctness, by a forward pass, against the tracking's at θ_T.
    np.testing.assert_allclose(points["loss"], final["loss"], rtol=1e-5, atol=1e-6)
    assert (points["correct"].to_numpy() == final["correct"].to_numpy()).mean() > 0.99
    dataset = load_dataset("first:256:mnist-embedded")
    assert (points["label"].to_numpy() == dataset.train_y.numpy()).all()
    assert ((points["prediction"] == points["label"]) == (points["correct"] == 1)).all()
    # The per-step ε at the final checkpoint rises with Δ*; at Δ* = Γ it is one step of dp_accounting's PLD
    # accountant for the Poisson-subsampled Gaussian (accounting.md §3.3).
    order = np.argsort(points["grad_norm"].to_numpy(), kind="stable")
    assert (np.diff(points["eps_step"].to_numpy()[order]) >= -1e-12).all()
    one_step = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    one_step.compose(dp_accounting.PoissonSampledDpEvent(config.sample_rate,
                                                         dp_accounting.GaussianDpEvent(config.noise_multiplier)))
    at_bound = points["sensitivity_ratio"] > 1 - 1e-6
    assert at_bound.any()
    np.testing.assert_allclose(points.loc[at_bound, "eps_step"], one_step.get_epsilon(delta), rtol=2e-3)


def test_groups_go_to_points_csv_and_the_report(lenet):
    workdir, _, document = lenet
    points = points_of(workdir, "lenet")
    assert list(points["group"].iloc[:4]) == ["even", "odd", "even", "odd"] and points["group"].iloc[200:].isna().all()
    finding = next(finding for finding in document.findings if finding.key == "points-per-group")
    rows = {row[0]: row for row in finding.table.rows}
    assert set(rows) == {"even", "odd"} and rows["even"][1] == "100" and rows["odd"][1] == "100"
    even = points.loc[points["group"] == "even", "eps_rdp"].median()
    assert rows["even"][2].startswith(f"{even:.4g} [")
    assert "56 points are in no group." == finding.note
    assert {figure.file for figure in document.figures} >= {run_report.FIGURES["group"], run_report.FIGURES["class"]}


def test_image_data_get_galleries_and_every_finding_stays_short(lenet):
    workdir, _, document = lenet
    folder = workdir / "figures" / "lenet"
    for key in ("highest", "lowest", "held_below", "class", "group"):
        assert (folder / run_report.FIGURES[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", key
    findings = {finding.key: finding for finding in document.findings}
    assert findings["points-highest-eps"].table is None and findings["points-highest-eps"].figures == (
        run_report.FIGURES["highest"],)
    for finding in document.findings:
        assert prose_words(finding) <= PROSE_LIMIT, (finding.key, prose_words(finding))
    assert (folder / "report.md").exists() and (folder / "report.html").exists()


def test_the_extremes_are_the_top_and_bottom_16_by_eps_then_loss():
    rng = np.random.default_rng(0)
    eps = np.round(rng.uniform(1, 3, size=200), 1)  # many ties
    losses = rng.uniform(0, 5, size=200)
    points = np.arange(200)[::-1].copy()
    for key, sign in (("highest", -1), ("lowest", 1)):
        expected = sorted(range(200), key=lambda row: (sign * eps[row], sign * losses[row], points[row]))[:16]
        assert list(run_report.extreme_rows(eps, losses, points, key)) == expected


def markdown_rows(markdown, key):
    """The first cells of the table of finding `key` in report.md."""
    section = markdown.split(f'<a id="{key}"></a>')[1].split("<a id=")[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    return [line.split(" | ")[0].removeprefix("| ") for line in lines[2:]]


def test_other_data_get_tables_of_the_same_points(synthetic):
    workdir, result, document = synthetic
    points = points_of(workdir, "syn")
    folder = workdir / "figures" / "syn"
    assert not any((folder / run_report.FIGURES[key]).exists() for key in ("highest", "lowest", "held_below"))
    markdown = (folder / "report.md").read_text()
    # The headline here is the held estimate of every point (Δ* measured at the checkpoints by the report itself).
    assert "compute_sensitivity.py --run" in result.stdout
    for key in ("highest", "lowest"):
        expected = points["point"].to_numpy()[run_report.extreme_rows(points["eps_held"].to_numpy(),
                                                                      points["loss"].to_numpy(),
                                                                      points["point"].to_numpy(), key)]
        assert markdown_rows(markdown, f"points-{key}-eps") == [str(point) for point in expected]
    for finding in document.findings:
        assert prose_words(finding) <= PROSE_LIMIT, (finding.key, prose_words(finding))


def test_tracked_points_get_their_bound_and_the_others_the_held_estimate(synthetic):
    workdir, _, document = synthetic
    points = points_of(workdir, "syn").set_index("point")
    tracked = points.index < 50
    assert (points.loc[tracked, "eps_rdp_kind"] == "certified").all()
    assert (points.loc[~tracked, "eps_rdp_kind"] == "held_estimate").all()
    assert (points["eps_pld_kind"] == "held_estimate").all()
    np.testing.assert_array_equal(points.loc[~tracked, "eps_rdp"], points.loc[~tracked, "eps_held"])
    config = runs.load_run(str(workdir / "models" / "syn"))
    table = storage.read_frame(tracked_rows.table_path(str(workdir / "models" / "syn")))
    ratios = table.pivot(index="step", columns="point", values="value").loc[range(config.total_steps)].to_numpy()
    np.testing.assert_allclose(points.loc[tracked, "eps_rdp"],
                               accountant_eps(ratios / config.clip_bound, config, float(points["delta"].iloc[0])),
                               rtol=1e-6)
    summary = dict(document.summary.rows)
    assert summary["what each point's composed ε is"].startswith("held-Δ* estimate")
    # The held-below table: the tracked points whose held estimate falls furthest below their bound, relative to it.
    held_below = next(finding for finding in document.findings if finding.key == "points-held-below-bound")
    shortfall = ((points["eps_rdp"] - points["eps_held"]) / points["eps_rdp"])[tracked]
    expected = shortfall[shortfall > 0].sort_values(ascending=False, kind="stable").index[:16]
    assert len(expected) and [int(row[0]) for row in held_below.table.rows] == list(expected)


@pytest.mark.parametrize("content,fragment", [
    (None, "no file"),
    ("point,team\n0,a\n", "no column group"),
    ("point,group\n0,a\n512,b\n", "line 3: point 512 is not a training point"),
    ("point,group\n3,a\n4,b\n3,b\n", "line 4: point 3 is listed twice (first on line 2)"),
    ("point,group\n3,a\n5, \n", "line 3: point 5 has an empty group"),
    ("point,group\nx,a\n", "'x' is not a point index"),
])
def test_bad_groups_are_refused_before_anything_is_written(synthetic, content, fragment):
    workdir, _, _ = synthetic
    groups = workdir / "bad_groups.csv"
    if content is not None:
        groups.write_text(content)
    before = snapshot(workdir)
    result = run_in_process("report.py", "--run", "syn", "--groups", groups.name, "--out-dir", "fresh", cwd=workdir)
    assert_usage_error(result, "--groups")
    assert fragment in result.stderr, result.stderr
    assert snapshot(workdir) == before and not (workdir / "fresh").exists()
    if content is not None:
        groups.unlink()


def test_the_mean_rule_is_refused(tmp_path, run):
    trained = run("train_dpsgd.py", *SYNTHETIC, "--epochs", "0.25", "--reduction", "mean", "--save-name", "mean")
    assert trained.returncode == 0, trained.stderr
    before = snapshot(tmp_path)
    result = run("report.py", "--run", "mean")
    assert_usage_error(result, "--run")
    assert "sum rule" in result.stderr
    assert snapshot(tmp_path) == before


PROBE = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({images: images.length,
    loaded: images.filter((image) => image.complete && image.naturalWidth > 0).length,
    summary: document.querySelector("#summary + div.table table") !== null,
    summaryRows: document.querySelectorAll("#summary + div.table tbody tr").length});
  document.body.appendChild(probe);
});
</script>"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium (apt-get install chromium)")
def test_report_html_loads_every_image_in_a_headless_browser(lenet, tmp_path):
    workdir, _, document = lenet
    page = (workdir / "figures" / "lenet" / "report.html").read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"  # a copy elsewhere: the page must stand alone, its folder out of reach
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dumped = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--dump-dom",
         f"file://{probed}"], capture_output=True, text=True, timeout=300, env={**os.environ, "HOME": str(tmp_path)})
    found = re.search(r'<pre id="probe">(.*?)</pre>', dumped.stdout, re.S)
    assert found, (dumped.returncode, dumped.stderr[-2000:])
    probe = json.loads(html.unescape(found.group(1)))
    assert probe["images"] == len(document.figures) >= 5
    assert probe["loaded"] == probe["images"]
    assert probe["summary"] and probe["summaryRows"] == len(document.summary.rows)


def test_display_images_undo_the_normalisation_and_find_the_images_of_features():
    digits = load_dataset("mnist-embedded")
    shown = display_images(digits, np.array([0, 5]))
    assert shown.shape == (2, 32, 32, 1) and shown.min() >= 0 and shown.max() <= 1
    # The padding around each digit is black: pixel 0 before the normalisation, 0 again after it is undone.
    np.testing.assert_allclose(shown[:, :2], 0, atol=1e-6)
    assert shown.max() > 0.99  # and the strokes white
    features = dataclasses.replace(digits, name="first:100:scatternet:mnist-embedded", pixel_scale=None,
                                   train_x=torch.zeros(100, 81, 8, 8))
    np.testing.assert_array_equal(display_images(features, np.array([0, 5])), shown)
    assert display_images(load_dataset("synthetic"), np.array([0])) is None

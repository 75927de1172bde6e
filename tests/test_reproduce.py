import dataclasses
import html
import re
import typing

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
import report_markdown
import torch
from conftest import assert_usage_error, run_in_process, snapshot
from PIL import Image
from scipy.special import logit
from scipy.stats import binom

from perinstance.accounting import one_run_audit
from perinstance.accounting.intervals import FALLS, NO_DIFFERENCE, RISES
from perinstance.errors import UsageError
from perinstance.experiments import main_run, one_run, report_audits, report_filter, run_report
from perinstance.experiments.commands import CAPTIONS, FIGURES, FILTER_FIGURES, ONE_RUN_FIGURE
from perinstance.experiments.config import (
    MAIN_RUN_FIELDS,
    MEAN_RULE_FIELDS,
    PRESETS,
    apply_overrides,
    check_config,
    overridden,
    variant_tag,
)
from perinstance.experiments.report import figures_drawn, report_figures
from perinstance.experiments.sampling_rates import FIXED_WHOLE_RUN, MATCHED_WHOLE_RUN
from perinstance.files import storage
from perinstance.train.runs import load_run

# The tiny preset on a small image folder instead of its synthetic points (a dataset override),
# with the sizes that need more points than the folder has overridden too.
IMAGE_OVERRIDES = ["--set", "track_points=random:16", "--set", "mean_batch_sizes=8,16"]
CHANGED_ACCOUNTANT = ["--set", "per_step_method=holder"]
# Rows above which a result named without an extension turns Parquet, lowered so that the tiny preset crosses it.
PARQUET_THRESHOLD = 200


def write_image_folder(root, classes=3, train_per_class=32, test_per_class=8):
    """PATH/train/<class>/*.png and PATH/test/<class>/*.png: 8×8 grey images, a brightness per class plus noise."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for label in range(classes):
            folder = root / split / f"c{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                pixels = np.clip(60 + 60 * label + rng.normal(0, 40, size=(8, 8)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels, "L").save(folder / f"{index}.png")


@pytest.fixture(scope="module")
def image_runs(tmp_path_factory):
    """The tiny preset on an image folder: a first run, the same again, and one with a changed accountant flag.
    Returns (workdir, dataset name, {run: (result, report text, per-step (ε, δ) output bytes)})."""
    workdir = tmp_path_factory.mktemp("reproduce")
    write_image_folder(workdir / "images")
    dataset = f"imagefolder:{workdir / 'images'}"
    base = ["--preset", "tiny", "--dataset", dataset, *IMAGE_OVERRIDES, "--out-dir", "out"]
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        # The main run's Δ* file and the mean-rule statistics cross the automatic Parquet threshold, as the quick
        # preset's do at real size: every result path must go through the one resolver.
        patch.setattr(storage, "AUTO_PARQUET_ROWS", PARQUET_THRESHOLD)
        for label, extra in (("first", []), ("again", []), ("changed", CHANGED_ACCOUNTANT)):
            result = run_in_process("reproduce.py", *base, *extra, cwd=workdir)
            assert result.returncode == 0, result.stderr[-3000:]
            per_step = sorted((workdir / "res").glob("*-sum_eps_delta.csv"))
            runs[label] = (result, (workdir / "out" / "report.md").read_text(), [path.read_bytes() for path in per_step])
    return workdir, dataset, runs


def test_result_files_past_the_parquet_threshold_are_read(image_runs):
    workdir, _, runs = image_runs
    parquet = sorted(path.name for path in (workdir / "res").glob("*.parquet"))
    assert any(name.endswith("-sum.parquet") for name in parquet), parquet
    assert not (workdir / "res" / parquet[0].replace(".parquet", ".csv")).exists()
    # The timing table closes the run and the report.
    for result, report, _ in runs.values():
        assert "| **total** |" in result.stdout and "## Time and memory" in report


def test_tiny_preset_writes_every_figure(image_runs):
    workdir, _, _ = image_runs
    for name in FIGURES:
        data = (workdir / "out" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        image = matplotlib.image.imread(workdir / "out" / name)
        assert image.shape[0] > 200 and image.shape[1] > 200


def test_the_main_runs_points_csv_and_galleries(image_runs):
    workdir, _, runs = image_runs
    points = pd.read_csv(workdir / "out" / "points.csv")
    # 3 classes of 32 training images; 16 points tracked at every step (a bound), the others held between checkpoints.
    assert list(points["point"]) == list(range(96))
    assert (points["eps_rdp_kind"] == "certified").sum() == 16 and set(points["eps_pld_kind"]) == {"held_estimate"}
    for name in (run_report.FIGURES["highest"], run_report.FIGURES["lowest"], run_report.FIGURES["class"]):
        assert (workdir / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "points.csv" in runs["first"][0].stdout


def test_report_states_findings_with_numbers(image_runs):
    _, _, runs = image_runs
    report = runs["first"][1]
    found = report_markdown.findings(report)
    # Two per-step findings of the sum rule; the mean rule's three designs (fixed early and final checkpoint,
    # matched steps) and GLA's claim judged on them; four of composition; the audits (sum rule, mean rule, the
    # realised-size mean rule's gap), the membership attack, and the one-run audit (a finding per canary group, what
    # it can show, the realised-size mean rule's canaries against the sum rule's accounting).
    # Then the individual filter against uniform DP-SGD, and the main run's points (run_report.per_point_report):
    # its galleries, classes and points.csv.
    points = [finding["key"] for finding in found[20:]]
    assert points and all(key.startswith("points-") for key in points), points
    found = found[:20]
    assert [finding["number"] for finding in found] == list(range(1, 21))
    assert [finding["key"] for finding in found] == [
        "per-step-eps", "misclassified", "mean-rule-early", "mean-rule-final", "mean-rule-matched", "gla-claim",
        "composed-eps", "accountants", "loss-and-class", "held-estimate", "audit-sum", "audit-mean", "mean-rule-gap",
        "membership", "one-run-c0-1", "one-run-c0-3", "one-run-c1", "one-run-scope", "mean-rule-gap-canaries",
        "filter-run"]
    for finding in found:
        assert finding["tables"] and any(re.search(r"\d", cell) for cell in report_markdown.cells(finding)), finding
        assert "More: [docs/findings.md#" in "\n".join(finding["lines"]), finding["key"]
    designs = found[2:5]
    for design, name in zip(designs, ("(a) fixed early checkpoint", "(a) fixed final checkpoint", "(b) matched steps")):
        assert name in design["title"]
        # A row per rate: the mechanism, the one-step medians (certified, Monte Carlo, baseline, both ratios), the
        # whole run; then the verdicts between adjacent rates.
        mechanism, one_step, whole_run, changes = design["tables"]
        rates = len(mechanism) - 1
        assert rates >= 2 and len(one_step) == len(whole_run) == rates + 1
        assert one_step[0][:6] == ["q", "certified", "Monte Carlo estimate", "mean-rule baseline",
                                   "certified ÷ baseline", "Monte Carlo ÷ baseline"]
        assert all(re.fullmatch(r"[\d.e+-]+ \[[\d.e+-]+, [\d.e+-]+\]", cell) for row in one_step[1:] for cell in row[1:3])
        assert len(changes[0]) == rates and changes[1][0] == "certified ÷ baseline, one step"
        assert all(any(cell.startswith(verdict) for verdict in (FALLS, RISES, NO_DIFFERENCE))
                   for row in changes[1:] for cell in row[1:] if cell)
    assert all(FIXED_WHOLE_RUN in "\n".join(design["lines"]) for design in designs[:2])
    assert MATCHED_WHOLE_RUN in "\n".join(designs[2]["lines"])
    # The claim is judged per adjacent pair of rates from the 95% intervals, never from a strict order of medians.
    claim = found[5]
    assert "GLA's claim" in claim["prose"][0] and re.search(r"at \d+ of \d+ steps up in q", claim["prose"][0])
    steps = sum(len(design["tables"][3][0]) - 1 for design in designs)
    assert len(claim["tables"][0]) == steps + 1
    interval = re.compile(r"-?[\d.e+-]+%? \[-?[\d.e+-]+%?, -?[\d.e+-]+%?\]")
    for finding in (found[0], found[1], found[6], found[7], found[8], found[9], found[13], found[19]):
        assert any(interval.fullmatch(cell) for cell in report_markdown.cells(finding)), finding["key"]
    accountants = {row[0]: row for row in found[7]["tables"][0][1:]}
    assert {"RDP", "PLD"} <= set(accountants)
    # 16 tracked points of 96: every point's composition holds Δ* between checkpoints, the bound covers those 16.
    assert "a held-Δ* estimate, since only 16 points were tracked at every step" in found[6]["prose"][0]
    assert accountants["RDP, Δ* at every step of the 16 tracked points"][1] == "bound along the observed run"
    assert accountants["RDP"][1] == "held-Δ* estimate"
    assert "16 points; the held-Δ* estimate holds Δ* between the" in "\n".join(found[9]["lines"])
    assert "Simulated audit of the sum rule" == found[10]["title"] and "Simulated audit of the mean rule" == found[11]["title"]
    for audit in found[10:12]:
        groups = {row[0]: row for row in audit["tables"][0][1:]}
        assert set(groups) <= {"easy", "hard", "misclassified", "all"} and groups["all"][-1].startswith("0 of ")
    assert "realised-size mean rule" in found[12]["title"] and "Membership" in found[13]["title"]
    for finding, norm in zip(found[14:17], ("0.1", "0.3", "1")):
        assert f"canaries of norm {norm}·Γ" in finding["title"] and finding["prose"][0].startswith("No violation")
        rows = {row[0]: row for row in finding["tables"][0][1:]}
        # The assumption-free bound beside the family bound, each at the group's level α/G, and what the family
        # bound assumes.
        assert rows["f-DP family bound, likelihood ratio"][2] == (
            "lower bound (98.3%), if the curve has the subsampled-Gaussian shape")
        assert rows["Steinke et al.'s (ε, δ) test, likelihood ratio (assumption-free)"][2] == "lower bound (98.3%)"
        assert "each bound at level 0.05/3 = 0.0167" in "\n".join(finding["lines"])
    assert "holds for the 3 groups together at 0.05" in found[17]["prose"][0]
    assert "canaries" in found[18]["title"] and "the f-DP test needs" in found[18]["prose"][0]
    for name in FIGURES:
        assert f"({name})" in report


def test_report_keeps_its_rules(image_runs):
    # At most 60 words of prose a finding, a one-sentence takeaway, and every summary cell a cell of its finding.
    _, _, runs = image_runs
    report = runs["first"][1]
    assert report_markdown.rule_breaks(report) == []
    summary = report_markdown.summary_rows(report)
    assert [row["report"] for row in summary][:2] == ["[1](#per-step-eps)", "[2](#misclassified)"]
    assert any("assumption-free" in row["finding"] for row in summary)


def test_report_html_beside_report_md(image_runs):
    workdir, _, runs = image_runs
    page = (workdir / "out" / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "http://" not in page and "https://" not in page
    report = runs["changed"][1]  # the last run's: both files are rewritten by every run
    for finding in report_markdown.findings(report):
        assert f'<section id="{finding["key"]}">' in page
        for cell in report_markdown.cells(finding):
            assert html.escape(cell, quote=False) in page or "`" in cell or "[" in cell, cell
    # Every figure the Markdown shows is inlined in the page: the reproduction's own and the main run's galleries.
    shown = [line for line in report.splitlines() if line.startswith("![")]
    assert len(shown) > len(FIGURES) and page.count('<img src="data:image/png;base64,') == len(shown)


def test_the_filtered_run_against_uniform_dp_sgd(image_runs):
    """The main job's individual filter (filtered_run.py, report_filter.py): trained at the main run's σ and δ with its
    ε as every budget to 2·T, against the main run retrained without canaries; its numbers against the runs' own
    files."""
    workdir, _, runs = image_runs
    report = runs["first"][1]
    finding = {finding["key"]: finding for finding in report_markdown.findings(report)}["filter-run"]
    (main, filtered, uniform) = (load_run(str(next((workdir / "models").glob(f"*-{suffix}"))))
                                 for suffix in ("sum", "filter", "uniform"))
    assert filtered.noise_multiplier == uniform.noise_multiplier == main.noise_multiplier and not uniform.canaries
    assert filtered.total_steps == 2 * main.total_steps and filtered.measure_every == PRESETS["tiny"].filter_every
    assert filtered.point_filter["budget_eps"] == PRESETS["tiny"].eps and filtered.delta == main.delta
    assert main.total_steps in filtered.checkpoint_steps
    trainings = [line for line in report_commands(report) if line.startswith("python train_dpsgd.py")]
    assert sum("--budget-eps 10.0 " in line and f"--sigma {main.noise_multiplier!r} " in line for line in trainings) == 1
    rows = {row[0]: row for row in finding["tables"][0][1:]}
    record = pd.read_csv(workdir / "models" / filtered.run / "filter_points.csv")
    left = record["left_step"].notna()
    assert rows["points that left before the cap"][2] == f"{left.sum()} of {len(record)}"
    past = (record["steps_active"] > main.total_steps).mean()
    assert rows["points trained past uniform DP-SGD's last step [95% interval]"][2].startswith(f"{100 * past:.3g}% [")
    assert rows["points whose composed ε passes their guarantee"][2] == f"0 of {len(record)}"
    composed = main_run.guarantees(pd.read_csv(workdir / "res" / f"{filtered.run}_compo.csv"), ["point"])
    assert np.all(composed["eps"] <= composed["guarantee_eps"])
    # The test accuracies are the trainer's own at those checkpoints.
    for column, run, step in ((1, uniform, main.total_steps), (2, filtered, main.total_steps)):
        payload = torch.load(workdir / "models" / run.run / f"step_{step:07d}.pt", weights_only=True)
        assert rows[f"test accuracy at step T = {main.total_steps}"][column] == f"{payload['test_accuracy']:.4f}"
    headline = [row for row in report_markdown.summary_rows(report) if row["report"] == "[20](#filter-run)"]
    assert len(headline) == 3


def test_a_preset_without_a_filtered_run_says_so():
    assert PRESETS["mnist"].filter_cap == PRESETS["cifar10"].filter_cap == 0
    skipped = dataclasses.replace(PRESETS["tiny"], filter_cap=0.0)
    assert not set(FILTER_FIGURES.values()) & set(figures_drawn(skipped))
    assert set(FILTER_FIGURES.values()) <= set(figures_drawn(PRESETS["tiny"]))
    (finding,), headlines = report_filter.filter_findings(skipped, None)
    assert finding.key == "filter-run" and finding.takeaway.startswith("Not run: filter_cap = 0") and not headlines
    for value, fragment in (("0.5", "at least 1"), ("-1", "at least 1")):
        with pytest.raises(UsageError, match=fragment):
            check_config(apply_overrides(PRESETS["tiny"], [f"filter_cap={value}"]))
    with pytest.raises(UsageError, match="filter_every=0"):
        check_config(apply_overrides(PRESETS["tiny"], ["filter_every=0"]))


def test_one_run_audit_of_the_tiny_preset(image_runs):
    workdir, _, runs = image_runs
    report = runs["first"][1]
    tiny = PRESETS["tiny"]
    (main_audit,) = (workdir / "res").glob("*-sum_one_run_audit.csv")
    rows = pd.read_csv(main_audit)
    assert rows["norm"].tolist() == pytest.approx(list(tiny.canary_norms))
    assert rows["canaries"].tolist() == [tiny.canaries // len(tiny.canary_norms)] * len(tiny.canary_norms)
    assert not rows["violated"].any()
    assert rows["group_significance"].tolist() == pytest.approx([tiny.audit_significance / 3] * 3)
    found = {finding["key"]: finding for finding in report_markdown.findings(report)}
    # The c = 1 group's upper bounds are the main run's worst case composed by each accountant (finding 8, its
    # baseline from renyi_per_instance_sum_compo.py), at the 3 digits the report quotes.
    accountants = found["accountants"]["tables"][0]
    worst = {row[0]: float(row[accountants[0].index("worst case")]) for row in accountants[1:]}
    last = rows.iloc[-1]
    assert last["upper_rdp"] == pytest.approx(worst["RDP"], rel=5e-3)
    assert last["upper_pld"] == pytest.approx(worst["PLD"], rel=5e-3)
    # Each group's caps in the report: every lower bound below its test's cap; the (ε, δ) test's below
    # logit((α/3/8)^(1/r)), the δ → 0 cap of r right guesses at the grid's largest count (r = m/2).
    scope = found["one-run-scope"]["tables"][0]
    caps = [(row[scope[0].index("f-DP test's cap")], row[scope[0].index("(ε, δ) test's cap")]) for row in scope[1:]]
    grid = len(one_run_audit.GUESS_FRACTIONS)
    for (fdp_cap, steinke_cap), row in zip(caps, rows.itertuples(), strict=True):
        assert row.lower_bound <= float(fdp_cap) * (1 + 5e-3) and row.steinke_lower <= float(steinke_cap) * (1 + 5e-3)
        assert float(steinke_cap) <= logit((tiny.audit_significance / 3 / grid) ** (1 / (row.canaries // 2))) + 1e-2
    # The output folder's table: a row per group and statistic, the columns of docs/audit.md §1b.
    table = pd.read_csv(workdir / "out" / one_run.TABLE)
    assert list(table.columns) == ["canary_norm", "canaries", "lower_bound", "upper_bound", "ideal_lower_bound",
                                   "statistic"]
    assert table["statistic"].tolist() == ["likelihood_ratio", "summed"] * 3
    assert table["lower_bound"].tolist() == pytest.approx(
        [value for pair in zip(rows["lower_bound"], rows["lower_bound_summed"]) for value in pair])
    (gap_audit,) = (workdir / "res").glob("*-gap-canaries_one_run_audit.csv")
    gap = pd.read_csv(gap_audit)
    assert gap["canaries"].tolist() == [tiny.gap_canaries] and gap["norm"].tolist() == [1.0]
    # The timing table has the audit's steps.
    assert re.search(r"\| audit.py run=[^|]*-sum \| [\d.]+ \|", report)
    assert "| figure 10: the one-run audit |" in report


def test_report_reflects_the_dataset_override(image_runs):
    _, dataset, runs = image_runs
    result, report, _ = runs["first"]
    assert "synthetic" not in report  # the preset's own dataset is named nowhere
    assert f"on `{dataset}`" in report and "N = 96" in report  # from the main run's run.json
    assert f"| `dataset` | `{dataset}` (overridden) |" in report
    assert "| `mean_batch_sizes` | `8,16` (overridden) |" in report
    assert "| `num_batches` | `64` |" in report  # not overridden: the preset's value, unmarked
    trainings = [line for line in report_commands(report) if line.startswith("python train_dpsgd.py")]
    # The main run, one mean-rule run per batch size, the small runs of the gap audit and of its one-run audit (the
    # dataset's first points, the second with canaries), the non-private runs of the membership attack: one per
    # learning rate of the grid on the points less the held-out fifth (a random 19 of 96 held out), then the chosen one; and
    # the filtered run with its uniform reference (the main run without canaries).
    grid = PRESETS["tiny"].nodp_lrs
    assert len(trainings) == 8 + len(grid) and all(f"{dataset} " in line for line in trainings)
    assert sum(f"--dataset first:32:{dataset} " in line for line in trainings) == 2
    assert sum(f"--dataset holdout:19:{dataset} " in line and "--no-dp" in line for line in trainings) == len(grid)
    assert sum("--canaries" in line for line in trainings) == 2
    # Every command of the report is one that the run printed as it executed it, and vice versa.
    printed = [line[2:] for line in result.stdout.splitlines() if line.startswith("$ ")]
    assert [line for line in report_commands(report) if not line.startswith("# in-process: ")] == printed


ACCOUNTANTS = ("eps_delta.py", "renyi_per_instance_sum.py", "renyi_per_instance_mean.py", "renyi_per_instance_sum_compo.py",
               "audit.py", "membership_inference.py")


def report_command_lines(report):
    """The lines of the report's Commands section, with their '# cached' marks."""
    return report.split("## Commands")[1].split("```")[1].strip().splitlines()


def report_commands(report):
    return [line.removesuffix("  # cached") for line in report_command_lines(report)]


def uncached_accountants(report):
    return [line for line in report_command_lines(report)
            if line.split()[1] in ACCOUNTANTS and not line.endswith("  # cached")]


def test_rerun_reuses_everything(image_runs):
    _, _, runs = image_runs
    first, again = runs["first"][0], runs["again"][0]
    assert "trained steps" in first.stdout and "skipping" not in first.stdout
    assert not any(line.endswith("# cached") for line in report_command_lines(runs["first"][1]))
    assert "already trained" in again.stdout and "trained steps" not in again.stdout
    assert "0 rows written" in again.stdout
    assert uncached_accountants(runs["again"][1]) == []
    # Four accountants of the main run; per checkpoint of the fixed-checkpoint design its measurement and one
    # accountant per rate; four accountants per mean-rule run; three audits and the membership attack; the one-run
    # audits of the main run and of the gap run with canaries; the filtered run's composition.
    rates = len(PRESETS["tiny"].fixed_sample_rates)
    assert sum(line.endswith("  # cached") for line in report_command_lines(runs["again"][1])) == (
        4 + 2 * (1 + rates) + 4 * 2 + 4 + 2 + 1)
    assert runs["again"][2] == runs["first"][2]


def test_changed_accountant_flag_recomputes_only_that_output(image_runs, tmp_path):
    workdir, _, runs = image_runs
    result, report, per_step = runs["changed"]
    assert "| `per_step_method` | `holder` (overridden) |" in report
    [command] = uncached_accountants(report)
    out = command.split("--out ")[1].split()[0]
    assert command.startswith("python eps_delta.py ") and out.endswith("-sum_eps_delta.csv")
    assert "--method holder" in command
    assert f"(skipping eps_delta.py: {out} " not in result.stdout
    # The recomputed output is what the accountant writes on its own for --method holder, not the exact one.
    argv = command.split()[2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "direct.csv")
    direct = run_in_process("eps_delta.py", *argv, cwd=workdir)
    assert direct.returncode == 0, direct.stderr
    assert per_step == [(tmp_path / "direct.csv").read_bytes()]
    assert per_step != runs["first"][2]


def test_presets_hold_values_of_their_fields_types():
    for preset in PRESETS.values():
        for field in dataclasses.fields(preset):
            value = getattr(preset, field.name)
            if typing.get_origin(field.type) is tuple:
                (item_type, _) = typing.get_args(field.type)
                assert type(value) is tuple and value, field.name
                assert all(type(item) is item_type for item in value), field.name
            elif typing.get_origin(field.type) is typing.Literal:
                assert value in typing.get_args(field.type), field.name
            else:
                assert type(value) is field.type, (field.name, value)


def test_overrides_are_parsed_by_field_type():
    tiny = PRESETS["tiny"]
    config = apply_overrides(tiny, ["mean_batch_sizes=64,256", "num_batches=100", "lr=0.25",
                                              "per_step_method=holder", "mean_points=random:7", "num_batches=120"])
    assert config == dataclasses.replace(tiny, mean_batch_sizes=(64, 256), num_batches=120, lr=0.25,
                                         per_step_method="holder", mean_points="random:7")
    assert overridden(config, "tiny") == {"mean_batch_sizes": (64, 256), "num_batches": 120, "lr": 0.25,
                                                    "per_step_method": "holder", "mean_points": "random:7"}
    assert apply_overrides(tiny, ["epochs=2"]) == tiny  # 2 is the preset's 2.0


def test_a_changed_run_or_measurement_gets_a_new_name_and_an_accountant_flag_does_not():
    tiny = PRESETS["tiny"]
    main_fields, mean_fields = MAIN_RUN_FIELDS, MAIN_RUN_FIELDS + MEAN_RULE_FIELDS
    assert variant_tag(tiny, "tiny", mean_fields) == ""
    lr = apply_overrides(tiny, ["lr=0.3"])
    other_lr = apply_overrides(tiny, ["lr=0.4"])
    assert re.fullmatch(r"-[0-9a-f]{8}", variant_tag(lr, "tiny", main_fields))
    assert variant_tag(lr, "tiny", main_fields) != variant_tag(other_lr, "tiny", main_fields)
    points = apply_overrides(tiny, ["mean_points=random:5"])
    assert variant_tag(points, "tiny", main_fields) == ""
    assert variant_tag(points, "tiny", mean_fields) != ""
    accountant = apply_overrides(tiny, ["delta=1e-6", "per_step_method=holder"])
    assert variant_tag(accountant, "tiny", mean_fields) == ""


def test_canaries_zero_trains_the_main_run_without_them_and_skips_the_one_run_audit():
    tiny = PRESETS["tiny"]
    no_canaries = apply_overrides(tiny, ["canaries=0"])
    check_config(no_canaries)  # accepted, whatever canary_norms holds
    name, flags = main_run.main_run_flags(no_canaries, "tiny", "tiny-synthetic", "cpu")
    assert "--canaries" not in flags and "--canary-norms" not in flags
    default_name, default_flags = main_run.main_run_flags(tiny, "tiny", "tiny-synthetic", "cpu")
    assert default_flags[default_flags.index("--canaries") + 1] == str(tiny.canaries)
    # Its own folder: never resumed from, nor mistaken for, the preset's run with canaries.
    assert name != default_name and flags[flags.index("--save-name") + 1] == name
    # Otherwise the same training flags.
    assert [flag for flag in default_flags[:default_flags.index("--canaries")] if flag != default_name] == [
        flag for flag in flags if flag != name]
    assert figures_drawn(no_canaries) == [figure for figure in FIGURES if figure != ONE_RUN_FIGURE]
    assert figures_drawn(tiny) == FIGURES
    assert [figure.file for figure in report_figures(no_canaries)] == [
        file for file in CAPTIONS if file != ONE_RUN_FIGURE]
    skipped = report_audits.gap_canary_finding(no_canaries, None)
    assert skipped.takeaway == "Not run (gap_canaries = 0)." and skipped.table is None


def test_tiny_preset_without_canaries(tmp_path):
    result = run_in_process("reproduce.py", "--preset", "tiny", "--set", "canaries=0", "--out-dir", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "out" / "report.md").read_text()
    findings = report_markdown.findings(report)
    assert report_markdown.rule_breaks(report) == []
    # The findings per canary group and the one on what the audit shows are one finding saying it did not run.
    assert findings[14]["prose"] == ["Not run: the main run carries no canaries (canaries = 0)."]
    # Every point tracked at every step: the headline is a bound, the held-Δ* estimate is compared with it, and Δ*
    # at the checkpoints is read from the tracked table instead of measured again.
    assert "a bound along the observed run, from Δ* of every point at every step" in findings[6]["prose"][0]
    accountants = {row[0]: row[1] for row in findings[7]["tables"][0][1:]}
    assert accountants == {"RDP": "bound along the observed run", "PLD": "bound along the observed run",
                           "RDP, Δ* held between the checkpoints": "held-Δ* estimate"}
    assert "512 points; the held-Δ* estimate holds Δ* between the 8 checkpoints" in "\n".join(findings[9]["lines"])
    assert not any("one-run audit" in row["finding"] for row in report_markdown.summary_rows(report))
    commands = report_commands(report)
    assert not [line for line in commands if line.startswith("python compute_sensitivity.py") and "-sum " in line]
    composed = [line for line in commands if line.startswith("python renyi_per_instance_sum_compo.py --res-file models/")
                and "-filter/" not in line]
    assert len(composed) == 3 and all("tracked_norms.csv" in line for line in composed)
    assert sum("--steps 0,1,2,4,8,16,24,32 " in line for line in composed) == 1
    assert "canaries against the sum rule's accounting" in findings[15]["title"]
    # Without canaries the main run is the uniform run the filtered run is compared with.
    assert findings[16]["key"] == "filter-run" and "uniform DP-SGD: the main run (`tiny-synthetic-" in "\n".join(
        findings[16]["lines"])
    assert not [line for line in commands if line.startswith("python train_dpsgd.py") and "-uniform " in line + " "]
    assert all(finding["key"].startswith("points-") for finding in findings[17:])
    assert not (tmp_path / "out" / ONE_RUN_FIGURE).exists() and f"({ONE_RUN_FIGURE})" not in report
    assert "figure 10" not in report and "figure 10" not in result.stdout
    for name in figures_drawn(PRESETS["tiny"]):
        assert (name == ONE_RUN_FIGURE) != (f"({name})" in report), name
    assert f"{len(FIGURES) - 1} figures, " in result.stdout
    # Only the gap run of §1c carries canaries; the main run is audited by nothing else than before.
    trainings = [line for line in report_commands(report) if line.startswith("python train_dpsgd.py")]
    assert [line for line in trainings if "--canaries" in line] == [
        line for line in trainings if "-gap-canaries " in line + " "]
    assert len([line for line in trainings if "--canaries" in line]) == 1
    assert [path.name for path in (tmp_path / "res").glob("*_one_run_audit.csv")] == [
        path.name for path in (tmp_path / "res").glob("*-gap-canaries_one_run_audit.csv")]


@pytest.mark.parametrize("flags,flag,fragments", [
    (["--preset", "huge"], "--preset", []),
    (["--dataset", "imagefolder:/nonexistent/images"], "--dataset", ["/nonexistent/images"]),
    (["--set", "dataset=imagefolder:/nonexistent/images"], "--set", ["dataset=", "/nonexistent/images"]),
    (["--set", "batchsize=64"], "--set", ["'batchsize'", "mean_batch_sizes", "renyi_order"]),
    (["--set", "num_batches"], "--set", ["FIELD=VALUE", "num_batches"]),
    (["--set", "num_batches=many"], "--set", ["num_batches=many", "int", "mean_points"]),
    (["--set", "mean_batch_sizes=64,x"], "--set", ["mean_batch_sizes=64,x", "comma-separated ints"]),
    (["--set", "mean_batch_sizes="], "--set", ["mean_batch_sizes", "empty"]),
    (["--set", "lr=nan"], "--set", ["lr=nan", "finite"]),
    (["--set", "eps=inf"], "--set", ["eps=inf", "finite"]),
    (["--set", "per_step_method=gla"], "--set", ["per_step_method=gla", "one of exact, holder"]),
    (["--set", "canaries=100"], "--set", ["canaries=100", "0 (no one-run audit)", "multiple of the 3 canary_norms"]),
    (["--set", "canaries=-3"], "--set", ["canaries=-3", "0 (no one-run audit)"]),
    (["--set", "canaries=3"], "--set", ["canaries=3", "at least 2 per group"]),
    (["--set", "canary_norms=0.1,2"], "--set", ["canary_norms=0.1,2.0", "(0, 1]"]),
    (["--set", "audit_significance=1.5"], "--set", ["audit_significance=1.5", "(0, 1)"]),
    (["--set", "gap_canaries=1"], "--set", ["gap_canaries=1", "at least 2"]),
    (["--groups", "missing.csv"], "--groups", ["missing.csv", "point and group"]),
])
def test_bad_input(tmp_path, run, flags, flag, fragments):
    before = snapshot(tmp_path)
    result = run("reproduce.py", "--preset", "tiny", *flags) if flags[0] != "--preset" else run("reproduce.py", *flags)
    assert_usage_error(result, flag)
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
    assert snapshot(tmp_path) == before


def test_groups_naming_a_point_outside_the_training_set_are_refused_before_any_work(tmp_path, run):
    (tmp_path / "groups.csv").write_text("point,group\n0,a\n100000,b\n")
    before = snapshot(tmp_path)
    result = run("reproduce.py", "--preset", "tiny", "--groups", "groups.csv")
    assert_usage_error(result, "--groups")
    assert "line 3: point 100000 is not a training point" in result.stderr, result.stderr
    assert snapshot(tmp_path) == before  # nothing trained, no folder made


def test_out_dir_that_is_a_file_is_refused(tmp_path, run):
    (tmp_path / "taken").write_text("x")
    before = snapshot(tmp_path)
    assert_usage_error(run("reproduce.py", "--preset", "tiny", "--out-dir", "taken"), "--out-dir")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("others, sample_rate, expected_batch", [(72, 1 / 16, 4.0), (590, 1 / 16, 4.0), (0, 0.5, 1.0)])
def test_mean_rule_signal_ratio_by_enumeration(others, sample_rate, expected_batch):
    # E[B_exp/(1 + K)], K ~ Binomial(others, q), summed term by term.
    counts = np.arange(others + 1)
    enumerated = float(np.sum(binom.pmf(counts, others, sample_rate) * expected_batch / (1 + counts)))
    assert one_run.mean_rule_signal_ratio(others=others, sample_rate=sample_rate,
                                          expected_batch=expected_batch) == pytest.approx(enumerated, rel=1e-12)

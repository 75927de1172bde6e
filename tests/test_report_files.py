"""report.md and report.html from one Report (plots/report_files.py): the same cells in both, figures inlined."""

import base64
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from perinstance.plots import report_files  # noqa: E402
from perinstance.plots.document import Figure, Finding, Report, Section, Table  # noqa: E402


def small_report(folder):
    figure, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    figure.savefig(os.path.join(folder, "1_line.png"))
    plt.close(figure)
    return Report(
        title="A report", opening="One run, `tiny`.",
        summary=Table(("finding", "value"), (("median ε", "0.5 [0.4, 0.6]"), ("a | b", "7×"))),
        findings=(Finding("median", "Median ε", "The median point pays **less**.",
                          Table(("group", "median"), (("all", "0.5 [0.4, 0.6]"),)), figures=("1_line.png",),
                          note="A note.", more="docs/findings.md#median"),),
        figures=(Figure("1_line.png", "Figure 1: a line", "Look at the line: it rises."),),
        sections=(Section("Commands", code=("python train_dpsgd.py <x>",)),))


def test_both_files_hold_the_same_cells(tmp_path):
    report = small_report(tmp_path)
    markdown_path, html_path = report_files.write_report_files(str(tmp_path), report)
    markdown = open(markdown_path, encoding="utf-8").read()
    page = open(html_path, encoding="utf-8").read()
    for cell in ("0.5 [0.4, 0.6]", "7×", "Median ε", "Look at the line: it rises."):
        assert cell in markdown and cell in page
    assert "a \\| b" in markdown and "a | b" in page
    assert "[Figure 1: a line](#figure-1-line)" in markdown
    assert 'href="#figure-1-line"' in page and 'id="figure-1-line"' in page
    assert "<strong>less</strong>" in page and "&lt;x&gt;" in page
    with open(tmp_path / "1_line.png", "rb") as handle:
        assert base64.b64encode(handle.read()).decode("ascii") in page  # inlined: the page stands alone
    assert "http://" not in page and "https://" not in page


def test_a_missing_figure_is_refused_before_anything_is_written(tmp_path):
    report = small_report(tmp_path)
    os.remove(tmp_path / "1_line.png")
    with pytest.raises(ValueError, match="1_line.png"):
        report_files.write_report_files(str(tmp_path), report)
    assert not (tmp_path / "report.md").exists() and not (tmp_path / "report.html").exists()


def test_prose_words_count_takeaway_and_note_only():
    finding = Finding("k", "A long title of many words", "Three words here.", Table(("a",), (("x y z w",),)),
                      note="Two more.")
    assert report_files.prose_words(finding) == 5


def test_table_titles_further_tables_and_links_in_cells(tmp_path):
    report = small_report(tmp_path)
    finding = Finding("rates", "Per rate", "It falls.", Table(("q", "value"), (("0.1", "2"),), title="One step"),
                      extra_tables=(Table(("q", "verdict"), (("0.1→0.2", "falls"),), title="Between rates"),))
    report = Report(report.title, report.opening, Table(("finding", "report"), (("per rate", "[2](#rates)"),)),
                    (*report.findings, finding), report.figures, report.sections)
    markdown_path, html_path = report_files.write_report_files(str(tmp_path), report)
    markdown = open(markdown_path, encoding="utf-8").read()
    page = open(html_path, encoding="utf-8").read()
    # Both tables, in order, each under its title; the title is not prose.
    section = markdown.split('<a id="rates"></a>')[1]
    assert section.index("Table: One step") < section.index("| 0.1 | 2 |") < section.index("Table: Between rates") \
        < section.index("| 0.1→0.2 | falls |")
    assert report_files.prose_words(finding) == 2
    assert '<p class="table-title">One step</p><table>' in page
    assert '<p class="table-title">Between rates</p><table>' in page
    # A link in a cell is a link in the page, to the finding's section.
    assert "| per rate | [2](#rates) |" in markdown
    assert '<a href="#rates">2</a>' in page and '<section id="rates">' in page

"""The report's rules on the committed report of the main job (docs/figures/quick_report.md), read back as
report_files.py writes it: at most 60 words of prose a finding, a one-sentence takeaway, every summary cell the
very cell of the finding it links to; and every figure with a caption."""

import os
import re

import pytest
import report_markdown
from conftest import ROOT

from perinstance.experiments.commands import CAPTIONS, FIGURES
from perinstance.experiments.report_cells import Headline, summary_table
from perinstance.plots.document import Finding, Table

COMMITTED = os.path.join(ROOT, "docs", "figures", "quick_report.md")


def committed_report():
    with open(COMMITTED, encoding="utf-8") as handle:
        return handle.read()


def test_the_committed_report_keeps_the_rules():
    text = committed_report()
    assert report_markdown.rule_breaks(text) == []
    found = report_markdown.findings(text)
    assert len(found) >= 19 and all(report_markdown.prose_words(finding) > 0 for finding in found)
    assert len(report_markdown.summary_rows(text)) >= 10


def test_a_broken_rule_is_seen():
    text = committed_report()
    first = report_markdown.summary_rows(text)[0]
    changed = text.replace(f"| {first['value']} |", f"| {first['value']}0 |", 1)
    assert any("is no cell of" in line for line in report_markdown.rule_breaks(changed))
    takeaway = report_markdown.findings(text)[0]["prose"][0]
    longer = text.replace(takeaway, takeaway + " More words" * 40, 1)
    assert any("words of prose" in line for line in report_markdown.rule_breaks(longer))
    two_sentences = text.replace(takeaway, takeaway + " Another sentence.", 1)
    assert any("not one sentence" in line for line in report_markdown.rule_breaks(two_sentences))


def test_a_summary_row_quotes_its_findings_cell():
    finding = Finding("k", "A finding", "It holds.", Table(("", "value"), (("median", "1.5 [1.4, 1.6]"),
                                                                           ("worst case", "3"))))
    table = summary_table([Headline("the median", "k", "median", "value", ("worst case", "value"), "bound")], [finding])
    assert table.rows == (("the median", "1.5 [1.4, 1.6]", "3", "bound", "[1](#k)"),)
    with pytest.raises(ValueError, match=r"\('mean', 'value'\)"):
        summary_table([Headline("the median", "k", "mean", "value", None, "bound")], [finding])


def test_every_figure_has_a_title_and_a_caption_with_its_delta():
    assert set(CAPTIONS) == set(FIGURES)
    for file, (title, caption) in CAPTIONS.items():
        assert title.startswith("Figure ") and len(caption.split()) >= 20, file
        # Every figure that plots an ε says at which δ; one of Rényi DP says it has none.
        assert "δ = {delta}" in caption or "Rényi bounds have no δ" in caption, file


def test_every_findings_more_link_has_its_section_in_the_docs():
    with open(os.path.join(ROOT, "docs", "findings.md"), encoding="utf-8") as handle:
        anchors = set(re.findall(r'<a id="([^"]+)"></a>', handle.read()))
    linked = {anchor for finding in report_markdown.findings(committed_report()) for line in finding["lines"]
              for anchor in re.findall(r"More: \[docs/findings\.md#([^\]]+)\]", line)}
    assert len(linked) >= 15 and linked <= anchors, linked - anchors

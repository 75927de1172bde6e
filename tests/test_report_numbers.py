"""One set of numbers: every number about the main job's run that README.md or docs/ quote is one the committed
report (docs/figures/quick_report.md) contains, at the precision the page writes it.

Scope, by a convention the pages follow: a quote of the main job's numbers stands between the two lines

    <!-- report numbers -->
    <!-- /report numbers -->

(invisible in the rendered page). Every number inside such a passage is checked: it must round, at the
precision written, to a number of the report (a percentage also to a fraction, 5.7% to 0.0571; 8,000 is
8000; −0.75 is -0.754 rounded). References are not numbers of the run and are skipped: § sections, figure
and finding numbers, code spans, link targets, a name such as LeNet-5. Benchmarks, other runs, simulations
and docs/measurements.md (a dated log) stay outside these passages and outside this test. The report is read
as text, whatever its layout (sentences, tables), so a regenerated report in another format still serves;
a rerun that changes a finding makes every stale quote of it fail here.
"""

import bisect
import math
import os
import re
from typing import NamedTuple

import pytest
from conftest import ROOT

REPORT = os.path.join("docs", "figures", "quick_report.md")
PAGES = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                               if name.endswith(".md") and name != "measurements.md")
# The pages that quote the main job's run: each must keep its quotes where this test reads them.
QUOTING = {"README.md", os.path.join("docs", "findings.md"), os.path.join("docs", "performance.md"),
           os.path.join("docs", "audit.md")}
BEGIN, END = "<!-- report numbers -->", "<!-- /report numbers -->"
PASSAGE = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.S)

# Not numbers of the run: code, links, comments, section, figure and finding references.
REFERENCES = re.compile(
    r"```.*?```|`[^`\n]*`|\]\([^)]*\)|<!--.*?-->"
    r"|§\s?\d+(?:\.\d+)*(?:\s?[–-]\s?\d+(?:\.\d+)*)?"
    r"|\b(?:[Ff]igures?|[Ff]indings?)\s+\d+(?:(?:,\s*|\s+and\s+|\s*[–-]\s*)\d+)*", re.S)
# A number as a page or the report writes it: a sign only where it is one (not the hyphen of 10-90 or LeNet-5),
# thousands separators, a decimal part, an exponent, a percent sign; not part of a word (3T, x2, step125).
NUMBER = re.compile(
    r"(?<![\w.])(?<![A-Za-z]-)(?P<sign>[−+]|(?<![\w)\]])-)?"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?P<exponent>[eE][−+-]?\d+)?"
    r"(?![\w.]\d|[A-Za-z_])(?P<percent>\s?%)?")


class Written(NamedTuple):
    """A number as written: its value, half a unit of its last digit, whether it is a percentage, where it is."""

    value: float
    half_unit: float
    percent: bool
    start: int
    end: int


def numbers(text):
    """Every number in `text`, as Written."""
    found = []
    for match in NUMBER.finditer(text):
        digits = match["digits"].replace(",", "")
        exponent = int(match["exponent"][1:].replace("−", "-")) if match["exponent"] else 0
        decimals = len(digits.partition(".")[2])
        value = float(digits) * 10.0 ** exponent * (-1 if match["sign"] in ("−", "-") else 1)
        found.append(Written(value, 0.5 * 10.0 ** (exponent - decimals), bool(match["percent"]), *match.span()))
    return found


def report_values(text):
    """The sorted values of every number in the report's text (a percentage also as its fraction)."""
    values = []
    for number in numbers(text):
        values.append(number.value)
        if number.percent:
            values.append(number.value / 100)
    return sorted(values)


def in_report(value, half_unit, percent, values):
    """Whether a report value rounds to `value` at the precision written (as a fraction too where it is a
    percentage)."""
    candidates = [(value, half_unit)] + ([(value / 100, half_unit / 100)] if percent else [])
    for wanted, tolerance in candidates:
        slack = tolerance * (1 + 1e-9) + 1e-300
        index = bisect.bisect_left(values, wanted - slack)
        if index < len(values) and values[index] <= wanted + slack:
            return True
    return False


def quoted_passages(text):
    """The marked passages of a page, each as (line number, text), after checking that the marks pair up."""
    assert text.count(BEGIN) == text.count(END) == len(PASSAGE.findall(text)), "unpaired report-numbers marks"
    return [(text.count("\n", 0, match.start()) + 1, match.group(1)) for match in PASSAGE.finditer(text)]


def checked_numbers(passage):
    """The numbers of a passage that are numbers of the run: references blanked out, positions kept."""
    return numbers(REFERENCES.sub(lambda match: " " * len(match.group(0)), passage))


def stale_quotes(text, values):
    """'line: quote' for every number of the marked passages of `text` that the report does not contain."""
    stale = []
    for line, passage in quoted_passages(text):
        for number in checked_numbers(passage):
            if not in_report(number.value, number.half_unit, number.percent, values):
                stale.append(f"line {line + passage.count(chr(10), 0, number.start)}: "
                             f"{passage[number.start:number.end].strip()}")
    return stale


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


@pytest.fixture(scope="module")
def values():
    return report_values(read(REPORT))


@pytest.mark.parametrize("page", PAGES)
def test_every_quoted_number_of_the_main_job_is_the_reports(page, values):
    assert stale_quotes(read(page), values) == [], f"{page} quotes numbers that {REPORT} does not contain"


def test_the_pages_that_quote_the_main_job_mark_their_quotes():
    marked = {page: quoted_passages(read(page)) for page in PAGES}
    assert {page for page in QUOTING if not marked[page]} == set()
    checked = {page: [len(checked_numbers(passage)) for _, passage in passages] for page, passages in marked.items()}
    # A passage without a number, or a convention nobody follows, would check nothing.
    assert all(count >= 1 for counts in checked.values() for count in counts), checked
    assert sum(sum(counts) for counts in checked.values()) >= 150


def test_a_stale_number_planted_in_a_quote_is_caught(values):
    """Each quoted number of the README's passages, moved to a value the report does not hold at its precision,
    fails the check; the passages as written pass."""
    text = read("README.md")
    assert stale_quotes(text, values) == []
    planted = 0
    for _, passage in quoted_passages(text):
        for number in checked_numbers(passage):
            step = 2 * number.half_unit
            stale = next(number.value + k * step for k in range(1, 10_000)
                         if not in_report(number.value + k * step, number.half_unit, number.percent, values))
            digits = f"{stale:.{max(0, -round(math.log10(step)))}f}" + ("%" if number.percent else "")
            changed = passage[:number.start] + " " + digits + " " + passage[number.end:]
            found = stale_quotes(f"{BEGIN}{changed}{END}", values)
            assert len(found) == 1 and found[0].endswith(f": {digits}"), (digits, found)
            planted += 1
    assert planted >= 20


@pytest.mark.parametrize("stale", ["PLD/RDP medians 4.53/5.68", "29 of 200 points, by up to 4.8%",
                                   "peak memory 2.18 GB"])
def test_the_stale_quotes_once_in_the_docs_are_caught(stale, values):
    assert stale_quotes(f"{BEGIN}\n{stale}\n{END}\n", values)


def test_the_report_is_read_as_text_in_any_layout():
    sentence = "composed ε (b=∞, δ=1e-05): median 7.095 [7.026, 7.151] (8000 points), 14.1% of them below, r = -0.754"
    table = ("| finding | median | interval | points | below | r |\n| --- | ---: | --- | ---: | ---: | ---: |\n"
             "| composed ε, b = ∞, δ = 1e-05 | 7.095 | [7.026, 7.151] | 8,000 | 14.1 % | −0.754 |")
    assert report_values(sentence) == report_values(table)
    quote = f"{BEGIN}\nmedian 7.10 [7.03, 7.15] of 8,000 points; 14.1% below; r = −0.75\n{END}"
    assert stale_quotes(quote, report_values(table)) == []


@pytest.mark.parametrize("quote, report", [
    ("5.7% [3.0%, 10.1%]", "ratio 0.0571 [0.03, 0.101]"),  # a fraction quoted as a percentage
    ("×5.6e-4 [2.7e-5, 42]", "×0.00056 [2.74e-05, 41.5]"),  # scientific notation either way
    ("91.1% test accuracy", "test accuracy at the end 0.9105"),
    ("(10–90%: 5.66–9.99)", "(10-90%: 5.661-9.994)"),  # an en dash and a hyphen are ranges, not minus signs
])
def test_a_quote_matches_the_report_number_it_rounds(quote, report):
    assert stale_quotes(f"{BEGIN}{quote}{END}", report_values(report)) == []


@pytest.mark.parametrize("quote, report", [
    ("7.11", "7.095"),  # beyond its last digit
    ("−0.75", "0.754"),  # the sign counts
    ("5.8%", "0.0571"),
    ("2,050 of the 8,000 points", "1128 of 8000 points"),
])
def test_a_quote_the_report_does_not_round_to_is_stale(quote, report):
    assert stale_quotes(f"{BEGIN}{quote}{END}", report_values(report))


def test_references_are_not_numbers_of_the_run():
    passage = ("LeNet-5 (figure 3, findings 11 and 12; accounting.md §11.7–11.12) with `--holder-b 3T` "
               "[report](figures/quick_report_2.md) <!-- 999 -->")
    assert checked_numbers(passage) == []

"""The cells of the report's tables, each number formatted once (docs/accounting.md §10 for the intervals), and the
rows of the summary table that quote them: a summary row names the cell of a finding's table it repeats, so that
the two cannot differ.
"""

import math
import re
from dataclasses import dataclass

import numpy as np

from perinstance.accounting import intervals
from perinstance.accounting.intervals import Interval
from perinstance.experiments.commands import FIGURES
from perinstance.plots.document import Finding, Table
from perinstance.plots.plots import interval_text

# The docs page that holds each finding's long explanation, at the finding's anchor.
FINDINGS_PAGE = "docs/findings.md"
# A cell with nothing to say for its row (a value of another kind, or none).
EMPTY = ""
# The kinds of number, one meaning each (docs/accounting.md §3.5, §4, §11).
BOUND = "bound"
BOUND_ALONG_RUN = "bound along the observed run"
HELD_ESTIMATE = "held-Δ* estimate"
MONTE_CARLO = "Monte Carlo estimate"
LOWER_BOUND = "lower bound (95%)"


def more_link(anchor: str) -> str:
    """The link of a finding to its section of docs/findings.md."""
    return f"{FINDINGS_PAGE}#{anchor}"


def figure_files(*patterns: str) -> tuple[str, ...]:
    """The figures of FIGURES a finding rests on, by the start of their file names (regular expressions): a figure
    drawn as several files is linked by all of them."""
    return tuple(file for file in FIGURES if any(re.match(pattern, file) for pattern in patterns))


def number(value: float, digits: int = 3) -> str:
    """A value at `digits` significant digits; "undefined" for NaN."""
    return "undefined" if isinstance(value, float) and math.isnan(value) else f"{value:.{digits}g}"


def count(value: int) -> str:
    """A count of points, canaries or steps, with thousands separators."""
    return f"{value:,}"


def share(value: float) -> str:
    """A share of points as a percentage."""
    return f"{100 * value:.1f}%"


def of(part: int, whole: int) -> str:
    """'51 of 64'."""
    return f"{count(part)} of {count(whole)}"


def interval(found: Interval | None, fallback: float = math.nan) -> str:
    """'0.123 [0.101, 0.14]': a median, ratio or mean with its 95% interval; the value alone where it has none."""
    return interval_text(found) if found is not None else number(fallback)


def percent(found: Interval, sign: str = "+") -> str:
    """'+0.12% [−0.05%, +0.3%]': a relative value with its 95% interval (sign "": without the plus signs)."""
    return (f"{100 * found.estimate:{sign}.3g}% [{100 * found.low:{sign}.3g}%, "
            f"{100 * found.high:{sign}.3g}%]")


def share_text(holds: np.ndarray) -> str:
    """'78.6% [77.8%, 79.6%]': the share of the points where `holds`, with its 95% interval (§10)."""
    return percent(intervals.share_interval(holds), sign="")


def worst_text(worst: np.ndarray) -> str:
    """Points' worst cases or guarantees: '10', or '8–12' where they differ (a filter's --budgets)."""
    low, high = f"{worst.min():.4g}", f"{worst.max():.4g}"
    return low if low == high else f"{low}–{high}"


def pearson(value: float, found: Interval | None) -> str:
    """Pearson r with its 95% interval, or why it is undefined."""
    if found is None:
        return "undefined (fewer than two distinct values)" if math.isnan(value) else f"{value:.3f}"
    return f"{value:.3f} [{found.low:.3f}, {found.high:.3f}]"


def confidence(level: float) -> str:
    """The confidence of a bound tested at significance `level`: 'lower bound (98.3%)'."""
    return f"lower bound ({100 * (1 - level):.3g}%)"


@dataclass(frozen=True)
class Headline:
    """A row of the summary table: its `label`, the finding it comes from (`key`), the cell of that finding's tables
    it quotes (`row`: the row's first cell, `column`: the heading), the cell it is held against (a worst case, an
    upper bound, chance; or None), and its kind."""

    label: str
    key: str
    row: str
    column: str
    against: tuple[str, str] | None
    kind: str


def table_cell(finding: Finding, row: str, column: str) -> str:
    """The cell of `finding`'s tables in the row whose first cell is `row`, under the heading `column`."""
    for table in finding.tables:
        if column in table.columns:
            for cells in table.rows:
                if cells[0] == row:
                    return cells[table.columns.index(column)]
    raise ValueError(f"finding {finding.key} has no cell ({row!r}, {column!r})")


def summary_table(headlines: list[Headline], findings: list[Finding]) -> Table:
    """The summary table that opens the report: per headline its value and what it is held against, both the very
    cells of its finding's table, its kind, and a link to the finding (by its number in the report)."""
    numbers = {finding.key: index for index, finding in enumerate(findings, 1)}
    by_key = {finding.key: finding for finding in findings}
    rows = []
    for headline in headlines:
        finding = by_key[headline.key]
        against = EMPTY if headline.against is None else table_cell(finding, *headline.against)
        rows.append((headline.label, table_cell(finding, headline.row, headline.column), against, headline.kind,
                     f"[{numbers[headline.key]}](#{headline.key})"))
    return Table(("finding", "value", "against", "kind", "report"), tuple(rows))

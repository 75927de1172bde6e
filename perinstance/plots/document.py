"""What a report is made of, before it is written as Markdown or HTML: findings (a one-sentence takeaway and a
table each), figures with captions, and plain sections. Every number in a report is a cell of a Table, formatted
once, so that report.md and report.html cannot disagree.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Table:
    """A table of formatted cells: `columns` headings, `rows` of as many strings each, and an optional `title` (what
    the table holds and under which settings: written above it)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    title: str = ""

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"a row of {len(row)} cells under {len(self.columns)} columns: {row!r}")


@dataclass(frozen=True)
class Figure:
    """A figure file of the report's folder (`file`, a PNG), its title, and a caption that says what to look at and
    what it shows."""

    file: str
    title: str
    caption: str


@dataclass(frozen=True)
class Finding:
    """One finding: `key` (a stable anchor, e.g. "per-step-eps"), a short `title`, a one-sentence `takeaway`, its
    numbers as a `table` (and `extra_tables` after it, where one table would mix rows of different kinds), the
    figures it rests on (files of Figure), an optional `note` (at most a sentence or two: the report's prose limit
    counts takeaway and note together) and `more`, a link to the docs page that explains it at length (a path
    relative to the repository, with an anchor)."""

    key: str
    title: str
    takeaway: str
    table: Table | None = None
    figures: tuple[str, ...] = ()
    note: str = ""
    more: str = ""
    extra_tables: tuple[Table, ...] = ()

    @property
    def tables(self) -> tuple[Table, ...]:
        """Every table of the finding, in the order written."""
        return ((self.table,) if self.table is not None else ()) + self.extra_tables


@dataclass(frozen=True)
class Section:
    """A plain section after the findings (configuration, commands, time and memory): a table, or preformatted
    lines (`code`), or both, under a heading."""

    heading: str
    intro: str = ""
    table: Table | None = None
    code: tuple[str, ...] = ()


@dataclass(frozen=True)
class Report:
    """A whole report: its title, a short opening paragraph, the summary table that opens it, the findings, the
    figures (drawn in this order), and the sections that follow."""

    title: str
    opening: str
    summary: Table
    findings: tuple[Finding, ...]
    figures: tuple[Figure, ...] = ()
    sections: tuple[Section, ...] = field(default_factory=tuple)

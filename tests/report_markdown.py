"""report.md read back, as perinstance/plots/report_files.py writes it: the summary table and every finding (its
key, number, title, prose and tables), so that tests can hold the written report, not only the objects it was
written from, to the report's rules."""

import re

from perinstance.plots.report_files import TABLE_TITLE

ANCHOR = re.compile(r'^<a id="([^"]+)"></a>$')
HEADING = re.compile(r"^### (\d+)\. (.+)$")
# The lines of a finding that are not prose: its anchor and heading, its tables and their titles, its links.
NOT_PROSE = ("|", "<a id=", "### ", TABLE_TITLE, "Figure: ", "More: ")


def split_row(line):
    """The cells of a Markdown table row, `\\|` inside a cell kept as `|`."""
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [cell.strip().replace("\\|", "|") for cell in cells]


def tables_of(lines):
    """Every table in `lines`: a list of rows (the heading row first, the --- row left out), each a list of cells."""
    tables, current = [], None
    for line in lines:
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            if not re.fullmatch(r"\|( --- \|)+", line.strip()):
                current.append(split_row(line))
        else:
            current = None
    return tables


def section(text, heading):
    """The lines of the `## heading` section."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0].splitlines()


def summary_rows(text):
    """The summary table's rows as dicts by heading."""
    (table,) = tables_of(section(text, "Summary"))
    return [dict(zip(table[0], row, strict=True)) for row in table[1:]]


def findings(text):
    """Every finding of the report, in order: {"key", "number", "title", "prose" (the takeaway and note lines),
    "tables" (tables_of), "lines"}."""
    found, current = [], None
    for line in section(text, "Findings"):
        anchor = ANCHOR.match(line)
        if anchor:
            current = {"key": anchor.group(1), "lines": []}
            found.append(current)
        elif current is not None:
            current["lines"].append(line)
    for finding in found:
        heading = next(HEADING.match(line) for line in finding["lines"] if line.startswith("### "))
        finding["number"], finding["title"] = int(heading.group(1)), heading.group(2)
        finding["prose"] = [line for line in finding["lines"] if line and not line.startswith(NOT_PROSE)]
        finding["tables"] = tables_of(finding["lines"])
    return found


def prose_words(finding):
    """The words of a finding's prose as report.md shows it (report_files.prose_words on the written text)."""
    return len(re.findall(r"\S+", " ".join(finding["prose"])))


def cells(finding):
    """Every cell of a finding's tables, headings left out."""
    return {cell for table in finding["tables"] for row in table[1:] for cell in row}


MAX_PROSE_WORDS = 60
# A sentence ends at a full stop, question or exclamation mark followed by a space or the end (not "et al.'s").
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def rule_breaks(text):
    """Every way the written report breaks the report's rules, one line each: a finding with more than
    MAX_PROSE_WORDS words of prose or a takeaway of more than one sentence, a summary row whose value or reference
    is not a cell of the finding it links to."""
    found = findings(text)
    breaks = [f"finding {finding['number']} ({finding['key']}): {prose_words(finding)} words of prose"
              for finding in found if prose_words(finding) > MAX_PROSE_WORDS]
    breaks += [f"finding {finding['number']} ({finding['key']}): its takeaway is not one sentence"
               for finding in found if len(SENTENCE_END.findall(finding["prose"][0])) != 1]
    by_key = {finding["key"]: finding for finding in found}
    for row in summary_rows(text):
        ((number, key),) = re.findall(r"^\[(\d+)\]\(#([^)]+)\)$", row["report"])
        if by_key[key]["number"] != int(number):
            breaks.append(f"summary row {row['finding']!r} links finding {key} as {number}")
        for heading in ("value", "against"):
            if row[heading] and row[heading] not in cells(by_key[key]):
                breaks.append(f"summary row {row['finding']!r}: its {heading} {row[heading]!r} is no cell of {key}")
    return breaks

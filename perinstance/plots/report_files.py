"""A Report (document.py) written as report.md and report.html: the same findings, tables and captions in both. The
HTML page is one self-contained file: the figures are inlined as data URIs and the style sheet is in the page, so it
opens offline in any browser, and it loads nothing from a network.
"""

import base64
import html
import os
import re

from perinstance.files import fileio
from perinstance.plots.document import Figure, Finding, Report, Section, Table

MARKDOWN_NAME = "report.md"
HTML_NAME = "report.html"

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 84rem; margin: 2rem auto;
       padding: 0 1rem; line-height: 1.45; color: #1b1b1b; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05rem; margin-bottom: 0.3rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.86rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.55rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.number { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.takeaway { font-weight: 600; margin: 0.2rem 0; } .note, .more { color: #444; margin: 0.2rem 0; }
figure { margin: 1.5rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #333; font-size: 0.92rem; max-width: 60rem; }
pre { background: #f7f7f7; padding: 0.6rem; overflow-x: auto; font-size: 0.8rem; }
div.table { overflow-x: auto; } p.table-title { color: #444; font-size: 0.88rem; margin: 0.6rem 0 0.2rem; }
"""

# A cell that is a number, an interval or a ratio, right-aligned in the HTML table.
NUMBER_CELL = re.compile(r"^[−\-+]?[\d.,]+(e[−\-+]?\d+)?(%|×)?( \[.*\])?$")


def figure_anchor(file: str) -> str:
    """The anchor of a figure in both pages: "figure-" and its file name without the extension."""
    return "figure-" + os.path.splitext(os.path.basename(file))[0].replace("_", "-").lower()


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# The line that carries a table's title in report.md, before the table (the title of a table is not prose).
TABLE_TITLE = "Table: "


def markdown_table(table: Table) -> list[str]:
    """A Table as GitHub-flavoured Markdown lines, its title (if any) on a line of its own before it."""
    lines = [f"{TABLE_TITLE}{table.title}", ""] if table.title else []
    lines += ["| " + " | ".join(_markdown_cell(cell) for cell in table.columns) + " |",
              "| " + " | ".join("---" for _ in table.columns) + " |"]
    lines += ["| " + " | ".join(_markdown_cell(cell) for cell in row) + " |" for row in table.rows]
    return lines


def _links_line(finding: Finding, figures: dict[str, Figure], markdown: bool) -> str:
    """"Figure: <links to its figures>. More: <link>." under a finding, in Markdown or HTML ("" without links)."""
    links = []
    if finding.figures:
        named = [(f"#{figure_anchor(file)}", figures[file].title if file in figures else file)
                 for file in finding.figures]
        links.append("Figure: " + ", ".join(f"[{title}]({target})" if markdown else
                                            f'<a href="{target}">{html.escape(title)}</a>' for target, title in named))
    if finding.more:
        links.append(f"More: [{finding.more}]({finding.more})" if markdown else
                     f'More: <a href="{html.escape(finding.more)}">{html.escape(finding.more)}</a>')
    return ". ".join(links) + "." if links else ""


def render_markdown(report: Report) -> str:
    """report.md: the title, the opening, the summary table, every finding (takeaway, table, note, figure links, a
    link to more), the figures with their captions, then the sections."""
    figures = {figure.file: figure for figure in report.figures}
    lines = [f"# {report.title}", "", report.opening, "", "## Summary", "", *markdown_table(report.summary), "",
             "## Findings", ""]
    for index, finding in enumerate(report.findings, 1):
        lines += [f'<a id="{finding.key}"></a>', "", f"### {index}. {finding.title}", "", finding.takeaway, ""]
        for table in finding.tables:
            lines += [*markdown_table(table), ""]
        if finding.note:
            lines += [finding.note, ""]
        links = _links_line(finding, figures, markdown=True)
        if links:
            lines += [links, ""]
    if report.figures:
        lines += ["## Figures", ""]
        for figure in report.figures:
            lines += [f'<a id="{figure_anchor(figure.file)}"></a>', "", f"### {figure.title}", "",
                      f"![{figure.title}]({figure.file})", "", figure.caption, ""]
    for section in report.sections:
        lines += [f"## {section.heading}", ""]
        if section.intro:
            lines += [section.intro, ""]
        if section.table is not None:
            lines += [*markdown_table(section.table), ""]
        if section.code:
            lines += ["```", *section.code, "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _html_table(table: Table) -> str:
    """A Table as HTML, its title on a line above it (as wide as the page, not the table); cells may carry the little
    Markdown of _inline_markdown (a link to a finding, `code`, **bold**)."""
    head = "".join(f"<th>{_inline_markdown(cell)}</th>" for cell in table.columns)
    body = "".join(
        "<tr>" + "".join(f'<td class="number">{_inline_markdown(cell)}</td>' if NUMBER_CELL.match(cell) else
                         f"<td>{_inline_markdown(cell)}</td>" for cell in row) + "</tr>"
        for row in table.rows)
    title = f'<p class="table-title">{_inline_markdown(table.title)}</p>' if table.title else ""
    return f'<div class="table">{title}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _inline_markdown(text: str) -> str:
    """The little Markdown a takeaway or caption uses, as HTML: `code`, **bold** and [links](target)."""
    escaped = html.escape(text, quote=False)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    escaped = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", escaped)
    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", lambda match: f'<a href="{html.escape(match[2])}">{match[1]}</a>',
                  escaped)


def _data_uri(path: str) -> str:
    with open(path, "rb") as handle:
        return "data:image/png;base64," + base64.b64encode(handle.read()).decode("ascii")


def render_html(report: Report, folder: str) -> str:
    """report.html: the content of render_markdown as one page, the figures of `folder` inlined."""
    figures = {figure.file: figure for figure in report.figures}
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{html.escape(report.title)}</title><style>{STYLE}</style></head><body>",
             f"<h1>{html.escape(report.title)}</h1>", f"<p>{_inline_markdown(report.opening)}</p>",
             '<h2 id="summary">Summary</h2>', _html_table(report.summary), '<h2 id="findings">Findings</h2>']
    for index, finding in enumerate(report.findings, 1):
        parts += [f'<section id="{html.escape(finding.key)}"><h3>{index}. {html.escape(finding.title)}</h3>',
                  f'<p class="takeaway">{_inline_markdown(finding.takeaway)}</p>']
        for table in finding.tables:
            parts.append(_html_table(table))
        if finding.note:
            parts.append(f'<p class="note">{_inline_markdown(finding.note)}</p>')
        links = _links_line(finding, figures, markdown=False)
        if links:
            parts.append(f'<p class="more">{links}</p>')
        parts.append("</section>")
    if report.figures:
        parts.append('<h2 id="figures">Figures</h2>')
        for figure in report.figures:
            parts.append(f'<figure id="{figure_anchor(figure.file)}"><h3>{html.escape(figure.title)}</h3>'
                         f'<img src="{_data_uri(os.path.join(folder, figure.file))}" alt="{html.escape(figure.title)}">'
                         f"<figcaption>{_inline_markdown(figure.caption)}</figcaption></figure>")
    for section in report.sections:
        parts.append(_html_section(section))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _html_section(section: Section) -> str:
    parts = [f"<h2>{html.escape(section.heading)}</h2>"]
    if section.intro:
        parts.append(f"<p>{_inline_markdown(section.intro)}</p>")
    if section.table is not None:
        parts.append(_html_table(section.table))
    if section.code:
        parts.append("<pre>" + html.escape("\n".join(section.code)) + "</pre>")
    return "\n".join(parts)


def write_report_files(folder: str, report: Report) -> tuple[str, str]:
    """Write report.md and report.html to `folder` (each atomically; the figures must be there already): returns
    their paths."""
    missing = [figure.file for figure in report.figures if not os.path.isfile(os.path.join(folder, figure.file))]
    if missing:
        raise ValueError(f"the report's figures are not in {folder}: {', '.join(missing)}")
    markdown_path, html_path = os.path.join(folder, MARKDOWN_NAME), os.path.join(folder, HTML_NAME)
    fileio.write_text(markdown_path, render_markdown(report))
    fileio.write_text(html_path, render_html(report, folder))
    return markdown_path, html_path


def prose_words(finding: Finding) -> int:
    """The words of a finding's prose (takeaway and note; not its table, title or links): what the report's limit of
    about 60 words counts."""
    return len(re.findall(r"\S+", f"{finding.takeaway} {finding.note}"))

"""The reproduction's report, report.md and report.html from one Report (plots/report_files.py): the summary table,
the findings (report_privacy, report_rates, report_audits), the figures with their captions, then the
configuration, every command and the timing table.
"""

import dataclasses
import shlex

from perinstance.experiments.commands import CAPTIONS, FIGURES, FILTER_FIGURES, ONE_RUN_FIGURE, Commands
from perinstance.experiments.config import ReproduceConfig, field_text, field_types, overridden
from perinstance.experiments.report_audits import audit_findings
from perinstance.experiments.report_cells import Headline, summary_table
from perinstance.experiments.report_filter import filter_findings
from perinstance.experiments.report_privacy import privacy_findings
from perinstance.experiments.report_rates import rates_findings
from perinstance.plots.document import Figure, Finding, Report, Section, Table
from perinstance.plots.report_files import write_report_files
from perinstance.train.runs import RunConfig


def report_findings(config: ReproduceConfig, findings: dict) -> tuple[list[Finding], list[Headline]]:
    """Every finding of the report in its order (one step, the mean rule per sampling rate, the whole run, the
    audits, the individual filter) and the summary table's rows, in the order of the summary table."""
    privacy, privacy_headlines = privacy_findings(config, findings)
    rates, rates_headlines = rates_findings(config, findings["rates"])
    attacks, attack_headlines = audit_findings(config, findings)
    filtered, filter_headlines = filter_findings(config, findings.get("filter"))
    return [*privacy[:2], *rates, *privacy[2:], *attacks, *filtered], [*privacy_headlines, *attack_headlines,
                                                                       *filter_headlines, *rates_headlines]


def figures_drawn(config: ReproduceConfig) -> list[str]:
    """The figures a run of `config` writes: all of FIGURES, less the one-run audit's when `canaries` is 0 and the
    filtered run's when `filter_cap` is 0."""
    skipped = ([] if config.canaries else [ONE_RUN_FIGURE]) + ([] if config.filter_cap else
                                                                list(FILTER_FIGURES.values()))
    return [figure for figure in FIGURES if figure not in skipped]


def report_figures(config: ReproduceConfig) -> list[Figure]:
    """The report's figures in reading order, each with its title and caption (CAPTIONS, δ filled in)."""
    drawn = set(figures_drawn(config))
    return [Figure(file, title, caption.replace("{delta}", f"{config.delta:g}"))
            for file, (title, caption) in CAPTIONS.items() if file in drawn]


def assemble_report(title: str, opening: str, findings: list[Finding], headlines: list[Headline],
                    figures: list[Figure], sections: list[Section]) -> Report:
    """The report from its parts: the summary table quotes the findings' own cells (report_cells.summary_table);
    a finding's links go only to the figures the report draws."""
    drawn = {figure.file for figure in figures}
    linked = [dataclasses.replace(finding, figures=tuple(file for file in finding.figures if file in drawn))
              for finding in findings]
    return Report(title, opening, summary_table(headlines, linked), tuple(linked), tuple(figures), tuple(sections))


def configuration_table(preset: str, config: ReproduceConfig) -> Table:
    """Every field of the configuration; the ones overridden on the command line are marked."""
    changed = overridden(config, preset)
    return Table(("field", "value"),
                 tuple((f"`{name}`", f"`{field_text(getattr(config, name))}`"
                        + (" (overridden)" if name in changed else "")) for name in field_types()))


def report_sections(preset: str, config: ReproduceConfig, commands: Commands, seconds: float) -> list[Section]:
    """The configuration, every command in its order, and the time and memory of every step."""
    return [Section("Configuration", table=configuration_table(preset, config)),
            Section("Commands", intro="Every number above comes from these commands, in this order (\"cached\": the "
                                      "output of the same command on the same input was reused).",
                    code=tuple(f"{line}{'  # cached' if cached else ''}" for line, cached in commands.lines)),
            Section("Time and memory", table=commands.timing_table(seconds))]


def opening_text(argv: list[str], main_run: RunConfig, findings: dict, seconds: float) -> str:
    """The report's first paragraph: the command, its time, the main run, and how to read the numbers."""
    return (f"`{shlex.join(['python', 'reproduce.py', *argv])}` took {seconds:.0f} s. Main run `{main_run.run}` on "
            f"`{main_run.dataset}`: sigma = {main_run.noise_multiplier:.4g}, q = {main_run.sample_rate:.4g}, "
            f"T = {main_run.total_steps}, Γ = {main_run.clip_bound:g}, N = {main_run.dataset_size}; test accuracy at "
            f"the end {findings['test_accuracy']:.4f}. In brackets: the 95% bootstrap interval over the points (or "
            "classes, or pairs) a statistic rests on (docs/accounting.md §10). Each number says what it is: a bound "
            "(at the stated δ), a held-Δ* estimate (Δ* held between checkpoints), a Monte Carlo estimate, or a lower "
            "bound from an audit.")


def write_report(out_dir: str, preset: str, config: ReproduceConfig, argv: list[str], commands: Commands,
                 main_run: RunConfig, findings: dict, seconds: float) -> tuple[Report, str, str]:
    """Build the report and write report.md and report.html to `out_dir`: (the report, their paths)."""
    found, headlines = report_findings(config, findings)
    # The main run's points (run_report.PointReport, without the composed-ε finding that findings 7 and 8 give): its
    # galleries, classes, groups and points.csv.
    points = findings.get("points")
    point_findings = list(points.findings) if points else []
    built = assemble_report(f"Per-instance privacy of DP-SGD: preset {preset}",
                            opening_text(argv, main_run, findings, seconds), found + point_findings, headlines,
                            report_figures(config) + (list(points.figures) if points else []),
                            report_sections(preset, config, commands, seconds))
    return built, *write_report_files(out_dir, built)

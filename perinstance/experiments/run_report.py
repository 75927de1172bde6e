"""The points themselves, for one sum-rule run: the per-point table (point_table.py), the summary of every point's
composed ε, the breakdown by class and by the groups of --groups (medians with 95% intervals, accounting.md §10), and
the galleries: the 16 training points of highest and of lowest composed ε, and the 16 whose held-Δ* estimate (Δ* held
between checkpoints) falls furthest below their bound (Δ* at every step), where the run has both (§4). Image data
gets a gallery of the images (plots/gallery.py), other data a table. `perinstance report` writes these as a report
of their own (cli/report.py); `perinstance reproduce` writes them for its main run.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from perinstance.accounting import intervals
from perinstance.accounting.guarantees import Kind
from perinstance.accounting.intervals import Interval
from perinstance.experiments import filter_findings, point_table
from perinstance.experiments.main_run import Accounted, MainRun
from perinstance.experiments.report_cells import more_link, percent, share_text, worst_text
from perinstance.persample import batches
from perinstance.plots.document import Figure, Finding, Report, Section, Table
from perinstance.plots.gallery import plot_gallery
from perinstance.plots.group_plots import plot_group_medians
from perinstance.plots.plots import eps_label, interval_text
from perinstance.train import evaluation, training
from perinstance.train.data import display_images
from perinstance.train.runs import OpenRun

GALLERY_SIZE = 16
FIGURES = {"class": "eps_per_class.png", "group": "eps_per_group.png", "highest": "gallery_highest_eps.png",
           "lowest": "gallery_lowest_eps.png", "held_below": "gallery_held_below_bound.png",
           "left_first": "gallery_left_first.png"}
# A gallery's column of the step a filtered run's point left at (the other columns are ε).
LEFT_AT = "left at step"
# A point "at the worst case": its composed ε within this fraction of the data-independent one (Δ* rounded up to Γ at
# every step composes to it; the table's RDP evaluation and the baseline's may differ in the last digits).
WORST_CASE_TOLERANCE = 1e-3
MORE = "docs/accounting.md#4-composition-over-a-training-run-renyi_per_instance_sum_compopy"
KIND_TEXT = {Kind.CERTIFIED.value: "certified bound along the observed run",
             Kind.HELD_ESTIMATE.value: "held-Δ* estimate: Δ* held between checkpoints, not a bound"}
# What each column of points.csv holds (docs/commands.md gives the same list).
COLUMN_MEANINGS = {
    "point": "index of the training point in the dataset",
    "label": "its class (empty where the targets are not class labels)",
    "prediction": "the final model's class",
    "correct": "1 where prediction is label, else 0",
    "loss": "the final model's loss on the point",
    "grad_norm": "Δ* = ||h(g)|| at the final parameters θ_T",
    "sensitivity_ratio": "Δ*/Γ at θ_T",
    "eps_rdp": "composed ε by RDP (b = ∞)",
    "eps_rdp_kind": "certified (Δ* at every step) or held_estimate",
    "eps_pld": "composed ε by PLD, max of both directions",
    "eps_pld_kind": "certified or held_estimate",
    "eps_held": "composed ε by RDP, Δ* held between the checkpoints (empty for a run with per-point clipping)",
    "eps_step": "per-step ε at the final checkpoint (exact, §3.3)",
    "delta": "δ of every ε",
    "eps_guarantee": "a filtered run: the point's guarantee at δ, its filter budget (every trajectory)",
    "eps_guarantee_kind": "guarantee",
    "left_step": "a filtered run: the step the point left the training set at (empty: it stayed to the end)",
    "group": "the point's group in --groups (empty: none)",
}


@dataclass(frozen=True)
class PointReport:
    """The per-point part of a report: its summary rows (None where the caller asked for none), findings and figures
    (files in the report's folder), and the per-point table's path."""

    findings: tuple[Finding, ...]
    figures: tuple[Figure, ...]
    points_path: str
    summary: Table | None


@dataclass(frozen=True)
class Composed:
    """The report's points' composed ε by RDP (the headline composition) and by PLD, their rows in the points' order,
    with the intervals that the summary and the composed-ε finding both quote: each median, and the share of the
    points at the worst case by RDP."""

    rdp: pd.DataFrame
    pld: pd.DataFrame
    rdp_median: Interval
    pld_median: Interval
    at_worst: Interval


def at_worst_case(eps: np.ndarray, worst: float | np.ndarray) -> np.ndarray:
    return eps >= worst * (1 - WORST_CASE_TOLERANCE)


def worst_eps(frame: pd.DataFrame) -> np.ndarray:
    """Each point's worst case in a composition's rows (main_run.guarantees): its guarantee in a filtered run, which
    no composition along the run passes (accounting.md §12.3), else the data-independent baseline."""
    return frame["guarantee_eps" if "guarantee_eps" in frame else "baseline_eps"].to_numpy(dtype=float)


def composed_of(accounted: Accounted, points: np.ndarray) -> Composed:
    """The Composed of `points` (each interval computed once)."""
    rdp = accounted.composed.set_index("point").loc[points].reset_index()
    pld = accounted.composed_pld.set_index("point").loc[points].reset_index()
    rdp_eps = rdp["eps"].to_numpy(dtype=float)
    return Composed(rdp, pld, intervals.median_interval(rdp_eps),
                    intervals.median_interval(pld["eps"].to_numpy(dtype=float)),
                    intervals.share_interval(at_worst_case(rdp_eps, worst_eps(rdp))))


def per_point_report(out_dir: str, opened: OpenRun, main: MainRun, accounted: Accounted,
                     groups: point_table.Groups | None, device: str, data_root: str,
                     with_summary: bool = True, class_accuracy: list[float] | None = None) -> PointReport:
    """Write points.csv and the figures of the per-point findings to `out_dir` and return them (PointReport).
    `opened`: the run with its dataset (runs.open_run); the images of a gallery come from `data_root` where the data
    are features of images (display_images). `with_summary`: whether to give the summary rows and the finding of
    every point's composed ε (a reproduction has both in its own findings). `class_accuracy`: the final model's test
    accuracy per class (evaluation.per_class_accuracy) where the caller has it, else computed here."""
    config = main.run
    points = np.sort(accounted.composed["point"].to_numpy())
    if groups is not None:
        groups.check(points, config.run)
    model, payload = training.load_model(config, main.run_dir, config.total_steps, device)
    dataset = opened.dataset
    targets = dataset.train_y[points]
    # Every point of the dataset but a --less-point one: then the dataset's tensor itself, not a copy of it.
    inputs = dataset.train_x if np.array_equal(points, np.arange(len(dataset.train_y))) else dataset.train_x[points]
    predicted, losses, correct = evaluation.example_outputs(model, inputs, targets, device,
                                                          loss_fn=training.loss_for_run(config))
    class_labels = batches.class_indices(targets)
    labels = targets.numpy().astype(float) if class_labels else np.full(len(points), np.nan)
    record = None if config.point_filter is None else filter_findings.read_record(main.run_dir)
    table = point_table.point_table(main, accounted, labels, predicted, losses, correct, groups,
                                    None if record is None else record.set_index("point")["left_step"])
    points_path = point_table.write_points(out_dir, table)
    if class_labels and class_accuracy is None:
        class_accuracy = evaluation.per_class_accuracy(model, dataset.test_x, dataset.test_y, dataset.num_classes,
                                                     device)
    headline = accounted.composed.set_index("point").loc[points]
    eps, worst = headline["eps"].to_numpy(dtype=float), float(worst_eps(headline).max())
    kind = point_table.composed_kind(headline["kind"].iloc[0])
    delta = float(headline["delta"].iloc[0])
    axis_label = eps_label("composed ε", delta) + \
        f" (RDP, {'bound' if kind == Kind.CERTIFIED.value else 'held-Δ* estimate'})"
    # A filtered run's worst case is each point's guarantee (§12.3).
    worst_name = "worst case" if record is None else "guarantee"
    names = [str(name) for name in dataset.class_names]

    def path(key):
        return os.path.join(out_dir, FIGURES[key])

    findings, figures, composed = [], [], None
    if with_summary:
        composed = composed_of(accounted, points)
        findings.append(composed_finding(main, accounted, composed))
    if class_labels:
        finding, figure = class_finding(table, eps, worst, names, class_accuracy, path("class"), axis_label,
                                        worst_name)
        findings.append(finding)
        figures.append(figure)
    if groups is not None:
        finding, figure = group_finding(table, eps, worst, path("group"), axis_label, worst_name)
        findings.append(finding)
        figures.append(figure)
    gallery = Gallery(table, eps, kind, names, lambda rows: display_images(dataset, points[rows], data_root), delta,
                      out_dir)
    filtered = None if record is None else \
        filter_findings.filter_run(config, record, headline.reset_index(), accounted.composed_pld)
    if filtered is not None:
        found, drawn = filter_findings.filter_report(out_dir, filtered, table, names, class_labels, gallery)
        findings += found
        figures += drawn
    for key in ("highest", "lowest"):
        finding, figure = gallery.extreme(key)
        findings.append(finding)
        figures += [figure] if figure else []
    if accounted.bound is not None and accounted.estimate is not None:
        finding, figure = gallery.held_below(accounted, len(main.checkpoint_steps))
        findings.append(finding)
        figures += [figure] if figure else []
    findings.append(points_finding(points_path, table))
    summary = summary_table(main, composed, float(payload["test_accuracy"]), filtered) if with_summary else None
    return PointReport(tuple(findings), tuple(figures), points_path, summary)


def summary_table(main: MainRun, composed: Composed, test_accuracy: float,
                  filtered: filter_findings.FilterRun | None = None) -> Table:
    """The summary: the run's mechanism, δ, the test accuracy, the worst case and the median composed ε by RDP and PLD
    with their 95% intervals, and the share of the points at the worst case. A filtered run (`filtered`) gives each
    point's guarantee and uniform DP-SGD's steps and ε in place of the worst case, the share of the points at their
    guarantee, and the shares that left before the cap and that trained past uniform DP-SGD's stop."""
    config = main.run
    rdp, pld = composed.rdp, composed.pld
    kind = point_table.composed_kind(rdp["kind"].iloc[0])
    at_worst = percent(composed.at_worst, sign="")
    rows = [("run", config.run), ("training points N", f"{config.dataset_size:,}"), ("steps T", str(config.total_steps)),
            ("sampling rate q", f"{config.sample_rate:.4g}"), ("noise multiplier σ", f"{config.noise_multiplier:.4g}"),
            ("δ", f"{float(rdp['delta'].iloc[0]):g}"),
            ("test accuracy", "n/a" if np.isnan(test_accuracy) else f"{100 * test_accuracy:.2f}%")]
    if filtered is None:
        rows.append(("worst-case ε (data-independent), RDP / PLD",
                     f"{worst_text(worst_eps(rdp))} / {float(pld['baseline_eps'].iloc[0]):.4g}"))
    else:
        rows += [(f"each point's guarantee ε (its filter budget at λ_f = {filtered.order:g}; every trajectory)",
                  filter_findings.guarantee_text(filtered)),
                 ("uniform DP-SGD at this σ and q: steps T_u, ε of every point (RDP)",
                  f"{filtered.uniform_steps}, {filtered.uniform_eps:.4g}")]
    rows += [("what each point's composed ε is", KIND_TEXT[kind]),
             ("median composed ε, RDP [95% interval]", interval_text(composed.rdp_median, 4)),
             ("median composed ε, PLD [95% interval]", interval_text(composed.pld_median, 4))]
    if filtered is None:
        rows.append((f"points at the worst case (RDP ε within {100 * WORST_CASE_TOLERANCE:g}% of it) [95% interval]",
                     at_worst))
    else:
        rows += [(f"points at their guarantee (RDP ε within {100 * WORST_CASE_TOLERANCE:g}% of it) [95% interval]",
                  at_worst),
                 ("points that left the training set before the cap [95% interval]",
                  share_text(~filtered.stayed)),
                 (f"points trained past step T_u = {filtered.uniform_steps} [95% interval]",
                  share_text(filtered.past_uniform))]
    return Table(("quantity", "value"), tuple(rows))


def _eps_row(label: str, frame: pd.DataFrame, median: Interval | None = None,
             at_worst: Interval | None = None) -> tuple[str, ...]:
    """A composition's row of the composed-ε finding; `median` and `at_worst`: its intervals where already computed
    on these rows (Composed)."""
    eps, worst = frame["eps"].to_numpy(dtype=float), worst_eps(frame)
    median = intervals.median_interval(eps) if median is None else median
    at_worst = intervals.share_interval(at_worst_case(eps, worst)) if at_worst is None else at_worst
    return (label, point_table.composed_kind(frame["kind"].iloc[0]), f"{len(eps):,}", interval_text(median, 4),
            f"{intervals.quantile(eps, 0.1):.4g} – {intervals.quantile(eps, 0.9):.4g}", worst_text(worst),
            percent(at_worst, sign=""))


def composed_finding(main: MainRun, accounted: Accounted, composed: Composed) -> Finding:
    """Every point's composed ε by RDP and by PLD, and the other RDP composition beside the headline one: the held
    estimate where every point was tracked, the bound of the tracked points otherwise."""
    rdp = composed.rdp
    rows = [_eps_row("RDP (b = ∞)", rdp, composed.rdp_median, composed.at_worst),
            _eps_row("PLD (both directions)", composed.pld, composed.pld_median)]
    if main.every_point and accounted.estimate is not None:
        rows.append(_eps_row(f"RDP, Δ* held between the {len(main.checkpoint_steps)} checkpoints", accounted.estimate))
    elif not main.every_point and accounted.bound is not None:
        rows.append(_eps_row("RDP, Δ* at every step (the tracked points)", accounted.bound))
    median = composed.rdp_median
    kind = point_table.composed_kind(rdp["kind"].iloc[0])
    # A filtered run's worst case is each point's guarantee, which holds over every trajectory (§12.3).
    worst = "its guarantee" if "guarantee_eps" in rdp else "a worst case"
    return Finding(
        "points-composed-eps", "Composed ε of every point",
        f"The median point's composed ε is {interval_text(median, 4)} by RDP ({KIND_TEXT[kind]}), against {worst} "
        f"of {worst_text(worst_eps(rdp))}.",
        Table(("composition", "kind", "points", "median ε [95% interval]", "10% – 90% of the points",
               "worst case ε" if "guarantee_eps" not in rdp else "worst case ε: the guarantee",
               "points at the worst case [95% interval]"), tuple(rows)),
        note="Each ε holds along this run's trajectory, not over every run, and depends on the point's own data.",
        more=MORE)


def _breakdown(members: list[np.ndarray], eps: np.ndarray) -> list[Interval]:
    return [intervals.median_interval(eps[member]) for member in members]


def _extremes(kind_of_group: str, names: list[str], medians: list[Interval]) -> str:
    """The takeaway of a breakdown: the groups of highest and of lowest median, each with its interval."""
    estimates = np.array([median.estimate for median in medians])
    high, low = int(np.argmax(estimates)), int(np.argmin(estimates))
    if estimates[high] == estimates[low]:
        return (f"Every {kind_of_group} has the same median composed ε, {estimates[high]:.4g}, with its 95% interval "
                f"over the {kind_of_group}'s own points in the table.")
    return (f"By median composed ε, the highest {kind_of_group} is {names[high]} ({interval_text(medians[high], 3)}) "
            f"and the lowest {names[low]} ({interval_text(medians[low], 3)}); each interval is over that "
            f"{kind_of_group}'s own points.")


def class_finding(table: pd.DataFrame, eps: np.ndarray, worst: float, names: list[str], class_accuracy: list[float],
                  path: str, eps_label: str, worst_name: str = "worst case") -> tuple[Finding, Figure]:
    """The median composed ε of each class with its 95% interval, beside its misclassified share and test accuracy."""
    present, class_names, members = filter_findings.class_members(table["label"].to_numpy(), names)
    medians = _breakdown(members, eps)
    rows = tuple((names[label], f"{int(member.sum()):,}", interval_text(median, 4),
                  f"{100 * (1 - table['correct'].to_numpy()[member].mean()):.1f}%",
                  f"{100 * class_accuracy[label]:.1f}%")
                 for label, member, median in zip(present, members, medians, strict=True))
    plot_group_medians(class_names, medians, worst, path, title="Composed ε per class", eps_label=eps_label,
                       worst_label=f"{worst_name} ε")
    finding = Finding("points-per-class", "Per class", _extremes("class", class_names, medians),
                      Table(("class", "training points", "median composed ε [95% interval]",
                             "misclassified by the final model", "test accuracy"), rows),
                      figures=(os.path.basename(path),))
    return finding, Figure(os.path.basename(path), "Composed ε per class",
                           "Each class's median composed ε (dot) with its 95% interval over the class's points (bar), "
                           f"against the {worst_name} (dashed). Classes whose bars do not overlap differ at this "
                           "precision.")


def group_finding(table: pd.DataFrame, eps: np.ndarray, worst: float, path: str, eps_label: str,
                  worst_name: str = "worst case") -> tuple[Finding, Figure]:
    """The median composed ε of each group of --groups with its 95% interval (Yu et al.'s fairness question)."""
    names, members = filter_findings.group_members(table["group"])
    medians = _breakdown(members, eps)
    rows = tuple((name, f"{int(member.sum()):,}", interval_text(median, 4),
                  share_text(at_worst_case(eps[member], worst)))
                 for name, member, median in zip(names, members, medians, strict=True))
    outside = int(table["group"].isna().sum())
    plot_group_medians(names, medians, worst, path, title="Composed ε per group (--groups)", eps_label=eps_label,
                       worst_label=f"{worst_name} ε")
    finding = Finding("points-per-group", "Per group", _extremes("group", names, medians),
                      Table(("group", "points", "median composed ε [95% interval]",
                             "points at the worst case [95% interval]"), rows),
                      figures=(os.path.basename(path),),
                      note=f"{outside:,} points are in no group." if outside else "")
    return finding, Figure(os.path.basename(path), "Composed ε per group",
                           "Each group's median composed ε (dot) with its 95% interval over the group's points (bar), "
                           f"against the {worst_name} (dashed): groups whose bars do not overlap differ at this "
                           "precision.")


def points_finding(points_path: str, table: pd.DataFrame) -> Finding:
    """Where the per-point table is and what its columns hold."""
    name = os.path.basename(points_path)
    return Finding("points-file", "One row per training point",
                   f"`{name}` holds one row per training point ({len(table):,} rows): join it with your own metadata "
                   "on `point`.",
                   Table(("column", "what it holds"),
                         tuple((column, COLUMN_MEANINGS[column]) for column in table.columns)))


def value_text(name: str, value: float) -> str:
    """A gallery's value: a step as a whole number, an ε at 4 significant digits."""
    return f"{value:.0f}" if name == LEFT_AT else f"{value:.4g}"


def span_text(values: np.ndarray) -> str:
    """'runs from 2.9 to 3.1', or 'is 3.343' for equal values."""
    low, high = f"{values.min():.4g}", f"{values.max():.4g}"
    return f"is {low}" if low == high else f"runs from {low} to {high}"


def extreme_rows(eps: np.ndarray, losses: np.ndarray, points: np.ndarray, key: str,
                 size: int = GALLERY_SIZE) -> np.ndarray:
    """The rows of the `size` points of highest (`key` "highest") or lowest ("lowest") ε, in that order. Points of
    equal ε (many share the worst case: Δ* at Γ at every step) go by their final loss, the highest loss first among
    the highest ε and the lowest among the lowest, then by point index."""
    sign = -1 if key == "highest" else 1
    return np.lexsort((points, sign * np.asarray(losses), sign * np.asarray(eps)))[:size]


class Gallery:
    """The galleries of one run: the points picked by their composed ε, drawn as images (`images_of(rows)`: the
    images of these rows of `table`, display_images) or, for other data (`images_of` gives None), listed in a
    table."""

    def __init__(self, table: pd.DataFrame, eps: np.ndarray, kind: str, class_names: list[str],
                 images_of: Callable[[np.ndarray], np.ndarray | None], delta: float, out_dir: str) -> None:
        self.table, self.eps, self.kind, self.class_names = table, eps, kind, class_names
        self.images_of, self.delta, self.out_dir = images_of, delta, out_dir

    def _class(self, value: float) -> str:
        return "–" if np.isnan(value) else self.class_names[int(value)]

    def _rows(self, chosen: np.ndarray, values: dict[str, np.ndarray]) -> tuple[tuple[str, ...], ...]:
        table = self.table
        return tuple((str(table["point"].iloc[row]), self._class(table["label"].iloc[row]),
                      self._class(table["prediction"].iloc[row]), f"{table['loss'].iloc[row]:.3g}",
                      *(value_text(name, column[row]) for name, column in values.items())) for row in chosen)

    def _draw(self, key: str, chosen: np.ndarray, values: dict[str, np.ndarray], title: str,
              caption: str) -> tuple[Table | None, Figure | None]:
        """The chosen rows as a figure of their images, or as a table for other data."""
        images = self.images_of(chosen)
        if images is None:
            headings = (name if name in ("ε", LEFT_AT) else f"{name} ε" for name in values)
            return Table(("point", "label", "prediction", "final loss", *headings), self._rows(chosen, values)), None
        table = self.table
        captions = [f"#{table['point'].iloc[row]}  {self._class(table['label'].iloc[row])}→"
                    f"{self._class(table['prediction'].iloc[row])}\nloss {table['loss'].iloc[row]:.3g}\n"
                    + "\n".join(f"{name} {value_text(name, column[row])}" for name, column in values.items())
                    for row in chosen]
        flagged = [table["correct"].iloc[row] == 0 for row in chosen]
        plot_gallery(images, captions, flagged, f"{title}; δ = {self.delta:g}; red frame: misclassified "
                     "by the final model", os.path.join(self.out_dir, FIGURES[key]))
        return None, Figure(FIGURES[key], title, caption)

    def extreme(self, key: str) -> tuple[Finding, Figure | None]:
        """The GALLERY_SIZE points of highest (`key` "highest") or lowest ("lowest") composed ε (extreme_rows)."""
        chosen = extreme_rows(self.eps, self.table["loss"].to_numpy(), self.table["point"].to_numpy(), key)
        picked = self.eps[chosen]
        ties = int(np.sum(self.eps == picked[-1]))
        bound = "bound" if self.kind == Kind.CERTIFIED.value else "held-Δ* estimate"
        title = f"The {len(chosen)} training points of {key} composed ε (RDP, {bound})"
        wrong = int(np.sum(self.table["correct"].to_numpy()[chosen] == 0))
        table, figure = self._draw(key, chosen, {"ε": self.eps}, title,
                                   f"Each image with its point index, label→prediction of the final model, final loss "
                                   f"and composed ε ({bound}); a red frame marks a misclassified point.")
        tie_note = (f"{ties:,} points share the last ε shown, {picked[-1]:.4g}: of them, those of {key} final loss "
                    "are shown." if ties > 1 and ties > int(np.sum(picked == picked[-1])) else "")
        finding = Finding(f"points-{key}-eps", f"The {len(chosen)} points of {key} composed ε",
                          f"Their composed ε {span_text(picked)}; {wrong} of the {len(chosen)} are misclassified by "
                          "the final model.", table, figures=() if figure is None else (figure.file,), note=tie_note)
        return finding, figure

    def left_first(self, filtered: filter_findings.FilterRun) -> tuple[Finding, Figure | None]:
        """A filtered run's GALLERY_SIZE points that left the training set first (filter_findings.left_first_rows),
        with the step each left at and its composed ε."""
        chosen = filter_findings.left_first_rows(filtered, self.table["loss"].to_numpy(), GALLERY_SIZE)
        title = f"The {len(chosen)} points that left the training set first"
        if not len(chosen):
            return Finding("filter-left-first", "The points that left first",
                           f"No point left the training set before the cap of {filtered.total_steps} steps."), None
        wrong = int(np.sum(self.table["correct"].to_numpy()[chosen] == 0))
        table, figure = self._draw("left_first", chosen, {LEFT_AT: filtered.left_step, "ε": self.eps}, title,
                                   "Each image with its point index, label→prediction of the final model, final loss, "
                                   "the step it left the training set at and its composed ε along the run (bound); a "
                                   "red frame marks a misclassified point.")
        last = filtered.left_step[chosen[-1]]
        ties = int(np.sum(filtered.left_step == last))
        steps = filter_findings.span(filtered.left_step[chosen])
        finding = Finding("filter-left-first", title,
                          f"They left at step{'' if '–' not in steps else 's'} {steps}; {wrong} of the {len(chosen)} "
                          "are misclassified by the final model.", table,
                          figures=() if figure is None else (figure.file,), more=more_link("filter-left"),
                          note=f"{ties:,} points left at step {last:.0f}: of them, those of highest final loss are "
                               "shown." if ties > int(np.sum(filtered.left_step[chosen] == last)) else "")
        return finding, figure

    def held_below(self, accounted: Accounted, checkpoints: int) -> tuple[Finding, Figure | None]:
        """The points whose held-Δ* estimate falls furthest below their bound, relative to the bound (§4), among the
        points that have both."""
        bound = accounted.bound.set_index("point")["eps"].astype(float)
        held = accounted.estimate.set_index("point")["eps"].astype(float).reindex(bound.index)
        both = bound.index[held.notna() & (bound > 0)]
        shortfall = ((bound.loc[both] - held.loc[both]) / bound.loc[both]).to_numpy()
        below = shortfall > 0
        rows_of = pd.Series(np.arange(len(self.table)), index=self.table["point"].to_numpy())
        order = np.lexsort((both.to_numpy(), -shortfall))
        chosen_points = both.to_numpy()[order][:GALLERY_SIZE][below[order][:GALLERY_SIZE]]
        title = "The held-Δ* estimate against the bound"
        takeaway = (f"Holding Δ* between the {checkpoints} checkpoints gives an ε below the every-step bound for "
                    f"{share_text(below)} of the {len(both):,} points that have both")
        if not len(chosen_points):
            return Finding("points-held-below-bound", title, takeaway + ".", more=MORE), None
        rows = rows_of.loc[chosen_points].to_numpy()
        full_bound = np.full(len(self.table), np.nan)
        full_held = np.full(len(self.table), np.nan)
        full_bound[rows_of.loc[both].to_numpy()] = bound.loc[both].to_numpy()
        full_held[rows_of.loc[both].to_numpy()] = held.loc[both].to_numpy()
        largest = intervals.maximum_interval(shortfall)
        table, figure = self._draw("held_below", rows, {"bound": full_bound, "held": full_held},
                                   f"The {len(rows)} points whose held-Δ* estimate falls furthest below their bound",
                                   "Each image with its point index, label→prediction, final loss, its composed ε "
                                   "from Δ* at every step (bound) and with Δ* held between checkpoints (held): the "
                                   "held-Δ* estimate is not a bound, and here it falls below it.")
        finding = Finding("points-held-below-bound", title,
                          f"{takeaway}, by up to {percent(largest, sign='')} of the bound: a composition over "
                          "checkpoints is an estimate, not a bound.",
                          table, figures=() if figure is None else (figure.file,), more=MORE)
        return finding, figure


def run_document(point_report: PointReport, main: MainRun, commands: list[tuple[str, bool]]) -> Report:
    """`perinstance report`'s Report: the per-point findings of one run, the run's configuration, and every command
    whose output the numbers come from (`commands`: (command line, whether a cached output was reused))."""
    config = main.run
    measured = "every point at every step" if config.measure_every == 1 else (
        f"every point every {config.measure_every} steps and at θ_T, each clipped at (1 + {config.clip_margin:g})·Δ* of "
        "its latest measurement in between (accounting.md §12.4)")
    tracked = measured if main.every_point else (
        f"{len(main.run.tracked_points):,} tracked points at every step; every point at "
        f"{len(main.checkpoint_steps)} checkpoints" if main.tracked_path else
        f"every point at {len(main.checkpoint_steps)} checkpoints")
    run_rows = (("dataset", config.dataset), ("model", config.model),
                ("per-sample transform, bound Γ", f"{config.clipping}, {config.clip_bound:g}"),
                ("update rule", config.update_rule), ("expected batch size B_exp", str(config.batch_size)),
                ("seed", str(config.seed)), ("Δ* measured at", tracked),
                ("checkpoints", ", ".join(map(str, main.checkpoint_steps))))
    opening = ("Every training point's privacy loss over this DP-SGD run (sum rule): its composed ε by RDP and by "
               "PLD, `certified` where Δ* was measured at every step (a bound along the observed run) or "
               "`held_estimate` where Δ* is held between checkpoints (not a bound). The values are conditional on "
               "this run's trajectory, and publishing them releases information about the points that the run's "
               "DP guarantee does not cover (docs/accounting.md §4).")
    if config.point_filter is not None:
        point_filter = config.point_filter
        budgets = f"ε = {point_filter['budget_eps']:g}" if point_filter["budgets_file"] is None else \
            f"from {point_filter['budgets_file']} (smallest ε = {point_filter['smallest_eps']:g})"
        run_rows += (("individual filter", f"order λ_f = {point_filter['order']:g}, budgets {budgets} at δ = "
                                           f"{point_filter['delta']:g}, trained to the cap T = {config.total_steps}"),)
        opening += (" This run is an individual Rényi filter (§12): each point's `guarantee`, its budget, holds over "
                    "every trajectory; a point left the training set once its next charge would pass it.")
    return Report(
        title=f"Per-point privacy of run {config.run}",
        opening=opening,
        summary=point_report.summary, findings=point_report.findings, figures=point_report.figures,
        sections=(Section("Run", table=Table(("setting", "value"), run_rows)),
                  Section("Commands", intro="Every number above comes from these commands, in this order (\"cached\": "
                                            "the output of the same command on the same input was reused).",
                          code=tuple(f"{line}  # cached" if cached else line for line, cached in commands))))

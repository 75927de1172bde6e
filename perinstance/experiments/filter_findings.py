"""The points of a filtered run (train_dpsgd.py --budget-eps/--budgets, docs/accounting.md §12-§13): how many left
the training set and when, by class and by the groups of --groups, each point's composed ε along the run (certified)
against its guarantee, and the comparison with uniform DP-SGD at the same σ, q and worst-case ε, which stops after
T_u steps with every point at that ε. Shares and medians carry their 95% intervals (§10). `perinstance report`
writes these beside the per-point findings of any run (run_report.py); the main job's filtered run quotes them
(filtered_run.py).

T_u is individual_filter.uniform_steps at the run's σ, q, smallest budget and order λ_f: the filter's own arithmetic,
so that a point charged at Γ at every step leaves the filter exactly after T_u steps (§13.1), rather than Opacus's
calibration of σ (its own orders and tolerance), which need not stop at the same step.
"""

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

import perinstance
from perinstance.accounting import individual_filter, intervals, rdp_composition
from perinstance.accounting.mechanism import Mechanism
from perinstance.experiments.report_cells import more_link, percent, share_text, worst_text
from perinstance.files import results, storage
from perinstance.plots.document import Figure, Finding, Table
from perinstance.plots.filter_plots import plot_eps_against_guarantee, plot_points_training
from perinstance.plots.plots import interval_text
from perinstance.train import filtering
from perinstance.train.runs import RunConfig

FIGURES = {"class": "filter_points_training_per_class.png", "group": "filter_points_training_per_group.png",
           "guarantee": "filter_eps_against_guarantee.png"}
# Step ranges between T_u and the cap that the table of leaving steps splits the later leavers into.
LATER_RANGES = 4


@dataclass(frozen=True)
class FilterRun:
    """What the findings of a filtered run rest on: the run, its order λ_f and δ, the steps T_u of uniform DP-SGD at
    its σ, q and smallest budget (uniform_steps), that run's ε at the report's δ by RDP over the composition's orders,
    and per point (aligned with `points`) the steps it trained, the step it left at (NaN: it stayed to T), its
    guarantee and its composed ε along the run by RDP and by PLD (certified; None where PLD was not run), all at the
    report's δ."""

    run: RunConfig
    order: float
    delta: float
    uniform_steps: int
    uniform_eps: float
    points: np.ndarray
    steps_trained: np.ndarray
    left_step: np.ndarray
    guarantee: np.ndarray
    eps_rdp: np.ndarray
    eps_pld: np.ndarray | None

    @property
    def total_steps(self) -> int:
        return self.run.total_steps

    @property
    def past_uniform(self) -> np.ndarray:
        """Whether each point trained past step T_u, where uniform DP-SGD stops."""
        return self.steps_trained > self.uniform_steps

    @property
    def stayed(self) -> np.ndarray:
        """Whether each point stayed in the training set to the cap T."""
        return np.isnan(self.left_step)

    def still_training(self, members: np.ndarray | None = None) -> np.ndarray:
        """The number of points (of `members`, default all) in the training set at each step 0..T: a point that
        trained s steps is in it at steps 1..s (and at 0)."""
        trained = self.steps_trained if members is None else self.steps_trained[members]
        counts = np.bincount(trained, minlength=self.total_steps + 1)
        return len(trained) - np.concatenate([[0], np.cumsum(counts)[:-1]])


def read_record(run_dir: str) -> pd.DataFrame:
    """models/<run>/filter_points.csv (or .parquet), the filter's record of every point (filtering.record)."""
    return storage.read_frame(results.results_path(filtering.RECORD, run_dir, flag="--run"))


def class_members(labels: np.ndarray, names: list[str]) -> tuple[list[int], list[str], list[np.ndarray]]:
    """The classes that have points among `labels` (each point's class; NaN for none), their names, and each one's
    points (a mask over `labels`)."""
    present = [label for label in range(len(names)) if np.any(labels == label)]
    return present, [names[label] for label in present], [labels == label for label in present]


def group_members(groups: pd.Series) -> tuple[list[str], list[np.ndarray]]:
    """The groups of --groups among `groups` (each point's group; NaN for none), sorted, and each one's points (a
    mask over `groups`)."""
    names = sorted(groups.dropna().unique())
    return names, [(groups == name).to_numpy() for name in names]


def uniform_stop(run: RunConfig) -> int:
    """T_u: the steps uniform DP-SGD at the run's σ and q takes within the smallest budget at λ_f (the filter's
    arithmetic: a point charged at Γ at every step trains exactly T_u steps)."""
    point_filter = run.point_filter
    budget = individual_filter.budget_rdp([point_filter["smallest_eps"]], point_filter["delta"], point_filter["order"])
    return individual_filter.uniform_steps(run.sample_rate, run.noise_multiplier, float(budget[0]),
                                           point_filter["order"])


def filter_run(run: RunConfig, record: pd.DataFrame, composed: pd.DataFrame,
               composed_pld: pd.DataFrame | None = None) -> FilterRun:
    """The FilterRun of a filtered run from its record (read_record) and the composition of its tracked table by RDP
    (`composed`, main_run.guarantees' rows: point, eps, guarantee_eps, delta) and by PLD (or None): the points of
    `composed`, in its order."""
    order = float(run.point_filter["order"])
    delta = float(composed["delta"].iloc[0])
    points = composed["point"].to_numpy()
    record = record.set_index("point").reindex(points)
    uniform_steps = uniform_stop(run)
    orders = np.union1d(rdp_composition.COMPOSITION_ORDERS, [order])
    uniform_eps, _ = Mechanism.of_run(run).baseline_eps(delta, steps=uniform_steps, orders=orders)
    pld = None if composed_pld is None else composed_pld.set_index("point")["eps"].reindex(points).to_numpy(float)
    return FilterRun(run, order, delta, uniform_steps, uniform_eps, points,
                     record["steps_active"].to_numpy(dtype=np.int64), record["left_step"].to_numpy(dtype=float),
                     composed["guarantee_eps"].to_numpy(dtype=float), composed["eps"].to_numpy(dtype=float), pld)


def span(values: np.ndarray) -> str:
    """'126–249', or '126' for one value."""
    low, high = int(values.min()), int(values.max())
    return str(low) if low == high else f"{low}–{high}"


def guarantee_text(filtered: FilterRun) -> str:
    """The guarantee of every point ('10'), or its range where the budgets differ ('8–12')."""
    return worst_text(filtered.guarantee)


def leaving_rows(filtered: FilterRun) -> tuple[tuple[str, ...], ...]:
    """The table of leaving steps: the points that trained fewer than T_u steps, exactly T_u (left where uniform
    DP-SGD stops), LATER_RANGES ranges of steps between T_u and the cap, and those that stayed to the cap; each with
    its share of the points and that share's 95% interval."""
    trained, total, uniform = filtered.steps_trained, filtered.total_steps, filtered.uniform_steps
    stayed = filtered.stayed
    ranges = [(f"fewer than {uniform}", ~stayed & (trained < uniform)),
              (f"{uniform} (T_u, where uniform DP-SGD stops)", ~stayed & (trained == uniform))]
    # The later leavers trained T_u + 1 .. T − 1 steps (a point that trained T stayed); none where the cap is that close.
    edges = np.unique(np.linspace(uniform + 1, total, LATER_RANGES + 1).round().astype(int)) if uniform + 1 < total \
        else np.zeros(0, dtype=int)
    for first, after in zip(edges[:-1], edges[1:], strict=False):
        last = after - 1
        ranges.append((f"{first}–{last}" if last > first else str(first),
                       ~stayed & (trained >= first) & (trained <= last)))
    ranges.append((f"{total} (stayed to the cap)", stayed))
    rows = []
    for label, members in ranges:
        if label.startswith("fewer") and not members.any():
            continue
        left = filtered.left_step[members]
        rows.append((label, "–" if stayed[members].all() or not members.any() else span(left),
                     f"{int(members.sum()):,}", share_text(members)))
    return tuple(rows)


def leaving_finding(filtered: FilterRun) -> Finding:
    """How many points left before the cap and when, in ranges of the steps they trained, and the share still
    training past T_u."""
    count = len(filtered.points)
    left = ~filtered.stayed
    takeaway = (f"{int(left.sum()):,} of the {count:,} points left before the cap of {filtered.total_steps} steps, "
                f"and {share_text(filtered.past_uniform)} trained past step {filtered.uniform_steps}, where uniform DP-SGD at the "
                "same σ, q and worst-case ε stops.")
    return Finding(
        "filter-left", "Points that left the training set, and when", takeaway,
        Table(("steps trained", "left at step", "points", "share of the points [95% interval]"),
              leaving_rows(filtered),
              title=f"Individual filter at order λ_f = {filtered.order:g}; T_u = {filtered.uniform_steps} "
                    f"(individual_filter.uniform_steps: the steps a point charged at Γ at every step trains within "
                    f"the smallest budget); cap T = {filtered.total_steps}"),
        note="A point trained s steps is in the training set at steps 1 to s and leaves at step s + 1.",
        more=more_link("filter-left"))


def breakdown_rows(filtered: FilterRun, names: list[str], members: list[np.ndarray]) -> tuple[tuple[str, ...], ...]:
    rows = []
    for name, member in zip(names, members, strict=True):
        rows.append((name, f"{int(member.sum()):,}", share_text(filtered.past_uniform[member]),
                     share_text(filtered.stayed[member]),
                     interval_text(intervals.median_interval(filtered.steps_trained[member]), 4)))
    return tuple(rows)


def breakdown_finding(filtered: FilterRun, kind_of_group: str, names: list[str], members: list[np.ndarray],
                      path: str) -> tuple[Finding, Figure]:
    """Per class or per group of --groups: the share of its points trained past T_u and the share that stayed to
    the cap, each with its 95% interval, and its median steps trained; and the figure of the points still training
    over the steps."""
    stayed = [intervals.share_interval(filtered.stayed[member]) for member in members]
    estimates = np.array([share.estimate for share in stayed])
    high, low = int(np.argmax(estimates)), int(np.argmin(estimates))
    if estimates[high] == estimates[low]:
        takeaway = (f"Every {kind_of_group} keeps the same share of its points to the cap, "
                    f"{100 * estimates[high]:.3g}%.")
    else:
        takeaway = (f"The {kind_of_group} that keeps most of its points to the cap is {names[high]} "
                    f"({percent(stayed[high], sign='')}), the one that keeps fewest {names[low]} "
                    f"({percent(stayed[low], sign='')}).")
    key = "class" if kind_of_group == "class" else "group"
    title = f"Points still training, per {kind_of_group}" + (" (--groups)" if key == "group" else "")
    plot_points_training(names, [filtered.still_training(member) for member in members], filtered.uniform_steps,
                         path, title=title)
    finding = Finding(
        f"filter-left-per-{key}", f"Points that left, per {kind_of_group}", takeaway,
        Table((kind_of_group, "points", f"trained past step {filtered.uniform_steps} [95% interval]",
               f"stayed to the cap ({filtered.total_steps}) [95% interval]", "median steps trained [95% interval]"),
              breakdown_rows(filtered, names, members),
              title="Each interval is over the " + kind_of_group + "'s own points"),
        figures=(os.path.basename(path),), more=more_link("filter-left"))
    return finding, Figure(os.path.basename(path), title,
                           f"The number of points of each {kind_of_group} still in the training set at each step "
                           f"(a point leaves once its next charge would pass its budget), with the step "
                           f"T_u = {filtered.uniform_steps} where uniform DP-SGD at the same σ, q and worst-case ε "
                           "stops (dashed) and the cap (right edge). No point charged at most the worst case at "
                           "every step can leave before T_u + 1.")


def guarantee_rows(filtered: FilterRun) -> tuple[tuple[str, ...], ...]:
    rows = [("guarantee (the filter's budget at λ_f)", "guarantee", interval_text(
        intervals.median_interval(filtered.guarantee), 4), f"{filtered.guarantee.max():.4g}", "–", "–")]
    compositions = [("composed along the run, RDP (b = ∞)", filtered.eps_rdp)]
    if filtered.eps_pld is not None:
        compositions.append(("composed along the run, PLD (both directions)", filtered.eps_pld))
    for label, eps in compositions:
        above = eps > filtered.guarantee
        ratio = eps / filtered.guarantee
        rows.append((label, "certified", interval_text(intervals.median_interval(eps), 4), f"{eps.max():.4g}",
                     f"{int(above.sum()):,} of {len(eps):,}", f"{ratio.max():.6g}"))
    return tuple(rows)


def guarantee_finding(filtered: FilterRun, path: str) -> tuple[Finding, Figure]:
    """Each point's composed ε along the run (certified, by RDP and by PLD) against its guarantee: by RDP never above
    it (accounting.md §13.6; a point above it would be a fault of the filter or the accountant)."""
    above = int(np.sum(filtered.eps_rdp > filtered.guarantee))
    median = intervals.median_interval(filtered.eps_rdp)
    if above:
        takeaway = (f"FAULT: {above:,} points have a composed ε by RDP above their guarantee, which the filter's "
                    "charges should make impossible.")
    else:
        takeaway = (f"No point's composed ε by RDP passes its guarantee of {guarantee_text(filtered)} at "
                    f"δ = {filtered.delta:g}: the median is {interval_text(median, 4)}.")
    plot_eps_against_guarantee(filtered.eps_rdp, filtered.eps_pld, float(filtered.guarantee.max()),
                               filtered.uniform_eps, filtered.uniform_steps, path, delta=filtered.delta)
    finding = Finding(
        "filter-guarantee", "Composed ε along the run against the guarantee", takeaway,
        Table(("ε at δ", "kind", "median [95% interval]", "largest", "points above their guarantee",
               "largest ε ÷ guarantee"), guarantee_rows(filtered),
              title=f"δ = {filtered.delta:g}; the guarantee holds over every trajectory (accounting.md §12.3), the "
                    "composed ε along this run's (§4), from the bounds each point was clipped at (§12.4)"),
        figures=(os.path.basename(path),),
        note="By RDP the composition includes λ_f, at which a point's charges sum to at most its budget.",
        more=more_link("filter-guarantee"))
    return finding, Figure(os.path.basename(path), "Composed ε against the guarantee",
                           f"The share of points at or below each composed ε at δ = {filtered.delta:g} along this "
                           f"run (certified; by RDP{'' if filtered.eps_pld is None else ' and PLD'}), against each "
                           "point's guarantee (dashed) and the ε of "
                           f"uniform DP-SGD stopped after T_u = {filtered.uniform_steps} steps (dotted). Every curve "
                           "reaches 1 at or before the guarantee.")


def uniform_finding(filtered: FilterRun) -> Finding:
    """Against uniform DP-SGD at the same σ, q and worst-case ε: it stops after T_u steps with every point at its
    ε; the filter trains to the cap, each point within its guarantee, with the composed ε shown."""
    past = share_text(filtered.past_uniform)
    median = intervals.median_interval(filtered.eps_rdp)
    steps = intervals.median_interval(filtered.steps_trained)
    rows = (("steps", str(filtered.uniform_steps), f"{filtered.total_steps} (the cap)"),
            ("steps a point trains, median [95% interval]", str(filtered.uniform_steps), interval_text(steps, 4)),
            ("points trained past step T_u [95% interval]", "0%", past),
            ("ε of every point (data-independent)", f"{filtered.uniform_eps:.4g}", guarantee_text(filtered)),
            ("composed ε along the run, median [95% interval]", "–", interval_text(median, 4)))
    return Finding(
        "filter-uniform", "Against uniform DP-SGD at the same worst-case ε",
        f"Uniform DP-SGD at this σ and q stops after {filtered.uniform_steps} steps with every point at ε = "
        f"{filtered.uniform_eps:.4g}; the filter trained {past} of the points past that step, each "
        f"within its guarantee.",
        Table(("", "uniform DP-SGD", "individual filter (this run)"), rows,
              title=f"Same σ = {filtered.run.noise_multiplier:.4g} and q = {filtered.run.sample_rate:.4g}; ε at "
                    f"δ = {filtered.delta:g}, uniform DP-SGD's by RDP over the composition's orders and λ_f, the "
                    f"filter's guarantee at λ_f = {filtered.order:g}"),
        note="Whether the extra steps buy accuracy is a question for a held-out split, not for this table.",
        more=more_link("filter-uniform"))


def left_first_rows(filtered: FilterRun, losses: np.ndarray, size: int) -> np.ndarray:
    """The rows of the `size` points that left first: by leaving step; among points that left at the same step (many
    leave together, charged at Γ from the start), the highest final loss (`losses`, aligned with the points) first,
    then the point index."""
    left = np.flatnonzero(~filtered.stayed)
    order = np.lexsort((filtered.points[left], -np.asarray(losses)[left], filtered.left_step[left]))
    return left[order][:size]


def filter_report(out_dir: str, filtered: FilterRun, table: pd.DataFrame, names: list[str], class_labels: bool,
                  gallery: "perinstance.experiments.run_report.Gallery") -> tuple[list[Finding], list[Figure]]:
    """A filtered run's findings, their figures written to `out_dir`: when points left, per class (`class_labels`:
    whether the targets are classes, `names` theirs) and per group of --groups (the table's `group` column), each
    point's composed ε against its guarantee, uniform DP-SGD at the same worst-case ε, and the points that left first
    (`gallery`: the report's, run_report.Gallery)."""
    breakdowns = []
    if class_labels:
        _, class_names, members = class_members(table["label"].to_numpy(), names)
        breakdowns.append(("class", class_names, members))
    if "group" in table:
        breakdowns.append(("group", *group_members(table["group"])))
    drawn = [(leaving_finding(filtered), None)]
    drawn += [breakdown_finding(filtered, kind, group_names, members, os.path.join(out_dir, FIGURES[kind]))
              for kind, group_names, members in breakdowns]
    drawn += [guarantee_finding(filtered, os.path.join(out_dir, FIGURES["guarantee"])),
              (uniform_finding(filtered), None), gallery.left_first(filtered)]
    return [finding for finding, _ in drawn], [figure for _, figure in drawn if figure is not None]

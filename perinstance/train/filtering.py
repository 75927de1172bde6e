"""Per-point clipping and the individual Rényi filter in training (docs/accounting.md §12.2, §12.4, §13).

A run with a filter (--budget-eps, --budgets), or whose tracked points are measured every k > 1 steps (--track-every),
clips each point i at its own bound r_i·Γ: r_i = min(1, (1 + m)·Δ*_i(θ_s)/Γ) of its latest measurement θ_s, rounded
up onto a geometric grid (§13), 1 for a point that is not measured. Between measurements a point can then add at most
r_i·Γ, so every step's per-point cost computed from r_i is a bound (§12.4). The filter charges every active point
ρ_i = RDP_SGM(q, σ/r_i; λ_f) before each step, drawn or not, and takes it out of the training set for good once its
next charge would pass its budget (§12.2, individual_filter.FilterState); a point out is dropped from the step's
Poisson draw, which is drawn over all points, so that the others' draws are those of the run without a filter.

The state (each point's r, the filter's running sums and leaving steps) travels with every checkpoint, so a resumed
run is the uninterrupted one bit for bit. At the end the tracked table gets, besides Δ*, each point's charged bound
r·Γ (quantity held_bound, at every measurement and where it leaves, 0 from then on) and its Rényi budget (quantity
filter_budget, at λ_f): what `renyi_per_instance_sum_compo.py` composes into a certified ε beside each point's
guarantee; and models/<run>/filter_points.csv (.parquet past the storage threshold) records every point's budget,
spent charges and leaving step.
"""

import dataclasses
import hashlib
import io
from collections.abc import Callable

import numpy as np
import pandas as pd
import torch

import perinstance
from perinstance.accounting import individual_filter
from perinstance.errors import UsageError
from perinstance.files import results, storage
from perinstance.train import clipping
from perinstance.train.runs import RunConfig

# --filter-margin's default m (§13): measured on the quick preset's every-step Δ* at k = 10, m = 0.25 clips 10.5% of
# the (point, step) pairs harder than DP-SGD would (they lose 1.75% of the summed gradient norm) for charges 11%
# above the every-step ones; m = 0 clips 19% (2.9%) for +6.6%, m = 1 clips 2.4% (0.5%) for +21%.
DEFAULT_MARGIN = 0.25
# Each charged ratio is rounded up onto the grid (1 + CHARGE_PRECISION)^−j (§5: rounding a sensitivity up keeps a
# bound): at most 0.2% more charge, and the charges of a few thousand grid levels serve every point and step.
CHARGE_PRECISION = 1e-3
# The filter's record of every point, next to the tracked table.
RECORD = "filter_points"


def check_flags(args: "perinstance.train.run_plan.TrainingFlags") -> "perinstance.train.run_plan.TrainingFlags":
    """The filter's and per-point clipping's flags checked together (no dataset needed); a filtered run tracks every
    point (--track-points all, filled in when left out)."""
    if not args.filtered:
        for flag, value in (("--filter-order", args.filter_order), ("--filter-every", args.filter_every)):
            if value is not None:
                raise UsageError(flag, "belongs to a filter: give --budget-eps or --budgets")
    if args.track_every is not None:
        if args.filtered:
            raise UsageError("--track-every", "a filtered run measures every point: give --filter-every instead")
        if args.track_points is None:
            raise UsageError("--track-every", "measures the --track-points every K steps: give them too")
    if args.filter_margin is not None and args.measure_every == 1:
        raise UsageError("--filter-margin", "clips between measurements: give --filter-every or --track-every K > 1")
    if not args.filtered and args.measure_every == 1:
        return args
    flag = ("--budget-eps" if args.budget_eps is not None else "--budgets") if args.filtered else "--track-every"
    if args.dp != 1:
        raise UsageError(flag, "needs DP-SGD (--dp 1): without noise there is no privacy cost to charge")
    if args.reduction != "sum":
        raise UsageError("--reduction", "a filter and per-point clipping take the sum rule only (under the mean rule "
                                        "a point's sensitivity depends on the other points, accounting.md §12.6)")
    if args.clipping != "flat":
        raise UsageError("--clipping", "a filter and per-point clipping take flat clipping only (accounting.md §12.4)")
    for canary_flag, count in (("--canaries", args.canaries), ("--input-canaries", args.input_canaries)):
        if count:
            raise UsageError(canary_flag, f"is not combined with {flag}: train the one-run audit's canaries in a run "
                                          "without a filter or per-point clipping")
    if args.filtered:
        if args.track_points not in (None, ["all"]):
            raise UsageError("--track-points", "a filtered run measures every point: leave it out or give all")
        args = dataclasses.replace(args, track_points=["all"])
    return args


def clip_margin(args: "perinstance.train.run_plan.TrainingFlags") -> float | None:
    """m of a run's per-point clipping (§12.4): --filter-margin, DEFAULT_MARGIN between measurements, 0 for a
    filter that measures at every step; None without per-point clipping."""
    if args.measure_every > 1:
        return DEFAULT_MARGIN if args.filter_margin is None else args.filter_margin
    return 0.0 if args.filtered else None


def read_budgets(path: str, dataset_size: int, budget_eps: float | None) -> tuple[np.ndarray, str]:
    """Every point's target ε from --budgets (a CSV with columns point and eps) and --budget-eps for the points it
    does not list, and the file's sha256. A bad file is a one-line error naming --budgets."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError as error:
        raise UsageError("--budgets", f"cannot read {path}: {error.strerror or error}") from None
    try:
        frame = pd.read_csv(io.BytesIO(raw), keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise UsageError("--budgets", f"{path} is not a CSV of budgets: {str(error).splitlines()[0]}") from None
    missing = [column for column in ("point", "eps") if column not in frame.columns]
    if missing:
        raise UsageError("--budgets", f"{path} lacks the column{'s' if len(missing) > 1 else ''} "
                                      f"{', '.join(missing)} (expected point, eps)")
    points = pd.to_numeric(frame["point"], errors="coerce").to_numpy(dtype=float)
    eps = pd.to_numeric(frame["eps"], errors="coerce").to_numpy(dtype=float)
    bad = ~((points == np.round(points)) & (points >= 0) & (points < dataset_size))
    if bad.any():
        line = int(np.flatnonzero(bad)[0])
        raise UsageError("--budgets", f"{path} line {line + 2}: point {frame['point'].iloc[line]!r} is not a "
                                      f"training-set index in 0..{dataset_size - 1}")
    bad = ~(np.isfinite(eps) & (eps > 0))
    if bad.any():
        line = int(np.flatnonzero(bad)[0])
        raise UsageError("--budgets", f"{path} line {line + 2}: eps {frame['eps'].iloc[line]!r} is not a finite "
                                      "number > 0")
    points = points.astype(np.int64)
    repeated = pd.Series(points).duplicated()
    if repeated.any():
        line = int(np.flatnonzero(repeated)[0])
        first = int(np.flatnonzero(points == points[line])[0])
        raise UsageError("--budgets", f"{path} lists point {points[line]} twice (lines {first + 2} and {line + 2})")
    targets = np.full(dataset_size, np.nan if budget_eps is None else float(budget_eps))
    targets[points] = eps
    unlisted = np.flatnonzero(np.isnan(targets))
    if len(unlisted):
        raise UsageError("--budgets", f"{path} gives no budget to point {unlisted[0]} ({len(unlisted)} points "
                                      "unlisted): list every point, or give --budget-eps for the others")
    return targets, hashlib.sha256(raw).hexdigest()


def plan_filter(args: "perinstance.train.run_plan.TrainingFlags", dataset_size: int, sample_rate: float,
                noise_multiplier: float) -> dict:
    """run.json's record of the filter (RunConfig.point_filter): the order λ_f (--filter-order, or
    individual_filter.default_order at the smallest target ε, so that every budget is positive at it), δ, and the
    budgets (--budget-eps, the file and its sha256). Budgets that give no Rényi budget at λ_f are refused."""
    flag = "--budgets" if args.budgets is not None else "--budget-eps"
    targets, digest = (read_budgets(args.budgets, dataset_size, args.budget_eps) if args.budgets is not None
                       else (np.full(dataset_size, args.budget_eps), None))
    smallest = float(targets.min())
    order = args.filter_order
    try:
        if order is None:
            order = individual_filter.default_order(sample_rate, noise_multiplier, smallest, args.delta)
        individual_filter.budget_rdp(targets, args.delta, order)
    except ValueError as error:
        raise UsageError("--filter-order" if args.filter_order is not None else flag, str(error)) from None
    return {"order": float(order), "delta": args.delta, "budget_eps": args.budget_eps, "budgets_file": args.budgets,
            "budgets_sha256": digest, "smallest_eps": smallest}


def target_eps(run: RunConfig) -> np.ndarray:
    """Every point's target ε of a filtered run, its budgets file read again and checked against run.json."""
    point_filter = run.point_filter
    if point_filter["budgets_file"] is None:
        return np.full(run.dataset_size, float(point_filter["budget_eps"]))
    targets, digest = read_budgets(point_filter["budgets_file"], run.dataset_size, point_filter["budget_eps"])
    if digest != point_filter["budgets_sha256"]:
        raise UsageError("--budgets", f"{point_filter['budgets_file']} changed since {run.run} was planned (its "
                                      "sha256 differs from run.json's); restore it, or train with --overwrite")
    return targets


def held_ratio(norms: np.ndarray, clip_bound: float, margin: float) -> np.ndarray:
    """r = min(1, (1 + m)·Δ*/Γ) of measured Δ*, rounded up onto the grid (1 + CHARGE_PRECISION)^−j (§12.4, §13)."""
    ratio = np.minimum(1.0, (1.0 + margin) * np.asarray(norms, dtype=np.float64) / clip_bound)
    return storage.round_up(ratio, 1.0, CHARGE_PRECISION)


class PerPointBounds:
    """Each point's clip bound r_i·Γ in a run with per-point clipping, and its filter (None without budgets)."""

    def __init__(self, run: RunConfig, device: torch.device) -> None:
        self.run, self.device = run, device
        self.points = np.asarray(run.tracked_points, dtype=np.int64)
        self.ratio = np.ones(run.dataset_size)
        self.filter, self.order, self.known = None, None, {}
        if run.point_filter is not None:
            self.order = run.point_filter["order"]
            budget = individual_filter.budget_rdp(target_eps(run), run.point_filter["delta"], self.order)
            self.filter = individual_filter.FilterState(budget)
        self._held()

    def _held(self) -> None:
        """The clip bounds and, with a filter, each point's step charge of the current ratios, which change only at
        a measurement or a restore: every step between them is charged the same."""
        self.bounds = self._bounds()
        self.step_charge = None if self.filter is None else self.charges(self.ratio)

    def _bounds(self) -> torch.Tensor:
        """The clip bounds r·Γ in float32, the step's precision, each rounded down where float32 would round it up:
        a clipped norm is then at most its charged bound up to the rounding of w·||g|| itself, as with DP-SGD's
        clip at Γ (which stays exact where float32 holds it, Γ = 1 among them)."""
        charged = self.ratio * self.run.clip_bound
        bounds = charged.astype(np.float32)
        above = bounds.astype(np.float64) > charged
        bounds[above] = np.nextafter(bounds[above], np.float32(0))
        return torch.as_tensor(bounds, device=self.device)

    def measuring(self) -> np.ndarray | None:
        """Which tracked points a measurement needs (Tracker.measure's `wanted`): a filter's points still in
        training; None (all) without a filter."""
        return None if self.filter is None else self.filter.active[self.points]

    def measured(self, norms: np.ndarray) -> None:
        """The measured points' Δ* at a measurement θ_s (NaN: not measured): their bounds for the steps up to the
        next one."""
        measured = ~np.isnan(norms)
        self.ratio[self.points[measured]] = held_ratio(norms[measured], self.run.clip_bound, self.run.clip_margin)
        self._held()

    def charges(self, ratio: np.ndarray) -> np.ndarray:
        """ρ = RDP_SGM(q, σ/r; λ_f) of each ratio (individual_filter.step_charges), each grid level computed once."""
        levels, where = np.unique(ratio, return_inverse=True)
        fresh = [level for level in levels if level not in self.known]
        if fresh:
            values = individual_filter.step_charges(self.run.sample_rate, self.run.noise_multiplier, fresh, self.order)
            self.known.update(zip(fresh, values.tolist()))
        return np.array([self.known[level] for level in levels])[where]

    def before_step(self, step: int) -> None:
        """§12.2 before step `step`: every active point charged at its current bound; those it would take past their
        budget leave."""
        if self.filter is not None:
            self.filter.step(step, self.step_charge)

    def keep(self, batch: np.ndarray) -> np.ndarray:
        """The points of a Poisson draw that are still in the training set."""
        return batch if self.filter is None else batch[self.filter.active[batch]]

    def weights(self, indices: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """w(||g||) of the examples at `indices` (clipping.point_weights at their bounds)."""
        bounds = self.bounds.index_select(0, indices)
        return lambda norms: clipping.point_weights(norms, bounds)

    def payload(self) -> dict:
        """What a checkpoint keeps of the state (tensors only: torch.load(weights_only=True) reads it)."""
        state = {"ratio": torch.from_numpy(self.ratio.copy())}
        if self.filter is not None:
            state.update({f"filter_{name}": torch.from_numpy(value)
                          for name, value in self.filter.state_dict().items()})
        return {"point_bounds": state}

    def restore(self, payload: dict, step: int) -> None:
        """The state saved with checkpoint `step`."""
        state = payload.get("point_bounds")
        if state is None or (self.filter is not None) != ("filter_budget" in state):
            raise UsageError("--save-name", f"checkpoint {step} of {self.run.run} holds no per-point bounds of this "
                                            "run; train it again with --overwrite")
        self.ratio = state["ratio"].numpy().astype(np.float64)
        if self.filter is not None:
            restored = individual_filter.FilterState.from_state_dict(
                {name: state[f"filter_{name}"].numpy() for name in ("budget", "spent_hi", "spent_lo", "left_at")})
            if not np.array_equal(restored.budget, self.filter.budget):
                raise UsageError("--budgets", f"checkpoint {step} of {self.run.run} was trained with other budgets; "
                                              "train it again with --overwrite")
            self.filter = restored
        self._held()

    def table_rows(self, steps: np.ndarray, values: np.ndarray, labels: np.ndarray) -> pd.DataFrame:
        """The tracked table's rows of the bounds (quantity held_bound: r·Γ at each measurement step s < T, the bound
        of steps s + 1 up to the next row; 0 at the step before a point leaves) and, with a filter, of the budgets
        (quantity filter_budget at step 0, alpha λ_f). `values`: the tracked (steps, 3, points) measurements."""
        run, points = self.run, self.points
        before = np.asarray(steps) < run.total_steps
        step_of, ratio = [], []
        for step, norms in zip(np.asarray(steps)[before], values[before, 0, :]):
            step_of.append(np.full(len(points), step))
            ratio.append(held_ratio(norms, run.clip_bound, run.clip_margin))
        step_of, ratio, point_of = np.concatenate(step_of), np.concatenate(ratio), np.tile(points, int(before.sum()))
        if self.filter is not None:
            left = self.filter.left_at[point_of]
            keep = (left == 0) | (step_of + 1 < left)
            leaving = points[self.filter.left_at[points] > 0]
            step_of = np.concatenate([step_of[keep], self.filter.left_at[leaving] - 1])
            ratio = np.concatenate([ratio[keep], np.zeros(len(leaving))])
            point_of = np.concatenate([point_of[keep], leaving])
        order = np.lexsort((point_of, step_of))
        frames = [self._rows(step_of[order], point_of[order], ratio[order] * run.clip_bound, "held_bound", labels)]
        if self.filter is not None:
            frames.append(self._rows(np.zeros(len(points), dtype=np.int64), points, self.filter.budget[points],
                                     "filter_budget", labels, alpha=self.order))
        return pd.concat(frames, ignore_index=True)

    def _rows(self, steps, points, value, quantity, labels, alpha=np.nan):
        return results.result_rows(self.run, "sum", steps, {
            "point": points, "label": results.class_labels(labels)[points], "value": value, "loss": np.nan,
            "correct": np.nan, "exp": "tracked", "direction": "none", "target_batch": 0, "sample": 0,
            "quantity": quantity, "alpha": alpha})

    def record(self, labels: np.ndarray) -> pd.DataFrame:
        """The filter's record of every point: target ε and Rényi budget at λ_f, the charges it spent, the steps it was
        in the training set and the step it left at (empty: it stayed to the end), and both as ε at δ."""
        run, state = self.run, self.filter
        delta = run.point_filter["delta"]
        left = state.left_at
        return pd.DataFrame({
            "point": np.arange(run.dataset_size), "label": results.class_labels(labels),
            "target_eps": target_eps(run), "delta": delta, "order": self.order, "budget": state.budget,
            "spent": state.spent, "steps_active": np.where(left > 0, left - 1, run.total_steps),
            "left_step": np.where(left > 0, left, np.nan),
            "guarantee_eps": individual_filter.guarantee_eps(state.budget, delta, self.order),
            "spent_eps": individual_filter.guarantee_eps(state.spent, delta, self.order)})

    def summary(self) -> str:
        """How many points left the filter, and when."""
        if self.filter is None:
            return (f"each of {len(self.points)} tracked points clipped at (1 + {self.run.clip_margin:g})·Δ* of its "
                    f"latest measurement, every {self.run.measure_every} steps")
        left = self.filter.left_at[self.filter.left_at > 0]
        when = (f", at steps {left.min()}-{left.max()} (median {np.median(left):g})" if len(left) else "")
        point_filter = self.run.point_filter
        budgets = f"ε {point_filter['budget_eps']:g}" if point_filter["budgets_file"] is None else \
            f"ε from {point_filter['smallest_eps']:g} ({point_filter['budgets_file']})"
        return (f"filter at order {self.order:g} (budgets {budgets} at δ={point_filter['delta']:g}, Δ* every "
                f"{self.run.measure_every} step(s)): {len(left)} of {len(left) + int(self.filter.active.sum())} "
                f"points left{when}; {int(self.filter.active.sum())} trained to step {self.run.total_steps}")

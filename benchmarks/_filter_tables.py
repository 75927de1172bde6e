"""bench_filter.py's rows and tables: the selection on the held-out split, each run's and each class's row, and the
summary (means over seeds with their 95% t-intervals, paired differences, the time ratios)."""

import math

import numpy as np
import pandas as pd
from scipy import stats

# The methods' names: uniform DP-SGD, and filter-kK for the filter measuring Δ* every K steps.
UNIFORM = "uniform"
CONFIDENCE = 0.95


def filter_method(every: int) -> str:
    return f"filter-k{every}"


def every_of(method: str) -> int:
    """K of a filter method's name."""
    return int(method.removeprefix("filter-k"))


def select(rows: list[dict]) -> dict:
    """The checkpoint of best held-out accuracy (ties: the earliest)."""
    return max(rows, key=lambda row: (row["heldout_accuracy"], -row["step"]))


def run_row(plan, seed: int, method: str, outcome, timing: dict, record: pd.DataFrame | None, selected: int) -> dict:
    """One run: its mechanism, steps, times, and (a filter) who left, by each cap and by its selected checkpoint."""
    run = outcome.run
    row = {"workload": plan.workload.name, "seed": seed, "method": method, "points": plan.size,
           "sample_rate": run.sample_rate, "sigma": run.noise_multiplier, "uniform_steps": plan.uniform_steps,
           "trained_steps": run.total_steps, "selected_step": selected, "clock": timing["clock"],
           "seconds": timing["seconds"], "steps_seconds": timing["steps_seconds"],
           "tracking_seconds": timing["tracking_seconds"], "seconds_per_step": timing["seconds"] / run.total_steps,
           "test_accuracy_at_end": outcome.final_test_accuracy}
    if record is None:
        row["summary"] = (f"{run.total_steps} steps in {timing['seconds']:.1f} s ({timing['clock']}); selected step "
                          f"{selected}")
        return row
    left = record["left_step"].to_numpy(dtype=float)
    active_steps = record["steps_active"].to_numpy(dtype=float)
    row.update({"order": plan.order, "full_charge_steps": plan.full_charge_steps,
                "left_at_end": int(np.sum(left <= run.total_steps)),
                "left_by_selected": int(np.sum(left <= selected)),
                "left_at_full_charge": int(np.sum(left == plan.full_charge_steps + 1)),
                "median_left_step": float(np.nanmedian(left)) if np.isfinite(left).any() else math.nan,
                # Point-steps in the training set up to the selected checkpoint, against uniform DP-SGD's N·T_u.
                "point_steps_vs_uniform": float(np.minimum(active_steps, selected).sum())
                / (plan.size * plan.uniform_steps)})
    for cap in plan.caps:
        row[f"left_by_{cap}"] = int(np.sum(left <= cap))
    row["summary"] = (f"{run.total_steps} steps in {timing['seconds']:.1f} s ({timing['clock']}; tracking "
                      f"{timing['tracking_seconds']:.1f} s wall); {row['left_at_end']} of {plan.size} points left "
                      f"(median step {row['median_left_step']:g}); selected step {selected}, "
                      f"{row['left_by_selected']} left by then")
    return row


def class_rows(plan, seed: int, method: str, labels: np.ndarray, class_names: list[str],
               record: pd.DataFrame | None, chosen: dict) -> list[dict]:
    """Per class of one run: its training points, how many left the filter by the selected step and by the end, their
    median leaving step, and the selected model's test accuracy on the class."""
    rows = []
    for label, name in enumerate(class_names):
        row = {"workload": plan.workload.name, "seed": seed, "method": method, "label": label, "class": name,
               "points": int(np.sum(labels == label)), "selected_step": chosen["step"],
               "test_accuracy": chosen["class_accuracy"][label]}
        if record is not None:
            left = record.loc[record["label"] == label, "left_step"].to_numpy(dtype=float)
            row.update({"left_by_selected": int(np.sum(left <= chosen["step"])),
                        "left_at_end": int(np.sum(np.isfinite(left))),
                        "median_left_step": float(np.nanmedian(left)) if np.isfinite(left).any() else math.nan})
        rows.append(row)
    return rows


def seed_interval(values) -> tuple[float, float, float]:
    """The mean over seeds and its 95% Student-t interval (NaN bounds from fewer than two seeds)."""
    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.5 + CONFIDENCE / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def interval_text(values, scale: float = 100.0, digits: int = 1, signed: bool = False) -> str:
    mean, low, high = seed_interval(values)
    sign = "+" if signed else ""
    if math.isnan(low):
        return f"{mean * scale:{sign}.{digits}f}"
    return f"{mean * scale:{sign}.{digits}f} [{low * scale:{sign}.{digits}f}, {high * scale:{sign}.{digits}f}]"


def ratio_text(ratios) -> str:
    ratios = [ratio for ratio in ratios if np.isfinite(ratio)]
    if not ratios:
        return "not timed"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}×"
    return f"{np.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}×)"


def selected_accuracy(checkpoints: pd.DataFrame, method: str, step: int | None = None) -> pd.Series:
    """Each seed's test accuracy of `method`'s selected checkpoint (or of its checkpoint `step`), by seed."""
    rows = checkpoints[checkpoints["method"] == method]
    rows = rows[rows["selected"]] if step is None else rows[rows["step"] == step]
    return rows.set_index("seed")["test_accuracy"]


def paired(first: pd.Series, second: pd.Series) -> pd.Series:
    """first − second on the seeds both have."""
    seeds = first.index.intersection(second.index)
    return first[seeds] - second[seeds]


def same_seed_ratios(first: pd.Series, second: pd.Series) -> pd.Series:
    """first / second on the seeds both have: the runs of one seed ran one after the other, under the same load."""
    seeds = first.index.intersection(second.index)
    return first[seeds] / second[seeds]


def main_table(plan, checkpoints: pd.DataFrame, runs: pd.DataFrame) -> list[str]:
    """Per method: steps, test accuracy with its interval, the paired difference to uniform DP-SGD, who left, time."""
    uniform_selected = selected_accuracy(checkpoints, UNIFORM)
    uniform_at_end = selected_accuracy(checkpoints, UNIFORM, plan.uniform_steps)
    uniform_runs = runs[runs["method"] == UNIFORM].set_index("seed")
    lines = ["| method | seeds | steps (selected on held-out) | test accuracy, % [95% CI] | − uniform (selected), "
             "points [95% CI] | − uniform at T_u, points [95% CI] | points left by the selected step | time of T_u "
             "steps ÷ uniform's | whole run ÷ uniform's |",
             "| --- | ---: | --- | --- | --- | --- | ---: | ---: | ---: |"]
    lines.append(f"| uniform DP-SGD at T_u | {len(uniform_at_end)} | {plan.uniform_steps} | "
                 f"{interval_text(uniform_at_end)} | {interval_text(paired(uniform_at_end, uniform_selected), signed=True)}"
                 f" | — | — | 1 | 1 |")
    for method in runs["method"].unique():
        method_runs = runs[runs["method"] == method].set_index("seed")
        accuracy = selected_accuracy(checkpoints, method)
        steps = ", ".join(str(int(step)) for step in method_runs["selected_step"])
        versus_end = interval_text(paired(accuracy, uniform_at_end), signed=True)
        if method == UNIFORM:
            versus, left, at_stop, whole = "—", "—", "1", "1"
        else:
            versus = interval_text(paired(accuracy, uniform_selected), signed=True)
            left = f"{method_runs['left_by_selected'].mean() / plan.size:.1%}"
            at_stop = ratio_text(same_seed_ratios(method_runs["seconds_to_uniform_steps"], uniform_runs["seconds"]))
            whole = ratio_text(same_seed_ratios(method_runs["seconds"], uniform_runs["seconds"]))
        label = "uniform DP-SGD, best of its checkpoints" if method == UNIFORM else \
            f"filter, Δ* every {every_of(method)} step(s)"
        lines.append(f"| {label} | {len(accuracy)} | {steps} | {interval_text(accuracy)} | {versus} | {versus_end} | "
                     f"{left} | {at_stop} | {whole} |")
    return lines


def cap_table(plan, checkpoints: pd.DataFrame) -> list[str]:
    """Every candidate checkpoint: held-out and test accuracy over seeds, and how often the held-out split chose it."""
    lines = ["| method | step (× T_u) | held-out accuracy, % | test accuracy, % [95% CI] | selected |",
             "| --- | --- | ---: | --- | ---: |"]
    for (method, step), rows in checkpoints.groupby(["method", "step"], sort=False):
        lines.append(f"| {method} | {step} ({step / plan.uniform_steps:.2f}) | "
                     f"{rows['heldout_accuracy'].mean() * 100:.1f} | {interval_text(rows['test_accuracy'])} | "
                     f"{int(rows['selected'].sum())} of {len(rows)} |")
    return lines


def class_table(classes: pd.DataFrame) -> list[str]:
    """Per class: training points, the share that left each filter by the end and by its selected step, and the
    selected models' test accuracy against uniform DP-SGD's (means over seeds)."""
    methods = [method for method in classes["method"].unique() if method != UNIFORM]
    head = ["class", "points"] + [f"{method}: left by the end / by the selected step" for method in methods] + \
        ["uniform test acc, %"] + [f"{method} − uniform, points" for method in methods]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
    uniform = classes[classes["method"] == UNIFORM]
    for label, rows in uniform.groupby("label"):
        cells = [rows["class"].iloc[0], f"{rows['points'].mean():.0f}"]
        own = {method: classes[(classes["method"] == method) & (classes["label"] == label)].set_index("seed")
               for method in methods}
        for method in methods:
            mine = own[method]
            cells.append(f"{(mine['left_at_end'] / mine['points']).mean():.0%} / "
                         f"{(mine['left_by_selected'] / mine['points']).mean():.0%}")
        cells.append(f"{rows['test_accuracy'].mean() * 100:.1f}")
        for method in methods:
            cells.append(f"{paired(own[method]['test_accuracy'], rows.set_index('seed')['test_accuracy']).mean() * 100:+.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def stayer_lines(plan, runs: pd.DataFrame) -> list[str]:
    """What the every-step filter trains on past uniform DP-SGD's stop (means over its seeds)."""
    rows = runs[runs["method"] == filter_method(1)]
    if not len(rows) or "mass_at_uniform_stop" not in rows:
        return []
    after = rows["mass_after_uniform_stop"] / rows["mass_at_uniform_stop"]
    return ["", f"Past uniform DP-SGD's stop (every-step filter, means over {len(rows)} seed(s)): "
                f"{rows['stay_past_uniform_stop'].mean() / plan.size:.1%} of the points stay in training after step "
                f"{plan.uniform_steps}; the gradient mass in training, Σ Δ*/(N·Γ) over the points in, is "
                f"{rows['mass_at_uniform_stop'].mean():.3f} at step {plan.uniform_steps}, "
                f"{rows['mass_after_uniform_stop'].mean():.3f} at step {plan.uniform_steps + 1} "
                f"({after.mean():.1%} of it, against the same noise) and {rows['mass_at_cap'].mean():.3f} at step "
                f"{plan.caps[-1]}. At θ_{plan.uniform_steps} the points that stay have training loss "
                f"{rows['stayer_train_loss'].mean():.3f} and accuracy {rows['stayer_train_accuracy'].mean():.1%}; those "
                f"that leave {rows['leaver_train_loss'].mean():.3f} and {rows['leaver_train_accuracy'].mean():.1%}."]


def prefix_lines(prefix: pd.DataFrame) -> list[str]:
    """Each variant's runs capped short against its long runs at the same step: identical bytes, or how far apart."""
    lines = []
    for (method, step), rows in prefix.groupby(["method", "step"]):
        same = int(rows["identical_bytes"].sum())
        gap = "" if same == len(rows) else f"; DIFFERENT in the others (largest weight difference " \
                                           f"{rows['max_weight_gap'].max():.3g})"
        lines.append(f"Prefix check, {method}: the checkpoint at step {step} of a run capped there against the run "
                     f"capped at {rows['long_cap'].iloc[0]}, seeds {sorted(int(seed) for seed in rows['seed'])}: identical bytes in {same} "
                     f"of {len(rows)}{gap}.")
    return lines


def report(plans: list, frames: dict[str, pd.DataFrame], args) -> str:
    """The summary: per workload its mechanism, the main table, the candidates, the classes; the prefix checks."""
    out = [f"# Uniform DP-SGD against the individual filter at ε = {args.eps:g}, δ = {args.delta:g}",
           "",
           f"Times by the {args.clock} clock with {args.threads} torch thread(s); intervals: 95% Student-t over seeds; "
           "accuracy on the dataset's own test set, every selection made on the held-out split."]
    for plan in plans:
        name = plan.workload.name
        pick = {key: frame[frame["workload"] == name] for key, frame in frames.items() if len(frame)}
        runs, checkpoints = pick["runs"], pick["checkpoints"]
        out += ["", f"## {name}", "",
                f"{plan.workload.model} on {plan.workload.selection_dataset}: N = {plan.size}, B = "
                f"{plan.workload.batch_size}, q = {plan.sample_rate:.4g}, lr {plan.workload.lr:g}; uniform DP-SGD "
                f"T_u = {plan.uniform_steps} steps at σ = {plan.sigma:.6g}; the filter at λ_f = {plan.order:g} keeps a "
                f"point charged at Γ for {plan.full_charge_steps} steps; caps {list(plan.caps)}.", ""]
        k1_seeds = sorted(int(seed) for seed in runs.loc[runs["method"] == filter_method(1), "seed"])
        out += [f"Seeds {sorted(int(seed) for seed in runs['seed'].unique())} (the every-step filter on {k1_seeds}).",
                ""]
        out += main_table(plan, checkpoints, runs)
        gaps = runs.dropna(subset=["weights_gap_at_uniform_steps"]) if "weights_gap_at_uniform_steps" in runs \
            else runs.iloc[:0]
        for method, rows in gaps.groupby("method"):
            at_uniform = selected_accuracy(checkpoints, method, plan.uniform_steps)
            out.append(f"\n{method} at step T_u = {plan.uniform_steps} against uniform DP-SGD's T_u: largest weight "
                       f"difference {rows['weights_gap_at_uniform_steps'].max():.3g}; test accuracy "
                       f"{interval_text(paired(at_uniform, selected_accuracy(checkpoints, UNIFORM, plan.uniform_steps)), signed=True)} "
                       "points (paired)")
        out += stayer_lines(plan, runs)
        out += ["", "Every candidate checkpoint:", ""] + cap_table(plan, checkpoints)
        if "classes" in pick:
            out += ["", "By class:", ""] + class_table(pick["classes"])
        if "prefix" in pick:
            out += [""] + prefix_lines(pick["prefix"])
    return "\n".join(out) + "\n"

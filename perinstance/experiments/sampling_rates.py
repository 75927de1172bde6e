"""GLA's sampling-rate claim for the mean rule, in two controlled designs (docs/accounting.md §3.2, §4):
(a) the main run's final and an early checkpoint, each analysed as one mean-rule step at several q; (b) one
mean-rule run per batch size, trained for the main run's T steps.

Findings 3 to 6 (the mean rule per sampling rate, per step and over the whole run, and the verdict on the
claim); figure 3, drawn by figures.py.
"""

import dataclasses
import math
import os

import numpy as np
import pandas as pd

from perinstance.accounting import intervals, rdp_composition, renyi_step
from perinstance.accounting.guarantees import Kind
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis import composition, reading
from perinstance.experiments.commands import RES_DIR, Commands, account, result_file
from perinstance.experiments.config import DATA_ROOT, ReproduceConfig, training_flags
from perinstance.files import results, storage
from perinstance.measure import measurement
from perinstance.train import run_plan, runs
from perinstance.train.points import parse_points
from perinstance.train.runs import RunConfig

# The designs of the sampling-rate experiment, as figure 3 and the report name them.
DESIGN_EARLY, DESIGN_FINAL = "(a) fixed early checkpoint", "(a) fixed final checkpoint"
DESIGN_MATCHED = "(b) matched steps"
# What "the whole run" means in the report line of a fixed-checkpoint design and of the matched-steps design.
FIXED_WHOLE_RUN = "T steps at q, each charged at this one checkpoint: a what-if, not a trained run"
MATCHED_WHOLE_RUN = ("the run's T steps, each charged at the latest of its checkpoints (a held-Δ* estimate, "
                     "accounting.md §4); no Monte Carlo series: its Δ_B are drawn at the final checkpoint only")
# The series whose change with q is judged: the data-dependent ones (the baselines are single numbers).
JUDGED_SERIES = ("certified", "estimate")
# The mean rule's whole-run ε are often tens to hundreds, converted best at orders close to 1: its compositions
# take three orders below the composition grid's lowest.
MEAN_RULE_ORDERS = (1.02, 1.05, 1.1, *rdp_composition.COMPOSITION_ORDERS)
# The fixed-checkpoint design's Δ_B draws: Monte-Carlo blocks and grid sizes, compute_sensitivity.py's defaults.
FIXED_MC_BLOCKS, FIXED_MAX_SIZES = 4, 32


def adjacent_rate_verdicts(values_by_rate: dict[float, np.ndarray], *, paired: bool) -> list[dict]:
    """§10: per pair of adjacent rates (q, q'), the verdict on the median's change from q to q' ("falls",
    "rises", "no difference at this precision") and the interval of log(median at q' / median at q). paired: the
    same points in the same order at every rate (one checkpoint), resampled together; a point whose value is
    not a positive finite number at either rate is left out of that pair."""
    rates = sorted(values_by_rate)
    judged = []
    for first, second in zip(rates, rates[1:]):
        before, after = (np.asarray(values_by_rate[rate], dtype=float) for rate in (first, second))
        if paired:
            kept = np.isfinite(before) & np.isfinite(after) & (before > 0) & (after > 0)
            before, after = before[kept], after[kept]
        else:
            before = before[np.isfinite(before) & (before > 0)]
            after = after[np.isfinite(after) & (after > 0)]
        if len(before) == 0 or len(after) == 0:
            continue
        change = intervals.change_interval(before, after, paired=paired)
        judged.append({"from": first, "to": second, "verdict": intervals.verdict_of_change(change), "change": change})
    return judged


def design_verdicts(per_step: dict[float, dict], whole_run: dict[float, dict], *, paired: bool) -> dict[str, dict]:
    """§10 for one design of figure 3: {"ratio" (per step ÷ the mean rule's baseline at q), "per_step", "whole_run":
    {series: adjacent_rate_verdicts}} for the certified bound and the estimate, where the design has them."""
    def judged(series_by_rate: dict[float, dict], scale: bool) -> dict[str, list[dict]]:
        return {series: adjacent_rate_verdicts(
                    {rate: np.atleast_1d(np.asarray(values[series], dtype=float))
                     / (float(values["baseline"]) if scale else 1.0) for rate, values in series_by_rate.items()},
                    paired=paired)
                for series in JUDGED_SERIES if all(series in values for values in series_by_rate.values())}

    return {"ratio": judged(per_step, True), "per_step": judged(per_step, False), "whole_run": judged(whole_run, False)}


def rdp_table(rows: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The direction-max Rényi DP of `kind` from renyi_per_instance_mean.py's rows as a (points, orders) frame."""
    chosen = rows[(rows["kind"] == kind) & (rows["direction"] == "max")]
    return chosen.pivot_table(index="point", columns="alpha", values="rdp", aggfunc="first")


def at_order(table: pd.DataFrame, alpha: float) -> np.ndarray:
    return table[alpha].to_numpy()


def rate_mechanisms(main_run: RunConfig, sample_rates: tuple[float, ...], epochs: float,
                    eps: float) -> tuple[list[int], list[RunConfig], list[float]]:
    """The fixed-checkpoint design's mechanism per sampling rate q: a run at q lasts T_q = epochs/q steps, and its
    RunConfig (B_exp = qN, σ_q for `eps` over T_q steps, run_plan.analysed_config) and δ_size = δ/(10·T_q) (§3.4)
    are that run's. Returns (T_q, the RunConfigs, the δ_size), in the order of `sample_rates`."""
    size = main_run.dataset_size
    run_steps = [max(1, round(epochs / rate)) for rate in sample_rates]
    analysed = [run_plan.analysed_config(main_run, max(1, round(rate * size)), steps_at_rate, eps)
                for rate, steps_at_rate in zip(sample_rates, run_steps)]
    return run_steps, analysed, [main_run.delta / (10 * steps_at_rate) for steps_at_rate in run_steps]


def fixed_checkpoint_design(commands: Commands, config: ReproduceConfig, main_name: str, mean_name: str,
                            main_run: RunConfig, sensitivities: pd.DataFrame, device: str) -> dict[str, dict[float,
                            tuple[dict, dict, dict]]]:
    """Design (a) of the sampling-rate experiment: {checkpoint label: {q: (per-step series, whole-run series,
    facts)}}. One trained model, its final checkpoint and an early one, each analysed as one step of the mean
    rule at every q of fixed_sample_rates, σ_q calibrated so that the sum rule's worst case over the
    epochs/q steps of a run at q is the target ε: what changes with q is only the batches' concentration
    (§3.2), not how far training got. Whole run: epochs/q steps, each charged at this checkpoint (§4)."""
    run = runs.open_run(main_name, "models", DATA_ROOT)
    saved = run.saved_steps()
    total = main_run.total_steps
    checkpoint_of = {"early": min(saved, key=lambda step: (abs(step - config.early_stage * total), step)),
                     "final": total}
    size = main_run.dataset_size
    run_steps, analysed, size_deltas = rate_mechanisms(main_run, config.fixed_sample_rates, config.epochs, config.eps)
    points = parse_points(config.mean_points, size, main_run.seed)
    by_rate = {}
    for label, step in checkpoint_of.items():
        # Named by the main run and the mean-rule fields (mean_name), so that other draws never reuse these files.
        names = [f"{mean_name}-fixed-step{step}-bs{mechanism.batch_size}" for mechanism in analysed]
        measured = all(os.path.exists(result_file(res_name)) for res_name in names)
        if not measured:
            with commands.timed(f"measurement.measure_at_rates, step {step}, q = "
                                f"{', '.join(f'{rate:g}' for rate in config.fixed_sample_rates)}"):
                frames = measurement.measure_at_rates(run, step, points, analysed, size_deltas,
                                                      num_batches=config.num_batches, mc_blocks=FIXED_MC_BLOCKS,
                                                      max_sizes=FIXED_MAX_SIZES, mc_seed=main_run.seed, device=device)
                # Parquet: ~100,000 rows each, written in a third of a CSV's time, and each before the next pass.
                # strict: the generator is run to its end, which lets go of the checkpoint's Gram at once.
                for res_name, frame in zip(names, frames, strict=True):
                    storage.write_frame(os.path.join(RES_DIR, res_name + storage.PARQUET), frame)
        commands.note(f"measurement.measure_at_rates(run {main_name}, step {step}, {len(points)} points {config.mean_points}, "
                      f"batch sizes {', '.join(str(mechanism.batch_size) for mechanism in analysed)}, "
                      f"{config.num_batches} draws) -> {', '.join(result_file(res_name) for res_name in names)}",
                      cached=measured)
        norms = sensitivities[(sensitivities["step"] == step) & sensitivities["point"].isin(points)]
        norms = norms.set_index("point").loc[points, "value"].to_numpy()
        by_rate[label] = {}
        for mechanism, steps_at_rate, size_delta, res_name in zip(analysed, run_steps, size_deltas, names):
            # β of the certified event is the run at q's δ/(10·T_q), like δ_size (k_min = 0 leaves δ_size at 0).
            rows = account(commands, "renyi_per_instance_mean.py", res_name,
                           ["--alpha", f"{config.renyi_order:g}", "--failure", f"{size_delta!r}"], "renyi")
            loaded = reading.load(reading.Source(res_name=res_name, res_file=None, res_dir=RES_DIR),
                                      list(results.COUPLING_QUANTITIES), one_run=True,
                                      integer_columns={"sample": 0})
            with commands.timed(f"composition.mean_rule_repeated {res_name}"):
                whole = {kind: composition.mean_rule_repeated(loaded, steps=steps_at_rate, delta=config.delta,
                                                              orders=MEAN_RULE_ORDERS, kind=kind, failure=size_delta)
                         for kind in (Kind.CERTIFIED, Kind.ESTIMATE)}
            commands.note(f"composition.mean_rule_repeated({result_file(res_name)}, steps={steps_at_rate}, "
                          f"delta={config.delta:g},"
                          f" failure={size_delta:.4g}, kinds certified and estimate): ε over the whole run at q")
            by_rate[label][mechanism.sample_rate] = fixed_series(mechanism, steps_at_rate, rows, whole, norms, config,
                                                                 step)
    return by_rate


def fixed_series(mechanism: Mechanism, steps: int, rows: pd.DataFrame, whole: dict, norms: np.ndarray,
                 config: ReproduceConfig, step: int) -> tuple[dict, dict, dict]:
    """One rate of design (a): per-step Rényi DP at config.renyi_order and ε over the T_q steps of a run at q
    (each charged at this checkpoint), per series; the sum rule from the points' Δ* at the same σ_q (§3.1)."""
    alpha, orders = config.renyi_order, rdp_composition.COMPOSITION_ORDERS
    sum_rdp = renyi_step.rdp_sum_rule(norms, mechanism.clip_bound, mechanism.noise_multiplier, mechanism.sample_rate,
                                      orders)
    sum_mechanism = dataclasses.replace(Mechanism.of_run(mechanism, "sum"), total_steps=steps)
    tables = {kind: rdp_table(rows, kind) for kind in ("certified", "estimate", "baseline")}
    # Every point has a certified bound, not always an estimate: the point-wise series are aligned on the
    # certified points (NaN where one is missing), so that the rates' verdicts can pair the same points.
    points = tables["certified"].index
    per_step = {kind: at_order(tables[kind].reindex(points), alpha) for kind in ("certified", "estimate")}
    per_step["baseline"] = float(at_order(tables["baseline"], alpha)[0])
    per_step["sum_rule"] = sum_rdp[:, orders.index(alpha)]
    per_step["sum_baseline"] = float(sum_mechanism.baseline_rdp([alpha], steps=1)[0])

    def on_points(kind: Kind) -> np.ndarray:
        whole_points, eps, _ = whole[kind]
        return pd.Series(eps, index=whole_points).reindex(points).to_numpy()

    whole_run = {"certified": on_points(Kind.CERTIFIED), "estimate": on_points(Kind.ESTIMATE),
                 "baseline": whole[Kind.CERTIFIED][2],
                 "sum_rule": composition.repeated_step_eps(sum_rdp, steps, orders, config.delta)[0],
                 "sum_baseline": float(sum_mechanism.baseline_eps(config.delta)[0])}
    certified = rows[(rows["kind"] == "certified") & (rows["direction"] == "max")]
    facts = {"sigma": mechanism.noise_multiplier, "steps": steps, "batch_size": mechanism.batch_size,
             "checkpoint": step, "k_min": int(certified["k_min"].iloc[0]), "points": len(norms),
             "estimate_samples": int(rows.loc[rows["kind"] == "estimate", "samples"].median()),
             "dominated_by_k_min": float(certified["k_star_at_k_min"].mean())}
    return per_step, whole_run, facts


def matched_steps_design(commands: Commands, config: ReproduceConfig, mean_name: str, main_run: RunConfig,
                         device: str) -> dict[float, tuple[dict, dict, dict]]:
    """Design (b) of the sampling-rate experiment: {q: (per-step series, whole-run series, facts)}. One mean-rule
    run per batch size, each trained for the main run's T steps (not its epochs) to the same target ε (σ per q)
    and checkpointed mean_checkpoints times: d*, v_X, b_X of every point at every checkpoint (certified bound,
    composition), Δ_B draws of `mean_points` at the final checkpoint (estimate), and Δ* of every point there
    (the sum rule at the same θ and σ)."""
    by_rate = {}
    alpha = ["--alpha", f"{config.renyi_order:g}"]
    total = main_run.total_steps
    for batch_size in config.mean_batch_sizes:
        epochs = total * batch_size / main_run.dataset_size
        run = dataclasses.replace(config, batch_size=batch_size, epochs=epochs, save_steps="",
                                  save_freq=max(1, math.ceil(total / config.mean_checkpoints)))
        run_name = f"{mean_name}-bs{batch_size}"
        commands.run("train_dpsgd.py", [*training_flags(run, device), "--reduction", "mean", "--save-name", run_name])
        measure = ["--run", run_name, "--no-train", "--device", device]
        names = {part: f"{run_name}-{part}" for part in ("stats", "samples", "norms")}
        commands.run("compute_sensitivity.py", [*measure, "--reduction", "mean", "--points", "all", "--stage", "all",
                                                "--num-batches", "0", "--res-name", names["stats"]])
        commands.run("compute_sensitivity.py", [*measure, "--reduction", "mean", "--points", config.mean_points,
                                                "--stage", "final", "--num-batches", str(config.num_batches),
                                                "--res-name", names["samples"]])
        commands.run("compute_sensitivity.py", [*measure, "--reduction", "sum", "--points", "all", "--stage", "final",
                                                "--res-name", names["norms"]])
        certified = account(commands, "renyi_per_instance_mean.py", names["stats"],
                            [*alpha, "--filter", f"step={total}"], "renyi")
        estimate = account(commands, "renyi_per_instance_mean.py", names["samples"], alpha, "renyi")
        sum_rule = account(commands, "renyi_per_instance_sum.py", names["norms"], alpha, "renyi")
        # Over the whole run, the points that also have draws: the same points as the fixed-checkpoint design.
        composed = account(commands, "renyi_per_instance_sum_compo.py", names["stats"],
                           ["--delta", str(config.delta), "--alpha", *map(str, MEAN_RULE_ORDERS), "--points",
                            config.mean_points], "compo")
        run = runs.load_run(os.path.join("models", run_name))
        by_rate[run.sample_rate] = matched_series(run, config, certified, estimate, sum_rule, composed)
    return by_rate


def matched_series(run: RunConfig, config: ReproduceConfig, certified: pd.DataFrame, estimate: pd.DataFrame,
                   sum_rule: pd.DataFrame, composed: pd.DataFrame) -> tuple[dict, dict, dict]:
    """The numbers figure 3 draws for one rate of design (b), from the accountants' labelled outputs."""
    final_step = run.total_steps
    sum_mechanism = Mechanism.of_run(run, "sum")

    def per_step(rows, kind):
        chosen = rows[(rows["kind"] == kind) & (rows["direction"] == "max") & (rows["step"] == final_step)]
        return chosen["rdp"].to_numpy()

    at_end = certified[(certified["step"] == final_step) & (certified["direction"] == "max")]
    facts = {"sigma": run.noise_multiplier, "steps": run.total_steps, "batch_size": run.batch_size,
             "checkpoint": final_step, "k_min": int(at_end["k_min"].iloc[0]),
             "points": int(at_end.loc[at_end["kind"] == "certified", "point"].nunique()),
             "estimate_points": int(estimate["point"].nunique()),
             "estimate_samples": int(estimate.loc[estimate["kind"] == "estimate", "samples"].median()),
             "dominated_by_k_min": float(at_end.loc[at_end["kind"] == "certified", "k_star_at_k_min"].mean()),
             "estimate_spread": (estimate.loc[estimate["kind"] == "estimate", "rdp_max"]
                                 / estimate.loc[estimate["kind"] == "estimate", "rdp_min"]).median()}
    step_series = {"certified": per_step(certified, "certified"), "estimate": per_step(estimate, "estimate"),
                   "baseline": float(per_step(certified, "baseline")[0]), "sum_rule": per_step(sum_rule, "certified"),
                   "sum_baseline": float(sum_mechanism.baseline_rdp([config.renyi_order], steps=1)[0])}
    # The certified per-step values composed over the checkpoints: labelled held_estimate by the accountant (§4).
    composed_series = {"certified": composed.loc[composed["kind"] != "baseline", "eps"].to_numpy(),
                       "baseline": float(composed.loc[composed["kind"] == "baseline", "eps"].iloc[0]),
                       "sum_baseline": float(sum_mechanism.baseline_eps(config.delta)[0])}
    return step_series, composed_series, facts

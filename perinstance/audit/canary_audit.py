"""The one-run audit of a run trained with canaries (docs/audit.md §1b; the mathematics in accounting.md §11).

Each group of canaries (gradient canaries of one norm c; input canaries, whose bound is Γ) is audited on its own
canaries (m = the group's size; the other groups are part of the run's other data) at significance α/G, G the
number of groups (Bonferroni), so that the G verdicts hold together at α (each group's four lower bounds are each
valid at α/G, not all together):

- the verdict: the f-DP one-run test (§11.8) of the likelihood-ratio scores (§11.10) against the trade-off curve
  the suite's accountant claims for a point of sensitivity c·Γ at every step of this run (its PLD, §8.2, both
  directions). A rejected curve is a violation: the accounting, or the training code, is wrong;
- `lower_bound`: the ε at δ of the least private curve of that shape (the run's q and T, any noise) that the
  scores reject, the largest ε refuted (§11.9), a bound only for a run whose curve has that shape; `lower_bound_summed` the same for the summed projection Σ_t x_t, the last-iterate
  statistic; `steinke_lower` (and `_summed`) Steinke et al.'s (ε, δ) bound (§11.2) on the same guesses (§11.7),
  which holds for any (ε, δ)-DP mechanism, for comparison;
- `upper_rdp`, `upper_pld`: the suite's ε for that sensitivity at every step (§4, §8.2), `upper_bound` the
  smaller; `ideal_lower_bound` (and `_summed`): what the same test gets on the idealised mechanism with the
  run's m, q, T and σ/c (§11.11); `fdp_cap`, `steinke_cap`: what each test can show at most with these
  canaries (perfectly separated scores).
"""

import math
import os

import numpy as np
import pandas as pd

from perinstance.accounting import one_run_audit, one_run_fdp, one_run_ideal, pld, rdp_composition
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis import composition
from perinstance.errors import UsageError
from perinstance.files import checkpoints
from perinstance.train import canaries, runs, sampling

COLUMNS = ["kind", "norm", "canaries", "included", "lower_bound", "lower_bound_summed", "steinke_lower",
           "steinke_lower_summed", "ideal_lower_bound", "ideal_lower_bound_summed", "upper_rdp", "upper_pld",
           "upper_bound", "tightness", "fdp_cap", "steinke_cap", "violated", "significance", "group_significance",
           "delta", "steps", "sample_rate", "noise_multiplier"]
# §11.11: simulations of the idealised mechanism per group; the median of their bounds is reported.
IDEAL_REPLICATES = 5
# Key within CANARY_STREAM (after canaries.SETUP_KEY's 0): the idealised simulations, then the group's index.
IDEAL_KEY = 1


def upper_bounds(config: runs.RunConfig, norms: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The suite's ε over the whole run for a point of sensitivity c·Γ at every step, each c in
    `norms`: sum-rule RDP composition (§4) and PLD composition (§8.2, the larger direction)."""
    mechanism = Mechanism.of_run(config, "sum")
    ratios = np.asarray(norms, dtype=float)
    rdp_eps, _ = composition.compose_sum_rule(ratios[None, None, :], [0], mechanism,
                                              orders=rdp_composition.COMPOSITION_ORDERS, delta=delta)
    pld_eps = pld.sum_rule_eps(ratios[:, None], [0], config.total_steps, sample_rate=config.sample_rate,
                               noise_multiplier=config.noise_multiplier, delta=delta)
    return rdp_eps[0], pld_eps.max


def audit_group(config: runs.RunConfig, projections: np.ndarray, included: np.ndarray, norm: float, *,
                level: float, delta: float, rng: np.random.Generator | None) -> dict:
    """One group's bounds and verdict at significance `level` (its share of α); projections: canaries × steps;
    `rng` draws the idealised simulations (None: none, their columns NaN)."""
    sigma, rate, steps = config.noise_multiplier, config.sample_rate, config.total_steps
    statistics = one_run_ideal.statistics(projections, norm=norm, noise_multiplier=sigma, sample_rate=rate)
    family = dict(sample_rate=rate, steps=steps, delta=delta, significance=level)
    row = {}
    for suffix, scores in statistics.items():
        members, non_members = scores[included], scores[~included]
        row[f"lower_bound{suffix}"] = one_run_fdp.family_lower_bound(members, non_members, **family).epsilon
        row[f"steinke_lower{suffix}"] = one_run_audit.one_run_epsilon(members, non_members, significance=level,
                                                                      delta=delta)
    claim = one_run_fdp.subsampled_gaussian_curve(sigma / norm, rate, steps)
    row["violated"] = one_run_fdp.curve_rejected(claim.curve, statistics[""][included], statistics[""][~included],
                                                 significance=level)
    row.update(ideal_bounds(rng, included, norm=norm, noise_multiplier=sigma, **family) if rng is not None
               else {"ideal_lower_bound": math.nan, "ideal_lower_bound_summed": math.nan})
    row["fdp_cap"] = one_run_fdp.family_lower_bound(np.ones(int(included.sum())), np.zeros(int((~included).sum())),
                                                    **family).epsilon
    row["steinke_cap"] = one_run_audit.one_run_cap(members=int(included.sum()), non_members=int((~included).sum()),
                                                   significance=level, delta=delta, thresholds="grid")
    return row


def ideal_bounds(rng: np.random.Generator, included: np.ndarray, *, norm: float, noise_multiplier: float,
                 sample_rate: float, steps: int, delta: float, significance: float) -> dict:
    """§11.11: the median over IDEAL_REPLICATES simulations of the idealised mechanism of the family bound of
    each statistic."""
    bounds = {"": [], "_summed": []}
    for _ in range(IDEAL_REPLICATES):
        projections = one_run_ideal.simulated_projections(rng, included, steps=steps, norm=norm,
                                                          noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        for suffix, scores in one_run_ideal.statistics(projections, norm=norm, noise_multiplier=noise_multiplier,
                                                       sample_rate=sample_rate).items():
            bounds[suffix].append(one_run_fdp.family_lower_bound(
                scores[included], scores[~included], sample_rate=sample_rate, steps=steps, delta=delta,
                significance=significance).epsilon)
    return {f"ideal_lower_bound{suffix}": float(np.median(values)) for suffix, values in bounds.items()}


def canary_groups(record: canaries.CanaryRecord) -> list[tuple[str, float]]:
    """(kind, norm) of every group: the gradient canaries' norms in increasing order, then the input canaries."""
    gradient = sorted(set(record.norms[record.kinds == canaries.GRADIENT].tolist()))
    return [(canaries.GRADIENT, norm) for norm in gradient] + (
        [(canaries.INPUT, 1.0)] if np.any(record.kinds == canaries.INPUT) else [])


def audit_canaries(config: runs.RunConfig, record: canaries.CanaryRecord, *, significance: float, delta: float,
                   idealised: bool = True) -> pd.DataFrame:
    """One row per canary group (canary_groups): the module's columns, each group at significance/groups;
    without the idealised mechanism's bounds (NaN) when not `idealised` (the self-test, which prints none)."""
    groups = canary_groups(record)
    level = significance / len(groups)
    rdp_upper, pld_upper = upper_bounds(config, np.array([norm for _, norm in groups]), delta)
    rows = []
    for index, ((kind, norm), upper_rdp, upper_pld) in enumerate(zip(groups, rdp_upper, pld_upper, strict=True)):
        chosen = (record.kinds == kind) & (record.norms == norm)
        rng = sampling.stream_rng(config.seed, sampling.CANARY_STREAM, IDEAL_KEY, index) if idealised else None
        row = audit_group(config, record.projections[chosen], record.included[chosen], norm, level=level,
                          delta=delta, rng=rng)
        upper = min(upper_rdp, upper_pld)
        rows.append(dict(kind=kind, norm=norm, canaries=int(chosen.sum()), included=int(record.included[chosen].sum()),
                         upper_rdp=upper_rdp, upper_pld=upper_pld, upper_bound=upper,
                         tightness=row["lower_bound"] / upper if upper > 0 else math.nan, significance=significance,
                         group_significance=level, delta=delta, steps=config.total_steps,
                         sample_rate=config.sample_rate, noise_multiplier=config.noise_multiplier, **row))
    return pd.DataFrame(rows, columns=COLUMNS)


def audit_run(name: str, models_dir: str, *, significance: float, delta: float) -> tuple[runs.RunConfig, pd.DataFrame]:
    """The one-run audit of the run `name` (a folder or a name in `models_dir`) trained with canaries."""
    run_dir = runs.run_folder(name, models_dir)
    if not os.path.isfile(runs.run_file(run_dir)):
        raise UsageError("--run", f"no run {name!r}: neither a folder with {runs.RUN_FILE} nor {run_dir}")
    config = runs.load_run(run_dir)
    if not config.canaries and not config.input_canaries:
        raise UsageError("--run", f"{config.run} has no canaries: train it with --canaries M or --input-canaries M")
    if config.total_steps not in checkpoints.saved_steps(run_dir):
        raise UsageError("--run", f"{config.run} is not trained to its last step; rerun its train_dpsgd.py command")
    record = canaries.read_canaries(run_dir)
    for kind, norm in canary_groups(record):
        held_in = record.included[(record.kinds == kind) & (record.norms == norm)]
        if held_in.all() or not held_in.any():
            raise UsageError("--run", f"{config.run}: every {kind} canary of norm {norm:g} is held "
                                      f"{'in' if held_in.all() else 'out'}; a group needs both to be audited: train "
                                      "with more canaries")
    return config, audit_canaries(config, record, significance=significance, delta=delta)


def table_lines(config: runs.RunConfig, rows: pd.DataFrame) -> list[str]:
    """The audit's table: one line per group, what the canaries are and at which level above it."""
    first = rows.iloc[0]
    lines = [f"one-run audit of {config.run} ({config.update_rule} rule trained, sum-rule accounting; "
             f"T={config.total_steps} q={config.sample_rate:g} sigma={config.noise_multiplier:g}; significance "
             f"{first['significance']:g} split over {len(rows)} groups, {first['group_significance']:.3g} each; "
             f"delta {first['delta']:g})",
             "gradient canaries: insertions of c·Γ·u into the noisy gradient sum, not examples of the model; input "
             "canaries: crafted examples, sampled, differentiated and clipped like real points (bound: Γ)",
             "lower: f-DP test against the accountant's curves (likelihood ratio of every step; summed: Σ_t x_t, "
             "last-iterate); (ε,δ): Steinke et al.'s test; ideal: the same test on the idealised mechanism; caps: "
             "perfectly separated canaries",
             f"{'kind':>8} {'norm':>5} {'m':>6} {'in':>6} {'lower':>7} {'summed':>7} {'(ε,δ)':>7} {'ideal':>7} "
             f"{'upper':>7} {'l/u':>6} {'f-DP cap':>8} {'(ε,δ) cap':>9}  verdict"]
    for row in rows.itertuples():
        verdict = ("VIOLATION: the canaries reject the accountant's curve" if row.violated
                   else "consistent with the accounting")
        lines.append(f"{row.kind:>8} {row.norm:>5g} {row.canaries:>6d} {row.included:>6d} {row.lower_bound:>7.3f} "
                     f"{row.lower_bound_summed:>7.3f} {row.steinke_lower:>7.3f} {row.ideal_lower_bound:>7.3f} "
                     f"{row.upper_bound:>7.3f} {row.tightness:>6.3f} {row.fdp_cap:>8.3f} {row.steinke_cap:>9.3f}  "
                     f"{verdict}")
    return lines

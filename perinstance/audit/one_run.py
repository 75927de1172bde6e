"""audit.py's one-run modes (docs/audit.md §1b): anyone's canary scores, or a run trained with canaries.

    python audit.py --in-scores in.txt --out-scores out.npy --significance 0.05 --delta 1e-6
    python audit.py --run NAME --one-run

The second audits each canary norm group c of a run trained with `--canaries`: the one-run lower
bound on ε (accounting.md §11.2, the group's canaries alone) against the upper bound the suite's own
accounting gives a point of sensitivity c·Γ over the same run, by RDP (§4) and by PLD (§8.2). A lower
bound above an upper bound is a violation: the accounting (or the training code) is wrong.
"""

import math
import os

import numpy as np
import pandas as pd

from perinstance.accounting import one_run_audit, pld, rdp_composition
from perinstance.accounting.mechanism import Mechanism
from perinstance.analysis import composition
from perinstance.errors import UsageError
from perinstance.files import checkpoints
from perinstance.train import canaries, runs

COLUMNS = ["norm", "canaries", "included", "eps_lower", "eps_lower_fdp", "eps_lower_cp", "eps_upper_rdp",
           "eps_upper_pld", "tightness", "violated", "significance", "delta", "steps", "sample_rate",
           "noise_multiplier"]


def read_scores(path: str, flag: str) -> np.ndarray:
    """Scores from `path`: a .npy array, or text with one number a line (blank lines skipped)."""
    if not os.path.isfile(path):
        raise UsageError(flag, f"no file {path}")
    try:
        if path.endswith(".npy"):
            scores = np.load(path, allow_pickle=False).astype(float).ravel()
        else:
            with open(path) as handle:
                scores = np.array([float(line) for line in handle if line.strip()])
    except (ValueError, OSError) as error:
        raise UsageError(flag, f"{path} is not one number a line nor a .npy array of numbers ({error})") from None
    if scores.size == 0 or not np.all(np.isfinite(scores)):
        raise UsageError(flag, f"{path} must hold at least one score, all finite numbers")
    return scores


def score_bounds(in_scores: np.ndarray, out_scores: np.ndarray, *, significance: float,
                 delta: float) -> dict[str, float]:
    """The three lower bounds on ε of §11 from canary scores (higher = member)."""
    return {name: bound(in_scores, out_scores, significance=significance, delta=delta)
            for name, bound in (("one_run_eps", one_run_audit.one_run_epsilon),
                                ("one_run_fdp_eps", one_run_audit.one_run_fdp_epsilon),
                                ("clopper_pearson_eps", one_run_audit.clopper_pearson_epsilon))}


def upper_bounds(config: runs.RunConfig, norms: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The suite's ε over the whole run for a point of sensitivity c·Γ at every step, each c in
    `norms`: sum-rule RDP composition (§4) and PLD composition (§8.2, the larger direction)."""
    mechanism = Mechanism.of_run(config, "sum")
    sensitivity_ratio = np.asarray(norms, dtype=float)
    rdp_eps, _ = composition.compose_sum_rule(sensitivity_ratio[None, None, :], [0], mechanism,
                                              orders=rdp_composition.COMPOSITION_ORDERS, delta=delta)
    pld_eps = pld.sum_rule_eps(sensitivity_ratio[:, None], [0], config.total_steps, sample_rate=config.sample_rate,
                               noise_multiplier=config.noise_multiplier, delta=delta)
    return rdp_eps[0], pld_eps.max


def audit_canaries(config: runs.RunConfig, scores: canaries.CanaryScores, *, significance: float,
                   delta: float) -> pd.DataFrame:
    """One row per canary norm group: lower bounds from its canaries, the accountant's upper bounds, tightness.

    Each group is audited on its own canaries (m = the group's size); the other groups' canaries
    are part of the run's other data. eps_lower is Steinke et al.'s bound, the one that holds for
    any (ε, δ)-DP mechanism; eps_lower_fdp (a Gaussian trade-off curve) and eps_lower_cp (canaries
    as independent trials) are shown for comparison and not held against the upper bound.
    """
    norms = np.unique(scores.norms)
    rdp_upper, pld_upper = upper_bounds(config, norms, delta)
    rows = []
    for norm, upper_rdp, upper_pld in zip(norms, rdp_upper, pld_upper, strict=True):
        group = scores.norms == norm
        members, non_members = scores.scores[group & scores.included], scores.scores[group & ~scores.included]
        bounds = score_bounds(members, non_members, significance=significance, delta=delta)
        upper = min(upper_rdp, upper_pld)
        rows.append(dict(norm=norm, canaries=int(group.sum()), included=int(members.size),
                         eps_lower=bounds["one_run_eps"], eps_lower_fdp=bounds["one_run_fdp_eps"],
                         eps_lower_cp=bounds["clopper_pearson_eps"], eps_upper_rdp=upper_rdp, eps_upper_pld=upper_pld,
                         tightness=bounds["one_run_eps"] / upper if upper > 0 else math.nan,
                         violated=bool(bounds["one_run_eps"] > upper), significance=significance, delta=delta,
                         steps=config.total_steps, sample_rate=config.sample_rate,
                         noise_multiplier=config.noise_multiplier))
    return pd.DataFrame(rows, columns=COLUMNS)


def audit_run(name: str, models_dir: str, *, significance: float, delta: float) -> tuple[runs.RunConfig, pd.DataFrame]:
    """The one-run audit of the run `name` (a folder or a name in `models_dir`) trained with canaries."""
    run_dir = runs.run_folder(name, models_dir)
    if not os.path.isfile(runs.run_file(run_dir)):
        raise UsageError("--run", f"no run {name!r}: neither a folder with {runs.RUN_FILE} nor {run_dir}")
    config = runs.load_run(run_dir)
    if not config.canaries:
        raise UsageError("--run", f"{config.run} has no canaries: train it with --canaries M")
    if config.total_steps not in checkpoints.saved_steps(run_dir):
        raise UsageError("--run", f"{config.run} is not trained to its last step; rerun its train_dpsgd.py command")
    scores = canaries.read_canaries(run_dir)
    for norm in np.unique(scores.norms):
        held_in = scores.included[scores.norms == norm]
        if held_in.all() or not held_in.any():
            raise UsageError("--run", f"{config.run}: every canary of norm {norm:g} is held {'in' if held_in.all() else 'out'}"
                                      f"; a group needs both to be audited: train with more --canaries")
    return config, audit_canaries(config, scores, significance=significance, delta=delta)


def table_lines(config: runs.RunConfig, rows: pd.DataFrame) -> list[str]:
    lines = [f"one-run audit of {config.run} ({config.update_rule} rule trained, sum-rule accounting; "
             f"T={config.total_steps} q={config.sample_rate:g} sigma={config.noise_multiplier:g}; "
             f"significance {rows['significance'].iloc[0]:g}, delta {rows['delta'].iloc[0]:g})",
             f"{'norm':>6} {'m':>6} {'in':>6} {'eps_lower':>10} {'fdp':>8} {'cp':>8} {'upper_rdp':>10} "
             f"{'upper_pld':>10} {'lower/upper':>11}"]
    for row in rows.itertuples():
        flag = "  VIOLATION: lower bound above the accountant's upper bound" if row.violated else ""
        lines.append(f"{row.norm:>6g} {row.canaries:>6d} {row.included:>6d} {row.eps_lower:>10.4f} "
                     f"{row.eps_lower_fdp:>8.4f} {row.eps_lower_cp:>8.4f} {row.eps_upper_rdp:>10.4f} "
                     f"{row.eps_upper_pld:>10.4f} {row.tightness:>11.3f}{flag}")
    return lines



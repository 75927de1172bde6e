"""The one-run audit from canary scores (docs/audit.md §1b): anyone's scores, read and bounded (audit.py's one-run modes
are in perinstance/cli/audit.py; a run trained with canaries is audited by canary_audit.py).

    python audit.py --in-scores in.txt --out-scores out.npy --significance 0.05 --delta 1e-6
    python audit.py --run NAME --one-run

The first prints the lower bounds of accounting.md §11.2-§11.4 from the scores, on the pre-registered grid of
guesses (§11.7). The second audits each canary group of a run trained with `--canaries` or `--input-canaries`
(canary_audit.py): the f-DP one-run test of the group's canaries against the trade-off curve the suite's own
accounting claims for a point of their sensitivity over the same run (§11.8). A rejected curve is a violation:
the accounting (or the training code) is wrong.
"""

import os

import numpy as np

from perinstance.accounting import one_run_audit
from perinstance.errors import UsageError


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
    """The three lower bounds on ε of §11 from canary scores (higher = member), on the grid of guesses (§11.7)."""
    return {name: bound(in_scores, out_scores, significance=significance, delta=delta)
            for name, bound in (("one_run_eps", one_run_audit.one_run_epsilon),
                                ("one_run_fdp_eps", one_run_audit.one_run_fdp_epsilon),
                                ("clopper_pearson_eps", one_run_audit.clopper_pearson_epsilon))}

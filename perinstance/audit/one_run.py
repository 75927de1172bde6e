"""audit.py's one-run modes (docs/audit.md §1b): anyone's canary scores, or a run trained with canaries.

    python audit.py --in-scores in.txt --out-scores out.npy --significance 0.05 --delta 1e-6
    python audit.py --run NAME --one-run

The first prints the lower bounds of accounting.md §11.2-§11.4 from the scores, on the pre-registered grid of
guesses (§11.7). The second audits each canary group of a run trained with `--canaries` or `--input-canaries`
(canary_audit.py): the f-DP one-run test of the group's canaries against the trade-off curve the suite's own
accounting claims for a point of their sensitivity over the same run (§11.8). A rejected curve is a violation:
the accounting (or the training code) is wrong.
"""

import argparse
import os
import time

import numpy as np

from perinstance.accounting import one_run_audit
from perinstance.audit import canary_audit, self_test
from perinstance.errors import UsageError
from perinstance.files import fileio


def requested(args: argparse.Namespace) -> bool:
    """Whether the parsed audit.py flags ask for a one-run mode."""
    return args.one_run or args.self_test or args.in_scores is not None or args.out_scores is not None


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


def main(args: argparse.Namespace) -> int:
    """audit.py in a one-run mode: the parsed flags `args`."""
    if args.self_test:
        if args.run is not None or args.one_run or args.in_scores is not None or args.out_scores is not None:
            raise UsageError("--self-test", "trains and audits its own runs: drop --run, --one-run and the scores")
        lines, behaved = self_test.self_test(data_root=args.data_root, significance=args.significance,
                                             delta=args.delta)
        for line in lines:
            print(line)
        return 0 if behaved else 1
    if args.one_run:
        if args.run is None:
            raise UsageError("--one-run", "needs --run NAME (a run trained with --canaries)")
        if args.in_scores is not None or args.out_scores is not None:
            raise UsageError("--in-scores", "give either --in-scores/--out-scores or --run with --one-run, not both")
        started = time.time()
        config, rows = canary_audit.audit_run(args.run, args.models_dir, significance=args.significance,
                                              delta=args.delta)
        out = args.out or os.path.join("res", f"{config.run}_one_run_audit.csv")
        fileio.write_csv(out, rows, flag="--out")
        for line in canary_audit.table_lines(config, rows):
            print(line)
        print(f"audited {rows['canaries'].sum()} canaries in {len(rows)} groups in {time.time() - started:.1f}s; "
              f"wrote {out}")
        violated = rows[rows["violated"]]
        if len(violated):
            print("VIOLATION: the canaries reject the accountant's trade-off curve for "
                  + ", ".join(f"the {row.kind} canaries of norm {row.norm:g}" for row in violated.itertuples())
                  + " (the accounting, or the training code, is wrong)")
        return 1 if len(violated) else 0
    if args.in_scores is None or args.out_scores is None:
        missing = "--out-scores" if args.out_scores is None else "--in-scores"
        raise UsageError(missing, "the scores of the held-out canaries (one number a line, or .npy) are needed too"
                         if missing == "--out-scores" else "the scores of the held-in canaries are needed too")
    if args.run is not None:
        raise UsageError("--run", "scores from files audit no run: drop --run (or use --run NAME --one-run)")
    bounds = score_bounds(read_scores(args.in_scores, "--in-scores"), read_scores(args.out_scores, "--out-scores"),
                          significance=args.significance, delta=args.delta)
    for name, value in bounds.items():
        print(f"{name}: {value:.6f}")
    return 0

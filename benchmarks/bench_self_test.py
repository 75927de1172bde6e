"""The detection rates behind audit.py --self-test (docs/audit.md §1d): for each control, the share of replicates
of the idealised mechanism (accounting.md §11.11) with the control's fault that the audit's verdict flags, with its
two-sided 95% Clopper–Pearson interval, at the self-test's configuration (perinstance/audit/self_test.py).

A control is a run of the self-test: the correct run of each update rule (its share is the false-alarm rate, which
must stay at or below the significance) and every planted fault. The faults the self-test does not plant under the
mean rule (half the noise, no clipping, twice the rate) are measured too: the canaries, which join the mean rule's
batches, do not see them, and the self-test claims nothing about them.

    python benchmarks/bench_self_test.py [--replicates 400]   # the docs' table (about 0.1 s of CPU a replicate)
    python benchmarks/bench_self_test.py --smoke               # seconds: 2 replicates a control, same code paths
"""

import argparse
import os
import sys
import time

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from perinstance.audit import self_test
from perinstance.cli import options

# Faults the self-test does not plant under the mean rule, measured to say what it cannot see.
UNSEEN = (self_test.Control("mean", "half_noise"), self_test.Control("mean", "no_clipping"),
          self_test.Control("mean", "double_rate"))
SMOKE_REPLICATES = 2


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicates", type=int, default=400, help="idealised runs per control (default 400)")
    parser.add_argument("--significance", type=float, default=0.05, help="the audit's significance (default 0.05)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_REPLICATES} replicates a control, for CI")
    args = parser.parse_args()
    replicates = SMOKE_REPLICATES if args.smoke else args.replicates
    training_flags = options.parse_training_flags(self_test.SELF_TEST_FLAGS)
    controls = (*self_test.CONTROLS, *UNSEEN)
    print(f"audit.py --self-test's configuration ({' '.join(self_test.SELF_TEST_FLAGS)}), {replicates} idealised "
          f"runs per control at significance {args.significance:g}; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    wall, cpu = time.perf_counter(), time.process_time()
    rows = [row for control in tqdm(controls, desc="controls", leave=False)
            for row in self_test.detection_rates([control], training_flags=training_flags, replicates=replicates,
                                                 significance=args.significance)]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    first = rows[0]
    print(f"q={first['sample_rate']:g}, sigma={first['noise_multiplier']:g}, T={first['steps']}, "
          f"{first['groups']} canary groups at significance {args.significance:g}/{first['groups']} each")
    for line in self_test.rate_table(rows[:len(self_test.CONTROLS)], args.significance):
        print(line)
    print("not planted by the self-test (the mean rule's canaries cannot see them):")
    for line in self_test.rate_table(rows[len(self_test.CONTROLS):], args.significance)[1:]:
        print(line)
    for row in rows:
        if row["fault"] is None:
            print(f"{row['rule']} rule, correct run: false alarms at most {row['high'] / args.significance:.2f}x the "
                  f"significance (the 95% interval's upper end)")
    print(f"{len(controls) * replicates} idealised runs in {wall:.0f} s wall, {cpu:.0f} s CPU "
          f"({cpu / (len(controls) * replicates):.2f} s of CPU a run)")


if __name__ == "__main__":
    main()

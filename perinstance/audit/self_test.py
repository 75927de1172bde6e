"""audit.py --self-test (docs/audit.md §1d): positive and negative controls of the one-run audit.

Four small runs with the same configuration (SELF_TEST_FLAGS: the first 64 embedded-MNIST training points, an MLP,
q = 1/2, σ = 6, T = 40, 30,000 gradient canaries of norm Γ and 2,000 input canaries): one correct, and three with a
fault planted in the trainer that run.json does not state (runs.PLANTED_FAULTS): the noise at half its std, the
clipping skipped, the sampling at 2q. Each is audited as `audit.py --one-run` audits a run (canary_audit.py); a
faulty run must be reported as a violation, the correct one must not. The runs live in a temporary folder that is
deleted afterwards, and their run.json records the fault, so none can be read as a real run.

What each control needs of the audit: the gradient canaries see the noise and the sampler, the input canaries the
per-sample gradients and the clipping too. The configuration is one where the test has the power to see each
fault (accounting.md §11.12: on the idealised mechanism the correct claim is refuted in 0 of 50 simulations, half
the noise and twice the rate in 50 of 50 each), with few real points (32 a step) on the canaries' directions.
"""

import dataclasses
import os
import tempfile
import time

from perinstance.audit import canary_audit
from perinstance.train import run_plan, runs, training
from perinstance.train.data import load_dataset

SELF_TEST_FLAGS = ["--dataset", "first:64:mnist-embedded", "--model", "mlp", "--batch-size", "32", "--lr", "0.1",
                   "--epochs", "20", "--sigma", "6", "--save-freq", "10", "--canaries", "30000",
                   "--input-canaries", "2000", "--seed", "0"]
CONTROLS = (None, *runs.PLANTED_FAULTS)
FAULT_TEXT = {None: "none (the correct run)", "half_noise": "noise std σ/2 added, σ stated",
              "no_clipping": "per-sample clipping skipped", "double_rate": "Poisson sampling at 2q, q stated"}


def control_run(fault: str | None, training_flags: run_plan.TrainingFlags, models_dir: str) -> runs.RunConfig:
    """The self-test's run with `fault` planted (None: the correct one), trained under `models_dir`;
    `training_flags`: SELF_TEST_FLAGS as the command line parsed them."""
    flags = run_plan.resolve_training_args(dataclasses.replace(training_flags, models_dir=models_dir))
    dataset = load_dataset(flags.dataset, flags.data_root, class_labels=flags.loss is None)
    planned = run_plan.plan_run(flags, dataset)
    config = dataclasses.replace(planned, run=f"self-test-{fault or 'correct'}", planted_fault=fault)
    run_dir = runs.run_folder(config.run, models_dir)
    os.makedirs(run_dir)
    runs.save_run(run_dir, config)
    training.train_run(training.Trainer(config, dataset, "cpu"), run_dir, quiet=True)
    return config


def self_test(*, training_flags: run_plan.TrainingFlags, significance: float, delta: float) -> tuple[list[str], bool]:
    """Train and audit every control, each with `training_flags` (SELF_TEST_FLAGS as the command line parsed them):
    (the table's lines, whether every control behaved)."""
    lines = [f"audit.py --self-test: the one-run audit at significance {significance:g}, delta {delta:g}, on four "
             f"runs ({' '.join(SELF_TEST_FLAGS)}); a planted fault must be flagged, the correct run must not",
             f"{'planted fault':<34} {'verdict':<10} {'expected':<10} {'gradient: lower/upper':>22} "
             f"{'input: lower/upper':>19}  {'seconds':>7}"]
    behaved = True
    with tempfile.TemporaryDirectory(prefix="perinstance-self-test-") as models_dir:
        for fault in CONTROLS:
            started = time.time()
            config = control_run(fault, training_flags, models_dir)
            record = canary_audit.canaries.read_canaries(runs.run_folder(config.run, models_dir))
            rows = canary_audit.audit_canaries(config, record, significance=significance, delta=delta)
            flagged = bool(rows["violated"].any())
            expected = fault is not None
            behaved &= flagged == expected
            bounds = {row.kind: f"{row.lower_bound:.3g}/{row.upper_bound:.3g}" for row in rows.itertuples()}
            lines.append(f"{FAULT_TEXT[fault]:<34} {'VIOLATION' if flagged else 'no':<10} "
                         f"{'VIOLATION' if expected else 'no':<10} {bounds.get('gradient', '-'):>22} "
                         f"{bounds.get('input', '-'):>19}  {time.time() - started:>7.1f}"
                         + ("" if flagged == expected else "   <- the audit MISBEHAVED here"))
    lines.append("every control behaved: the audit flags each planted fault and passes the correct run" if behaved
                 else "SELF-TEST FAILED: some control did not behave (see the rows marked above)")
    return lines, behaved

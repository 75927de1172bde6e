"""audit.py --self-test (docs/audit.md §1d): positive and negative controls of the one-run audit.

Seven small runs with one configuration (SELF_TEST_FLAGS: the first 64 embedded-MNIST training points, an MLP,
q = 1/4, σ = 3, T = 80, 30,000 gradient canaries in two groups of norm Γ/2 and Γ, 1,000 input canaries), five
under the sum rule and two under the mean rule (CONTROLS). One run of each rule is correct; the others carry a fault
planted in the trainer that run.json does not state (runs.PLANTED_FAULTS). Each is audited as `audit.py --one-run`
audits a run (canary_audit.py); a faulty run must be reported as a violation, a correct one must not. The runs live
in a temporary folder that is deleted afterwards, and their run.json records the fault, so none can be read as a
real run.

What each control needs of the audit: the gradient canaries see the noise, the sampler and their own scaling, the
input canaries the per-sample gradients and the clipping too. detection_rates measures, for each control, how often
the audit flags the idealised mechanism (accounting.md §11.11) run with that fault: the share of its replicates that
the same verdict flags, which the docs' claims rest on (benchmarks/bench_self_test.py, docs/audit.md §1d).
"""

import dataclasses
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

from perinstance.accounting import audit_bounds, one_run_ideal
from perinstance.audit import canary_audit
from perinstance.train import canaries, run_plan, runs, sampling, training
from perinstance.train.data import Dataset, load_dataset

SELF_TEST_FLAGS = ["--dataset", "first:64:mnist-embedded", "--model", "mlp", "--batch-size", "16", "--lr", "0.1",
                   "--epochs", "20", "--sigma", "3", "--save-freq", "20", "--canaries", "30000", "--canary-norms",
                   "0.5,1", "--input-canaries", "1000", "--seed", "0"]


@dataclass(frozen=True)
class Control:
    """One run of the self-test: its update rule, and the fault planted in its trainer (None: a correct run)."""

    rule: str
    fault: str | None

    @property
    def name(self) -> str:
        return f"self-test-{self.rule}-{self.fault or 'correct'}"


CONTROLS = (Control("sum", None), Control("sum", "half_noise"), Control("sum", "no_clipping"),
            Control("sum", "double_rate"), Control("sum", "inverted_norm"), Control("mean", None),
            Control("mean", "noise_before_division"))
FAULT_TEXT = {None: "none (the correct run)", "half_noise": "noise std σ/2 added, σ stated",
              "no_clipping": "per-sample clipping skipped", "double_rate": "Poisson sampling at 2q, q stated",
              "inverted_norm": "canaries added at Γ/c, c·Γ stated",
              "noise_before_division": "noise of the mean added before /|B|"}
# The idealised stand-in for the unclipped gradient of an input canary (no_clipping), in units of Γ: measured on the
# self-test's no_clipping run, at every checkpoint at least 2/3 of the input canaries' unclipped gradients are above
# 4Γ and their median above 11Γ (docs/audit.md §1d), so that a guesser of at most a quarter of the canaries, whose
# guesses are the members with the largest signals, sees at least this much.
UNCLIPPED_NORM = 4.0
# Key within sampling.CANARY_STREAM (after canaries.SETUP_KEY's 0 and canary_audit.IDEAL_KEY's 1): the idealised
# replicates of detection_rates, then the rule's and the fault's index in RULES and (None, *runs.PLANTED_FAULTS).
DETECTION_KEY = 2
RULES = ("sum", "mean")


def planned_run(control: Control, training_flags: run_plan.TrainingFlags,
                models_dir: str) -> tuple[runs.RunConfig, Dataset]:
    """The self-test's run for `control` as it is planned under `models_dir` (not trained), and its data;
    `training_flags`: SELF_TEST_FLAGS as the command line parsed them."""
    flags = run_plan.resolve_training_args(dataclasses.replace(training_flags, models_dir=models_dir,
                                                               reduction=control.rule))
    dataset = load_dataset(flags.dataset, flags.data_root, class_labels=flags.loss is None)
    planned = run_plan.plan_run(flags, dataset)
    return dataclasses.replace(planned, run=control.name, planted_fault=control.fault), dataset


def control_run(control: Control, training_flags: run_plan.TrainingFlags, models_dir: str) -> runs.RunConfig:
    """The self-test's run for `control`, trained under `models_dir`."""
    config, dataset = planned_run(control, training_flags, models_dir)
    run_dir = runs.run_folder(config.run, models_dir)
    os.makedirs(run_dir)
    runs.save_run(run_dir, config)
    training.train_run(training.Trainer(config, dataset, "cpu"), run_dir, quiet=True)
    return config


def group_label(kind: str, norm: float) -> str:
    return f"c={norm:g}" if kind == canaries.GRADIENT else kind


def self_test(*, training_flags: run_plan.TrainingFlags, significance: float, delta: float) -> tuple[list[str], bool]:
    """Train and audit every control, each with `training_flags` (SELF_TEST_FLAGS as the command line parsed them):
    (the table's lines, whether every control behaved)."""
    lines = [f"audit.py --self-test: the one-run audit at significance {significance:g}, delta {delta:g}, on "
             f"{len(CONTROLS)} runs ({' '.join(SELF_TEST_FLAGS)}; sum rule, or --reduction mean); a planted fault must "
             "be flagged, a correct run must not. Columns: each canary group's lower/upper bound"]
    behaved = True
    with tempfile.TemporaryDirectory(prefix="perinstance-self-test-") as models_dir:
        for control in CONTROLS:
            started = time.time()
            config = control_run(control, training_flags, models_dir)
            record = canaries.read_canaries(runs.run_folder(config.run, models_dir))
            rows = canary_audit.audit_canaries(config, record, significance=significance, delta=delta,
                                              idealised=False)
            flagged = bool(rows["violated"].any())
            expected = control.fault is not None
            behaved &= flagged == expected
            bounds = [(group_label(row.kind, row.norm), f"{row.lower_bound:.3g}/{row.upper_bound:.3g}")
                      for row in rows.itertuples()]
            if len(lines) == 1:
                lines.append(f"{'rule':<5} {'planted fault':<37} {'verdict':<10} {'expected':<10} "
                             + " ".join(f"{label:>12}" for label, _ in bounds) + f"  {'seconds':>7}")
            lines.append(f"{control.rule:<5} {FAULT_TEXT[control.fault]:<37} {'VIOLATION' if flagged else 'no':<10} "
                         f"{'VIOLATION' if expected else 'no':<10} " + " ".join(f"{text:>12}" for _, text in bounds)
                         + f"  {time.time() - started:>7.1f}"
                         + ("" if flagged == expected else "   <- the audit MISBEHAVED here"))
    lines.append("every control behaved: the audit flags each planted fault and passes the correct runs" if behaved
                 else "SELF-TEST FAILED: some control did not behave (see the rows marked above)")
    return lines, behaved


def idealised_claim(config: runs.RunConfig) -> one_run_ideal.IdealisedRun:
    """What `config` states, as an idealised run (the sum rule's accounting): its canary groups in the audit's
    order (canary_audit.canary_groups: the gradient canaries' norms increasing, then the input canaries at Γ), half
    of each group in."""
    gradient = sorted(config.canary_norms or ()) if config.canaries else []
    signals = (*gradient, *([1.0] if config.input_canaries else []))
    members = (*[config.canaries // len(gradient) // 2] * len(gradient),
               *([config.input_canaries // 2] if config.input_canaries else []))
    return one_run_ideal.IdealisedRun(signals=tuple(signals), members=members, steps=config.total_steps,
                                      noise_multiplier=config.noise_multiplier, sample_rate=config.sample_rate)


def idealised_run(config: runs.RunConfig,
                  claim: one_run_ideal.IdealisedRun | None = None) -> one_run_ideal.IdealisedRun:
    """The idealised mechanism of the run `config` describes, with its planted fault (runs.PLANTED_FAULTS): its
    claim (`claim`, idealised_claim(config) where not given) with the fault applied."""
    claim = idealised_claim(config) if claim is None else claim
    fault, gradient_groups = config.planted_fault, len(claim.signals) - (1 if config.input_canaries else 0)
    signals = list(claim.signals)
    if fault == "inverted_norm":
        signals[:gradient_groups] = [1 / norm for norm in signals[:gradient_groups]]
    if fault == "no_clipping" and config.input_canaries:
        signals[-1] = UNCLIPPED_NORM
    sigma = config.noise_multiplier / (2 if fault == "half_noise" else 1)
    mean_rule = config.update_rule == "mean"
    return dataclasses.replace(
        claim, signals=tuple(signals),
        noise_multiplier=0.0 if fault == "noise_before_division" else sigma,
        sample_rate=min(1.0, 2 * config.sample_rate) if fault == "double_rate" else config.sample_rate,
        expected_batch=float(config.batch_size) if mean_rule else None,
        other_examples=config.dataset_size if mean_rule else 0,
        noise_before_division=sigma / config.batch_size if fault == "noise_before_division" else 0.0)


def detection_rates(controls: Iterable[Control], *, training_flags: run_plan.TrainingFlags, replicates: int,
                    significance: float) -> list[dict]:
    """Per control: how many of `replicates` idealised runs of its mechanism (idealised_run) the audit flags against
    what its run states (idealised_claim), at `significance` split over the groups, with the share's two-sided 95%
    Clopper–Pearson interval. Each control draws from its own stream (seeded by SELF_TEST_FLAGS' seed)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="perinstance-self-test-") as models_dir:
        for control in controls:
            config, _ = planned_run(control, training_flags, models_dir)
            rng = sampling.stream_rng(config.seed, sampling.CANARY_STREAM, DETECTION_KEY, RULES.index(control.rule),
                                      (None, *runs.PLANTED_FAULTS).index(control.fault))
            claim = idealised_claim(config)
            flagged = one_run_ideal.flagged_runs(rng, claim, idealised_run(config, claim),
                                                 significance=significance, replicates=replicates)
            low, high = audit_bounds.clopper_pearson(flagged, replicates)
            rows.append({"rule": control.rule, "fault": control.fault, "flagged": flagged, "replicates": replicates,
                         "rate": flagged / replicates, "low": float(low), "high": float(high),
                         "sample_rate": config.sample_rate, "noise_multiplier": config.noise_multiplier,
                         "steps": config.total_steps, "groups": len(claim.signals)})
    return rows


def rate_table(rows: list[dict], significance: float) -> list[str]:
    """detection_rates' rows as lines: the share flagged with its interval, and what it shows."""
    lines = [f"{'rule':<5} {'planted fault':<37} {'flagged':>11} {'rate [95% interval]':>24}"]
    for row in rows:
        interval = f"{row['rate']:.3f} [{row['low']:.3f}, {row['high']:.3f}]"
        lines.append(f"{row['rule']:<5} {FAULT_TEXT[row['fault']]:<37} {row['flagged']:>5} of {row['replicates']:<3} "
                     f"{interval:>24}" + ("" if row["fault"] is not None else
                                          f"   (false alarms; level {significance:g})"))
    return lines

"""The commands of a reproduction and the cache of the accountants' outputs: every command runs in this process
as its script's command line would (`Commands.call`: the command's main, which perinstance/cli/reproduce.py
hands over by script name), each command is remembered for the report, an accountant's output is reused when
the same command ran on the same input (`command_key`), and every step is timed for the timing table. Also the
folders and the figure files a reproduction writes.
"""

import contextlib
import inspect
import json
import os
import resource
import shlex
import time
from collections.abc import Callable, Iterator, Mapping

import pandas as pd

from perinstance.files import fileio, results
from perinstance.plots.document import Table
from perinstance.train.memory import release_freed_memory

RES_DIR = "res"
# Every figure the run writes, by what it shows. The audits' figures of their bounds (AUDIT_FIGURES) are drawn by
# audit.py itself, the membership figure by membership_inference.py.
HISTOGRAM_FIGURE = "1_per_step_eps_histogram.png"
CORRECTNESS_FIGURE = "2_correct_vs_misclassified.png"
# Figure 3, one file per quantity (plots/sampling_rate_plots.QUANTITIES), each with a panel per design.
RATE_FIGURES = {"per_step": "3a_mean_rule_per_step.png", "composed": "3b_mean_rule_whole_run.png",
                "ratios": "3c_mean_rule_per_step_ratio.png"}
CURVES_FIGURE = "4_composed_eps_over_training.png"
INDIVIDUAL_FIGURE = "5_individual_accounting.png"
ESTIMATE_FIGURE = "6_estimate_accuracy.png"
AUDIT_FIGURES = {"sum": "7_audit.png", "mean": "7_audit_mean.png"}
MEMBERSHIP_FIGURE = "8_membership_inference.png"
GAP_FIGURE = "9_mean_rule_gap_audit.png"
GAP_BOUNDS_FIGURE = "9_gap_audit_bounds.png"
# Drawn only when the main run carries canaries (canaries > 0).
ONE_RUN_FIGURE = "10_one_run_audit.png"
# Drawn only with a filtered run (filter_cap > 0), by filtered_run.py.
FILTER_FIGURES = {"training": "11_filter_points_training.png", "guarantee": "11_filter_eps_against_guarantee.png"}
FIGURES = [HISTOGRAM_FIGURE, CORRECTNESS_FIGURE, *RATE_FIGURES.values(), CURVES_FIGURE, INDIVIDUAL_FIGURE,
           ESTIMATE_FIGURE, *AUDIT_FIGURES.values(), MEMBERSHIP_FIGURE, GAP_FIGURE, GAP_BOUNDS_FIGURE, ONE_RUN_FIGURE,
           *FILTER_FIGURES.values()]
# Per figure file: its title, and a caption that says what to look at and what it shows (the report renders both).
CAPTIONS: dict[str, tuple[str, str]] = {
    HISTOGRAM_FIGURE: (
        "Figure 1: per-step ε of every training point at the final checkpoint",
        "One per-step (ε, δ) guarantee per point at δ = {delta} (sum rule, Δ* of the final checkpoint), on a log axis. Look at the "
        "orange median against the dashed worst case, and at the red bar: the points whose gradient is clipped "
        "(Δ* = Γ) sit at the worst case, and the share of them is written next to it. The title gives the share of "
        "points at or below half the worst case and the share at it."),
    CORRECTNESS_FIGURE: (
        "Figure 2: per-step ε of correctly classified against misclassified points",
        "The share of points at or below each per-step ε at δ = {delta} (log axis), for the points the final model classifies "
        "correctly and those it misclassifies, with each group's median and its 95% interval. The title gives the "
        "ratio of the two medians with its interval: above 1, misclassified points pay more."),
    RATE_FIGURES["per_step"]: (
        "Figure 3a: the mean rule per sampling rate, one step",
        "The per-step Rényi DP of the mean update rule at each sampling rate q, one panel per controlled design "
        "(two fixed checkpoints analysed as one step at every q, and one run per q trained for the same number of "
        "steps). Medians over the points with 95% intervals, the certified bound's 10-90% band shaded, next to the "
        "mean rule's data-independent baseline and the sum rule at the same weights and σ. Rényi bounds have no δ."),
    RATE_FIGURES["composed"]: (
        "Figure 3b: the mean rule per sampling rate, ε over the whole run",
        "ε at δ = {delta} over the whole run per sampling rate, per design, with the per-step values held between "
        "checkpoints: held-Δ* estimates, not bounds (accounting.md §4). They also change with the number of steps "
        "and σ at each q, so they do not judge GLA's claim; figure 3c does."),
    RATE_FIGURES["ratios"]: (
        "Figure 3c: the mean rule per sampling rate, per step relative to its baseline",
        "GLA's sampling-rate claim: the per-step data-dependent value divided by the mean rule's own baseline "
        "should fall as q grows. Each point is a median ratio with its 95% interval, for the certified bound and "
        "the Monte Carlo estimate; a step up in q supports the claim where both intervals fall apart downwards. "
        "Rényi bounds have no δ."),
    CURVES_FIGURE: (
        "Figure 4: composed ε over training of a few points",
        "Composed ε at δ = {delta} after every step for an easy, a median, a misclassified point and the point whose "
        "held-Δ* estimate falls furthest below its bound. Solid: Δ* at every step, a bound along the run; "
        "dashed: Δ* held between the checkpoints marked on the step axis, a held-Δ* estimate. The dashed black line is the "
        "worst case: a point whose gradient is clipped at every step follows it, and a curve flattens where the "
        "point's gradient norm falls far below Γ."),
    INDIVIDUAL_FIGURE: (
        "Figure 5: individual accounting, ε against loss, per class, by accountant",
        "Left: every point's composed ε (δ = {delta}) against its final training loss, with the median ε of each twelfth of the "
        "points by loss and its 95% interval (the medians stay inside the data and at or below the worst case); "
        "the Pearson r of ε and ln loss is in the title. Middle: each class's mean ε against its test accuracy. "
        "Right: the share of points at or below each ε, by accountant (RDP, PLD, and the held-Δ* estimate), "
        "with each accountant's worst case."),
    ESTIMATE_FIGURE: (
        "Figure 6: the held-Δ* estimate against the bound",
        "Each point's composed ε (δ = {delta}) from Δ* held between checkpoints (a held-Δ* estimate) against ε from "
        "Δ* at every step (the bound along the run). Points below the diagonal, in red, are points whose estimate is "
        "below their bound: a composition over checkpoints is not a bound. The title gives the relative error and the share "
        "below."),
    AUDIT_FIGURES["sum"]: (
        "Figure 7: audit of one step of the main run (sum rule)",
        "Each audited point's lower bound on its per-step ε at δ = {delta} (95% confidence, from simulated "
        "releases) against the accountant's upper bound. Colours are the report's groups: easy and hard are correctly classified points "
        "below / at or above the median upper bound of the correct points, then the misclassified ones. A point "
        "above the diagonal would prove its upper bound wrong; none is expected."),
    AUDIT_FIGURES["mean"]: (
        "Figure 7, mean rule: audit of one step of a mean-rule run",
        "As figure 7 (δ = {delta}), for the realised-size mean rule on the matched-steps run at the main batch size; its upper "
        "bound is the Monte Carlo estimate of the mean rule, not a certified bound."),
    MEMBERSHIP_FIGURE: (
        "Figure 8: membership inference per class, with and without DP",
        "Left: the loss-threshold attack's accuracy per class (its spread over random splits) against the class's "
        "mean composed ε (δ = {delta}) of the DP run; 0.5 is chance. Right: each class's test accuracy. The legends state each "
        "model's learning rate and test accuracy: the non-private run's rate is the best of a small grid on held-out "
        "training points (never the test set), so it is trained to its own best accuracy."),
    GAP_FIGURE: (
        "Figure 9: the realised-size mean rule against the sum rule's accounting",
        "The audit's lower bound on the per-step ε (δ = {delta}) of each point of a small mean-rule run (64 points, about 4 a "
        "batch, σ = 1), ranked, against the per-step ε the sum rule's accounting gives at the same σ and q (dashed) "
        "and the mean rule's own baseline (solid). Points above the dashed line show leakage the sum rule's "
        "accounting does not cover. Whether a point is misclassified says little here: a run this small and noisy "
        "barely learns, its noise dominating its updates. The note under the figure gives the run's own numbers: how "
        "many points its final model gets right against chance, and how far its weights moved against the most its "
        "clipped gradients could move them."),
    GAP_BOUNDS_FIGURE: (
        "Figure 9, bounds: audit of the small mean-rule run, lower against upper bounds",
        "Figure 9's points, each lower bound against the mean rule's Monte Carlo estimate of its per-step ε "
        "(δ = {delta}), "
        "coloured by the report's groups. Where the misclassified group is most of the run, it is because the "
        "model has not learned (the note under the figure compares its accuracy with chance), not because those "
        "points are hard."),
    ONE_RUN_FIGURE: (
        "Figure 10: one-run audit of the trained main run",
        "Per group of gradient canaries (norm c·Γ): the lower bounds on ε at δ = {delta} over the whole run from the "
        "canaries (the f-DP family bounds of two statistics, which hold if the run's trade-off curve has the "
        "subsampled-Gaussian shape, and the assumption-free bound of Steinke et al.'s test), the family bound on the "
        "idealised mechanism, and the RDP and PLD upper bounds for a point of that sensitivity, with the test's cap "
        "as a dashed tick. A lower bar above an upper one would be a violation (hatched); a lower bound below says "
        "nothing about how loose the upper one is."),
    FILTER_FIGURES["training"]: (
        "Figure 11: the individual filter, points still training, per class",
        "The filtered run at the main run's σ and q, every point's budget the main run's ε at δ = {delta}: the number "
        "of points of each class still in the training set at each step, against T_u (dashed), the steps uniform "
        "DP-SGD at the same ε takes, after which a point charged at Γ at every step leaves. A point leaves once its "
        "next charge would pass its budget; the classes whose lines fall furthest lose most of their points for the "
        "steps past T_u."),
    FILTER_FIGURES["guarantee"]: (
        "Figure 11, guarantee: the individual filter, composed ε against the guarantee",
        "The share of the filtered run's points at or below each composed ε along the run at δ = {delta} (certified, "
        "RDP, from the bounds each point was clipped at), against every point's guarantee (dashed: it holds over "
        "every trajectory) and uniform DP-SGD's ε after its steps (dotted). The curve reaches 1 at or before the "
        "guarantee: no point passes it."),
}


def command_key(script: str, main: Callable[[list[str]], object], argv: list[str], inputs: list[str]) -> dict:
    """What an output depends on: the script, the code of its command (the file of `main`, its main), its full
    argv, and each input file's size and hash."""
    return {"script": script, "code_sha256": fileio.sha256_of(inspect.getsourcefile(main)), "argv": list(argv),
            "inputs": [{"path": path, "size": os.path.getsize(path), "sha256": fileio.sha256_of(path)}
                       for path in inputs]}


def key_path(out: str) -> str:
    """The sidecar of an accountant's output that holds the command_key it was computed with."""
    return out + ".cmd"


def is_cached(out: str, key: dict) -> bool:
    """True when `out` exists and was computed by exactly this command on exactly these inputs."""
    if not (os.path.exists(out) and os.path.exists(key_path(out))):
        return False
    with open(key_path(out), encoding="utf-8") as handle:
        try:
            return json.load(handle) == key
        except json.JSONDecodeError:
            return False


class Commands:
    """Runs the commands of one reproduction and remembers each, for the report, and what each step of the
    reproduction cost, for the timing table at its end. `mains`: every command's main by its script's name
    (train_dpsgd.py, ...), the names the report's command lines give."""

    def __init__(self, mains: Mapping[str, Callable[[list[str]], object]]) -> None:
        self.mains = mains
        self.lines = []  # (command line, whether a cached output was reused)
        self.timings = []  # (step, wall seconds, CPU seconds, peak resident bytes so far)

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        """Time the work inside the block as one row of the timing table; then hand what it freed back to the
        system, so that the next step's peak does not stand on this one's leftovers."""
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        release_freed_memory()
        self.timings.append((step, time.perf_counter() - wall, time.process_time() - cpu, peak_resident_bytes()))
        print(f"[{step}: {self.timings[-1][1]:.1f}s wall, {self.timings[-1][2]:.1f}s CPU, peak resident memory "
              f"so far {self.timings[-1][3] / 1e9:.2f} GB]", flush=True)

    def note(self, line: str, cached: bool = False) -> None:
        """A step done in this process by a package function, listed with the commands; `cached` when its result
        was found on disk and the step did not run."""
        self.lines.append((f"# in-process: {line}", cached))

    def call(self, script: str, argv: list[str]) -> None:
        """Run the command of `script` in this process, as `python script argv` would."""
        print(f"\n$ python {script} {shlex.join(argv)}", flush=True)
        self.mains[script](argv)

    def run(self, script: str, argv: list[str]) -> None:
        self.lines.append((f"python {script} {shlex.join(argv)}", False))
        with self.timed(step_label(script, argv)):
            self.call(script, argv)

    def account(self, script: str, argv: list[str], out: str, source: str) -> pd.DataFrame:
        """Run an accountant on `source` into `out` unless `out` holds this very command's output; its rows."""
        argv = [*argv, "--out", out]
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)  # a reproduction writes its outputs under res/
        key = command_key(script, self.mains[script], argv, [source])
        cached = is_cached(out, key)
        self.lines.append((f"python {script} {shlex.join(argv)}", cached))
        if cached:
            print(f"\n(skipping {script}: {out} was computed by this command on this input)")
        else:
            with self.timed(step_label(script, argv)):
                self.call(script, argv)
            fileio.write_json(key_path(out), key)
        return pd.read_csv(out)

    def timing_table(self, total_seconds: float) -> Table:
        """The timing table: every timed step, and the whole reproduction."""
        rows = [(step, f"{wall:.1f}", f"{cpu:.1f}", f"{rss / 1e9:.2f} GB") for step, wall, cpu, rss in self.timings]
        timed = sum(wall for _, wall, _, _ in self.timings)
        rows.append(("everything else (imports, reading results, the report)", f"{total_seconds - timed:.1f}", "", ""))
        rows.append(("**total**", f"**{total_seconds:.1f}**", f"**{time.process_time():.1f}**",
                     f"**{peak_resident_bytes() / 1e9:.2f} GB**"))
        return Table(("step", "wall s", "CPU s", "peak RSS so far"), tuple(rows))


def step_label(script: str, argv: list[str]) -> str:
    """A short name of a command for the timing table: the script and its main arguments."""
    words = [script]
    for flag in ("--run", "--save-name", "--res-name", "--res-file", "--reduction", "--points", "--stage",
                 "--num-batches", "--rule", "--kind", "--accountant", "--steps"):
        if flag in argv:
            value = argv[argv.index(flag) + 1]
            # A list of steps is long: its count says which command it is.
            shown = f"{len(value.split(','))} of them" if flag == "--steps" else os.path.basename(value)
            words.append(f"{flag.lstrip('-')}={shown}")
    return " ".join(words)


def result_file(res_name: str) -> str:
    """The result file compute_sensitivity.py wrote for --res-name `res_name`: CSV, or Parquet once it holds more
    than storage.AUTO_PARQUET_ROWS rows. Every result path here comes from this resolver (results.results_path,
    the one the accountants use), never from a name built by hand."""
    return results.results_path(res_name, RES_DIR)


def peak_resident_bytes() -> int:
    """This process's peak resident set size: every step runs in it (Commands.call), so this is the run's."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB


def account(commands: Commands, script: str, res_name: str, flags: list[str], suffix: str) -> pd.DataFrame:
    """An accountant on the result file of `res_name` into res/<res_name>_<suffix>.csv (cached by its command)."""
    return commands.account(script, ["--res-name", res_name, *flags], os.path.join(RES_DIR, f"{res_name}_{suffix}.csv"),
                            result_file(res_name))

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
# Every figure the run writes; 7_audit_mean and 9_gap_audit_bounds are drawn by audit.py itself (its own
# figure of the bounds).
FIGURES = ["1_per_step_eps_histogram.png", "2_correct_vs_misclassified.png", "3_mean_rule_sampling_rates.png",
           "4_composed_eps_over_training.png", "5_individual_accounting.png", "6_estimate_accuracy.png",
           "7_audit.png", "8_membership_inference.png", "9_mean_rule_gap_audit.png", "7_audit_mean.png",
           "9_gap_audit_bounds.png", "10_one_run_audit.png"]
# Drawn only when the main run carries canaries (canaries > 0).
ONE_RUN_FIGURE = FIGURES[11]
# Every figure's title and caption in the report, in reading order: what to look at and what it shows. "{delta}"
# in a caption stands for the run's δ (report.report_figures fills it in).
CAPTIONS = {
    "1_per_step_eps_histogram.png": (
        "Figure 1: per-step ε of every point",
        "How many points (bars) have each per-step ε, sum rule at the final checkpoint, (ε, δ) at δ = {delta}. Look "
        "at how much of the mass lies left of the dashed line, DP-SGD's worst case: those points lose less per "
        "step than it. The orange line and band are the median and its 95% interval."),
    "2_correct_vs_misclassified.png": (
        "Figure 2: correctly classified against misclassified points",
        "The share of points whose per-step ε (δ = {delta}) is at most x, for correctly classified (green) and "
        "misclassified (red) points. A curve further left pays less; the dotted lines and bands are each group's "
        "median and its 95% interval, the title gives the ratio of the medians."),
    "3_mean_rule_sampling_rates.png": (
        "Figure 3: the mean rule per sampling rate, in three designs",
        "A row per design. Left: per-step Rényi DP at the order on the axis; middle: ε over the whole run at "
        "δ = {delta}, each step's value held (held-Δ* estimates); right: the per-step values ÷ the mean rule's "
        "baseline. Error bars are 95% intervals of each median. GLA's claim is that the right column falls as q "
        "grows; the report judges each step up in q from the 95% interval of its change, which the bars of the "
        "medians alone do not show."),
    "4_composed_eps_over_training.png": (
        "Figure 4: composed ε over training",
        "Composed ε (Rényi DP, b = ∞, δ = {delta}) of a few chosen points after every step. Solid: the bound from Δ* "
        "at every step; dashed: the held-Δ* estimate from Δ* at the checkpoints (ticks on the step axis). Where a "
        "dashed line runs below its solid one, holding Δ* between checkpoints under-reports ε. Black dashed: the "
        "worst case."),
    "5_individual_accounting.png": (
        "Figure 5: individual accounting",
        "Left: each point's composed ε (δ = {delta}) against its final training loss, with a least-squares fit on "
        "log loss. Middle: each class's mean ε against its test accuracy. Right: the share of points at or below "
        "each ε by accountant (RDP, PLD; dashed: the held-Δ* estimate), each worst case dotted: a curve further "
        "left is a tighter accounting of the same run."),
    "6_estimate_accuracy.png": (
        "Figure 6: the held-Δ* estimate against the bound",
        "Each point's whole-run ε (δ = {delta}) from Δ* held between checkpoints (y) against its bound from Δ* at "
        "every step (x). Red points lie below the diagonal: their held-Δ* estimate is below their bound, which is "
        "why such a composition is an estimate, not a bound."),
    "7_audit.png": (
        "Figure 7: simulated audit of the sum rule",
        "Each audited point's empirical lower bound (95%) against its exact per-step upper bound (δ = {delta}), "
        "correctly classified (easy and hard) and misclassified points in their colours. A point above the grey "
        "diagonal would be a violated bound; the distance below it is what a realistic adversary cannot show."),
    "7_audit_mean.png": (
        "Figure 7, mean rule: simulated audit of the mean rule",
        "As figure 7, for the mean rule on the matched-steps run at the main batch size (δ = {delta}). The upper "
        "bound is the Monte Carlo estimate, not a bound: a point above the diagonal would mean that estimate is "
        "wrong or too noisy."),
    "8_membership_inference.png": (
        "Figure 8: membership inference per class",
        "Left: the loss-threshold attack's accuracy per class against the class's mean composed ε (DP run, "
        "δ = {delta}), for the DP and the non-private model; error bars: its spread over the attack's random "
        "splits; dotted: chance (0.5). A class near the dotted line is one whose training points the attack cannot "
        "tell from its test points. Right: each class's test accuracy against the same ε."),
    "9_mean_rule_gap_audit.png": (
        "Figure 9: the realised-size mean rule against the sum rule's accounting",
        "The gap run's points ranked by their empirical lower bound (95%) on the per-step ε at δ = {delta}. Points "
        "above the blue dashed line, the per-step ε the sum rule's accounting prints, show that this accounting "
        "does not cover the realised-size mean rule; none may pass the black line, the mean rule's own baseline."),
    "9_gap_audit_bounds.png": (
        "Figure 9, bounds: the gap run's lower against upper bounds",
        "The gap run's empirical lower bounds (95%) against each point's upper bound, the mean rule's Monte Carlo "
        "estimate (δ = {delta}). A point above the diagonal would mean that estimate is wrong or too noisy."),
    "10_one_run_audit.png": (
        "Figure 10: the one-run audit",
        "Per canary group (norm c·Γ), ε over the whole run at δ = {delta}: the f-DP family bounds of the "
        "likelihood-ratio and summed statistics (they assume the subsampled-Gaussian shape), the same test on the "
        "idealised mechanism, and the upper bounds by RDP and PLD; dashed: the f-DP test's cap. A lower bar above "
        "the upper ones would be a violation; a gap between them says little, the cap and the test's power "
        "limit it."),
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

"""Reproduce the papers' findings on your own run: train, measure, account, draw, report.

    python reproduce.py                      # quick preset: embedded MNIST, LeNet-5, CPU
    python reproduce.py --preset mnist --device cuda
    python reproduce.py --dataset imagefolder:/data/my-images

Runs train_dpsgd.py, compute_sensitivity.py and the accountant scripts exactly as a user
would (same code, same files under models/ and res/), skips what a previous run finished,
and writes six figures and report.md to --out-dir (default figures/).
"""

import importlib.util
import os
import re
import time

import numpy as np
import pandas as pd

from perinstance import accounting, checkpoints, fileio, plots, training
from perinstance.data import load_dataset
from perinstance.errors import UsageError, run_main
from perinstance.options import Parser

ROOT = os.path.dirname(os.path.abspath(__file__))
RENYI_ORDER = 8
COMPOSITION_DELTA = 1e-5

# Each preset: the main (sum rule) run, the mean-rule runs at several batch sizes, and the
# Monte-Carlo sizes of the mean-rule experiments.
PRESETS = {
    "tiny": {  # for CI: a few hundred synthetic points, seconds
        "train": ["--dataset", "synthetic", "--model", "mlp", "--batch-size", "32", "--lr", "0.5", "--epochs", "2",
                  "--eps", "10", "--save-freq", "4"],
        "track": "random:64", "mean_batch_sizes": [16, 64, 128], "mean_epochs": "1", "mean_points": "random:4",
        "num_batches": 40, "renyi_batches": 8, "renyi_iters": 4,
    },
    "quick": {  # the README's main command: embedded MNIST, LeNet-5, 2 CPU cores
        "train": ["--dataset", "mnist-embedded", "--model", "lenet5", "--batch-size", "256", "--lr", "2.0",
                  "--epochs", "4", "--eps", "10", "--save-freq", "10"],
        "track": "random:200", "mean_batch_sizes": [64, 256, 1024], "mean_epochs": "1", "mean_points": "random:10",
        "num_batches": 200, "renyi_batches": 20, "renyi_iters": 10,
    },
    "mnist": {  # paper scale, meant for a GPU
        "train": ["--dataset", "MNIST", "--model", "lenet5", "--batch-size", "256", "--lr", "2.0", "--epochs", "20",
                  "--eps", "10", "--save-freq", "100"],
        "track": "random:1000", "mean_batch_sizes": [64, 256, 1024, 4096], "mean_epochs": "5",
        "mean_points": "random:100", "num_batches": 1000, "renyi_batches": 100, "renyi_iters": 20,
    },
    "cifar10": {  # paper scale, meant for a GPU
        "train": ["--dataset", "CIFAR10", "--model", "resnet20", "--batch-size", "512", "--lr", "2.0",
                  "--epochs", "40", "--eps", "10", "--save-freq", "200"],
        "track": "random:1000", "mean_batch_sizes": [128, 512, 2048], "mean_epochs": "10",
        "mean_points": "random:100", "num_batches": 1000, "renyi_batches": 100, "renyi_iters": 20,
    },
}


def call_script(script, argv):
    """Run a top-level script's main(argv) in this process, as its command line would."""
    print(f"\n$ python {script} {' '.join(argv)}", flush=True)
    spec = importlib.util.spec_from_file_location(os.path.splitext(script)[0], os.path.join(ROOT, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def up_to_date(output, inputs):
    """True when `output` exists and is newer than every input (so the step can be skipped)."""
    if not os.path.exists(output):
        return False
    return all(os.path.getmtime(output) >= os.path.getmtime(path) for path in inputs if os.path.exists(path))


def account(script, res_name, out, argv=()):
    """Run an accountant unless its output is newer than its input; return its output rows."""
    source = os.path.join("res", f"{res_name}.csv")
    if up_to_date(out, [source]):
        print(f"\n(skipping {script}: {out} is up to date)")
    else:
        call_script(script, ["--res-name", res_name, "--out", out, *argv])
    return pd.read_csv(out)


def check_out_dir(out_dir):
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError("--out-dir", f"{out_dir} is a file, not a folder")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        raise UsageError("--out-dir", f"cannot create {out_dir}: {error.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise UsageError("--out-dir", f"{out_dir} is not writable")


def slug(text):
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick", choices=list(PRESETS))
    parser.add_argument("--dataset", default=None, help="override the preset's dataset (e.g. imagefolder:PATH)")
    parser.add_argument("--out-dir", default="figures", help="where the figures and report.md go")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    train_flags = list(preset["train"])
    if args.dataset is not None:
        train_flags[train_flags.index("--dataset") + 1] = args.dataset
        load_dataset(args.dataset, "./data")  # bad paths fail here, before any work
    check_out_dir(args.out_dir)
    dataset_name = train_flags[train_flags.index("--dataset") + 1]
    name = f"{args.preset}-{slug(dataset_name)}"
    common = [*train_flags, "--device", args.device]
    started = time.time()

    # 1. The main run (sum rule), with per-step norms of the tracked points (figure 6).
    main_flags = [*common, "--save-name", f"{name}-sum", "--track-points", preset["track"]]
    call_script("train_dpsgd.py", main_flags)
    run_dir = os.path.join("models", f"{name}-sum")
    metadata = checkpoints.load_metadata(run_dir)

    # 2. Δ* of every training point at every checkpoint.
    call_script("compute_sensitivity.py", [*main_flags, "--exp", "eps_delta", "--reduction", "sum", "--points", "all",
                                           "--stage", "all", "--res-name", f"{name}-sum", "--no-train"])
    sensitivities = pd.read_csv(os.path.join("res", f"{name}-sum.csv"))

    # 3. Accountants on it: per-step (ε, δ), and composition along the run (Hölder b = ∞).
    # With one deterministic Δ* per point (sum rule), Hölder p = ∞ is the tightest choice of §3.3.
    per_step = account("eps_delta.py", f"{name}-sum", os.path.join("res", f"{name}-sum_eps_delta.csv"),
                       ["--holder-p", "inf"])
    composed = account("renyi_per_instance_sum_compo.py", f"{name}-sum",
                       os.path.join("res", f"{name}-sum_compo_inf.csv"), ["--holder-p", "inf"])
    tracked_out = os.path.join("res", f"{name}-tracked_compo_inf.csv")
    tracked_source = os.path.join(run_dir, "tracked_norms.csv")
    if not up_to_date(tracked_out, [tracked_source]):
        call_script("renyi_per_instance_sum_compo.py", ["--res-file", tracked_source, "--out", tracked_out,
                                                        "--holder-p", "inf"])
    tracked = pd.read_csv(tracked_out)

    # 4. Mean update rule at several sampling rates.
    mean_results = {}
    for batch_size in preset["mean_batch_sizes"]:
        flags = [*common, "--reduction", "mean", "--batch-size", str(batch_size), "--epochs", preset["mean_epochs"],
                 "--save-name", f"{name}-mean-bs{batch_size}"]
        flags[flags.index("--save-freq") + 1] = "1000000"
        call_script("train_dpsgd.py", flags)
        delta_name, renyi_name = f"{name}-mean-bs{batch_size}-delta", f"{name}-mean-bs{batch_size}-renyi"
        call_script("compute_sensitivity.py", [*flags, "--exp", "eps_delta", "--reduction", "mean", "--points",
                                               preset["mean_points"], "--stage", "final", "--num-batches",
                                               str(preset["num_batches"]), "--res-name", delta_name, "--no-train"])
        call_script("compute_sensitivity.py", [*flags, "--exp", "renyi", "--reduction", "mean", "--points",
                                               preset["mean_points"], "--stage", "final", "--alpha", str(RENYI_ORDER),
                                               "--num-batches", str(preset["renyi_batches"]), "--num-iters",
                                               str(preset["renyi_iters"]), "--res-name", renyi_name, "--no-train"])
        rdp = account("renyi_per_instance_mean.py", renyi_name, os.path.join("res", f"{renyi_name}_mean.csv"),
                      ["--alpha", str(RENYI_ORDER)])
        eps = account("eps_delta.py", delta_name, os.path.join("res", f"{delta_name}_eps_delta.csv"))
        mean_results[batch_size] = (pd.read_csv(os.path.join("res", f"{delta_name}.csv")), rdp, eps)

    # 5. Figures and report.
    findings = draw_figures(args.out_dir, metadata, run_dir, sensitivities, per_step, composed, tracked, mean_results,
                            args.device)
    report = write_report(args, preset, metadata, findings, time.time() - started)
    print(f"\nreproduce.py --preset {args.preset}: 6 figures and {report} written in {time.time() - started:.0f}s")
    for line in findings["headlines"]:
        print(f"  - {line}")


def final_rows(frame, step):
    return frame[frame["step"] == step]


def draw_figures(out_dir, metadata, run_dir, sensitivities, per_step, composed, tracked, mean_results, device):
    total_steps = metadata["total_steps"]
    final_step = max(checkpoints.saved_steps(run_dir))
    at_end = final_rows(sensitivities, final_step).set_index("point")
    findings = {"headlines": []}

    def path(name):
        return os.path.join(out_dir, name)

    # Figure 1: per-step ε of every point at the final checkpoint.
    step_eps = final_rows(per_step, final_step).set_index("point")
    baseline_step = float(step_eps["baseline_eps"].iloc[0])
    findings["histogram"] = plots.plot_per_step_histogram(
        step_eps["eps"].to_numpy(), baseline_step, path("1_per_step_eps_histogram.png"),
        title=f"Per-instance per-step ε at step {final_step} (sum rule, δ={step_eps['delta'].iloc[0]:g})")

    # Figure 2: correct vs misclassified.
    correct = at_end.loc[step_eps.index, "correct"].astype(bool).to_numpy()
    findings["correctness"] = plots.plot_correct_vs_misclassified(
        step_eps["eps"].to_numpy(), correct, baseline_step, path("2_correct_vs_misclassified.png"),
        "per-instance per-step ε")

    # Figure 3: mean rule at several sampling rates.
    sensitivities_by_rate, rdp_by_rate, baseline_by_rate, eps_by_rate, baseline_eps_by_rate = {}, {}, {}, {}, {}
    for delta_rows, rdp_rows, eps_rows in mean_results.values():
        rate = float(delta_rows["sample_rate"].iloc[0])
        eps_by_rate[rate] = float(eps_rows["eps"].median())
        baseline_eps_by_rate[rate] = float(eps_rows["baseline_eps"].iloc[0])
        sensitivities_by_rate[rate] = delta_rows["value"].to_numpy()
        worst = rdp_rows[rdp_rows["direction"] == "max"]
        rdp_by_rate[rate] = worst["rdp"].to_numpy()
        baseline_by_rate[rate] = float(worst["baseline_rdp"].iloc[0])
    findings["rates"] = plots.plot_sampling_rates(sensitivities_by_rate, rdp_by_rate, baseline_by_rate, RENYI_ORDER,
                                                  path("3_mean_rule_sampling_rates.png"))
    findings["rates"].update(baseline_rdp=baseline_by_rate, median_eps=eps_by_rate, baseline_eps=baseline_eps_by_rate)

    # Figure 4: composed ε over training for an easy, a hard and a misclassified point.
    composed = composed.set_index("point")
    chosen = pick_points(composed["eps"], at_end.loc[composed.index, "correct"].astype(bool))
    curves, baseline_curve = composition_curves(metadata, sensitivities, chosen)
    findings["curves"] = plots.plot_composed_over_training(curves, baseline_curve, path("4_composed_eps_over_training.png"),
                                                           COMPOSITION_DELTA)

    # Figure 5: individual accounting of every point vs its final loss; classes.
    model, payload = training.load_model(metadata, run_dir, final_step, device)
    findings["test_accuracy"] = payload["test_accuracy"]
    dataset = load_dataset(metadata["dataset"], "./data", metadata["less_point"])
    class_accuracy = training.per_class_accuracy(model, dataset.test_x, dataset.test_y, dataset.num_classes, device)
    findings["individual"] = plots.plot_individual_accounting(
        composed["eps"].to_numpy(), at_end.loc[composed.index, "loss"].to_numpy(),
        at_end.loc[composed.index, "label"].to_numpy(), dataset.class_names, class_accuracy,
        float(composed["baseline_eps"].iloc[0]), path("5_individual_accounting.png"))
    findings["individual"]["lowest_class"] = int(np.argmin(class_accuracy))
    findings["individual"]["highest_class"] = int(np.argmax(class_accuracy))

    # Figure 6: ε from norms at checkpoints only vs from norms at every step.
    exact = tracked.set_index("point")["eps"]
    findings["estimate"] = plots.plot_estimate_accuracy(
        composed.loc[exact.index, "eps"].to_numpy(), exact.to_numpy(), path("6_estimate_accuracy.png"),
        float(composed["baseline_eps"].iloc[0]))
    findings["estimate"]["points"] = len(exact)
    findings["composed_median"] = float(composed["eps"].median())
    findings["composed_baseline"] = float(composed["baseline_eps"].iloc[0])
    findings["total_steps"] = total_steps
    findings["final_step"] = final_step
    findings["chosen"] = chosen
    return findings


def pick_points(eps, correct):
    """An easy (lowest ε), a hard (highest ε) correctly classified point, and a misclassified one."""
    chosen = {}
    right = eps[correct.to_numpy()]
    if len(right):
        chosen[f"easy (point {right.idxmin()})"] = int(right.idxmin())
        chosen[f"hard (point {right.idxmax()})"] = int(right.idxmax())
    wrong = eps[~correct.to_numpy()]
    if len(wrong):
        point = int((wrong - wrong.median()).abs().idxmin())
        chosen[f"misclassified (point {point})"] = point
    return chosen


def composition_curves(metadata, sensitivities, chosen):
    """Composed ε after t steps (accounting.md §4, b = ∞) at each checkpoint, for the chosen points."""
    orders = np.asarray(accounting.COMPOSITION_ORDERS, dtype=float)
    rows = sensitivities[sensitivities["point"].isin(list(chosen.values()))]
    table_of = rows.pivot_table(index="step", columns="point", values="value", aggfunc="first")
    steps = table_of.index.to_numpy()
    ratio = (table_of[list(chosen.values())].to_numpy() / metadata["clip_bound"])[None]
    table = accounting.RdpTable(metadata["sample_rate"], metadata["noise_multiplier"], orders,
                                accounting.sensitivity_levels(0.0, ratio))
    horizon = [int(step) for step in steps if step > 0]
    curves = {label: (np.asarray(horizon), np.empty(len(horizon))) for label in chosen}
    baseline = np.empty(len(horizon))
    for column, end in enumerate(horizon):
        rdp = accounting.compose_rdp(table, ratio, steps, end, orders, np.inf)
        eps, _ = accounting.rdp_to_eps(orders, rdp, COMPOSITION_DELTA)
        for index, label in enumerate(chosen):
            curves[label][1][column] = eps[index]
        baseline[column] = accounting.rdp_to_eps(
            orders, accounting.baseline_rdp(metadata["noise_multiplier"], metadata["sample_rate"], orders, end),
            COMPOSITION_DELTA)[0]
    return curves, (np.asarray(horizon), baseline)


def write_report(args, preset, metadata, findings, seconds):
    hist, corr, rates = findings["histogram"], findings["correctness"], findings["rates"]
    individual, estimate = findings["individual"], findings["estimate"]
    sorted_rates = sorted(rates["median_rdp"])
    medians = [rates["median_rdp"][rate] for rate in sorted_rates]
    decreasing = all(a >= b for a, b in zip(medians, medians[1:]))
    misclassified_more = corr["count_misclassified"] > 0 and corr["median_misclassified"] > corr["median_correct"]
    lines = [
        f"median per-instance per-step ε is {hist['median']:.4g}, baseline {hist['baseline']:.4g}; "
        f"{100 * hist['share_2x_below']:.1f}% of points are at least 2× below the baseline",
        (f"misclassified median / correct median = {corr['ratio']:.3g} "
         f"({corr['count_misclassified']} misclassified, {corr['count_correct']} correct points)"
         + ("" if misclassified_more else " — NOT borne out by this run: misclassified points do not pay more")),
        ("mean rule: median per-instance Rényi DP (α=8) by sampling rate: "
         + ", ".join(f"q={rate:.4g}: {rates['median_rdp'][rate]:.4g} (baseline {rates['baseline_rdp'][rate]:.4g})"
                     for rate in sorted_rates)
         + ("; it falls as q grows" if decreasing else
            " — it does NOT fall as q grows in this run (the papers' finding is not borne out here)")),
        ("mean rule: median per-instance per-step ε (Δ_B samples, Hölder p=1e4) by sampling rate: "
         + ", ".join(f"q={rate:.4g}: {rates['median_eps'][rate]:.4g} (baseline {rates['baseline_eps'][rate]:.4g})"
                     for rate in sorted_rates)),
        (f"composed ε over {findings['total_steps']} steps (b=∞, δ={COMPOSITION_DELTA:g}): median {findings['composed_median']:.4g}, "
         f"baseline {findings['composed_baseline']:.4g}; "
         + ", ".join(f"{label}: {value:.4g}" for label, value in findings["curves"]["final"].items())),
        (f"Pearson r between composed ε and log final loss = {individual['pearson_log_loss']:.3f}; "
         f"class with the lowest test accuracy ({individual['lowest_class']}) has mean ε "
         f"{individual['class_mean_eps'][list(individual['class_mean_eps'])[individual['lowest_class']]]:.4g}, "
         f"the highest ({individual['highest_class']}) "
         f"{individual['class_mean_eps'][list(individual['class_mean_eps'])[individual['highest_class']]]:.4g}"),
        (f"ε from norms at checkpoints only vs at every step, {estimate['points']} points: Pearson r = "
         f"{estimate['pearson']:.3f}, mean |error| {estimate['mean_abs_error']:.3g}, max |error| "
         f"{estimate['max_abs_error']:.3g}"),
    ]
    findings["headlines"] = lines
    settings = " ".join(preset["train"])
    figures = ["1_per_step_eps_histogram.png", "2_correct_vs_misclassified.png", "3_mean_rule_sampling_rates.png",
               "4_composed_eps_over_training.png", "5_individual_accounting.png", "6_estimate_accuracy.png"]
    text = [f"# Per-instance privacy of DP-SGD: preset `{args.preset}`", "",
            f"Run `{metadata['run']}`: `{settings}`; σ = {metadata['noise_multiplier']:.4g}, q = "
            f"{metadata['sample_rate']:.4g}, T = {metadata['total_steps']}, Γ = {metadata['clip_bound']:g}, "
            f"N = {metadata['dataset_size']}; test accuracy at the end "
            f"{findings['test_accuracy']:.4f}. Took {seconds:.0f} s.", "", "## Findings", ""]
    text += [f"{index}. {line}" for index, line in enumerate(lines, 1)]
    text += ["", "## Figures", ""] + [f"![{figure}]({figure})" for figure in figures]
    path = os.path.join(args.out_dir, "report.md")
    fileio.write_text(path, "\n".join(text) + "\n")
    return path


if __name__ == "__main__":
    run_main(main)

"""The main job's individual Rényi filter (docs/accounting.md §12-§13) against uniform DP-SGD at the same σ, q and
worst-case ε.

The filtered run is the main run's configuration (dataset, model, batch size, learning rate, seed) at the main run's
σ and q, every point's budget the main run's target ε at its δ, trained to a cap of `filter_cap` × the main run's T
steps, a number fixed before training (choosing it on held-out points is the filter benchmark's), with Δ* of every
point measured every `filter_every` steps and each point clipped at 1.25 × its latest value in between (§12.4, §13.5).
Its checkpoints include the main run's T, so the two are compared at T and at the cap. The uniform run is the main
run, or, where the main run carries the one-run audit's canaries (which add to its noisy sums), the same run trained
again without them, so that the two differ by the filter alone (the same seed draws the same batches until a point
leaves, §13.6).

Both runs are train_dpsgd.py commands (listed in the report, skipped when finished); the composition of the filtered
run's tracked table is renyi_per_instance_sum_compo.py's (cached on its input). Test accuracy is compared on the
same test points, the difference with its 95% interval over them (one seed: training's own randomness is not in it).
"""

import os

import numpy as np

import perinstance
from perinstance.accounting import intervals
from perinstance.experiments import filter_findings
from perinstance.experiments.commands import FILTER_FIGURES, RES_DIR, Commands
from perinstance.experiments.config import DATA_ROOT, FILTER_RUN_FIELDS, ReproduceConfig, training_flags, variant_tag
from perinstance.experiments.main_run import MainRun, guarantees
from perinstance.files import tracked_rows
from perinstance.persample import batches
from perinstance.plots.filter_plots import plot_eps_against_guarantee, plot_points_training
from perinstance.train import evaluation, runs, training
from perinstance.train.data import load_dataset


def filter_flags(config: ReproduceConfig, main: MainRun, name: str, device: str) -> list[str]:
    """train_dpsgd.py's flags of the filtered run `name`: the main run's configuration at its σ and δ, every budget
    its target ε, to the cap, with a checkpoint at the main run's T."""
    run = main.run
    cap = round(config.filter_cap * run.total_steps)
    return ["--dataset", config.dataset, "--model", config.model, "--batch-size", str(config.batch_size),
            "--lr", str(config.lr), "--sigma", repr(run.noise_multiplier), "--target-delta", repr(run.delta),
            "--total-steps", str(cap), "--save-freq", str(config.save_freq), "--save-steps", str(run.total_steps),
            "--budget-eps", str(config.eps), "--filter-every", str(config.filter_every), "--save-name", name,
            "--device", device]


def test_outputs(run_dir: str, step: int, dataset: "perinstance.train.data.Dataset",
                 device: str) -> tuple[np.ndarray, list[float]]:
    """Whether the model of checkpoint `step` classifies each test point correctly (1.0 or 0.0), and its test accuracy
    per class from those (one pass over the test set)."""
    run = runs.load_run(run_dir)
    model, _ = training.load_model(run, run_dir, step, device)
    _, _, correct = evaluation.example_outputs(model, dataset.test_x, dataset.test_y, device,
                                             loss_fn=training.loss_for_run(run))
    return correct, evaluation.class_accuracy(correct, dataset.test_y, dataset.num_classes)


def accuracy_change(first: np.ndarray, second: np.ndarray) -> intervals.Interval:
    """The test accuracy of `second` minus that of `first` (each one correctness per test point), with its 95%
    interval over the test points, resampled together (§10)."""
    return intervals.block_mean_interval(np.asarray(second, dtype=float) - np.asarray(first, dtype=float))


def filter_comparison(commands: Commands, config: ReproduceConfig, preset: str, name: str, main: MainRun,
                      out_dir: str, device: str) -> dict | None:
    """Train the filtered run and the uniform one (each skipped when finished), compose the filtered run's tracked
    table by RDP (cached), draw its two figures into `out_dir`, and return the comparison's numbers: the runs, the
    FilterRun (filter_findings.filter_run), the classes, and for class labels the test accuracies at T and at the cap
    with their changes against the uniform run. None where `filter_cap` is 0."""
    if not config.filter_cap:
        return None
    tag = variant_tag(config, preset, FILTER_RUN_FIELDS)
    filter_name = f"{name}{tag}-filter"
    commands.run("train_dpsgd.py", filter_flags(config, main, filter_name, device))
    uniform_dir = main.run_dir
    if main.run.canaries:
        uniform_name = f"{name}{tag}-uniform"
        commands.run("train_dpsgd.py", [*training_flags(config, device), "--save-name", uniform_name])
        uniform_dir = os.path.join("models", uniform_name)
    filter_dir = os.path.join("models", filter_name)
    run, uniform_run = runs.load_run(filter_dir), runs.load_run(uniform_dir)
    if uniform_run.noise_multiplier != run.noise_multiplier:
        raise ValueError(f"the uniform run's σ {uniform_run.noise_multiplier!r} is not the filtered run's "
                         f"{run.noise_multiplier!r}")
    source = tracked_rows.table_path(filter_dir)
    rows = commands.account("renyi_per_instance_sum_compo.py",
                            ["--res-file", source, "--holder-b", "inf", "--delta", str(config.delta)],
                            os.path.join(RES_DIR, f"{filter_name}_compo.csv"), source)
    record = filter_findings.read_record(filter_dir)
    filtered = filter_findings.filter_run(run, record, guarantees(rows, ["point"]))
    labels = record.set_index("point")["label"].reindex(filtered.points).to_numpy(dtype=float)
    dataset = load_dataset(config.dataset, DATA_ROOT)
    names = [str(class_name) for class_name in dataset.class_names]
    present, class_names, members = filter_findings.class_members(labels, names)
    os.makedirs(out_dir, exist_ok=True)
    with commands.timed("the filtered run against the uniform one: figures and test accuracy"):
        plot_points_training(class_names, [filtered.still_training(member) for member in members],
                             filtered.uniform_steps, os.path.join(out_dir, FILTER_FIGURES["training"]),
                             title="Points still training, per class")
        plot_eps_against_guarantee(filtered.eps_rdp, None, float(filtered.guarantee.max()), filtered.uniform_eps,
                                   filtered.uniform_steps, os.path.join(out_dir, FILTER_FIGURES["guarantee"]),
                                   delta=filtered.delta)
        comparison = {"run": filter_name, "uniform_run": uniform_run.run, "uniform_is_main": uniform_dir == main.run_dir,
                      "main_steps": main.run.total_steps, "filtered": filtered,
                      "classes": list(zip(present, class_names, members, strict=True)), "accuracy": None}
        if batches.class_indices(dataset.test_y):
            steps = main.run.total_steps
            uniform, uniform_classes = test_outputs(uniform_dir, steps, dataset, device)
            at_steps, _ = test_outputs(filter_dir, steps, dataset, device)
            at_cap, cap_classes = test_outputs(filter_dir, run.total_steps, dataset, device)
            comparison["accuracy"] = {
                "uniform": float(np.mean(uniform)), "at_steps": float(np.mean(at_steps)),
                "at_cap": float(np.mean(at_cap)), "change_at_steps": accuracy_change(uniform, at_steps),
                "change_at_cap": accuracy_change(uniform, at_cap),
                "per_class": {"uniform": uniform_classes, "at_cap": cap_classes}}
    return comparison

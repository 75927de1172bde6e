"""The run a measurement names, trained on demand: planned from its training flags until it is trained, then
read from its run.json. compute_sensitivity.py trains a run that has no final checkpoint first, as the paper
repository did."""

import os
from dataclasses import dataclass

from perinstance.errors import UsageError
from perinstance.train import run_plan, runs, training
from perinstance.train.data import load_dataset, without_point


@dataclass
class PlannedRun(runs.OpenRun):
    """The training run the flags name; its config is planned from the flags until the run is
    trained, then read from its run.json."""

    training_args: run_plan.TrainingFlags
    finished: bool


def plan(training_args: run_plan.TrainingFlags) -> PlannedRun:
    """The run that the training flags `training_args` describe, checked against what is on disk; nothing is
    written."""
    training_args = run_plan.resolve_training_args(training_args)
    name, root, less_point = training_args.dataset, training_args.data_root, training_args.less_point
    dataset = load_dataset(name, root, class_labels=training_args.loss is None)
    run_data = dataset if less_point is None else without_point(dataset, less_point)
    planned = run_plan.plan_run(training_args, run_data)
    run_dir = run_plan.run_dir_for(training_args)
    run = PlannedRun(run_dir, planned, dataset, run_data.train_x, run_data.train_y, training_args, finished=False)
    if os.path.exists(runs.run_file(run_dir)):
        existing = runs.load_run(run_dir)
        check_same_run(run_dir, existing, planned)
        run.config = existing
        run.finished = existing.total_steps in run.saved_steps()
    return run


def check_same_run(run_dir: str, existing: runs.RunConfig, planned: runs.RunConfig) -> None:
    """The run on disk was trained with these flags on this dataset (fingerprints equal)."""
    differing = run_plan.run_differences(existing, planned)
    if differing:
        raise UsageError("--save-name", f"{run_dir} holds a run that differs in {', '.join(differing)}; "
                                        "give the flags it was trained with, or another --save-name")


def ensure_trained(run: PlannedRun) -> runs.RunConfig:
    """Train the run if it has no final checkpoint (as the paper repository did); returns its config."""
    if not run.finished:
        run.config = training.train(run.training_args).run
        run.finished = True
    return run.config

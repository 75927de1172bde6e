"""The non-private run's learning rate (experiments/nonprivate_run.py): chosen from the grid by the accuracy on
training points its runs were not trained on (never the test set), the grid's best there, the same again on a rerun,
and then trained on every training point."""

import dataclasses
import math
import os
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from perinstance.cli.main import script_mains
from perinstance.errors import UsageError
from perinstance.experiments import nonprivate_run
from perinstance.experiments.commands import Commands
from perinstance.experiments.config import DATA_ROOT, PRESETS
from perinstance.train import evaluation, runs, training
from perinstance.train.data import load_dataset


def test_the_best_held_out_accuracy_wins_the_smallest_rate_among_equals():
    assert nonprivate_run.best_learning_rate({0.1: 0.80, 0.3: 0.91, 1.0: 0.91, 3.0: math.nan}) == 0.3
    assert nonprivate_run.best_learning_rate({0.5: 0.2}) == 0.5
    # A diverged run (nan) is never chosen, even over a poor one.
    assert nonprivate_run.best_learning_rate({0.1: 0.11, 3.0: math.nan}) == 0.1
    with pytest.raises(UsageError, match="nodp_lrs=1.0,3.0: the non-private run diverged"):
        nonprivate_run.best_learning_rate({1.0: math.nan, 3.0: math.nan})


def test_the_held_out_points_are_the_last_share_of_the_training_set():
    assert nonprivate_run.held_out_split(8000, 0.2) == (6400, 1600)
    assert nonprivate_run.held_out_split(512, 0.2) == (410, 102)
    for size, share in ((10, 0.01), (10, 0.99)):
        with pytest.raises(UsageError, match="nodp_holdout"):
            nonprivate_run.held_out_split(size, share)


@pytest.fixture
def selected(tmp_path, monkeypatch):
    """The tiny preset's selection, run in a fresh folder, with every evaluation's inputs recorded."""
    monkeypatch.chdir(tmp_path)
    evaluated = []
    evaluate = evaluation.evaluate

    def recording_evaluate(model, inputs, labels, device, **options):
        # The selection's own calls (training evaluates on the test set as it goes, to print its progress).
        if sys._getframe(1).f_globals["__name__"] == nonprivate_run.__name__:
            evaluated.append((inputs.clone(), labels.clone()))
        return evaluate(model, inputs, labels, device, **options)

    monkeypatch.setattr(evaluation, "evaluate", recording_evaluate)
    config = dataclasses.replace(PRESETS["tiny"], nodp_lrs=(0.05, 0.5, 2.0))
    commands = Commands(script_mains())
    name, selection = nonprivate_run.train_nonprivate(commands, config, "tiny", "tiny-synthetic", "cpu")
    return config, commands, name, selection, evaluated


def test_the_rate_is_the_grids_best_on_held_out_training_points(selected):
    config, commands, name, selection, evaluated = selected
    dataset = load_dataset(config.dataset, DATA_ROOT)
    trained, held_out = nonprivate_run.held_out_split(len(dataset.train_y), config.nodp_holdout)
    assert (selection["trained_points"], selection["held_out_points"]) == (trained, held_out)
    # Every candidate is judged on the training points it was not trained on (holdout:M:'s random sample of them),
    # none on the test set.
    held = load_dataset(f"holdout:{held_out}:{config.dataset}", DATA_ROOT)
    kept = [index for index in range(len(dataset.train_y))
            if not any(torch.equal(dataset.train_x[index], row) for row in held.test_x)]
    assert len(kept) == trained and torch.equal(dataset.train_x[kept], held.train_x)
    assert len(evaluated) == len(config.nodp_lrs)
    for inputs, labels in evaluated:
        assert torch.equal(inputs, held.test_x) and torch.equal(labels, held.test_y)
        assert inputs.shape != dataset.test_x.shape or not torch.equal(inputs, dataset.test_x)
    # Each held-out accuracy, recomputed here from the candidate's final weights, and the choice its best.
    table = pd.read_csv(selection["table"])
    for rate in config.nodp_lrs:
        row = table[table["lr"] == rate].iloc[0]
        run_dir = os.path.join("models", row["run"])
        run = runs.load_run(run_dir)
        assert run.dataset_size == trained and not run.private and run.lr == rate
        model, _ = training.load_model(run, run_dir, run.total_steps)
        with torch.no_grad():
            predicted = model(held.test_x).argmax(dim=1)
        accuracy = float((predicted == held.test_y).double().mean())
        assert selection["held_out_accuracy"][rate] == pytest.approx(accuracy, abs=1e-12)
        assert row["held_out_accuracy"] == pytest.approx(accuracy, rel=1e-9)  # the table's 10 digits
    best = max(selection["held_out_accuracy"].values())
    assert selection["held_out_accuracy"][selection["lr"]] == best
    assert table.loc[table["chosen"], "lr"].tolist() == [selection["lr"]]
    assert selection["at_edge"] == (selection["lr"] in (min(config.nodp_lrs), max(config.nodp_lrs)))
    # Then trained at that rate on every training point; the selection's runs and its note are in the command list.
    final = runs.load_run(os.path.join("models", name))
    assert (final.lr, final.dataset_size, final.private) == (selection["lr"], len(dataset.train_y), False)
    listed = [line for line, _ in commands.lines]
    assert sum(f"--dataset holdout:{held_out}:synthetic" in line for line in listed) == len(config.nodp_lrs)
    assert any(line.startswith("# in-process: nonprivate_run.select_learning_rate") for line in listed)


def test_a_rerun_makes_the_same_choice_without_training(selected, capsys):
    config, _, name, selection, _ = selected
    capsys.readouterr()
    again_name, again = nonprivate_run.train_nonprivate(Commands(script_mains()), config, "tiny", "tiny-synthetic",
                                                        "cpu")
    assert again_name == name
    assert again["lr"] == selection["lr"]
    assert np.array_equal(list(again["held_out_accuracy"].values()), list(selection["held_out_accuracy"].values()))
    # Every run was there already: none is trained again.
    assert capsys.readouterr().out.count(": already trained;") == len(config.nodp_lrs) + 1

"""The non-private run: the main run's configuration trained without DP, the reference model of the membership attack
(membership.py), at its own best learning rate.

The rate is chosen from `nodp_lrs` on held-out points: one run per rate on the training points less the last
`nodp_holdout` share of them, each judged by its accuracy on that share (training points it was not trained on; the
test set, on which the attack and the figure measure the models, plays no part); the most accurate rate (the smallest
among equals) is then trained on every training point. The selection's runs are train_dpsgd.py commands (listed in
the report, skipped when finished, so a rerun makes the same choice without training), its table
res/<run>_lr_selection.csv.

No finding or figure of its own: the membership finding and figure 8 compare it with the main run.
"""

import dataclasses
import math
import os
from collections.abc import Mapping

import pandas as pd

from perinstance.errors import UsageError
from perinstance.experiments.commands import RES_DIR, Commands
from perinstance.experiments.config import (
    DATA_ROOT,
    NODP_RUN_FIELDS,
    ReproduceConfig,
    field_text,
    training_flags,
    variant_tag,
)
from perinstance.files import fileio
from perinstance.train import evaluation, runs, training
from perinstance.train.data import HOLDOUT_PREFIX, load_dataset

# The selection's runs keep their first and last checkpoints only: the last is all the selection reads.
SELECTION_SAVE_FREQ = 1_000_000


def held_out_split(size: int, share: float) -> tuple[int, int]:
    """(training points the selection's runs are trained on, points held out): round(share·size) of `size` training
    points are held out (which ones: holdout:M:DATASET's random sample). A UsageError (--set nodp_holdout) when
    either part would be empty."""
    held_out = round(share * size)
    if not 0 < held_out < size:
        raise UsageError("--set", f"nodp_holdout={share:g} holds out {held_out} of {size} training points; "
                                  "both parts must hold at least one")
    return size - held_out, held_out


def best_learning_rate(held_out_accuracy: Mapping[float, float]) -> float:
    """The learning rate of the highest held-out accuracy, the smallest among equals; a rate whose run diverged
    (nan) is never chosen. A UsageError (--set nodp_lrs) when every run diverged."""
    finite = {rate: accuracy for rate, accuracy in held_out_accuracy.items() if math.isfinite(accuracy)}
    if not finite:
        raise UsageError("--set", f"nodp_lrs={field_text(tuple(held_out_accuracy))}: the non-private run diverged "
                                  "at every learning rate, or its targets are not class labels; give smaller rates")
    return min(finite, key=lambda rate: (-finite[rate], rate))


def select_learning_rate(commands: Commands, config: ReproduceConfig, preset: str, name: str, device: str) -> dict:
    """Train one non-private run per rate of `nodp_lrs` on the training points less the held-out ones (cached by
    train_dpsgd.py), measure each on the held-out points, write the table and choose (best_learning_rate).
    {"lr": the choice, "held_out_accuracy": {rate: accuracy, nan where its run diverged}, "at_edge": whether the
    choice is the grid's smallest or largest rate, "trained_points", "held_out_points", "table": the table's path}."""
    dataset = load_dataset(config.dataset, DATA_ROOT)
    trained, held_out = held_out_split(len(dataset.train_y), config.nodp_holdout)
    # holdout:M: a random sample of the training points as the test split (the last M of an imagefolder would be
    # one class): the candidates train on the rest and are measured on it.
    split = f"{HOLDOUT_PREFIX}{held_out}:{config.dataset}"
    held_out_data = load_dataset(split, DATA_ROOT)
    held_x, held_y = held_out_data.test_x, held_out_data.test_y
    base = f"{name}{variant_tag(config, preset, NODP_RUN_FIELDS)}-nodp-holdout{held_out}"
    rows = []
    for rate in config.nodp_lrs:
        run_name = f"{base}-lr{rate:g}"
        candidate = dataclasses.replace(config, dataset=split, lr=rate,
                                        save_freq=SELECTION_SAVE_FREQ, save_steps="")
        accuracy = loss = math.nan
        try:
            commands.run("train_dpsgd.py", [*training_flags(candidate, device), "--no-dp", "--save-name", run_name])
            diverged = False
        except training.Diverged as error:
            print(f"(learning rate {rate:g} is out of the selection: {error.message})", flush=True)
            diverged = True
        else:
            run_dir = os.path.join("models", run_name)
            run = runs.load_run(run_dir)
            model, _ = training.load_model(run, run_dir, run.total_steps, device)
            accuracy, loss = evaluation.evaluate(model, held_x, held_y, device, loss_fn=training.loss_for_run(run))
        rows.append({"lr": rate, "run": run_name, "trained_points": trained, "held_out_points": held_out,
                     "held_out_accuracy": accuracy, "held_out_loss": loss, "diverged": diverged})
    accuracies = {row["lr"]: row["held_out_accuracy"] for row in rows}
    chosen = best_learning_rate(accuracies)
    table = os.path.join(RES_DIR, f"{base}_lr_selection.csv")
    fileio.write_csv(table, pd.DataFrame(rows).assign(chosen=lambda frame: frame["lr"] == chosen))
    # A choice at either end of the grid may have a better rate beyond it: said, for the grid to be widened.
    at_edge = len(accuracies) > 1 and chosen in (min(accuracies), max(accuracies))
    commands.note(f"nonprivate_run.select_learning_rate: each run above measured on the {held_out} training points "
                  f"that {split} holds out (not the test set), learning rate {chosen:g} chosen"
                  + (" (at the end of the grid nodp_lrs)" if at_edge else "") + f"; wrote {table}")
    return {"lr": chosen, "held_out_accuracy": accuracies, "at_edge": at_edge, "trained_points": trained,
            "held_out_points": held_out, "table": table}


def train_nonprivate(commands: Commands, config: ReproduceConfig, preset: str, name: str,
                     device: str) -> tuple[str, dict]:
    """Choose the learning rate (select_learning_rate), then train the non-private run at it on every training point
    (skipped by train_dpsgd.py when it is there already): its name, and the selection with the run's name."""
    selection = select_learning_rate(commands, config, preset, name, device)
    nodp_name = f"{name}{variant_tag(config, preset, NODP_RUN_FIELDS)}-nodp-lr{selection['lr']:g}"
    nodp = dataclasses.replace(config, lr=selection["lr"], save_steps="")
    commands.run("train_dpsgd.py", [*training_flags(nodp, device), "--no-dp", "--save-name", nodp_name])
    return nodp_name, {**selection, "run": nodp_name}

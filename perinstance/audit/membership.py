"""The torch and file side of the membership attack (Yu et al., Appendix D; docs/audit.md).

Per class, the loss-threshold attack on a run's checkpoint, its members drawn from the training
set, and the per-class mean composed ε it is compared with. The mathematics (threshold choice,
balanced accuracy, Pearson r) is in perinstance/accounting/audit_bounds.py.
"""

import numpy as np
import pandas as pd
import torch

from perinstance.accounting import audit_bounds, intervals
from perinstance.errors import UsageError
from perinstance.persample import batches
from perinstance.train import runs, sampling, training
from perinstance.train.data import are_class_labels
from perinstance.train.user_code import describe_targets

LOSS_CHUNK = 1024
MODELS = {"DP": "--run", "non-private": "--nondp-run"}
# Flags in which a DP run and its non-private counterpart may differ: privacy by construction,
# and what is recorded rather than trained.
NOT_COMPARED = {"dp", "eps", "sigma", "delta", "save_freq", "track_points"}


def open_pair(run: str, nondp_run: str, models_dir: str,
              data_root: str) -> tuple[dict[str, runs.OpenRun], list[str]]:
    """The DP run (--run) and the non-private run (--nondp-run), opened (runs.open_run) and checked to
    be the two halves of one comparison: {model: run}, and the training flags they differ in
    besides privacy."""
    opened = {model: runs.open_run(name, models_dir, data_root, flag)
              for (model, flag), name in zip(MODELS.items(), (run, nondp_run), strict=True)}
    for model, flag in MODELS.items():
        config = opened[model].config
        if config.private != (model == "DP"):
            raise UsageError(flag, f"{opened[model].name} is {'a DP run' if config.private else 'non-private'}; "
                                   "give the DP run as --run and the non-private one as --nondp-run")
        if config.less_point is not None:
            raise UsageError(flag, f"{opened[model].name} was trained without point {config.less_point}; "
                                   "use runs on the whole training set")
        targets = opened[model].dataset.train_y
        if not are_class_labels(targets):
            raise UsageError(flag, f"{opened[model].name} was trained on targets that are not class labels "
                                   f"({describe_targets(targets)}, with --loss {config.loss}): the attack is per "
                                   "class, so it does not apply")
    private, public = opened["DP"].config, opened["non-private"].config
    if private.dataset_fingerprint != public.dataset_fingerprint:
        raise UsageError("--nondp-run", f"{opened['non-private'].name} was trained on other data than "
                                        f"{opened['DP'].name}")
    differing = sorted(key for key in set(private.flags) | set(public.flags)
                       if key not in NOT_COMPARED and private.flags.get(key) != public.flags.get(key))
    return opened, differing


@torch.no_grad()
def losses_and_predictions(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, device: str,
                           loss_fn: batches.LossFn | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The loss (the run's: batches.per_example_loss, the cross-entropy unless `loss_fn`) and the predicted class
    of every example (float64, int64 arrays)."""
    model.eval()
    losses, predicted = [], []
    for start in range(0, len(labels), LOSS_CHUNK):
        logits = model(inputs[start:start + LOSS_CHUNK].to(device))
        target = labels[start:start + LOSS_CHUNK].to(device)
        losses.append(batches.per_example_loss(logits, target, loss_fn).double().cpu())
        predicted.append(logits.argmax(dim=1).cpu())
    return torch.cat(losses).numpy(), torch.cat(predicted).numpy()


def class_members(train_labels: np.ndarray, test_labels: np.ndarray, num_classes: int,
                  seed: int) -> dict[int, np.ndarray]:
    """Per class c: as many training rows of class c as there are test points of class c
    (all of them if fewer), drawn at random from (seed, c): the members the attack sees."""
    chosen = {}
    for label in range(num_classes):
        candidates = np.flatnonzero(train_labels == label)
        wanted = min(len(candidates), int(np.sum(test_labels == label)))
        rng = sampling.stream_rng(seed, sampling.MEMBERSHIP_STREAM, label)
        chosen[label] = np.sort(rng.choice(candidates, size=wanted, replace=False))
    return chosen


def attack_by_class(run: runs.OpenRun, step: int, members: dict[int, np.ndarray], splits: int, seed: int,
                    device: str) -> pd.DataFrame:
    """Per class: the loss-threshold attack's balanced accuracy and advantage (members: the
    class_members rows of the run's training set; non-members: the class's test points) and
    the class's test accuracy. A DataFrame with one row per class. The losses are the run's own (--loss)."""
    model, _ = training.load_model(run.config, run.run_dir, step, device)
    loss_fn = training.loss_for_run(run.config)
    train_losses, _ = losses_and_predictions(model, run.train_x, run.train_y, device, loss_fn)
    test_y = run.dataset.test_y.numpy()
    test_losses, test_predicted = losses_and_predictions(model, run.dataset.test_x, run.dataset.test_y, device,
                                                         loss_fn)
    rows = []
    for label, member_rows in members.items():
        nonmember = test_y == label
        rng = sampling.stream_rng(seed, sampling.MEMBERSHIP_STREAM, label, 1)
        if len(member_rows) >= 2 and nonmember.sum() >= 2:
            accuracy, advantage, spread = audit_bounds.loss_threshold_attack(train_losses[member_rows],
                                                                             test_losses[nonmember], rng, splits)
        else:
            accuracy = advantage = spread = np.nan
        rows.append({"class": label, "members": len(member_rows), "nonmembers": int(nonmember.sum()),
                     "attack_accuracy": accuracy, "attack_advantage": advantage, "accuracy_std": spread,
                     "test_accuracy": float(np.mean(test_predicted[nonmember] == label)) if nonmember.any()
                     else np.nan})
    return pd.DataFrame(rows)


def class_mean_eps(path: str, labels: np.ndarray, total_steps: int,
                   flag: str = "--eps-csv") -> tuple[pd.Series, float | None]:
    """Mean composed ε per class from a renyi_per_instance_sum_compo.py output (columns point,
    eps, optionally steps, delta and kind: then the certified rows, or the one kind that is not the
    baseline); `labels` are the full dataset's training labels. A Series indexed by class, and the δ of the ε
    (None where the file has no single one)."""
    try:
        frame = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise UsageError(flag, f"cannot read {path}: {str(error).splitlines()[0]}") from None
    missing = [column for column in ("point", "eps") if column not in frame.columns]
    if missing:
        raise UsageError(flag, f"{path} is not a renyi_per_instance_sum_compo.py output (no column "
                               f"{', '.join(missing)})")
    if "kind" in frame.columns:
        # One row per point and kind (certified, estimate, baseline): the point's own bound.
        kinds = sorted(set(frame["kind"].astype(str)) - {"baseline"})
        chosen = "certified" if "certified" in kinds else (kinds[0] if len(kinds) == 1 else None)
        if chosen is None:
            raise UsageError(flag, f"{path} has no per-point kind to take (kinds: {', '.join(kinds) or 'baseline'})")
        frame = frame[frame["kind"].astype(str) == chosen].reset_index(drop=True)
    if frame["point"].duplicated().any():
        raise UsageError(flag, f"{path} has point {frame['point'][frame['point'].duplicated()].iloc[0]} twice")
    points = pd.to_numeric(frame["point"], errors="coerce").to_numpy()
    eps = pd.to_numeric(frame["eps"], errors="coerce").to_numpy()
    bad = ~np.isfinite(points) | (points < 0) | (points >= len(labels)) | (points != np.round(points)) | ~(eps >= 0)
    if bad.any():
        line = int(np.argmax(bad)) + 2
        raise UsageError(flag, f"{path} line {line}: point {frame['point'].iloc[line - 2]!r}, eps "
                               f"{frame['eps'].iloc[line - 2]!r} is not a point of this dataset with an ε >= 0")
    if "steps" in frame.columns and (frame["steps"] != total_steps).any():
        raise UsageError(flag, f"{path} composes {sorted(set(frame['steps']))} steps, the run has {total_steps}; "
                               "give the composition of this run")
    deltas = pd.to_numeric(frame["delta"], errors="coerce").unique() if "delta" in frame.columns else []
    delta = float(deltas[0]) if len(deltas) == 1 and np.isfinite(deltas[0]) else None
    means = pd.Series(eps).groupby(labels[points.astype(np.int64)]).mean()
    missing = sorted(set(np.unique(labels).tolist()) - set(means.index.tolist()))
    if missing:
        raise UsageError(flag, f"{path} has no point of class {missing[0]}: give the ε of every training point "
                               "(compute_sensitivity.py --points all)")
    return means, delta


def membership_summary(rows: pd.DataFrame) -> dict[str, dict]:
    """Per model: classes, attack points (members and non-members), the test accuracy over every class (the classes'
    accuracies weighted by their test points), the mean attack accuracy over classes with
    its 95% interval (docs/accounting.md §10, the classes resampled: each has its own threshold), and the
    Pearson r across classes of the attack accuracy and of the test accuracy with the class's mean composed ε,
    the first with its interval (None where r is undefined)."""
    summary = {}
    for model, group in rows.groupby("model", sort=False):
        valid = group.dropna(subset=["attack_accuracy", "mean_eps"])
        pearson_attack = audit_bounds.pearson(valid["mean_eps"], valid["attack_accuracy"])
        accuracies = valid["attack_accuracy"].to_numpy()
        tested = group.dropna(subset=["test_accuracy"])
        summary[model] = {"classes": len(valid), "points": int((valid["members"] + valid["nonmembers"]).sum()),
                          "test_accuracy": float(np.average(tested["test_accuracy"], weights=tested["nonmembers"]))
                          if tested["nonmembers"].sum() > 0 else float("nan"),
                          "mean_attack_accuracy": float(accuracies.mean()) if len(valid) else float("nan"),
                          "attack_accuracy_interval": intervals.block_mean_interval(accuracies) if len(valid) else None,
                          "pearson_attack": pearson_attack,
                          "pearson_attack_interval": (None if np.isnan(pearson_attack) else intervals.pearson_interval(
                              valid["mean_eps"].to_numpy(), valid["attack_accuracy"].to_numpy())),
                          "pearson_test": audit_bounds.pearson(valid["mean_eps"], valid["test_accuracy"])}
    return summary

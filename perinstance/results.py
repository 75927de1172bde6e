"""The sensitivity CSV written by compute_sensitivity.py and read by the accountants.

Long format, one row per measured value (accounting.md §2). `quantity` is one of
QUANTITIES; values are raw, in the units of accounting.md.
"""

import os

import pandas as pd

from perinstance.errors import UsageError

COLUMNS = [
    "run", "seed", "step", "stage", "total_steps", "point", "label", "correct", "loss",
    "exp", "reduction", "direction", "target_batch", "sample", "quantity", "value",
    "alpha", "sigma", "clip_bound", "sample_rate", "batch_size", "dataset_size",
    "noise_std", "dataset", "model", "clipping", "update_rule", "target_eps", "delta",
    "accuracy",
]

# quantity -> the script and flags that produce it, for error messages.
QUANTITIES = {
    "grad_norm": "compute_sensitivity.py --reduction sum",
    "batch_sensitivity": "compute_sensitivity.py --exp eps_delta --reduction mean",
    "renyi_statistic": "compute_sensitivity.py --exp renyi --reduction mean",
}

# Columns that describe the run configuration: rows that differ in these cannot be mixed
# in one accounting (the expectation over runs is over `run`/`seed` only).
CONFIG_COLUMNS = [
    "sigma", "clip_bound", "sample_rate", "batch_size", "dataset_size", "noise_std",
    "dataset", "model", "clipping", "update_rule", "total_steps", "reduction",
]


def results_path(res_name, res_dir="res"):
    return os.path.join(res_dir, f"{res_name}.csv")


def read_results(path, flag="--res-file"):
    """Read a sensitivity CSV; a missing, unreadable or foreign file is a UsageError."""
    if not os.path.isfile(path):
        raise UsageError(flag, f"no result file at {path} (compute_sensitivity.py writes it)")
    try:
        frame = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as error:
        raise UsageError(flag, f"cannot read {path}: {str(error).splitlines()[0]}") from None
    missing = [column for column in COLUMNS if column not in frame.columns]
    if missing:
        raise UsageError(flag, f"{path} is not a sensitivity result file (missing columns: {', '.join(missing)})")
    return frame


def noise_std(metadata, reduction):
    """Noise std in the units of the analysed rule: σΓ (sum) or σΓ/B_exp (mean), accounting.md §1."""
    std = metadata["noise_multiplier"] * metadata["clip_bound"]
    return std if reduction == "sum" else std / metadata["batch_size"]


def run_columns(metadata, reduction):
    """The columns of a result row that come from the training run's metadata."""
    return {
        "run": metadata["run"],
        "seed": metadata["seed"],
        "total_steps": metadata["total_steps"],
        "reduction": reduction,
        "sigma": metadata["noise_multiplier"],
        "clip_bound": metadata["clip_bound"],
        "sample_rate": metadata["sample_rate"],
        "batch_size": metadata["batch_size"],
        "dataset_size": metadata["dataset_size"],
        "noise_std": noise_std(metadata, reduction),
        "dataset": metadata["dataset"],
        "model": metadata["model"],
        "clipping": metadata["clipping"],
        "update_rule": metadata["update_rule"],
        "target_eps": metadata["target_eps"],
        "delta": metadata["delta"],
    }

"""The run folder: `run.json` (every flag and derived quantity) and `step_NNNNNNN.pt` checkpoints.

Checkpoints hold only tensors and plain values, so `torch.load(weights_only=True)` reads
them: a checkpoint from someone else cannot run code. Both files are checked when read: a
run.json that is not this tool's (not an object, a key missing or of the wrong type, a newer
format) or a checkpoint that does not fit the run's model is a one-line error naming the file.
"""

import json
import math
import os
import re
from contextlib import contextmanager

import torch

from perinstance import fileio
from perinstance.errors import UsageError

METADATA_FILE = "run.json"
CHECKPOINT_PATTERN = re.compile(r"^step_(\d{7})\.pt$")
# The run.json format this version writes; it reads this one and every earlier one.
METADATA_FORMAT = 1
# Every error about the run folder names the flag that chose it.
FLAG = "--save-name"


def checkpoint_path(run_dir, step):
    return os.path.join(run_dir, f"step_{step:07d}.pt")


def saved_steps(run_dir):
    """Steps of the checkpoints present in `run_dir`, ascending."""
    if not os.path.isdir(run_dir):
        return []
    steps = [int(match.group(1)) for name in os.listdir(run_dir) if (match := CHECKPOINT_PATTERN.match(name))]
    return sorted(steps)


def metadata_path(run_dir):
    return os.path.join(run_dir, METADATA_FILE)


# --- run.json ---------------------------------------------------------------------------------

def _integer(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value):
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


def _optional(check):
    return lambda value: value is None or check(value)


# Every key of format 1 that the code reads, with what its value must be.
METADATA_KEYS = {
    "run": ("a text", lambda value: isinstance(value, str) and value != ""),
    "args": ("an object of flags", lambda value: isinstance(value, dict)),
    "seed": ("an integer >= 0", lambda value: _integer(value) and value >= 0),
    "dataset": ("a text", lambda value: isinstance(value, str)),
    "dataset_fingerprint": ("a text", lambda value: isinstance(value, str)),
    "dataset_size": ("an integer > 0", lambda value: _integer(value) and value > 0),
    "num_classes": ("an integer > 0", lambda value: _integer(value) and value > 0),
    "input_shape": ("a list of 3 integers > 0",
                    lambda value: isinstance(value, list) and len(value) == 3
                    and all(_integer(size) and size > 0 for size in value)),
    "model": ("a text", lambda value: isinstance(value, str)),
    "norm_type": ("a text", lambda value: isinstance(value, str)),
    "dp": ("0 or 1", lambda value: _integer(value) and value in (0, 1)),
    "clipping": ("a text", lambda value: isinstance(value, str)),
    "clip_norm": ("a number > 0", lambda value: _number(value) and value > 0),
    "scale_r": ("a number or null", _optional(_number)),
    "scale_s": ("a number or null", _optional(_number)),
    "clip_bound": ("a number > 0", lambda value: _number(value) and value > 0),
    "noise_multiplier": ("a number >= 0", lambda value: _number(value) and value >= 0),
    "target_eps": ("a number or null", _optional(_number)),
    "delta": ("a number in (0, 1)", lambda value: _number(value) and 0 < value < 1),
    "sample_rate": ("a number in (0, 1]", lambda value: _number(value) and 0 < value <= 1),
    "batch_size": ("an integer > 0", lambda value: _integer(value) and value > 0),
    "total_steps": ("an integer > 0", lambda value: _integer(value) and value > 0),
    "steps_per_epoch": ("a number > 0", lambda value: _number(value) and value > 0),
    "update_rule": ("sum or mean", lambda value: value in ("sum", "mean")),
    "less_point": ("an integer or null", _optional(_integer)),
    "checkpoint_steps": ("a list of integers >= 0",
                         lambda value: isinstance(value, list) and all(_integer(step) and step >= 0 for step in value)),
    "tracked_points": ("a list of integers or null",
                       _optional(lambda value: isinstance(value, list) and all(map(_integer, value)))),
    "versions": ("an object", lambda value: isinstance(value, dict)),
}


def load_metadata(run_dir):
    """run.json of `run_dir`, checked: a JSON object of a format this version reads, with every key."""
    path = metadata_path(run_dir)
    try:
        with open(path, encoding="utf-8") as handle:
            metadata = json.load(handle)
    except FileNotFoundError:
        raise UsageError(FLAG, f"no run metadata at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(FLAG, f"corrupt run metadata {path}: {error}") from None
    except OSError as error:
        raise UsageError(FLAG, f"cannot read {path}: {error.strerror or error}") from None
    check_metadata(metadata, path)
    return metadata


def check_metadata(metadata, path):
    """Refuse run metadata that this version cannot use, naming the file and the problem."""
    if not isinstance(metadata, dict):
        raise UsageError(FLAG, f"{path} is not run metadata: it holds a JSON {_json_type(metadata)}, not an object")
    version = metadata.get("format", 1)  # every format-1 file has the key; default to it all the same
    if not _integer(version) or version < 1:
        raise UsageError(FLAG, f"{path}: format is {version!r}, expected an integer >= 1")
    if version > METADATA_FORMAT:
        raise UsageError(FLAG, f"{path} has format {version}, newer than this version reads (up to "
                               f"{METADATA_FORMAT}); update the code, or use another --save-name or --models-dir")
    missing = [key for key in METADATA_KEYS if key not in metadata]
    if missing:
        raise UsageError(FLAG, f"{path} lacks the key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                               "of run metadata; delete the folder to train the run again")
    for key, (expected, valid) in METADATA_KEYS.items():
        if not valid(metadata[key]):
            raise UsageError(FLAG, f"{path}: {key} is {_short(metadata[key])}, expected {expected}")


def _json_type(value):
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _short(value, limit=60):
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def save_metadata(run_dir, metadata):
    fileio.write_json(metadata_path(run_dir), metadata, flag="--models-dir")


# --- checkpoints --------------------------------------------------------------------------------

# What every checkpoint holds besides its tensors (Trainer.state writes these).
CHECKPOINT_KEYS = ("step", "model", "test_accuracy")


def save_checkpoint(run_dir, step, payload):
    fileio.save_torch(checkpoint_path(run_dir, step), payload, flag="--models-dir")


def load_checkpoint(run_dir, step, device="cpu"):
    path = checkpoint_path(run_dir, step)
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise UsageError(FLAG, f"corrupt or truncated checkpoint {path} ({_one_line(error)}); "
                               "delete it to resume from the one before") from None
    if not isinstance(payload, dict) or any(key not in payload for key in CHECKPOINT_KEYS) \
            or payload["step"] != step or not isinstance(payload["model"], dict) \
            or not all(isinstance(tensor, torch.Tensor) for tensor in payload["model"].values()):
        raise UsageError(FLAG, f"{path} is not a checkpoint of this tool; delete it to resume from the one before")
    return payload


@contextmanager
def restoring(run_dir, step):
    """Around loading checkpoint `step` into a model or optimizer: one that does not fit (another
    architecture, foreign or missing tensors, another optimizer) is a one-line error naming it."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        raise UsageError(FLAG, f"{checkpoint_path(run_dir, step)} does not fit this run's model "
                               f"({_one_line(error)}); it comes from another run: delete it or use another "
                               "--save-name") from None


def _one_line(error, limit=300):
    """The exception's message on one line, shortened (torch's can run to many lines)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."

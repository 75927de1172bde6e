"""The run folder: `run.json` (every flag and derived quantity) and `step_NNNNNNN.pt` checkpoints.

Checkpoints hold only tensors and plain values, so `torch.load(weights_only=True)` reads
them: a checkpoint from someone else cannot run code.
"""

import json
import os
import re

import torch

from perinstance import fileio
from perinstance.errors import UsageError

METADATA_FILE = "run.json"
CHECKPOINT_PATTERN = re.compile(r"^step_(\d{7})\.pt$")


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


def load_metadata(run_dir):
    path = metadata_path(run_dir)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise UsageError("--save-name", f"no run metadata at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError("--save-name", f"corrupt run metadata {path}: {error}") from None


def save_metadata(run_dir, metadata):
    fileio.write_json(metadata_path(run_dir), metadata)


def save_checkpoint(run_dir, step, payload):
    fileio.save_torch(checkpoint_path(run_dir, step), payload)


def load_checkpoint(run_dir, step, device="cpu"):
    path = checkpoint_path(run_dir, step)
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # torch raises many types for truncated or foreign files
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError("--save-name", f"corrupt or truncated checkpoint {path} ({reason}); delete it to resume from the one before") from None
    if not isinstance(payload, dict) or "model" not in payload or payload.get("step") != step:
        raise UsageError("--save-name", f"{path} is not a checkpoint of this tool; delete it to resume from the one before")
    return payload

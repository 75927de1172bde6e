"""The checkpoints of a run folder, `step_NNNNNNN.pt` (run.json is runs.py's).

Checkpoints hold only tensors and plain values, so `torch.load(weights_only=True)` reads
them: a checkpoint from someone else cannot run code. A checkpoint that is not this tool's or
does not fit the run's model is a one-line error naming the file.
"""

import os
import pickle
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from perinstance.errors import UsageError
from perinstance.files import fileio

CHECKPOINT_PATTERN = re.compile(r"^step_(\d{7})\.pt$")
# Terminal control sequences (colours, bold) that torch puts in some of its messages.
ESCAPE_SEQUENCE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Every error about the run folder names the flag that chose it.
FLAG = "--save-name"


def checkpoint_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"step_{step:07d}.pt")


def saved_steps(run_dir: str) -> list[int]:
    """Steps of the checkpoints present in `run_dir`, ascending."""
    if not os.path.isdir(run_dir):
        return []
    steps = [int(match.group(1)) for name in os.listdir(run_dir) if (match := CHECKPOINT_PATTERN.match(name))]
    return sorted(steps)


# --- checkpoints --------------------------------------------------------------------------------

# What every checkpoint holds besides its tensors (Trainer.state writes these).
CHECKPOINT_KEYS = ("step", "model", "test_accuracy")


def save_checkpoint(run_dir: str, step: int, payload: dict) -> None:
    fileio.save_torch(checkpoint_path(run_dir, step), payload, flag="--models-dir")


def load_checkpoint(run_dir: str, step: int, device: str = "cpu") -> dict:
    path = checkpoint_path(run_dir, step)
    try:
        with warnings.catch_warnings():
            # torch warns on stderr about a foreign file's pickle protocol; the error below says all.
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises loading without weights_only, which would run the file's code.
        raise UsageError(FLAG, f"{path} holds objects other than tensors and plain values (or is no checkpoint at "
                               "all): it is refused, never unpickled; delete it to resume from the one before") from None
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise UsageError(FLAG, f"corrupt or truncated checkpoint {path} ({_one_line(error)}); "
                               "delete it to resume from the one before") from None
    if not isinstance(payload, dict) or any(key not in payload for key in CHECKPOINT_KEYS) \
            or payload["step"] != step or not isinstance(payload["model"], dict) \
            or not all(isinstance(tensor, torch.Tensor) for tensor in payload["model"].values()):
        raise UsageError(FLAG, f"{path} is not a checkpoint of this tool; delete it to resume from the one before")
    return payload


@contextmanager
def restoring(run_dir: str, step: int) -> Iterator[None]:
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
    text = " ".join(ESCAPE_SEQUENCE.sub("", str(error)).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."

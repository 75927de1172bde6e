"""The tracked points' values of a run on disk (docs/accounting.md §4): while it trains, one segment file per span of
steps between checkpoints, `<run>/tracked/steps_FIRST-LAST.pt`, written atomically before the checkpoint that
ends the span, so that a resume needs only what was written; at the end, one result table
`<run>/tracked_norms.csv` (`.parquet` past storage.AUTO_PARQUET_ROWS, the same stem), which the accountants read.

A segment holds only tensors and integers (torch.load(weights_only=True) reads it): the first step, the steps measured
(first .. last, or every k-th of them in a run measured every k steps), the points, and a float32 (steps, 3, points)
array of ||h(g)||, loss and correctness at those θ. A segment written before the steps were kept holds every step
from first to last.
"""

import os
import pickle
import re
import shutil
import warnings

import numpy as np
import pandas as pd
import torch

from perinstance.errors import UsageError
from perinstance.files import fileio, results

FOLDER = "tracked"
TABLE = "tracked_norms"
SEGMENT_PATTERN = re.compile(r"^steps_(\d{7})-(\d{7})\.pt$")
# Every error about the run folder names the flag that chose it.
FLAG = "--save-name"


def segment_path(run_dir: str, first: int, last: int) -> str:
    return os.path.join(run_dir, FOLDER, f"steps_{first:07d}-{last:07d}.pt")


def segments(run_dir: str) -> list[tuple[int, int]]:
    """(first, last) step of every segment in the run folder, ascending."""
    folder = os.path.join(run_dir, FOLDER)
    if not os.path.isdir(folder):
        return []
    return sorted((int(match.group(1)), int(match.group(2)))
                  for name in os.listdir(folder) if (match := SEGMENT_PATTERN.match(name)))


def save_segment(run_dir: str, steps: list[int], points: np.ndarray, values: np.ndarray) -> None:
    """Write the values (steps, 3, points) measured at `steps` (ascending) atomically."""
    os.makedirs(os.path.join(run_dir, FOLDER), exist_ok=True)
    fileio.save_torch(segment_path(run_dir, steps[0], steps[-1]),
                      {"first_step": steps[0], "steps": torch.as_tensor(steps, dtype=torch.int64),
                       "points": torch.as_tensor(points, dtype=torch.int64),
                       "values": torch.as_tensor(values, dtype=torch.float32)}, flag="--models-dir")


def load_segment(run_dir: str, first: int, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points, steps, values) of one segment; a damaged or foreign one is a one-line error naming it."""
    path = segment_path(run_dir, first, last)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True)
        points, values = payload["points"].numpy(), payload["values"].numpy()
        steps = payload["steps"].numpy() if "steps" in payload else np.arange(first, last + 1)
        if payload["first_step"] != first or steps[0] != first or steps[-1] != last or \
                values.shape != (len(steps), 3, len(points)):
            raise ValueError("its steps or shape do not match its name")
    except (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            OSError) as error:
        raise UsageError(FLAG, f"{path} is not a segment of tracked values ({str(error).splitlines()[0]}); "
                               "delete it and the checkpoints after its first step to train them again") from None
    return points, steps, values


def drop_segments_from(run_dir: str, step: int) -> None:
    """Remove the segments that start at `step` or later (written before a checkpoint that was never saved: a
    resume from the checkpoint before writes them again), and the temp files of killed writes."""
    folder = os.path.join(run_dir, FOLDER)
    if not os.path.isdir(folder):
        return
    fileio.remove_stale_temps(folder)
    for first, last in segments(run_dir):
        if first >= step:
            os.remove(segment_path(run_dir, first, last))


def gather(run_dir: str, schedule: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(points, steps, values (steps, 3, points)) from the segments, which must hold exactly the measured steps
    `schedule` (ascending: 0..T, or every k-th step and T)."""
    spans = segments(run_dir)
    loaded = [load_segment(run_dir, first, last) for first, last in spans]
    steps = np.concatenate([steps for _, steps, _ in loaded]) if loaded else np.zeros(0, dtype=np.int64)
    if not np.array_equal(steps, schedule):
        raise UsageError(FLAG, f"the tracked values of {run_dir} do not cover the measured steps {schedule[0]}.."
                               f"{schedule[-1]} (segments {', '.join(f'{first}-{last}' for first, last in spans) or 'none'}"
                               f" in {os.path.join(run_dir, FOLDER)}); train the run again with --overwrite")
    points = loaded[0][0]
    if any(not np.array_equal(other, points) for other, _, _ in loaded):
        raise UsageError(FLAG, f"the segments in {os.path.join(run_dir, FOLDER)} track different points; train the "
                               "run again with --overwrite")
    return points, steps, np.concatenate([values for _, _, values in loaded])


def table_path(run_dir: str) -> str:
    """The tracked table of a run: tracked_norms.csv, or .parquet when that is the one written."""
    return results.results_path(TABLE, run_dir, flag=FLAG)


def write_table(run_dir: str, frame: pd.DataFrame) -> str:
    """Write the tracked table (CSV up to storage.AUTO_PARQUET_ROWS rows, Parquet beyond), remove the other
    format's file and the segments, and return its path."""
    path = results.write_sized(TABLE, run_dir, frame, "--models-dir")
    shutil.rmtree(os.path.join(run_dir, FOLDER), ignore_errors=True)
    return path


def has_table(run_dir: str) -> bool:
    return any(os.path.exists(path) for path in results.format_paths(TABLE, run_dir))

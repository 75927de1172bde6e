"""The tracked points' values of a run on disk (docs/accounting.md §4): while it trains, one segment file per span of
steps between checkpoints, `<run>/tracked/steps_FIRST-LAST.pt`, written atomically before the checkpoint that
ends the span, so that a resume needs only what was written; at the end, one result table
`<run>/tracked_norms.csv` (`.parquet` past storage.AUTO_PARQUET_ROWS, the same stem), which the accountants read.

A segment holds only tensors and integers (torch.load(weights_only=True) reads it): the first and last step, the
points, and a float32 (steps, 3, points) array of ||h(g)||, loss and correctness at θ_first .. θ_last.
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


def save_segment(run_dir: str, first: int, points: np.ndarray, values: np.ndarray) -> None:
    """Write the values (steps, 3, points) of steps first .. first + steps − 1 atomically."""
    os.makedirs(os.path.join(run_dir, FOLDER), exist_ok=True)
    fileio.save_torch(segment_path(run_dir, first, first + len(values) - 1),
                      {"first_step": first, "points": torch.as_tensor(points, dtype=torch.int64),
                       "values": torch.as_tensor(values, dtype=torch.float32)}, flag="--models-dir")


def load_segment(run_dir: str, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """(points, values) of one segment; a damaged or foreign one is a one-line error naming it."""
    path = segment_path(run_dir, first, last)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True)
        points, values = payload["points"].numpy(), payload["values"].numpy()
        if payload["first_step"] != first or values.shape != (last - first + 1, 3, len(points)):
            raise ValueError("its steps or shape do not match its name")
    except (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, TypeError, AttributeError, OSError) as error:
        raise UsageError(FLAG, f"{path} is not a segment of tracked values ({str(error).splitlines()[0]}); "
                               "delete it and the checkpoints after its first step to train them again") from None
    return points, values


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


def gather(run_dir: str, total_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(points, values (T + 1, 3, points)) of θ_0 .. θ_T from the segments, which must tile 0..T."""
    spans = segments(run_dir)
    expected = 0
    for first, last in spans:
        if first != expected:
            break
        expected = last + 1
    if expected != total_steps + 1 or not spans:
        raise UsageError(FLAG, f"the tracked values of {run_dir} do not cover steps 0..{total_steps} (segments "
                               f"{', '.join(f'{first}-{last}' for first, last in spans) or 'none'} in "
                               f"{os.path.join(run_dir, FOLDER)}); train the run again with --overwrite")
    loaded = [load_segment(run_dir, first, last) for first, last in spans]
    points = loaded[0][0]
    if any(not np.array_equal(other, points) for other, _ in loaded):
        raise UsageError(FLAG, f"the segments in {os.path.join(run_dir, FOLDER)} track different points; train the "
                               "run again with --overwrite")
    return points, np.concatenate([values for _, values in loaded])


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

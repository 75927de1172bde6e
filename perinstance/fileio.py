"""Atomic file writes: a reader never sees a half-written file (temp file + rename)."""

import json
import os
import tempfile
from contextlib import contextmanager


@contextmanager
def atomic_path(path):
    """Yield a temporary path next to `path`; rename it over `path` only on success."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temp_path = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(handle)
    # mkstemp makes the file private (0600); give it the permissions a plain open() would.
    os.chmod(temp_path, 0o666 & ~_current_umask())
    try:
        yield temp_path
        os.replace(temp_path, path)
    finally:
        if os.path.exists(temp_path):
            os.remove(temp_path)


def _current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path, text):
    with atomic_path(path) as temp_path:
        with open(temp_path, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())


def write_json(path, data):
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_csv(path, frame):
    """Write a pandas DataFrame as CSV atomically, with a fixed float format for stable bytes."""
    write_text(path, frame.to_csv(index=False, float_format="%.10g", lineterminator="\n"))


def save_torch(path, obj):
    import torch

    with atomic_path(path) as temp_path:
        torch.save(obj, temp_path)

"""Safe file writes: atomic (temp file + rename), locked read-modify-write, no leftovers.

A reader never sees a half-written file: every write goes to a temp file in the target's folder
that is renamed over the target only once it is complete. A write killed before the rename
leaves its temp file behind; the next write in that folder removes it. Temp names carry a
marker, a host tag and the writer's pid, so only temps of our own writers that no longer run
are removed, never another file and never a write in progress.
"""

import errno
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pandas as pd

from perinstance.errors import OutOfSpace, UsageError

TEMP_PREFIX = ".tmp-perinstance-"
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# .tmp-perinstance-<host tag>-<pid>-<random>-<target name>
TEMP_PATTERN = re.compile(r"^\.tmp-perinstance-([0-9a-f]{8})-(\d+)-[0-9a-f]{8}-.+$")
# Earlier versions wrote .tmp-<8 mkstemp characters><target name>; only names of files we write qualify.
LEGACY_TEMP_PATTERN = re.compile(r"^\.tmp-[a-z0-9_]{8}(step_\d{7}\.pt|run\.json|.+\.csv|.+\.md|.+\.png)$")
# The writer of another host's temp cannot be asked whether it runs; a temp untouched this long is dead.
FOREIGN_TEMP_SECONDS = 24 * 3600
# Target names are cut to this length inside temp names, which must stay under the 255-byte limit.
TEMP_NAME_PART = 64
# errno values that mean "the disk, the quota or the file-size limit (RLIMIT_FSIZE) is full".
NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


# --- folders ----------------------------------------------------------------------------------

def check_folder(directory: str, flag: str | None = None) -> None:
    """Refuse a destination folder that we could not write in or create, creating nothing.

    One-line UsageError naming `flag` and the path: a regular file where the folder (or one of
    its parents) should be, or a read-only folder (the nearest one that exists, for a missing folder).
    """
    directory = directory or "."
    if os.path.isdir(directory):
        if not os.access(directory, os.W_OK | os.X_OK):
            raise UsageError(flag, f"cannot write in folder {directory}: it is read-only")
        return
    if os.path.lexists(directory):
        raise UsageError(flag, f"{directory} is a file, not a folder")
    ancestor = _existing_ancestor(directory)
    if not os.path.isdir(ancestor):
        raise UsageError(flag, f"cannot create folder {directory}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(flag, f"cannot create folder {directory}: {ancestor} is read-only")


def check_output(path: str, flag: str | None = None) -> None:
    """Refuse an output file that could not be written, creating nothing (its missing folders are created when it
    is written, atomic_path): a folder where the file goes, or a folder of its path that check_folder refuses."""
    if os.path.isdir(path):
        raise UsageError(flag, f"{path} is a folder; give the output a file name")
    check_folder(os.path.dirname(os.path.abspath(path)), flag)


def writable_folder(directory: str, flag: str | None = None) -> None:
    """check_folder, then create the folder if it is missing."""
    directory = directory or "."
    check_folder(directory, flag)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise UsageError(flag, f"cannot create folder {directory}: {error.strerror or error}") from None


def _existing_ancestor(directory):
    """The nearest parent of `directory` that exists, spelled as the user gave it."""
    path = os.path.normpath(directory)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent in ("", path):
            return "."
        path = parent
    return path


# --- temp files of killed writes ----------------------------------------------------------------

@contextmanager
def removing_new_files(folder: str, when: type[BaseException]) -> Iterator[None]:
    """Within the block: where it raises `when`, what the block made in `folder` is removed, and nothing else:
    each file it created or replaced (a path that did not exist, or is another file now), then each folder it
    created that is empty then, `folder` and its parents included."""
    folder = os.path.normpath(folder)
    before = _identities(folder)
    missing, path = [], folder  # folder and the parents that do not exist yet, deepest first
    while not os.path.lexists(path):
        missing.append(path)
        if os.path.dirname(path) in ("", path):
            break
        path = os.path.dirname(path)
    try:
        yield
    except when:
        after = _identities(folder)
        for path in sorted(after, reverse=True):  # deepest first: a folder's files before the folder
            if after[path] != before.get(path) and not os.path.isdir(path):
                os.unlink(path)
            elif after[path] != before.get(path) and not os.listdir(path):
                os.rmdir(path)
        for path in missing:
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        raise


def _identities(folder):
    """{path: identity} of `folder` and everything below it: a file's device, inode, size and modification time, a
    folder's device and inode (a folder made again is another)."""
    identities = {}
    for directory, _, names in os.walk(folder):
        for path in [directory, *(os.path.join(directory, name) for name in names)]:
            try:
                status = os.lstat(path)
            except FileNotFoundError:
                continue
            identities[path] = (status.st_dev, status.st_ino) if stat.S_ISDIR(status.st_mode) else \
                (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)
    return identities


def remove_stale_temps(directory: str) -> list[str]:
    """Remove the temps that our killed writes left in `directory`; returns their names.

    A temp is stale when its writer (same host, pid in the name) no longer runs, when it comes
    from another host and is older than a day, or when it has the name format of earlier
    versions. Files of any other name are never touched.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        path = os.path.join(directory, name)
        if _is_stale_temp(name, path):
            try:
                os.remove(path)
            except OSError:  # removed by another writer meanwhile, or a read-only folder: leave it
                continue
            removed.append(name)
    return removed


def _is_stale_temp(name, path):
    match = TEMP_PATTERN.match(name)
    if match is None and (name.startswith(TEMP_PREFIX) or not LEGACY_TEMP_PATTERN.match(name)):
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        return False
    if match is None:
        return True  # the legacy format, written by a version that no longer runs
    host, pid = match.group(1), int(match.group(2))
    if host != HOST_TAG:
        return time.time() - info.st_mtime > FOREIGN_TEMP_SECONDS
    return pid != os.getpid() and not _process_runs(pid)


def _process_runs(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


# --- atomic writes ------------------------------------------------------------------------------

def write_error(path: str, error: OSError, flag: str | None = None) -> UsageError:
    """The UsageError for an OSError raised while writing `path`."""
    if error.errno in NO_SPACE:
        return OutOfSpace(path)
    return UsageError(flag, f"cannot write {path}: {error.strerror or error}")


@contextmanager
def atomic_path(path: str, flag: str | None = None) -> Iterator[str]:
    """Yield a temporary path next to `path`; rename it over `path` only on success.

    Creates the folder if needed and first removes the stale temps in it. Any OSError (a full
    disk, a read-only folder) becomes a one-line UsageError naming `path` (and `flag`); the
    previous `path` is untouched and no temp file is left.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    writable_folder(directory, flag)
    remove_stale_temps(directory)
    temp_path = os.path.join(directory, f"{TEMP_PREFIX}{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}-"
                                        f"{os.path.basename(path)[:TEMP_NAME_PART]}")
    try:
        # Created like a plain open() would (0666 less the umask), and never over another file.
        os.close(os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as error:
        raise write_error(path, error, flag) from None
    try:
        yield temp_path
        os.replace(temp_path, path)
    except OSError as error:
        raise write_error(path, error, flag) from None
    finally:
        if os.path.lexists(temp_path):
            os.remove(temp_path)
    _sync_folder(directory)


def _sync_folder(directory):
    """Make the rename durable (best effort: some file systems cannot open a folder)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def write_bytes(path: str, data: bytes, flag: str | None = None) -> None:
    with atomic_path(path, flag) as temp_path:
        with open(temp_path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def write_text(path: str, text: str, flag: str | None = None) -> None:
    write_bytes(path, text.encode("utf-8"), flag)


def write_json(path: str, data: object, flag: str | None = None) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n", flag)


# Floats are written with ten significant digits, so that the bytes are stable.
CSV_FLOAT_FORMAT = "%.10g"


def csv_text(frame: pd.DataFrame) -> str:
    """A pandas DataFrame as CSV text, floats in CSV_FLOAT_FORMAT (NaN as an empty field).

    The same bytes as `frame.to_csv(float_format=CSV_FLOAT_FORMAT)`, faster: a float64 column's distinct values
    (told apart by their bits, so that -0.0 stays -0) are formatted once each. A result file repeats its
    configuration on every row, and pandas formats every cell."""
    columns = {}
    for position, (_, values) in enumerate(frame.items()):
        if values.dtype == np.float64:
            codes, distinct_bits = pd.factorize(values.to_numpy().view(np.int64))
            texts = np.array([CSV_FLOAT_FORMAT % value if value == value else ""
                              for value in distinct_bits.view(np.float64)] or [""], dtype=object)
            values = pd.Series(texts[codes], index=values.index, dtype=object)
        columns[position] = values
    formatted = pd.DataFrame(columns, index=frame.index)
    formatted.columns = frame.columns
    return formatted.to_csv(index=False, float_format=CSV_FLOAT_FORMAT, lineterminator="\n")


def write_csv(path: str, frame: pd.DataFrame, flag: str | None = None) -> None:
    write_text(path, csv_text(frame), flag)


def save_torch(path: str, obj: object, flag: str | None = None) -> None:
    """torch.save atomically; serialised in memory first so that a full disk is an OSError we can name."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes(path, buffer.getvalue(), flag)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- locked read-modify-write ---------------------------------------------------------------------

def lock_path(path: str) -> str:
    return os.fspath(path) + ".lock"


@contextmanager
def locked(path: str, flag: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock for `path` (fcntl.flock on `<path>.lock` beside it).

    Every process that reads, merges into and rewrites `path` does it inside this block, so
    concurrent writers (two measurements, the ranks of one torchrun) never lose each other's
    rows. The kernel releases the lock when its process dies, so a killed writer never leaves
    it held. Not re-entrant: do not nest two blocks for the same path in one process.
    """
    lock = lock_path(path)
    writable_folder(os.path.dirname(os.path.abspath(lock)), flag)
    try:
        handle = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        raise write_error(lock, error, flag) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)

"""Spreading work over the processes that torchrun starts, on CPUs (Gloo) or GPUs (NCCL).

    torchrun --nproc-per-node K train_dpsgd.py --seeds 0-15 ...
    torchrun --nproc-per-node K compute_sensitivity.py ...

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK in every process it starts; a plain `python`
start is rank 0 of a world of 1. Work is split by a fixed rule (`share`: item i goes to rank
i mod W), so a rank needs no scheduler, and every rank writes only its own files. The process
group is used for two things: rank 0 decides what is left to do and sends that list to the
others (`from_rank0`), so that all ranks split the same list even while a fast rank is already
writing its parts; and a run whose tracked points the ranks share is gone through in lockstep
(tracking.py): rank 0 sends its parameters before each step and gathers the values at each
checkpoint, and before each of these it tells the others to go on or to stop with its error.
"""

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd
import torch

from perinstance.errors import UsageError
from perinstance.files import fileio, storage

DEVICE_CHOICES = "cpu, cuda, cuda:N or auto"
# How long a rank waits for rank 0's plan, which may include training the run first. A rank
# that dies does not leave the others waiting this long: torchrun stops them all.
PLAN_TIMEOUT = datetime.timedelta(days=1)
# Whatever every rank holds alike: an item shared out, the value rank 0 computes.
Shared = TypeVar("Shared")


@dataclass(frozen=True)
class World:
    """This process's place among the processes of one launch."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    launched: bool = False  # started by torchrun (even a world of 1)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "World":
        environ = os.environ if environ is None else environ
        if "WORLD_SIZE" not in environ:
            return cls()
        try:
            rank, size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
            local_rank = int(environ.get("LOCAL_RANK", rank))
        except (KeyError, ValueError):
            raise UsageError(None, "WORLD_SIZE is set but RANK/LOCAL_RANK are missing or not integers; "
                                   "start with torchrun, or unset WORLD_SIZE") from None
        if not 0 <= rank < size:
            raise UsageError(None, f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={size})")
        return cls(rank, size, local_rank, launched=True)

    @property
    def label(self) -> str:
        """`rank R/W`, the start of every rank's summary line."""
        return f"rank {self.rank}/{self.size}"

    def share(self, items: Iterable[Shared]) -> list[Shared]:
        """This rank's items of a list that every rank holds in the same order (item i → rank i mod W)."""
        return list(items)[self.rank::self.size]


def resolve_device(text: str, world: World | None = None) -> str:
    """The torch device a `--device` value means for this process.

    auto: CUDA when present, else CPU. Under torchrun, `cuda` and `auto` mean this process's
    own GPU, cuda:LOCAL_RANK. Anything else is returned as given (training checks it).
    """
    world = World.from_env() if world is None else world
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cuda" and world.launched:
        if torch.cuda.is_available() and world.local_rank >= torch.cuda.device_count():
            raise UsageError("--device", f"process {world.local_rank} of this node has no GPU of its own "
                                         f"({torch.cuda.device_count()} GPUs): start at most that many processes")
        text = f"cuda:{world.local_rank}"
    return text


def device_flag(text: str) -> str:
    """argparse `type` of --device: one of DEVICE_CHOICES, with "auto" and (under torchrun) "cuda"
    resolved to a device."""
    text = text.strip().lower()
    if not re.fullmatch(r"cpu|cuda(:\d+)?|auto", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (allowed: {DEVICE_CHOICES})")
    return resolve_device(text)


def make_deterministic(device: str | torch.device) -> None:
    """Same seeds, same results on one device type: on CUDA, turn off the nondeterministic
    cuDNN algorithm search and TF32 rounding, and fix cuBLAS's workspace (CPU needs nothing)."""
    if not str(device).startswith("cuda"):
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@contextmanager
def process_group(world: World, device: str | torch.device) -> Iterator[None]:
    """torch.distributed's process group for a torchrun launch of more than one process
    (NCCL when this rank computes on a GPU, Gloo otherwise); nothing for a single process."""
    if world.size == 1:
        yield
        return
    import torch.distributed as dist

    on_gpu = str(device).startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=PLAN_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def from_rank0(world: World, compute: Callable[[], Shared]) -> Shared:
    """`compute()` run on rank 0 only, its value given to every rank.

    A UsageError on rank 0 is raised on every rank, so that all of them stop with the same
    one-line message instead of waiting for a plan that never comes.
    """
    if world.size == 1:
        return compute()
    import torch.distributed as dist

    message = [None]
    if world.rank == 0:
        try:
            message = [("value", compute())]
        except UsageError as error:
            message = [("error", (error.flag, error.message))]
    dist.broadcast_object_list(message, src=0)
    kind, payload = message[0]
    if kind == "error":
        raise UsageError(*payload)
    return payload


# --- lockstep: ranks that follow rank 0 through one run ------------------------------------------

def rank0_says_go(world: World, error: UsageError | None = None) -> None:
    """Before each collective of a lockstep, rank 0 tells the others to go on (`error` None) or to stop with its
    one-line error, which each of them then raises: a rank that waits is never left waiting for rank 0."""
    import torch.distributed as dist

    message = [None if error is None else (error.flag, error.message)]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None and world.rank:
        raise UsageError(*message[0])


def broadcast_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Each of `tensors` (the same shapes on every rank) overwritten in place by rank 0's."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def gather_to_rank0(world: World, value: Shared) -> list[Shared] | None:
    """Every rank's `value`, in rank order, on rank 0; None on the others."""
    import torch.distributed as dist

    gathered = [None] * world.size if world.rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


# --- per-rank parts of one result file, merged once ---------------------------------------------

@dataclass(frozen=True)
class Item:
    """One unit of work: `points` at checkpoint `step`; `wanted` lists, per direction, the points
    whose rows the result file lacks; `blocks`, the Monte-Carlo blocks it measures (empty: all,
    or none to split). Its key names its part file."""

    step: int
    points: tuple
    wanted: tuple  # ((direction, (point, ...)), ...)
    blocks: tuple = ()

    @property
    def key(self) -> str:
        blocks = [list(self.blocks)] if self.blocks else []
        digest = hashlib.sha256(json.dumps([self.step, self.points, self.wanted, *blocks]).encode()).hexdigest()[:12]
        block_text = f"_blocks_{self.blocks[0]}-{self.blocks[-1]}" if self.blocks else ""
        return f"step_{self.step:07d}_points_{self.points[0]}-{self.points[-1]}{block_text}_{digest}"


def plan_items(step: int, missing: Mapping[str, Sequence[int]], part_points: int, blocks: int = 0) -> list[Item]:
    """The items of one checkpoint: the points that lack rows in any direction (`missing`:
    {direction: points}), in consecutive chunks of `part_points`; with `blocks` > 0 Monte-Carlo
    blocks, one item per chunk and block, so that few points with many draws spread over ranks."""
    needed = sorted(set().union(*missing.values()))
    items = []
    for start in range(0, len(needed), part_points):
        chunk = needed[start:start + part_points]
        chunk_set = set(chunk)
        wanted = tuple((direction, tuple(point for point in points if point in chunk_set))
                       for direction, points in sorted(missing.items()))
        wanted = tuple((d, tuple(map(int, p))) for d, p in wanted)
        items += [Item(int(step), tuple(map(int, chunk)), wanted, (block,)) for block in range(blocks)] or \
            [Item(int(step), tuple(map(int, chunk)), wanted)]
    return items


class Parts:
    """The part files of one job (one command's items) for one result file:
    <res-dir>/.parts/<result file name>/<job>/<item key>.parquet.

    Parquet holds exactly what the result file will hold (storage.write_frame), and a part is
    written atomically, so a part file that exists is complete. The job's folder name hashes
    the command's request and points: a rerun of the same command finds the parts of a killed run.
    """

    def __init__(self, result_path: str, job_description: str) -> None:
        job = hashlib.sha256(job_description.encode()).hexdigest()[:16]
        self.root = os.path.join(os.path.dirname(result_path) or ".", ".parts", os.path.basename(result_path))
        self.directory = os.path.join(self.root, job)

    def path(self, item: Item) -> str:
        return os.path.join(self.directory, item.key + storage.PARQUET)

    def has(self, item: Item) -> bool:
        return os.path.exists(self.path(item))

    def write(self, item: Item, frame: pd.DataFrame, flag: str | None = None) -> None:
        storage.write_frame(self.path(item), frame, flag)

    def read(self, items: Sequence[Item]) -> list[pd.DataFrame]:
        return [storage.read_frame(self.path(item)) for item in items]

    def merge_once(self, items: Sequence[Item], merge: Callable[[list[pd.DataFrame]], object],
                   flag: str | None = None) -> bool:
        """If every item's part exists: `merge(frames)` (which writes the result file) and remove
        the parts, all under this result file's parts lock, so that of the ranks that try, only
        the one that finds every part there merges. Returns whether this call merged.

        No items means that the result file holds every row already: the parts of this job that
        a rank killed between writing the result file and removing the parts left are removed."""
        with fileio.locked(self.root, flag):
            if items and not all(self.has(item) for item in items):
                return False
            if items:
                merge(self.read(items))
            if os.path.isdir(self.directory):
                shutil.rmtree(self.directory)
            with suppress(OSError):  # other jobs' parts are still there
                os.rmdir(self.root)
        return bool(items)

"""Which training points a command means: `--points` tokens (indices, ranges, all, random:N) as indices."""

from collections.abc import Sequence

import numpy as np

from perinstance.errors import UsageError
from perinstance.train import sampling


def parse_points(specs: str | Sequence[str], dataset_size: int, seed: int = 0, flag: str = "--points") -> np.ndarray:
    """Point indices from `--points` tokens: `3`, `0-99`, `all`, `random:N` (seeded).

    Returns a sorted array of unique indices in [0, dataset_size).
    """
    if isinstance(specs, str):
        specs = [specs]
    chosen = []
    for spec in specs:
        for token in str(spec).replace(",", " ").split():
            chosen.extend(_parse_point_token(token, dataset_size, seed, flag))
    if not chosen:
        raise UsageError(flag, "no points given (use indices like 0 1 2, ranges like 0-99, all, or random:N)")
    return np.unique(np.asarray(chosen, dtype=np.int64))


def _parse_point_token(token, dataset_size, seed, flag):
    allowed = "allowed: indices like 3, ranges like 0-99, all, random:N"
    if token == "all":
        return range(dataset_size)
    if token.startswith("random:"):
        count = _parse_int(token[len("random:"):], flag, token, allowed)
        if count <= 0 or count > dataset_size:
            raise UsageError(flag, f"{token}: N must be in 1..{dataset_size}")
        rng = sampling.stream_rng(seed, sampling.POINTS_STREAM)
        return rng.choice(dataset_size, size=count, replace=False).tolist()
    if "-" in token[1:]:
        start_text, end_text = token.split("-", 1) if not token.startswith("-") else (token, "")
        start = _parse_int(start_text, flag, token, allowed)
        end = _parse_int(end_text, flag, token, allowed)
        if start > end:
            raise UsageError(flag, f"{token}: range start is after its end")
        _check_index(start, dataset_size, flag)
        _check_index(end, dataset_size, flag)
        return range(start, end + 1)
    index = _parse_int(token, flag, token, allowed)
    _check_index(index, dataset_size, flag)
    return [index]


def _parse_int(text, flag, token, allowed):
    try:
        return int(text)
    except ValueError:
        raise UsageError(flag, f"{token!r} is not a point index ({allowed})") from None


def _check_index(index, dataset_size, flag):
    if not 0 <= index < dataset_size:
        raise UsageError(flag, f"point {index} is out of range 0..{dataset_size - 1}")

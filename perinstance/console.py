"""What the scripts print besides their results: progress bars and warnings, both on stderr."""

import sys

from tqdm import tqdm


def progress_bar(total: int, desc: str) -> tqdm:
    """A progress bar on stderr, shown only on a terminal, gone when done."""
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, disable=None, leave=False)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)

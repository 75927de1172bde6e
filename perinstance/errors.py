"""User-facing errors: one line that names the flag, a non-zero exit, no traceback."""

import sys
from collections.abc import Callable


class UsageError(Exception):
    """Bad input from the user. `flag` names what to fix (e.g. '--batch-size')."""

    def __init__(self, flag: str | None, message: str) -> None:
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag
        self.message = message


class OutOfSpace(UsageError):
    """The disk (or the file-size limit) ran out while writing `path`; the previous file is intact."""

    def __init__(self, path: str) -> None:
        super().__init__(None, f"no space left while writing {path}")
        self.path = path


EXIT_USAGE = 2


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a script's `main(argv)`, turning UsageError into a one-line message and exit 2."""
    try:
        result = main(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        print("interrupted: finished work is saved; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(result or 0)

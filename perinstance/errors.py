"""User-facing errors: one line that names the flag, a non-zero exit, no traceback."""

import os
import sys
import traceback
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
# The files of the user's own code (--model, --dataset and --loss specs, perinstance/train/user_code.py) by absolute
# path, each with {flag: spec} of the specs that named it: an exception raised in them is the user's bug, told in one
# line.
USER_FILES: dict[str, dict[str, str]] = {}
PACKAGE = os.path.dirname(os.path.abspath(__file__))


def describe(error: BaseException, path: str) -> str:
    """`Type: message (file:line)` of an exception raised by user code, on one line: the line is the
    deepest frame in `path`, else the deepest of all."""
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, SyntaxError) and error.lineno is not None:
        where = f" ({error.filename}:{error.lineno})"
    else:
        inside = [frame for frame in frames if frame.filename == path] or frames[-1:]
        where = f" ({inside[-1].filename}:{inside[-1].lineno})" if inside else ""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}{': ' + message if message else ''}{where}"


def user_code_error(error: BaseException) -> str | None:
    """One line for an exception raised in the user's own code (a file of USER_FILES): the flag, the spec, the
    exception and the user's file:line. A file that several specs name (a model, its data and its loss in one
    file) is told by the spec whose function raised, else by all of them. None when no frame of the traceback is
    the user's, or when one of the package's own frames lies below the user's deepest (then the error is the
    package's, raised within the user's call: its traceback is kept)."""
    frames = traceback.extract_tb(error.__traceback__)
    mine = [index for index, frame in enumerate(frames) if os.path.abspath(frame.filename) in USER_FILES]
    if not mine or any(os.path.abspath(frame.filename).startswith(PACKAGE + os.sep) for frame in frames[mine[-1]:]):
        return None
    frame = frames[mine[-1]]
    specs = USER_FILES[os.path.abspath(frame.filename)]
    named = {flag: spec for flag, spec in specs.items() if spec.endswith(f":{frame.name}")}
    specs = named if len(named) == 1 else specs
    return f"{'/'.join(specs)}: {' or '.join(specs.values())} raised {describe(error, frame.filename)}"


def run_main(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run a script's `main(argv)`, turning UsageError, and an exception of the user's own code
    (`user_code_error`), into a one-line message and exit 2."""
    try:
        result = main(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except Exception as error:
        line = user_code_error(error)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:
        print("interrupted: finished work is saved; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(result or 0)

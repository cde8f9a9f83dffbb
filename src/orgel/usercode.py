"""Errors raised by the user's own code, shown as the user's and not as orgel's.

A workload file that does not compile, a workload function that raises, or a
model whose forward or loss fails when orgel first runs it is the user's
error: the command line says which workload failed and shows the frames of the
user's code only (:class:`UserCodeError`). A frame is the user's when its file
is neither orgel's nor Python's or an installed package's (:func:`user_frame`).
An exception whose traceback holds no frame of the user's is orgel's own (or a
library's) and keeps its full traceback.
"""

from __future__ import annotations

import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_ORGEL = str(Path(__file__).resolve().parent)
_LIBRARIES = tuple(sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib",
                                                              "purelib", "platlib")}))


def user_frame(filename: str) -> bool:
    """Whether code in ``filename`` is the user's (not orgel's, Python's or a package's)."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = str(Path(filename).resolve())
    return not path.startswith((_ORGEL, *_LIBRARIES))


class UserCodeError(Exception):
    """The user's code for workload ``spec`` raised ``cause`` (kept as ``__cause__``).

    ``str()`` is a header naming the workload and the error, then the traceback
    of the user's frames only.
    """

    def __init__(self, spec: str, cause: BaseException) -> None:
        self.spec = spec
        self.cause = cause
        frames = [f for f in traceback.extract_tb(cause.__traceback__) if user_frame(f.filename)]
        lines = [f"the workload {spec} failed: {type(cause).__name__}: {cause}"]
        if frames:
            lines.append("Traceback (most recent call last), the workload's frames:")
            lines.extend(s.rstrip("\n") for s in traceback.format_list(frames))
        lines.extend(s.rstrip("\n")
                     for s in traceback.format_exception_only(type(cause), cause))
        super().__init__("\n".join(lines))


def is_users(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the user's code: a frame of the user's in its traceback,
    or a syntax error in a file of the user's."""
    if isinstance(exc, SyntaxError) and exc.filename and user_frame(exc.filename):
        return True
    return any(user_frame(f.filename) for f in traceback.extract_tb(exc.__traceback__))


@contextmanager
def user_code(spec: str, *, diagnoses: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run the user's code for workload ``spec``: what it raises becomes a
    :class:`UserCodeError`, except ``diagnoses`` (orgel's own errors that say what to change)
    and errors with no frame of the user's (orgel's own, kept whole)."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, (UserCodeError, *diagnoses)) or not is_users(exc):
            raise
        raise UserCodeError(spec, exc) from exc

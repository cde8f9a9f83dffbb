"""Failures of a distributed step: what went wrong, on which rank, in which action.

A rank that fails writes one JSON record (``rank{r}.json``) into the directory
named by ``ORGEL_ERROR_DIR`` (set by :func:`orgel.runtime.launch.spawn`) and
exits; the launcher reads every record and prints the root cause once. Under
``torchrun`` (no directory), the rank prints its record to stderr itself.

Two kinds of records:

* ``error``: an exception raised by the rank's own work (a stage, the loss,
  the optimizer). This is a root cause; its traceback is kept.
* ``comm``: a receive, send or collective that timed out or lost its peer.
  Usually a consequence of another rank's failure; its message names the rank,
  the action it was executing and the peer it waited on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ERROR_DIR_ENV = "ORGEL_ERROR_DIR"


class CommFailure(RuntimeError):
    """A receive, send or collective timed out or lost its peer.

    ``peer`` is the rank waited on (``None`` for a collective over a group),
    ``what`` says what was waited for, ``timed_out`` tells a timeout from a
    lost connection.
    """

    def __init__(self, message: str, *, peer: int | None, what: str, timed_out: bool) -> None:
        super().__init__(message)
        self.peer = peer
        self.what = what
        self.timed_out = timed_out


class StepFailure(RuntimeError):
    """A rank could not finish its step; the message names rank, action and peer."""

    def __init__(self, message: str, *, rank: int, action: str, cause: BaseException) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action
        self.cause = cause


class SpawnError(RuntimeError):
    """One or more spawned ranks failed; the message holds the root cause once."""


@dataclass
class FailureRecord:
    """What one rank writes when it fails (plain JSON)."""

    rank: int
    kind: str  # "error" (root cause) or "comm" (timeout / lost peer)
    message: str
    traceback: str
    time: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the transport (timeout, closed connection)."""
    if isinstance(exc, CommFailure):
        return True
    if isinstance(exc, StepFailure):
        return is_comm_error(exc.cause)
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Timed out", "Connection closed", "Connection reset",
                            "pair closure", "timed out", "Broken pipe")
    )


def record_failure(rank: int, exc: BaseException) -> FailureRecord:
    """Build the record for ``exc`` raised on ``rank`` and write/print it."""
    kind = "comm" if is_comm_error(exc) else "error"
    cause = exc.cause if isinstance(exc, StepFailure) and kind == "error" else exc
    tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    message = str(exc) if isinstance(exc, StepFailure) else f"rank {rank}: {exc}"
    record = FailureRecord(rank, kind, message, tb if kind == "error" else "", time.time())
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory:
        path = Path(directory) / f"rank{rank}.json"
        path.write_text(record.to_json())
    else:
        text = record.message if kind == "comm" else f"{record.message}\n{record.traceback}"
        print(f"orgel: {text}", file=sys.stderr, flush=True)
    return record


def read_records(directory: str | Path) -> list[FailureRecord]:
    """All failure records in ``directory``, earliest first."""
    records = []
    for path in sorted(Path(directory).glob("rank*.json")):
        try:
            records.append(FailureRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # a rank died while writing: its exit code still tells
    return sorted(records, key=lambda r: r.time)


def summarize(records: list[FailureRecord], exitcodes: dict[int, int | None]) -> str:
    """One report: the root cause (with traceback) once, then one line per other rank."""
    roots = [r for r in records if r.kind == "error"]
    lines: list[str] = []
    reported = {r.rank for r in records}
    if roots:
        root = roots[0]
        lines.append(root.message)
        lines.append(root.traceback.rstrip())
        others = [r for r in records if r is not root]
    else:
        others = list(records)
    for rank, code in sorted(exitcodes.items()):
        if rank not in reported and code not in (0, None):
            lines.append(f"rank {rank} exited with code {code} without reporting an error "
                         "(killed or crashed)")
    for r in others:
        lines.append(r.message)
    return "\n".join(lines)

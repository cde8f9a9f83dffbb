"""Failures of a distributed step: what went wrong, on which rank, in which action.

Two kinds of failure:

* a root cause: an exception raised by the rank's own work (a stage, the loss,
  the optimizer), or a rank that died; its traceback is kept;
* a consequence (:func:`is_comm_error`): a receive, send or collective that
  timed out or lost its peer, usually because another rank failed; its message
  names the rank, the action it was executing and the peer it waited on.

:func:`describe` turns either into the one line and the traceback that the
local launcher (:class:`orgel.launch.processes.LocalGroup`) puts in its report,
and that a rank under ``torchrun`` prints itself (:func:`report_failure`).
"""

from __future__ import annotations

import re
import sys
import traceback


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


class MemberFailure(RuntimeError):
    """A tensor-parallel member's own work raised where its partners' did not.

    Its partners ran on into a collective this member never joins, so the step
    cannot be dropped as a failure every member shares is: the pipeline stops at
    once. The message is the member's error with the reason; its cause is chained.
    """


class StepAbandoned(StepFailure):
    """Every rank dropped this step after one rank's own work raised (its data's reason).

    Raised on every rank at the end of the step: ``rank`` is the rank whose error
    came first, ``report`` its line and traceback (:func:`describe`), ``cause``
    this rank's own error (on the others :class:`PeerStepFailed`). No rank
    stepped its optimizer; gradients and messages of the step are gone, and the
    pipeline can train on.
    """

    def __init__(self, message: str, *, rank: int, action: str, cause: BaseException,
                 report: tuple[str, str]) -> None:
        super().__init__(message, rank=rank, action=action, cause=cause)
        self.report = report


class PeerStepFailed(RuntimeError):
    """Another rank's work raised during this step: this rank dropped the step with it."""


class NonFiniteLoss(FloatingPointError):
    """A loss is NaN or infinite (``check_finite``): orgel's own finding, whose message says
    where and what to check; reported in one line, without a traceback."""


#: errors whose message is the whole report: orgel found them and says what to change
DIAGNOSES: tuple[type[BaseException], ...] = (NonFiniteLoss,)


class WorkerError(RuntimeError):
    """A local rank raised or died; every rank was stopped. ``rank`` names the root cause's.

    The message holds the root cause once (with its traceback), then one line per
    other rank that reported a consequence.
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class StepError(WorkerError):
    """A step failed on a rank for its data's own reason; every rank dropped that step.

    The pipeline is still usable: no rank changed its parameters or optimizer
    state, and the next ``step`` trains as if this one had not been called.
    ``rank`` is the rank whose error came first; the message holds it once, and
    ``report`` its line and traceback (:func:`describe`).
    """

    def __init__(self, message: str, rank: int, report: tuple[str, str] = ("", "")) -> None:
        super().__init__(message, rank)
        self.report = report


class Reported(RuntimeError):
    """A rank's failure as :func:`describe` put it, raised again where it is reported from
    (``orgel run``'s ranks end on the :class:`StepError` their pipeline raised)."""

    def __init__(self, report: tuple[str, str]) -> None:
        super().__init__(report[0])
        self.report = report

    def __reduce__(self) -> tuple[type[Reported], tuple[tuple[str, str]]]:
        return Reported, (self.report,)


def step_error(rank: int, report: tuple[str, str], call: str = "step") -> StepError:
    """The caller's :class:`StepError` for the ``call`` (``"step"`` or ``"evaluate"``) rank
    ``rank`` failed in (``report``: its :func:`describe` line and traceback)."""
    line, tb = report
    text = f"rank {rank} failed in {call}: {line}"
    if tb:
        text += "\n" + tb.rstrip()
    what = "step" if call == "step" else "pass"
    return StepError(text + f"\nEvery rank dropped this {what} (no parameter or optimizer "
                     "state changed): the pipeline is still usable; fix or skip this batch "
                     "and go on", rank, report)


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the transport (timeout, closed connection)."""
    if isinstance(exc, (CommFailure, PeerStepFailed)):
        return True
    if isinstance(exc, StepFailure):
        return is_comm_error(exc.cause)
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Timed out", "Connection closed", "Connection reset",
                            "pair closure", "timed out", "Broken pipe")
    )


def describe(exc: BaseException) -> tuple[str, str]:
    """``(one line, traceback)`` of a rank's failure: a failed step by its cause, once.

    A step failure (:class:`StepFailure`) wraps the error that stopped it with the
    action it was running; the line gives that error's type and message with the
    action, and the traceback is that error's only. A consequence
    (:func:`is_comm_error`) needs no traceback: its line names the peer, nor does one of
    orgel's own findings (:data:`DIAGNOSES`): its line says what to check.
    """
    if isinstance(exc, Reported):
        return exc.report
    cause = exc.cause if isinstance(exc, StepFailure) else exc
    action = ""
    if isinstance(exc, StepFailure):
        where = str(exc).rsplit(" [while running ", 1)
        action = f" [while running {where[1]}" if len(where) == 2 else ""
    if is_comm_error(exc):
        return f"{cause}{action}", ""
    if isinstance(cause, DIAGNOSES):
        return f"{type(cause).__name__}: {cause}{action}", ""
    return (f"{type(cause).__name__}: {cause}{action}",
            "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)))


def report_failure(rank: int, exc: BaseException) -> None:
    """Print ``exc`` raised on ``rank`` to stderr, as a rank with no launcher above it does
    (under ``torchrun``): one line naming the rank, the traceback for a root cause."""
    line, tb = describe(exc)
    text = f"rank {rank}: {line}" + (f"\n{tb.rstrip()}" if tb else "")
    print(f"orgel: {text}", file=sys.stderr, flush=True)


def transport_reason(exc: BaseException) -> str:
    """The short reason in a gloo/NCCL error (no source path, no advice)."""
    text = str(exc).strip().strip("'\"")
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else repr(exc))
    return text.split(". This is typically")[0]

"""Ctrl-C while the ranks run a call: they finish it, then the caller is interrupted.

A ``KeyboardInterrupt`` raised in the calling process while local ranks run a step
would leave them running it: their answer would then be read as the answer to the next
call (each later ``pipe.step`` returned the loss of the one before and counted its
optimizer steps one call late), and a forward of several graphs would leave its
micro-batch threads half-way. So a pipeline's calls that run on the ranks (``step``,
``evaluate``, ``save``, ``load``) are wrapped in :func:`finishes_first`: the first Ctrl-C
is held until the call is done, and raised then (the call has taken effect: that batch
trained); a second one stops the ranks at once and the pipeline with them (resume from
a checkpoint).

Only where Python's own handler is in force (it raises ``KeyboardInterrupt``) and in the
main thread (the only one a signal handler may be set in): a handler of the caller's own
is left alone, and the caller's handler is back in place after every call.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def held_interrupt(what: str) -> Iterator[None]:
    """Inside: a first SIGINT is held (and raised as ``KeyboardInterrupt`` on leaving), a
    second raises at once."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt
        print(f"orgel: interrupted; the ranks finish {what} first (Ctrl-C again to stop "
              "them now)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if len(received) == 1:  # also where the call raised (its error is the context)
            raise KeyboardInterrupt


def finishes_first(method: F) -> F:
    """A pipeline method that runs on the ranks, under :func:`held_interrupt`; a
    ``KeyboardInterrupt`` that stops it half-way (a second Ctrl-C) stops the ranks too
    (``pipe.kill()``: they were in the middle of it, and nothing can resume it)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with held_interrupt(f"pipe.{method.__name__}"):
            try:
                return method(self, *args, **kwargs)
            except KeyboardInterrupt:  # the call cut half-way (the held one comes after)
                self.kill()
                raise

    return run  # type: ignore[return-value]

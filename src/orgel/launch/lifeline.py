"""No process orgel starts outlives the process that started it.

A rank, a profiling companion or a link benchmark that lost its parent (killed
by SIGKILL, a segfault, a scheduler's SIGTERM) would otherwise run on with
parent id 1, at full speed, forever. Every process orgel starts is tied to its
parent the same way: the parent calls :func:`lifeline` before starting the
child and passes the result to it; the child calls :func:`tie` first thing.

* On Linux the child asks for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``),
  but only when the parent started it from its main thread: the kernel sends
  that signal when the *thread* that started the child ends, and a pipeline
  built in a worker thread must not lose its ranks when that thread returns.
* Then the child checks that its parent is still the process that started it
  (a parent that died before the request was made sends nothing).
* Everywhere (so also after a start from another thread, and on other POSIX
  systems) a watcher thread in the child looks at its parent's id every
  :data:`POLL_S` seconds: another parent (the orphan was adopted) ends the
  child at once with ``os._exit``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass

POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Lifeline:
    """What a child needs to watch its parent (picklable for a spawned child)."""

    parent: int        # the parent's process id
    main_thread: bool  # started from the parent's main thread: PDEATHSIG is safe


def lifeline() -> Lifeline:
    """In the parent, before starting a child: what the child passes to :func:`tie`."""
    return Lifeline(os.getpid(), threading.current_thread() is threading.main_thread())


def tie(line: Lifeline) -> None:
    """In the child, first thing: end this process when the parent that started it ends."""
    if line.main_thread and sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != line.parent:  # the parent died before the request above
        os._exit(1)
    threading.Thread(target=_watch, args=(line.parent,), daemon=True,
                     name="orgel-lifeline").start()


def _watch(parent: int) -> None:
    pause = threading.Event()
    while not pause.wait(POLL_S):
        if os.getppid() != parent:
            os._exit(1)

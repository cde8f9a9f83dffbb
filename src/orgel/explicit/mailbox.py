"""The controller's inbox: what the ranks send the controller of a several-graph forward.

:class:`Mailbox` reads each rank's pipe in its own thread and keeps every
message by ``(kind, key)`` and the rank that sent it until :meth:`Mailbox.get` takes it;
a closed pipe or :meth:`Mailbox.abort` stops every waiter with :class:`Stopped`
(:mod:`orgel.explicit.glued` runs the controller). :class:`RankPipes` is the other way,
the controller's messages to the ranks (``orgel.backend``'s closures send on it too).
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection
from typing import Any


class Stopped(RuntimeError):
    """The step stopped elsewhere (a rank or another micro-batch failed) while this one waited."""


class Mailbox:
    """Messages from the ranks to the controller by ``(kind, key, rank)``; a reader thread per
    rank (data-parallel replicas send the same kinds and keys)."""

    def __init__(self, conns: list[Connection], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._items: dict[tuple[str, Any, int], Any] = {}
        self._cond = threading.Condition()
        self._aborted: str | None = None
        for r, conn in enumerate(conns):
            threading.Thread(target=self._read, args=(r, conn), daemon=True,
                             name=f"orgel-mail{r}").start()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                kind, key, payload = conn.recv()
            except (EOFError, OSError):
                self.abort(f"rank {rank} closed its pipe")
                return
            with self._cond:
                self._items[(kind, key, rank)] = payload
                self._cond.notify_all()

    def abort(self, why: str) -> None:
        with self._cond:
            self._aborted = self._aborted or why
            self._cond.notify_all()

    def get(self, kind: str, key: Any, rank: int, what: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while (kind, key, rank) not in self._items:
                if self._aborted is not None:
                    raise Stopped(f"the step stopped ({self._aborted}) while the "
                                       f"controller waited for {what} from rank {rank}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the controller waited {self.timeout_s:g} s for {what} "
                                       f"from rank {rank}")
                self._cond.wait(left)
            return self._items.pop((kind, key, rank))


class RankPipes:
    """The controller's ends of the ranks' pipes, for sending: one lock per pipe, since
    several threads (one per micro-batch) send to the same rank."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = list(conns)
        self._locks = [threading.Lock() for _ in self.conns]

    def send(self, rank: int, message: tuple[str, Any, Any]) -> None:
        """Send ``message`` to ``rank``; :class:`Stopped` if its process is gone (then its
        own error is the one to report)."""
        try:
            with self._locks[rank]:
                self.conns[rank].send(message)
        except OSError as exc:
            raise Stopped(f"rank {rank} closed its pipe while the controller sent it "
                          f"{message[0]!r}") from exc

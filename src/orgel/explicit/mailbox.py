"""The controller's inbox: what the ranks send the controller of a several-graph forward.

:class:`Mailbox` reads each rank's pipe in its own thread and keeps every
message by ``(kind, key)`` and the rank that sent it until :meth:`Mailbox.get` takes it;
a closed pipe, a rank's ``"failed"`` or :meth:`Mailbox.abort` stops every waiter with
:class:`Stopped` (:mod:`orgel.explicit.glued` runs the controller). A step ends with
every rank's ``"done"`` (:meth:`Mailbox.finish`): nothing of it is still on the way when
:meth:`Mailbox.begin` starts the next. :class:`RankPipes` is the other way,
the controller's messages to the ranks (``orgel.backend``'s closures send on it too).
Under torchrun the pipes are :func:`connect`'s connections (:mod:`orgel.explicit.glued_job`).
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener, Pipe
from typing import Any

from orgel.launch.errors import WorkerError
from orgel.launch.messages import dumps, send


class Stopped(RuntimeError):
    """The step stopped elsewhere (a rank or another micro-batch failed) while this one waited."""


def members(plan: Any) -> list[list[int]]:
    """The processes of each pipeline rank (its ``plan.tp`` tensor-parallel members), by rank:
    the controller's pipes are by process, its messages by rank."""
    return [plan.processes_of(r) for r in range(plan.num_ranks)]


#: what every tensor-parallel member sends the controller, each its own part: the values of
#: its parameters mid-step (:meth:`orgel.explicit.fallback.Fallback.values`)
EVERY_MEMBER = frozenset({"v_values", "p_value"})


class Mailbox:
    """Messages from the ranks to the controller by ``(kind, key, rank)``; a reader thread per
    process (data-parallel replicas send the same kinds and keys).

    ``members``: each pipeline rank's processes (:func:`members`; one each by default). The
    tensor-parallel members of a rank compute the same values and each sends them; member 0
    speaks for the rank, and the others' messages are read and dropped (so that no pipe fills).
    """

    def __init__(self, conns: list[Connection], timeout_s: float,
                 members: list[list[int]] | None = None) -> None:
        self.timeout_s = timeout_s
        self._items: dict[tuple[str, Any, int], Any] = {}
        self._cond = threading.Condition()
        self._aborted: str | None = None  # this step's stop (a failed micro-batch or rank)
        self._closed: str | None = None  # a pipe that closed: every later step stops too
        ranks = members or [[p] for p in range(len(conns))]
        owner = {p: r for r, procs in enumerate(ranks) for p in procs}
        for p, conn in enumerate(conns):
            threading.Thread(target=self._read, args=(p, owner[p], p == ranks[owner[p]][0],
                                                      conn),
                             daemon=True, name=f"orgel-mail{p}").start()

    def _read(self, process: int, rank: int, speaks: bool, conn: Connection) -> None:
        """Keep what ``process`` sends, as rank ``rank``'s; from a member that does not
        speak for its rank (``speaks``), only its own part of the values
        (:data:`EVERY_MEMBER`), whose key names the member."""
        while True:
            try:
                kind, key, payload = conn.recv()
            except (EOFError, OSError):
                with self._cond:
                    self._closed = self._closed or f"process {process} closed its pipe"
                    self._cond.notify_all()
                return
            if kind == "failed":  # its own work failed: it will send nothing more this step
                self.abort(f"process {process}'s work failed")
            if not speaks and kind not in EVERY_MEMBER:
                continue
            with self._cond:
                self._items[(kind, key, rank)] = payload
                self._cond.notify_all()

    def begin(self) -> None:
        """A new step: the last one's stop and messages are gone (it ended with
        :meth:`finish`, so none of them is still on the way)."""
        with self._cond:
            self._aborted = None
            self._items.clear()

    def abort(self, why: str) -> None:
        """Stop this step's waiters (:class:`Stopped`) until :meth:`begin`."""
        with self._cond:
            self._aborted = self._aborted or why
            self._cond.notify_all()

    def finish(self, ranks: int) -> None:
        """Wait for the ``"done"`` each of ``ranks`` ranks sends as its step ends (a
        stopped step's too): the step's last messages from them are in; a stopped step's
        are dropped, and its stop ends (an evaluation may follow before the next step)."""
        for rank in range(ranks):
            self.get("done", None, rank, "the end of its step", stopped=False)
        with self._cond:
            if self._aborted is not None:  # a stopped step: what it left is of no use
                self._aborted = None
                self._items.clear()

    def get(self, kind: str, key: Any, rank: int, what: str, *, stopped: bool = True) -> Any:
        """Take message ``(kind, key)`` of ``rank``, waiting for it (at most the timeout);
        :class:`Stopped` once the step stopped (``stopped=False``: only a closed pipe)."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while (kind, key, rank) not in self._items:
                why = self._closed or (self._aborted if stopped else None)
                if why is not None:
                    raise Stopped(f"the step stopped ({why}) while the "
                                  f"controller waited for {what} from rank {rank}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the controller waited {self.timeout_s:g} s for {what} "
                                       f"from rank {rank}")
                self._cond.wait(left)
            return self._items.pop((kind, key, rank))


class RankPipes:
    """The controller's ends of the ranks' pipes (by process), for sending to a pipeline rank:
    every process of it (``members``, as :class:`Mailbox` takes them) gets the message. One
    lock per pipe, since several threads (one per micro-batch) send to the same rank."""

    def __init__(self, conns: list[Connection], members: list[list[int]] | None = None) -> None:
        self.conns = list(conns)
        self.members = members or [[p] for p in range(len(self.conns))]
        self._locks = [threading.Lock() for _ in self.conns]

    def send(self, rank: int, message: tuple[str, Any, Any]) -> None:
        """Send ``message`` to ``rank``'s processes; :class:`Stopped` if one is gone (then its
        own error is the one to report)."""
        for p in self.members[rank]:
            try:
                with self._locks[p]:
                    send(self.conns[p], message)  # small tensors by value
            except (OSError, TypeError) as exc:  # TypeError: closed by another thread meanwhile
                raise Stopped(f"rank {rank} (process {p}) closed its pipe while the controller "
                              f"sent it {message[0]!r}") from exc

    def send_every(self, message: tuple[str, Any, Any]) -> None:
        """Send ``message`` to every process."""
        for rank in range(len(self.members)):
            self.send(rank, message)

    # -- the end of a step (:class:`orgel.worker.closure.RankInbox` reads both) -----------

    def fail(self, words: str) -> None:
        """This process's part of the step failed (``words``: how): every process's waits
        for it raise, and every rank drops the step. A process already gone is passed
        over (its own error ends the step)."""
        self._tell_every(("fail", None, words))

    def end(self) -> None:
        """This process's part of the step is over: the ranks, past their last action,
        sum the gradients, or drop the step where :meth:`fail` came first."""
        self._tell_every(("end", None, None))

    def _tell_every(self, message: tuple[str, Any, Any]) -> None:
        try:
            self.send_every(message)
        except Stopped:
            pass


# -- torchrun: every process's connections to process 0 ---------------------------------

class ByValue:
    """A connection whose messages are pickled by value.

    :mod:`multiprocessing` pickles tensors with torch's reductions, which hand a
    tensor's memory over as a file descriptor that only a process of the same family
    (forked, sharing its key) can take; torchrun's processes are not one family.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self.conn.send_bytes(dumps(message))

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())  # noqa: S301 - a process of this job

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        """Shut the socket down, then close it: a thread of this process blocked reading
        it wakes (EOF), and the other end sees EOF now. A plain close would do neither while
        such a read is in progress (it holds the socket open), and the process at the
        other end would wait out its timeout."""
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already, or not a socket
            pass
        self.conn.close()


def pipe_here() -> tuple[ByValue, ByValue]:
    """A pipe inside this process (between process 0's controller and its own rank)."""
    here, there = Pipe()
    return ByValue(here), ByValue(there)


def connect(timeout_s: float) -> tuple[list[Any], list[Any]]:
    """Connect every process to process 0; ``(commands, exchanges)``.

    On process 0, by process (index 0 unused: its own rank is in this process); on any
    other, the one connection of each kind to process 0.
    """
    import torch.distributed as dist

    process, world = dist.get_rank(), dist.get_world_size()
    listener = None
    key, address = b"", ("", 0)
    if process == 0:
        key, host = secrets.token_bytes(16), _own_address()
        listener = Listener((host if host == "127.0.0.1" else "", 0), authkey=key)
        address = (host, int(listener.address[1]))
    shared: list[Any] = [address, key]
    dist.broadcast_object_list(shared, src=0)
    if listener is None:
        found = []
        for kind in ("commands", "exchanges"):
            conn = ByValue(Client(tuple(shared[0]), authkey=shared[1]))
            conn.send((process, kind))
            found.append(conn)
        return [found[0]], [found[1]]
    return _accept(listener, world, timeout_s)


def _own_address() -> str:
    """The address other processes reach this one at: 127.0.0.1 where the job runs on one
    machine, else the one this machine reaches torchrun's store from."""
    world = os.environ.get("WORLD_SIZE")
    if os.environ.get("LOCAL_WORLD_SIZE", world) == world:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        return str(s.getsockname()[0])


def _accept(listener: Listener, world: int, timeout_s: float,
            ) -> tuple[list[Any], list[Any]]:
    """Process 0: every other process's two connections, by process."""
    found: dict[tuple[int, str], ByValue] = {}
    failed: list[BaseException] = []

    def accept() -> None:
        try:
            while len(found) < 2 * (world - 1):
                conn = ByValue(listener.accept())
                process, kind = conn.recv()
                found[(int(process), str(kind))] = conn
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    thread = threading.Thread(target=accept, name="orgel-accept", daemon=True)
    thread.start()
    thread.join(timeout_s)
    listener.close()
    if len(found) < 2 * (world - 1):
        missing = sorted({p for p in range(1, world) for k in ("commands", "exchanges")
                          if (p, k) not in found})
        raise WorkerError(f"processes {missing} did not connect to process 0 within "
                          f"{timeout_s:g} s" + (f" ({failed[0]})" if failed else ""), missing[0])
    none: Any = None
    return ([none, *(found[(p, "commands")] for p in range(1, world))],
            [none, *(found[(p, "exchanges")] for p in range(1, world))])

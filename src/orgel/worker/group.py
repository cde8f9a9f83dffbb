"""Local-spawn mode: this process drives worker processes it forked, one per rank.

Piper's single controller, kept small: the calling process (the *controller*)
forks ``num_ranks`` workers on this machine. Each worker joins a gloo process
group on 127.0.0.1, builds its own engine with ``make_engine(rank)`` and then
serves commands ``(method, args)`` sent over a pipe, answering with the return
value or the error. Every command goes to all ranks at once because most of
them (a training step, a checkpoint) need every rank to take part.

Forking (not spawning) is deliberate: the workers inherit the captured graph,
the plan and the stage modules from the controller's memory, so nothing built
by the user (models defined in ``__main__``, lambdas) has to be pickled.

A worker that dies (SIGKILL, out of memory) or raises leaves the others stuck
in a collective, so any failure closes the whole group: the controller kills
every worker it started and raises :class:`WorkerError` naming the rank. Resume
from the last checkpoint with a new pipeline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from orgel.runtime.errors import StepFailure
from orgel.runtime.launch import free_port


class WorkerError(RuntimeError):
    """A worker raised or died; the group is closed. ``rank`` names the first one seen."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def _worker_main(
    rank: int,
    num_ranks: int,
    port: int,
    timeout_s: float,
    threads: int,
    make_engine: Callable[[int], Any],
    conn: Connection,
) -> None:
    # A killed controller must not leave orphans: die with it (Linux only).
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=num_ranks,
            timeout=timedelta(seconds=timeout_s),
        )
        engine = make_engine(rank)
    except BaseException as exc:  # noqa: BLE001 - reported to the controller
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ok", None, ""))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            break
        if method == "__close__":
            conn.send(("ok", None, ""))
            break
        try:
            result = getattr(engine, method)(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the controller
            conn.send(("error", *_report(exc)))
            continue
        conn.send(("ok", result, ""))
    if dist.is_initialized():
        dist.destroy_process_group()


def _report(exc: BaseException) -> tuple[str, str]:
    """``(one line, traceback)`` of a worker's failure: a failed step by its cause, once.

    A step failure (:class:`orgel.runtime.errors.StepFailure`) wraps the error
    that stopped it with the action it was running; the report gives that
    error's type and message with the action, and that error's traceback only.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(exc, StepFailure) and isinstance(cause, BaseException):
        where = str(exc).rsplit(" [while running ", 1)
        action = f" [while running {where[1]}" if len(where) == 2 else ""
        return (f"{type(cause).__name__}: {cause}{action}",
                "".join(traceback.format_exception(cause)))
    return f"{type(exc).__name__}: {exc}", traceback.format_exc()


#: how many ports LocalGroup tries when the one it chose is taken before rank 0 binds it
_PORT_ATTEMPTS = 3


class LocalGroup:
    """``num_ranks`` forked workers, each running ``make_engine(rank)``, driven by :meth:`call`."""

    def __init__(
        self,
        num_ranks: int,
        make_engine: Callable[[int], Any],
        *,
        timeout_s: float = 300.0,
        threads: int | None = None,
    ) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        cores = os.cpu_count() or 1
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        threads = threads or max(1, cores // num_ranks)
        # The port was free when chosen; another process can take it before rank 0 binds
        # it. That is no fault of the run: choose another and start again.
        for attempt in range(_PORT_ATTEMPTS):
            try:
                self._start(free_port(), threads, make_engine)
                return
            except WorkerError as exc:
                if "EADDRINUSE" not in str(exc) or attempt == _PORT_ATTEMPTS - 1:
                    raise

    def _start(self, port: int, threads: int, make_engine: Callable[[int], Any]) -> None:
        ctx = mp.get_context("fork")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._closed = False
        for rank in range(self.num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.num_ranks, port, self.timeout_s, threads, make_engine, child),
                name=f"orgel-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        # A pipeline dropped without close() still stops its workers (at garbage
        # collection, or at interpreter exit at the latest).
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        self._collect(list(range(self.num_ranks)), "start")

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, by rank."""
        return [int(p.pid) for p in self._procs]

    def call(
        self, method: str, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``engine.method(*args, **kwargs)`` on ``ranks`` (all by default); results by rank."""
        if self._closed:
            raise WorkerError("the local ranks are closed; create a new pipeline", -1)
        targets = list(range(self.num_ranks)) if ranks is None else list(ranks)
        for r in targets:
            try:
                self._conns[r].send((method, args, kwargs))
            except (BrokenPipeError, OSError):
                self._fail(f"rank {r} is gone (exit code {self._procs[r].exitcode})", r)
        return self._collect(targets, method)

    def _collect(self, ranks: list[int], what: str) -> list[Any]:
        results: dict[int, Any] = {}
        pending = {self._conns[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in ranks}
        while pending:
            ready = wait(list(pending) + list(sentinels), timeout=self.timeout_s + 30)
            if not ready:
                self._fail(f"ranks {sorted(pending.values())} did not answer {what!r}", -1)
            for obj in ready:
                if obj in pending:
                    r = pending[obj]
                    try:
                        status, value, tb = obj.recv()
                    except (EOFError, OSError):
                        self._fail(self._death(r, what), r)
                    if status == "error":
                        dead = self._dead_peer(exclude=r)
                        if dead is not None:  # the error is a consequence of that death
                            self._fail(self._death(dead, what), dead)
                        self._fail(f"rank {r} failed in {what}: {value}\n{tb}", r)
                    results[r] = value
                    del pending[obj]
                elif sentinels.get(obj) is not None:  # type: ignore[call-overload]
                    r = sentinels.pop(obj)  # type: ignore[call-overload]
                    if self._conns[r] in pending and not self._conns[r].poll():
                        self._fail(self._death(r, what), r)
        return [results[r] for r in ranks]

    def _dead_peer(self, *, exclude: int, grace_s: float = 1.0) -> int | None:
        """A rank (not ``exclude``) that died abnormally (signal, crash), waiting ``grace_s``.

        A rank that reported its own error exits cleanly (code 0) and is not a death.
        """
        others = {self._procs[q].sentinel: q for q in range(self.num_ranks) if q != exclude}
        ready = wait(list(others), timeout=grace_s) if others else []
        for q in sorted(others[s] for s in ready):  # type: ignore[index]
            self._procs[q].join(timeout=1)
            if self._procs[q].exitcode not in (None, 0):
                return q
        return None

    def _death(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        proc.join(timeout=1)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"rank {rank} died during {what} ({how}); resume from the last checkpoint"

    def _fail(self, message: str, rank: int) -> None:
        self.kill()
        raise WorkerError(message, rank)

    def kill(self) -> None:
        """Kill every worker this group started (by process id) and mark the group closed."""
        self._closed = True
        self._finalizer.detach()
        _kill(self._procs)

    def close(self) -> None:
        """Ask the workers to leave the process group and exit; kill any that do not.

        Idempotent; also runs when the group is garbage-collected or the interpreter exits.
        """
        self._closed = True
        self._finalizer()


def _kill(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def _stop_workers(procs: list[Any], conns: list[Connection]) -> None:
    """Ask the workers to leave the process group and exit; kill any that do not."""
    for conn in conns:
        try:
            conn.send(("__close__", (), {}))
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(timeout=10)
    _kill(procs)

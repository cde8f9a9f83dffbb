"""Start the ranks: local processes this one drives, or join a ``torchrun`` job.

One launcher for one machine, :class:`LocalGroup` (Piper's single controller,
kept small): the calling process (the *controller*) starts ``num_ranks``
workers; each joins a process group on 127.0.0.1, builds its engine with
``make_engine(rank)`` and serves commands ``(method, args)`` sent over a pipe,
answering with the return value or the error. Every command goes to all ranks
at once because most of them (a training step, a checkpoint) need every rank.
``orgel.pipeline`` forks its workers, so they inherit the captured graph, the
plan and the stage modules (nothing the user built has to be pickled);
:func:`orgel.launch.spawn.spawn` starts fresh interpreters and runs one function on each.

A failure means the same thing everywhere: the first rank that raises or dies
is the root cause, every worker is killed at once (a rank blocked on a
message from a failed peer would otherwise wait for its timeout) and
:class:`~orgel.launch.errors.WorkerError` reports the cause once. Only when
the first report is a consequence (a peer lost or timed out) does the
controller wait, up to a second, for the cause: a death or another rank's own
error.

:func:`init_from_env` is the same program under ``torchrun`` (many machines):
it reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; there
``torchrun`` stops the other ranks when one exits with an error.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists, and so before orgel makes one. Its functions
# take ``group=group.WORLD`` as a default argument, bound when the module is imported:
# imported after ``init_process_group`` (FSDP, DTensor and torch's sharded tensors import
# it on first use), ten defaults held the group for the life of the interpreter. Then
# ``destroy_process_group`` left gloo's threads running, the group was destroyed while the
# interpreter finalized, and a rank could abort at exit ("terminate called without an
# active exception": torchrun reported a failed job after the script had finished).
import torch.distributed.nn.functional  # noqa: F401, E402  (see above)

from orgel.launch import forkserver
from orgel.launch.devices import backend_for, host, rank_device, resolve_device
from orgel.launch.errors import WorkerError, describe, is_comm_error
from orgel.launch.forks import (
    FORKED_BACKWARD,
    fork_threads,
    forked_backward_fails,
    inductor_in_process,
)
from orgel.launch.lifeline import Lifeline, lifeline, tie
from orgel.launch.messages import send

#: what torchrun tells its ranks (a local group's workers are not torchrun's ranks)
_TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT"}
#: how many ports a group tries when the one it chose is taken before rank 0 binds it
PORT_ATTEMPTS = 3
#: how long the controller waits for a failure's cause after a consequence reached it (s)
CAUSE_GRACE_S = 1.0


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun job (or of any launcher that sets
    torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_from_env(*, backend: str | None = None, timeout: float = 60.0,
                  device: str = "auto") -> tuple[int, int]:
    """Join the job described by torchrun's environment; return ``(rank, world)``.

    ``backend`` by default: :func:`orgel.launch.devices.backend_for` the ``device``
    kind and the ranks on this node."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"not under torchrun: {', '.join(missing)} not set; run with "
                           "torchrun or use orgel.runtime.spawn on one machine")
    if backend is None:
        backend = backend_for(resolve_device(device), int(os.environ.get(
            "LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if backend == "nccl":
        rank_device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    # A group made again in the same processes (a pipeline closed, then orgel.load) meets
    # on torchrun's same store, where the last group's keys are still there: gloo then
    # connected to stale addresses (a hang in 4 of 9 tries). Each group this process makes
    # gets keys of its own; every rank makes its groups in the same order.
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    store.set_timeout(timedelta(seconds=timeout))
    generation = next(_GROUPS)
    dist.init_process_group(backend, store=dist.PrefixStore(f"orgel/group{generation}", store),
                            rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    atexit.register(leave_group)
    return dist.get_rank(), dist.get_world_size()


def leave_group() -> None:
    """Destroy the default process group, if one is left (at the interpreter's exit).

    The group :func:`init_from_env` makes under torchrun outlives the pipeline that made it:
    a pipeline made again in the same processes (``orgel.load`` after ``close``) uses it.
    Destroying gloo's group and making another at once crashed or hung gloo's connect
    now and then (``epoll_ctl`` in its loop, a receive that timed out) under load.
    """
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        from orgel.launch.meshes import forget_meshes

        forget_meshes()
        dist.destroy_process_group()
        gc.collect()  # what a dropped pipeline's cycles still held of gloo ends now too


#: how many process groups :func:`init_from_env` made in this process
_GROUPS = itertools.count()


def watch_stacks() -> None:
    """With ``ORGEL_STACKS=N`` in the environment, print every thread's stack to stderr each
    ``N`` seconds: where a slow start-up or a hang spends its time, in the caller and in
    every process orgel forks (each starts its own watcher: a thread does not survive a
    fork, and ``faulthandler.dump_traceback_later`` would wait forever for the parent's)."""
    import faulthandler
    import threading

    seconds = float(os.environ.get("ORGEL_STACKS") or 0)
    if seconds <= 0:
        return

    def watch() -> None:
        while True:
            time.sleep(seconds)
            print(f"-- orgel: stacks of process {os.getpid()} --", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    threading.Thread(target=watch, name="orgel-stacks", daemon=True).start()


def serve(engine: Any, conn: Connection, idle_s: float | None = None) -> tuple[Any, ...]:
    """Answer the commands ``(method, args, kwargs)`` that come over ``conn`` with what
    ``engine.method(*args, **kwargs)`` returns (or its error) until a message that is no
    command; return that message.

    ``("__close__",)`` is answered before it is returned; a message of another name that
    starts with ``__`` is the caller's own (:mod:`orgel.explicit.glued_job`); a closed
    connection returns ``("__eof__",)``. ``idle_s``: the longest wait for a message
    (TimeoutError after it; None: no limit).
    """
    while True:
        try:
            if idle_s is not None and not conn.poll(idle_s):
                raise TimeoutError(f"no command came within {idle_s:g} s")
            message = conn.recv()
        except (EOFError, OSError):
            return ("__eof__",)
        if message[0] == "__close__":
            _answer(conn, ("ok", None, "", False))
            return tuple(message)
        if message[0].startswith("__"):
            return tuple(message)
        method, args, kwargs = message
        try:
            answer = ("ok", host(getattr(engine, method)(*args, **kwargs)), "", False)
        except BaseException as exc:  # noqa: BLE001 - reported to the controller
            answer = ("error", *describe(exc), is_comm_error(exc))
        if not _answer(conn, answer):
            return ("__eof__",)


def _answer(conn: Connection, answer: tuple[Any, ...]) -> bool:
    """Send ``answer``; False where the controller's end is closed (it stopped the ranks)."""
    try:
        send(conn, answer)
        return True
    except OSError:
        return False


_INHERITED: list[Any] = []  # the forking process's groups: kept, never shut down here


def forget_inherited_group() -> None:
    """In a forked child: drop the process groups the forking process had made, so that
    this process can make its own (a rank that plans, say, forks the ranks that measure
    links). Their connections are the parent's: they are kept alive, never shut down."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    _INHERITED.append(c10d._world)
    c10d._world = c10d._World()
    c10d._unregister_all_process_groups()


def _worker_main(rank: int, num_ranks: int, port: int, timeout_s: float, threads: int,
                 backend: str, log_dir: str | None, make_engine: Callable[[int], Any],
                 conn: Connection, line: Lifeline) -> None:
    tie(line)  # a killed controller leaves no orphans: its ranks end with it
    if mp.get_start_method(allow_none=True) in ("spawn", "forkserver") and \
            "fork" in mp.get_all_start_methods():
        # a spawned child inherits "spawn"; as any Linux process, start others by fork: then
        # the locks its libraries make (tqdm's) are unlinked at once, and a rank killed when
        # another fails leaves no semaphore for the resource tracker to warn about
        mp.set_start_method("fork", force=True)
    if log_dir is not None:  # shown by spawn on success; a failure is reported once instead
        os.dup2(os.open(Path(log_dir) / f"rank{rank}.log",
                        os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    torch.set_num_threads(threads)
    inductor_in_process()
    watch_stacks()  # a forked child has no watchdog thread of its own
    # a group started by a torchrun rank (to measure links while planning) is a world of
    # its own: torchrun's variables would make torch join torchrun's store instead
    for key in [k for k in os.environ if k in _TORCHRUN_VARS or k.startswith("TORCHELASTIC")]:
        del os.environ[key]
    forget_inherited_group()
    try:
        if backend == "nccl":  # one GPU per rank (orgel.launch.devices.backend_for)
            rank_device("cuda", rank)
        store = dist.TCPStore("127.0.0.1", port, num_ranks, rank == 0,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=num_ranks,
                                timeout=timedelta(seconds=timeout_s))
        engine = make_engine(rank)
    except BaseException as exc:  # noqa: BLE001 - reported to the controller
        conn.send(("error", *describe(exc), is_comm_error(exc)))
        return
    conn.send(("ok", None, "", False))
    serve(engine, conn)
    if dist.is_initialized():
        dist.destroy_process_group()


class LocalGroup:
    """``num_ranks`` local workers, each running ``make_engine(rank)``, driven by :meth:`call`.

    ``context``: ``"fork"`` (the workers inherit this process's memory),
    ``"spawn"`` (fresh interpreters: ``make_engine`` must be picklable) or
    ``"forkserver"`` (as fresh, forked from orgel's server, :mod:`orgel.launch.forkserver`:
    seconds faster to start; CPU ranks only).
    ``threads``: intra-op threads per rank (default: the cores shared out; forked workers
    always one, :func:`fork_threads`).
    ``log_dir``: where each rank's stderr goes, if not to this process's.
    ``daemon=False`` lets a worker start processes of its own (the planning process
    measures the links between ranks); its lifeline still ends it with this process, and
    the caller must close the group (at exit Python waits for such a worker).
    """

    def __init__(self, num_ranks: int, make_engine: Callable[[int], Any], *,
                 timeout_s: float = 300.0, threads: int | None = None, context: str = "fork",
                 backend: str = "gloo", log_dir: str | None = None,
                 daemon: bool = True) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout_s}")
        if context == "fork" and forked_backward_fails():
            raise ValueError(FORKED_BACKWARD)
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        threads = (fork_threads(threads) if context == "fork"
                   else threads or max(1, (os.cpu_count() or 1) // num_ranks))
        # The port was free when chosen; another process can take it before rank 0 binds
        # it. That is no fault of the run: choose another and start again.
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._start(free_port(), threads, make_engine, context, backend, log_dir,
                            daemon)
                return
            except WorkerError as exc:
                if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                    raise

    def _start(self, port: int, threads: int, make_engine: Callable[[int], Any], context: str,
               backend: str, log_dir: str | None, daemon: bool = True) -> None:
        ctx: Any = forkserver.Context() if context == "forkserver" else mp.get_context(context)
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self.closed = False
        self._why = ""  # why it was closed, where not by close()
        # a child of the fork server watches the server (its parent) and takes this
        # process's environment (the server's is the one it started with)
        line = forkserver.lifeline() if context == "forkserver" else lifeline()
        env = dict(os.environ) if context == "forkserver" else None
        for rank in range(self.num_ranks):
            parent, child = ctx.Pipe()
            args = (rank, self.num_ranks, port, self.timeout_s, threads, backend, log_dir,
                    make_engine, child, line)
            proc = ctx.Process(target=_worker_main if env is None else forkserver.run_in,
                               name=f"orgel-rank{rank}", daemon=daemon,
                               args=args if env is None else (env, _worker_main, *args))
            with _main_left_alone(make_engine if context != "fork" else None):
                proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        # A group dropped without close() still stops its workers (at garbage
        # collection, or at interpreter exit at the latest).
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        self._collect(list(range(self.num_ranks)), "start", self.timeout_s + 30)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, by rank."""
        return [int(p.pid) for p in self._procs]

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None,
             wait_s: float | None = -1.0, **kwargs: Any) -> list[Any]:
        """Run ``engine.method(*args, **kwargs)`` on ``ranks`` (all by default); results by rank.

        ``wait_s``: how long to wait for the answers (default: the group's timeout
        plus 30 s; ``None``: as long as the ranks run, whose own waits time out).
        """
        if self.closed:
            raise WorkerError(f"the local ranks are closed{self._why}; create a new pipeline", -1)
        targets, told = list(range(self.num_ranks)) if ranks is None else list(ranks), 0
        try:
            for r in targets:
                try:
                    send(self._conns[r], (method, args, kwargs))
                except (BrokenPipeError, OSError):
                    self._fail(targets, method, {r: (self._death(r, method), "", False)}, {})
                told += 1
            return self._collect(targets, method, self.timeout_s + 30 if wait_s == -1.0 else wait_s)
        except BaseException as exc:  # a Ctrl-C half-way: the next call would read its answers
            if told and not isinstance(exc, WorkerError):
                self._why = f" ({method!r} was stopped half-way by {type(exc).__name__})"
                self.kill()
            raise

    def _collect(self, ranks: list[int], what: str, wait_s: float | None) -> list[Any]:
        results: dict[int, Any] = {}
        pending = {self._conns[r]: r for r in ranks}
        sentinels = self._watched(ranks)
        while pending:
            ready = wait(list(pending) + list(sentinels), timeout=wait_s)
            if not ready:
                quiet = sorted(pending.values())
                self._fail(ranks, what, {quiet[0]: (
                    f"gave no answer to {what!r} within {wait_s:g} s (ranks {quiet})", "",
                    False)}, results)
            for r in sorted({pending.get(o, sentinels.get(o)) for o in ready}):  # type: ignore
                if self._conns[r] not in pending:
                    continue
                if not self._conns[r].poll():  # its process ended with nothing to say
                    self._fail(ranks, what, {r: (self._death(r, what), "", False)}, results)
                status, value, tb, consequence = self._receive(r, what)
                if status == "error":
                    self._fail(ranks, what, {r: (value, tb, consequence)}, results)
                results[r] = value
                del pending[self._conns[r]]
        return [results[r] for r in ranks]

    def _receive(self, r: int, what: str) -> tuple[str, Any, str, bool]:
        """Rank ``r``'s answer; a rank whose pipe closed answers with its death."""
        try:
            status, value, tb, consequence = self._conns[r].recv()
        except (EOFError, OSError):
            return "error", self._death(r, what), "", False
        if status == "error":
            value = f"failed in {what}: {value}"
        return status, value, tb, consequence

    def _fail(self, ranks: list[int], what: str, first: dict[int, tuple[str, str, bool]],
              done: dict[int, Any]) -> None:
        """Kill every worker and raise one report: the root cause once, then the others.

        ``first`` maps the first failed rank to ``(what happened, traceback,
        whether it is a consequence)``. A rank's own error is the cause: the
        report goes out at once, with whatever else is already there. After a
        consequence or a death, wait up to :data:`CAUSE_GRACE_S` for the cause
        and for what the other ranks (whose waits a death ends) have to say.
        """
        failures = dict(first)
        others = [r for r in ranks if r not in failures and r not in done]
        own_error = any(not f[2] and f[1] for f in failures.values())
        deadline = time.monotonic() + (0.0 if own_error else CAUSE_GRACE_S)
        while others:
            by_object = {self._conns[r]: r for r in others}
            by_object.update(self._watched(others))
            ready = wait(list(by_object), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for r in sorted({by_object[o] for o in ready}):  # type: ignore[index]
                others.remove(r)
                answer = (self._receive(r, what) if self._conns[r].poll()
                          else ("error", self._death(r, what), "", False))
                if answer[0] == "error":
                    failures[r] = answer[1:]
                    if not answer[3] and answer[2]:  # a rank's own error: the cause is here
                        deadline = time.monotonic()
        self.kill()
        # the cause: a rank's own error (it has a traceback), else a death, else the first
        ranked = sorted(failures, key=lambda r: (failures[r][2], not failures[r][1]))
        root = ranked[0]
        lines = [f"rank {r} {failures[r][0]}" for r in [root, *sorted(set(ranked) - {root})]]
        if failures[root][1]:
            lines.insert(1, failures[root][1].rstrip())
        if others:
            lines.append(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} "
                         f"had not finished {what!r}: stopped")
        raise WorkerError("\n".join(lines), root)

    def _watched(self, ranks: Sequence[int]) -> dict[Any, int]:
        """What ends when a rank's process ends (its sentinel), by rank: waited on beside
        the pipes."""
        return {self._procs[r].sentinel: r for r in ranks}

    def _death(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        proc.join(timeout=1)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"died during {what} ({how}); resume from the last checkpoint"

    def kill(self) -> None:
        """Kill every worker this group started (by process id) and mark the group closed."""
        self.closed = True
        self._finalizer.detach()
        _kill(self._procs)

    def close(self) -> None:
        """Ask the workers to leave the process group and exit; kill any that do not.

        Idempotent; also runs when the group is garbage-collected or the interpreter exits.
        """
        self.closed = True
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


@contextmanager
def _main_left_alone(make_engine: Callable[..., Any] | None) -> Iterator[None]:
    """While a ``spawn`` child starts, keep it from re-running ``__main__``.

    A spawned child imports the parent's main script before it runs anything,
    so a script without an ``if __name__ == "__main__"`` guard (a notebook
    cell, or a training script under torchrun that profiles on rank 0) would
    run again in every child and start children of its own. When the function
    the ranks run lives in an importable module the children never need
    ``__main__``: hide it.
    """
    fn = getattr(make_engine, "args", (make_engine,))[0]  # spawn's partial(Job, fn, ...)
    main = sys.modules.get("__main__")
    if make_engine is None or main is None or getattr(fn, "__module__", "__main__") == "__main__":
        yield
        return
    saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__file__", "__spec__")
                             if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)

"""Start the ranks: spawn local processes, or join a ``torchrun`` job from its environment.

:func:`spawn` runs ``fn(rank, world, *args)`` in ``nranks`` fresh processes on
this machine (rendezvous on 127.0.0.1 at a free port, gloo by default, one
thread per rank unless told otherwise) and returns each rank's result. A rank
that fails writes one failure record (:mod:`orgel.runtime.errors`); the
launcher waits for the others to stop on their own (they time out or see the
lost peer), terminates any that do not, and raises :class:`SpawnError` with the
root cause shown once.

:func:`init_from_env` is the same program under ``torchrun`` (many machines):
it reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orgel.runtime.errors import ERROR_DIR_ENV, SpawnError, read_records, record_failure, summarize


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun job (or of any launcher that sets
    torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_from_env(*, backend: str | None = None, timeout: float = 60.0) -> tuple[int, int]:
    """Join the job described by torchrun's environment; return ``(rank, world)``."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"not under torchrun: {', '.join(missing)} not set; run with "
                           "torchrun or use orgel.runtime.spawn on one machine")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            timeout: float, threads: int | None, backend: str, outdir: str) -> None:
    os.environ[ERROR_DIR_ENV] = outdir
    # the rank's stderr goes to a log (shown by the launcher on success): on failure the
    # report says it once, without N copies of C++ warnings and fx's own printouts
    log = os.open(Path(outdir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        result = fn(rank, world, *args)
        with open(Path(outdir) / f"result{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        # every rank reaches here before any tears down the store it may still read
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then exit
        record_failure(rank, exc)
        _leave(1)  # no teardown: peers blocked on us must see the connection close
    _leave(0)


def _leave(code: int) -> None:
    """Exit now, without destroy_process_group (which can block on a dead peer).

    multiprocessing's finalizers run first (semaphores made by libraries, e.g.
    during capture), so the launcher's resource tracker has nothing to warn about.
    """
    from multiprocessing import util

    sys.stdout.flush()
    try:
        util._run_finalizers(0)  # type: ignore[attr-defined]
    finally:
        os._exit(code)


@contextmanager
def _main_left_alone(fn: Callable[..., Any]) -> Iterator[None]:
    """While processes start, keep the ``spawn`` children from re-running ``__main__``.

    A spawned child imports the parent's main script before it runs anything,
    so a script without an ``if __name__ == "__main__"`` guard (a notebook
    cell, or a training script under torchrun that profiles on rank 0) would
    run again in every child and start children of its own. When ``fn`` lives
    in an importable module the children never need ``__main__``: hide it.
    """
    main = sys.modules.get("__main__")
    if main is None or getattr(fn, "__module__", "__main__") == "__main__":
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


def spawn(fn: Callable[..., Any], nranks: int, *args: Any, timeout: float = 60.0,
          threads: int | None = 1, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, nranks, *args)`` on ``nranks`` local processes; return their results.

    ``fn`` must be importable (module level) and its results picklable.
    ``timeout`` (seconds) is the process group's timeout; raises
    :class:`SpawnError` naming the root cause when any rank fails.
    """
    if not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"nranks must be a positive integer, got {nranks!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="orgel-") as outdir:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, nranks, port, fn, args, timeout,
                                                   threads, backend, outdir), daemon=True)
                 for r in range(nranks)]
        with _main_left_alone(fn):
            for p in procs:
                p.start()
        _join(procs, timeout)
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        if any(c != 0 for c in codes.values()):
            records = read_records(outdir)
            raise SpawnError(summarize(records, codes))
        for r in range(nranks):
            text = (Path(outdir) / f"rank{r}.log").read_text(errors="replace").strip()
            if text:
                print(f"[rank {r}] " + text.replace("\n", f"\n[rank {r}] "), file=sys.stderr)
        results = []
        for r in range(nranks):
            with open(Path(outdir) / f"result{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _join(procs: list[Any], timeout: float) -> None:
    """Wait for every rank; once one fails, give the rest ``timeout`` + 5 s to stop."""
    deadline: float | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if failed and deadline is None:
            deadline = time.monotonic() + timeout + 5.0
        if deadline is not None and time.monotonic() > deadline:
            for p in alive:
                p.terminate()
            for p in alive:
                p.join(5)
            return
        alive[0].join(0.05)

"""Run one function on fresh local processes: :func:`spawn`, on :class:`LocalGroup`."""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orgel.launch import forkserver
from orgel.launch.forks import forks_run_backward
from orgel.launch.processes import LocalGroup


class Job:
    """The engine :func:`spawn` gives each rank: it runs ``fn(rank, world, *args)`` once."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], world: int,
                 rank: int) -> None:
        self.fn, self.args, self.world, self.rank = fn, args, world, rank

    def run(self) -> Any:
        return self.fn(self.rank, self.world, *self.args)


def spawn(fn: Callable[..., Any], nranks: int, *args: Any, timeout: float = 60.0,
          threads: int | None = 1, backend: str = "gloo", context: str | None = None,
          ) -> list[Any]:
    """Run ``fn(rank, nranks, *args)`` on ``nranks`` fresh local processes; their results.

    ``fn`` must be importable (module level) and its arguments and results
    picklable. By default gloo ranks fork from orgel's fork server, which has imported
    torch, orgel and Dynamo once (``context="forkserver"``, :mod:`orgel.launch.forkserver`:
    as fresh, and about 3 s of a core faster to start each; the server starts with the
    first call), and NCCL ranks are fresh interpreters (``context="spawn"``: no import in
    the server can touch a GPU before they do). ``context="fork"`` starts them as
    copies of this process instead (no imports to repeat; only for work on the CPU, since
    a child forked from a process that used CUDA cannot). ``timeout`` (seconds) is the process
    group's timeout. A failing
    rank stops them all: :class:`~orgel.launch.errors.WorkerError` names the
    root cause. Each rank's stderr is printed, prefixed, once all succeeded.
    """
    if context is None:
        context = "forkserver" if backend == "gloo" and forkserver.available() else "spawn"
    if context == "fork" and not forks_run_backward():
        # this process ran CUDA (the planning process of CUDA ranks, which then times the
        # runtime and the links on the CPU), or autograd's engine here started threads a
        # fork does not copy: a forked child's backward would fail
        context = "spawn"
    with tempfile.TemporaryDirectory(prefix="orgel-") as logs:
        group = LocalGroup(nranks, functools.partial(Job, fn, args, nranks), timeout_s=timeout,
                           threads=threads, context=context, backend=backend, log_dir=logs)
        try:
            results = group.call("run", wait_s=None)
        finally:
            group.close()
        for r in range(nranks):
            text = (Path(logs) / f"rank{r}.log").read_text(errors="replace").strip()
            if text:
                print(f"[rank {r}] " + text.replace("\n", f"\n[rank {r}] "), file=sys.stderr)
    return results

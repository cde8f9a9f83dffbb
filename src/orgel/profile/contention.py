"""Busy companion processes while profiling, so blocks are timed as the ranks will run them.

Ranks train at the same time on the same machine: each competes with the
others (and whatever else runs) for cores, caches and memory bandwidth. A
block timed in a lone process gets more of the machine than a rank does: on a
2-core host shared with other work, the ranks' actions measured about twice
their lone-profile time. :func:`companions` forks ``n`` processes that run
``work`` in a loop (the same blocks' forward and backward) until the body ends,
so the measurement sees the share of the machine a rank gets, whatever the
background load is at that moment.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from typing import Any

from orgel.launch.lifeline import Lifeline, lifeline, tie


def _loop(work: Callable[[], Any], stop: Any, ready: Any, threads: int, line: Lifeline) -> None:
    import torch

    tie(line)  # a profiler killed meanwhile leaves no companion spinning
    torch.set_num_threads(threads)
    work()  # one pass before the parent starts timing
    ready.release()
    while not stop.is_set():
        work()


@contextlib.contextmanager
def companions(n: int, work: Callable[[], Any], *, threads: int = 1,
               timeout: float = 60.0) -> Iterator[None]:
    """Run ``work`` in ``n`` forked processes (``threads`` intra-op threads each) meanwhile."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"companions must be a non-negative integer, got {n!r}")
    if n == 0 or os.name != "posix":
        yield
        return
    ctx = mp.get_context("fork")
    stop, ready = ctx.Event(), ctx.Semaphore(0)
    procs = [ctx.Process(target=_loop, args=(work, stop, ready, threads, lifeline()), daemon=True,
                         name=f"orgel-profile-companion{i}") for i in range(n)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.acquire(timeout=timeout)
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(5.0)

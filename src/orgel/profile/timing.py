"""Timing on the target device: the timer, interleaved rounds, threads and warm-up.

A :class:`Timer` times one ``work(setup())`` (CUDA events on GPUs, CPU and wall
time on the CPU); :func:`interleaved` times many jobs in rounds that each run
every job once, so load that comes and goes on a shared host touches them
alike; :func:`spin_up` wakes the device before any timing.

The profiler times under :func:`intra_op_threads` set to the thread count each
rank will train with (one by default, as the launchers give each rank): a profiling
process left at torch's default (every core) times each op with a thread pool
whose other threads compete with the rest of the machine, and on a shared CPU a
parallel region then waits for a descheduled thread: tiny ops measured 5-40x
their one-thread time (issue 5: a ViT forward profiled at 462 ms against
11.5 ms measured per action on the ranks).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


class Timer:
    """Times a callable on a device: CUDA events on GPUs, ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device, *, warmup: int = 2, repeats: int = 5) -> None:
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def sample(self, setup: Callable[[], Any], work: Callable[[Any], Any]) -> tuple[float, float]:
        """(wall ms, CPU ms) of one ``work(setup())`` (``setup`` is not timed).

        On CUDA both are the events' elapsed time; on CPU the CPU time is the
        process's (every intra-op thread counted).
        """
        state = setup()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            work(state)
            end.record()
            torch.cuda.synchronize(self.device)
            elapsed = float(start.elapsed_time(end))
            return elapsed, elapsed
        t0, c0 = time.perf_counter(), time.process_time()
        work(state)
        return (time.perf_counter() - t0) * 1000.0, (time.process_time() - c0) * 1000.0

    def median(self, setup: Callable[[], Any], work: Callable[[Any], Any]) -> float:
        """ms of ``work(setup())``: ``repeats`` runs after ``warmup`` (see :func:`interleaved`)."""
        return interleaved([{"job": (setup, work)}], self)[0]["job"]


#: A timed job: ``(setup, work)``, ``work(setup())`` timed without ``setup``.
Job = tuple[Callable[[], Any], Callable[[Any], Any]]


def interleaved(jobs: list[dict[str, Job]], timer: Timer, *, progress: str | None = None,
                stats: dict[str, float] | None = None) -> list[dict[str, float]]:
    """ms of every job, sampled in rounds that each run every job once.

    A block timed ``repeats`` times in a row and then the next one sees
    whatever the machine did meanwhile: on a shared host, load that comes and
    goes made identical transformer layers measure 1.1 and 1.6 ms in one
    profile. So every round runs every job once (``warmup`` rounds first, not
    kept), and a job's time is the median of its samples' CPU time (one
    intra-op thread on CPU): what the job's own work takes, which other
    processes' load, coming and going within seconds, leaves nearly alone
    (their wall times swung 1x-7x with the load of a shared 2-core host; a
    profile that kept that swing predicted the next minute's steps no better).
    With several intra-op threads (CPU time counts every thread) and on CUDA
    (events) the median wall time. ``progress``: a progress bar's label
    (None: no bar). ``stats`` (if given) receives ``wall_per_cpu``: all the
    samples' wall time over their CPU time (1 on an idle machine), the share
    of the machine the jobs did not get.
    """
    from tqdm import tqdm

    samples: list[dict[str, list[tuple[float, float]]]] = [{k: [] for k in group}
                                                           for group in jobs]
    rounds = range(timer.warmup + timer.repeats)
    for i in tqdm(rounds, desc=progress, unit="round", disable=progress is None):
        for group, out in zip(jobs, samples, strict=True):
            for key, (setup, work) in group.items():
                pair = timer.sample(setup, work)
                if i >= timer.warmup:
                    out[key].append(pair)
    wall = sum(w for out in samples for v in out.values() for w, _ in v)
    cpu = sum(c for out in samples for v in out.values() for _, c in v)
    if stats is not None:
        stats["wall_per_cpu"] = wall / cpu if cpu > 0 and wall > 0 else 1.0
    which = 1 if cpu > 0 and timer.device.type == "cpu" and torch.get_num_threads() == 1 else 0
    return [{k: float(statistics.median(pair[which] for pair in v)) for k, v in out.items()}
            for out in samples]


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(threads)``, restoring the old count after."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def spin_up(device: torch.device, seconds: float = 0.5) -> None:
    """Run small forward/backward work for ``seconds`` before any timing.

    The first calls in a process are slow for a while (thread pools waking up,
    kernels being picked: ~8 ms for a tiny matmul on a shared CPU here), which
    would inflate whichever block is measured first.
    """
    w = torch.randn(32, 32, device=device, requires_grad=True)
    x = torch.randn(4, 32, device=device, requires_grad=True)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.autograd.grad((x @ w).relu().sum(), (x, w))
    if device.type == "cuda":
        torch.cuda.synchronize(device)

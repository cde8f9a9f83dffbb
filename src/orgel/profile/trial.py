"""Try the measurements that can crash a process in a forked child before timing them.

The split backward's halves (:mod:`orgel.backward`) ask PyTorch's kernels for
what a full backward never asks (a node's parameter gradients without its input's),
and a kernel that gets such a mask wrong can take the whole process down: PyTorch's
CPU GroupNorm backward on a channels-last input wrote the input gradient through a
null pointer and killed the caller of ``orgel.pipeline`` while it profiled. So the
profiler runs each block's ``I`` then ``W`` once in a forked child first
(:func:`trial`); a block whose trial dies or raises is timed with its whole backward
only, and the table says why (:func:`skip_split`).
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from orgel.launch.forks import forks_run_backward
from orgel.launch.lifeline import lifeline, tie


def trial(jobs: list[Callable[[], Any]], *, timeout_s: float = 120.0) -> dict[int, str]:
    """Run every job once, in order, in a forked child: ``{index: why}`` for those that failed.

    A job that raises is reported with its error; one that kills the child
    (a signal) is reported with the signal, and the jobs after it run in a new
    child. Where a forked child could not run them (not POSIX, CUDA in use here, or
    autograd's engine started threads: :func:`orgel.launch.forks.forks_run_backward`)
    the jobs run here and only exceptions are caught. A child still busy after
    ``timeout_s`` is ended and the jobs it had not finished count as passed.
    """
    if not forks_run_backward():
        return _here(jobs)
    failed: dict[int, str] = {}
    start = 0
    while start < len(jobs):
        died, errors = _child(jobs, start, timeout_s)
        failed.update(errors)
        if died is None:
            break
        index, why = died
        failed[index] = why
        start = index + 1
    return failed


def _here(jobs: list[Callable[[], Any]]) -> dict[int, str]:
    failed: dict[int, str] = {}
    for i, job in enumerate(jobs):
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - reported with the block, never raised
            failed[i] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return failed


def _child(jobs: list[Callable[[], Any]], start: int,
           timeout_s: float) -> tuple[tuple[int, str] | None, dict[int, str]]:
    """Jobs ``start..`` in one child: (the job it died in and why, or None; the errors)."""
    line = lifeline()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report each job as it starts, then its error if any
        os.close(read)
        try:
            tie(line)
            faulthandler.disable()  # its death is reported by the parent, in one line
            torch.set_num_threads(1)  # no thread pool in a forked child
            for i in range(start, len(jobs)):
                os.write(write, f"start {i}\n".encode())
                try:
                    jobs[i]()
                except BaseException as exc:  # noqa: BLE001 - sent to the parent
                    text = f"{type(exc).__name__}: {str(exc)[:200]}".replace("\n", " ")
                    os.write(write, f"error {i} {text}\n".encode())
            os.write(write, b"done\n")
        finally:
            os._exit(0)
    os.close(write)
    data, deadline = b"", time.monotonic() + timeout_s
    ready = select.poll()  # not select.select: a busy process's descriptors pass 1024
    ready.register(read, select.POLLIN | select.POLLHUP)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not ready.poll(left * 1000.0):
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(read, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read)
        _, status = os.waitpid(pid, 0)
    lines = data.decode(errors="replace").splitlines()
    errors: dict[int, str] = {}
    current = None
    for text in lines:
        kind, _, rest = text.partition(" ")
        if kind == "start":
            current = int(rest)
        elif kind == "error":
            index, _, why = rest.partition(" ")
            errors[int(index)] = why
    if "done" in lines or current is None or not os.WIFSIGNALED(status):
        return None, errors
    sig = os.WTERMSIG(status)
    if sig == signal.SIGKILL and time.monotonic() >= deadline:
        return None, errors  # ended for taking too long: not a failure of the job
    return (current, f"the process died of {signal.Signals(sig).name} running it"), errors


def skip_split(why: str) -> str:
    """The note a block measured without its split backward carries."""
    return (f"the split backward (I then W) was not timed: {why}; the block's whole "
            "backward stands for its I, and its W for 0")

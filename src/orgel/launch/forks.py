"""What a process forked from this one inherits, and what it cannot use.

orgel forks its local ranks (they inherit the captured graph, the model and the
workload as they are) and some short-lived helpers (a trial of a risky backward, the
planning process of CUDA ranks). A fork copies memory, not threads: GNU OpenMP's pool,
Inductor's compile workers and autograd's device threads stay behind, and a child that
counts on them hangs or fails. :func:`fork_threads`, :func:`inductor_in_process` and
:func:`forks_run_backward` are the rules for that, in one place.
"""

from __future__ import annotations

import os
import sys

import torch


def inductor_in_process() -> None:
    """Let Inductor compile in this forked process's own thread (``compile_threads=1``)
    where its parent used Inductor: the pool of compile workers the parent made is not
    this process's (its threads did not survive the fork), and a compile waits on it for
    ever (a compiled stage's first step in a rank forked from a test process that had
    compiled before). A process that never used Inductor makes its own pool."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = 1  # type: ignore[attr-defined]


def fork_threads(requested: int | None) -> int:
    """Intra-op threads of a worker forked from this process: one.

    PyTorch's CPU wheels run intra-op work on GNU OpenMP, whose thread team does not
    survive a fork: a forked child that starts a parallel region after its parent used
    one waits forever (``torch.nn.functional.layer_norm`` of a 256x48x64 tensor with two
    threads is enough). The caller has always used it by the time ranks fork (the
    capture runs the model), so forked ranks run single-threaded, as PyTorch's own
    DataLoader workers do. ``requested`` above one is refused with a warning; for
    several threads per rank start fresh processes (``orgel run``, ``torchrun``)."""
    if requested is not None and requested > 1:
        import warnings

        warnings.warn(f"threads={requested}: ranks forked from this process run with one "
                      "intra-op thread each (GNU OpenMP hangs in a child forked from a "
                      "process that used it); for more threads per rank, start them with "
                      "torchrun or `orgel run --threads`", stacklevel=3)
    return 1


def forked_backward_fails() -> bool:
    """Whether a process forked from this one would fail its first backward.

    Autograd's engine marks every process forked after it started threads for a device
    ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"): after a backward with a GPU in sight, and with PyTorch's CUDA builds
    after a backward once TorchDynamo compiled anything, GPU or not
    (:func:`orgel.guard.autograd_first`). Nothing tells from here, so a forked child tries
    (a few milliseconds; PyTorch's CPU builds start no such threads).
    """
    if _BAD_FORKS:  # for good, once found
        return True
    if not torch.backends.cuda.is_built():
        return False
    pid = os.fork()
    if pid == 0:  # the child tries one backward and leaves at once
        code = 0
        try:
            with torch.enable_grad():
                torch.ones(1, requires_grad=True).sum().backward()
        except RuntimeError:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 1:
        _BAD_FORKS.append(True)
    return bool(_BAD_FORKS)


_BAD_FORKS: list[bool] = []


def forks_run_backward() -> bool:
    """Whether a child forked from this process can run a backward (and use CUDA): POSIX,
    no CUDA used here, and autograd's engine fit for it (:func:`forked_backward_fails`).
    Where not, work that can be pickled is spawned, and the rest runs here."""
    return os.name == "posix" and not torch.cuda.is_initialized() \
        and not forked_backward_fails()


FORKED_BACKWARD = (
    "autograd cannot run in processes forked from this one: this process ran a backward "
    "after torch.compile (TorchDynamo) compiled something, or with a GPU in sight, and "
    "PyTorch's autograd engine then started threads that a fork does not copy. Build the "
    "pipeline before this process trains anything (orgel.pipeline or orgel.backend near "
    "the top of the script), or start the ranks as fresh processes: `orgel run`, or "
    "torchrun")

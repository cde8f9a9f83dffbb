"""Fault injection through the public API: every fault ends the step with one clear report.

Through ``orgel.pipeline`` (2 local ranks, a 6 s timeout): one good step, then a
fault on a rank during the second step: an exception in a stage (a custom op
that raises), in the loss, in the optimizer; a NaN loss (``check_finite``); a
rank killed (SIGKILL) or stopped (SIGSTOP: hung); a rank that skips a tied
parameter's all-reduce (a collective deadlock).

Each case asserts the message (rank, action, cause, and what to do) and its
bound: 2 s from the fault for an error or a death, the configured timeout
(plus 2 s) for a hung rank or a deadlock; afterwards no worker is left and a new
pipeline in the same process trains. ``benchmarks/faults.py`` prints the times.

The faults switch on when a file exists (the ranks see the same file system),
so the capture and profiling in the calling process never trip them.

The cases of ``orgel run`` (the faulty workload, :data:`CLI_FAULTS`) are defined here
too, beside the API's, since ``benchmarks/faults.py`` imports both from this module;
their tests are in ``test_faults_cli.py``, those of damaged checkpoints in
``test_faults_checkpoints.py``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.launch.errors import WorkerError

pytestmark = pytest.mark.slow  # starts rank processes

TIMEOUT_S = 6.0
#: seconds from the fault to the step's error: at once for an error or a death, the
#: timeout for a rank that hangs or a collective no peer joins
PROPAGATION_S = 2.0
HANG_S = TIMEOUT_S + 2.0


class Injected(RuntimeError):
    """The error a fault raises on purpose."""


_STAGE_FLAG = [Path("/nonexistent/orgel-fault")]  # set by the "stage" case before the fork


@torch.library.custom_op("orgel_faults::tripwire", mutates_args=())
def tripwire(x: torch.Tensor) -> torch.Tensor:
    """The identity, or :class:`Injected` once the stage fault's file exists (a stage op)."""
    if _STAGE_FLAG[0].exists():
        raise Injected("the stage cannot run")
    return x.clone()


@tripwire.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


tripwire.register_autograd(lambda ctx, grad: grad)


class Net(nn.Module):
    """Three layers; ``a`` is used first and last, so the two ranks share it (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(tripwire(h)))
        h = torch.tanh(self.c(h))
        return self.a(h)[:, :4]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _plan() -> orgel.Plan:
    """Stages 0 and 1 on ranks 0 and 1 (1F1B, 2 micro-batches): both read ``a`` (tied)."""
    from orgel.plan.balanced import balanced_plan

    x, _ = _batch()
    plan = balanced_plan(orgel.capture(_model(), (x[:4],)), ranks=2, microbatches=2)
    return plan


def faulty_loss(flag: Path, fault: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if flag.exists() and fault == "loss":
            raise Injected("the loss cannot be computed")
        if flag.exists() and fault == "nan":
            return F.mse_loss(out, y) * float("nan")
        return F.mse_loss(out, y)

    return loss


def faulty_optimizer(flag: Path) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    class Faulty(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            if flag.exists():
                raise Injected("the optimizer cannot step")
            return super().step(closure)

    return lambda params: Faulty(params, lr=0.1)


@contextmanager
def collective_fault(flag: Path) -> Iterator[None]:
    """Once ``flag`` exists, rank 1 skips the tied sums and goes on to the step's last
    all-reduce, while rank 0 waits in the tied one: a deadlock until the timeout."""
    from orgel.runtime.optim import GradSync

    finish = GradSync.finish

    def skipping(self: GradSync, *args: Any, **kwargs: Any) -> Any:
        if flag.exists() and self.rank == 1:
            self.tied = {}
        return finish(self, *args, **kwargs)

    GradSync.finish = skipping  # type: ignore[method-assign]
    try:
        yield
    finally:
        GradSync.finish = finish  # type: ignore[method-assign]


def start(flag: Path, fault: str) -> orgel.Pipeline:
    x, y = _batch()
    optimizer = (faulty_optimizer(flag) if fault == "optimizer"
                 else (lambda p: torch.optim.SGD(p, lr=0.1)))
    _STAGE_FLAG[0] = flag if fault == "stage" else Path("/nonexistent/orgel-fault")
    return orgel.pipeline(_model(), (x,), y, faulty_loss(flag, fault), ranks=2, microbatches=2,
                          optimizer=optimizer, threads=1, timeout_s=TIMEOUT_S, plan=_plan(),
                          check_finite=fault == "nan")


#: what each fault's report says (regular expressions, each must match) and its bound (s)
API_FAULTS: dict[str, tuple[tuple[str, ...], float]] = {
    "stage": ((r"^rank 0 failed in step: Injected: the stage cannot run \[while running F0\.0",),
              PROPAGATION_S),
    "loss": ((r"^rank 1 failed in step: Injected: the loss cannot be computed \[while running "
              r"F1\.0",), PROPAGATION_S),
    "optimizer": ((r"^rank \d failed in step: Injected: the optimizer cannot step",),
                  PROPAGATION_S),
    "nan": ((r"^rank 1 failed in step: NonFiniteLoss: the loss of micro-batch 0 is nan "
             r"\(stage 1\)",), PROPAGATION_S),
    "sigkill": ((r"^rank 1 died during step \(killed by signal 9\); resume from the last "
                 r"checkpoint",), PROPAGATION_S),
    "sigstop": ((rf"^rank 0 failed in step: timed out after {TIMEOUT_S:g} s (waiting for .* "
                 r"from|sending .* to) rank 1 ", r"\nrank 1 had not finished 'step': stopped$"),
                HANG_S),
    # both ranks' waits, in either order: rank 0 in the tied sum, rank 1 past it
    "collective": ((rf"rank 0 failed in step: timed out after {TIMEOUT_S:g} s in the all-reduce "
                    r"of the tied parameter 'a\.(bias|weight)'",
                    rf"rank 1 failed in step: timed out after {TIMEOUT_S:g} s in the all-reduce "
                    r"of the step's loss and gradient norm"), HANG_S),
}


def inject(pipe: orgel.Pipeline, flag: Path, fault: str) -> tuple[str, float]:
    """Train one good step, inject ``fault``, run a step: (its error message, seconds).

    The seconds count from the injection (:func:`time.monotonic` minus them is when).
    """
    x, y = _batch()
    pipe.step((x,), y)
    if fault in ("sigstop", "sigkill"):
        os.kill(pipe.worker_pids[1], signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
    else:
        flag.touch()
    start_s = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pipe.step((x,), y)
    return str(info.value), time.monotonic() - start_s


def run_fault(flag: Path, fault: str) -> tuple[str, float, list[int], float]:
    """Start a pipeline, inject ``fault``, close.

    Returns the error message, the seconds the step took to raise, the worker
    pids and the :func:`time.monotonic` of the injection.
    """
    with collective_fault(flag) if fault == "collective" else _nothing():
        pipe = start(flag, fault)
    pids = pipe.worker_pids
    try:
        message, seconds = inject(pipe, flag, fault)
        injected = time.monotonic() - seconds
    finally:
        pipe.close()
    return message, seconds, pids, injected


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie no one reaped is gone too
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def _trains(flag: Path) -> None:
    """A new pipeline in this process trains (the failure left nothing behind)."""
    flag.unlink(missing_ok=True)
    with start(flag, "none") as again:
        x, y = _batch()
        assert torch.isfinite(torch.tensor(again.step((x,), y)))


@pytest.mark.parametrize("fault", list(API_FAULTS))
def test_a_fault_ends_the_step_with_one_report_and_leaves_nothing_behind(
        fault: str, tmp_path: Path) -> None:
    flag = tmp_path / "fault"
    message, seconds, pids, _ = run_fault(flag, fault)
    patterns, bound = API_FAULTS[fault]
    assert all(re.search(p, message) for p in patterns), message
    assert message.count("Traceback (most recent call last)") == (
        1 if fault in ("stage", "loss", "optimizer") else 0), message
    assert seconds < bound, f"{fault}: the step raised {seconds:.2f} s after the fault"
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "worker processes were left behind"
    _trains(flag)


# -- the CLI: orgel run, its workload failing inside fresh rank interpreters -------------------

FAULTY_WORKLOAD = """
import os, signal, time
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

FAULT, TIMES = {fault!r}, {times!r}
calls = [0, 0]


def _fault_now():
    with open(TIMES, "w") as f:
        f.write(repr(time.time()))


@torch.library.custom_op("orgel_cli_{token}::tripwire", mutates_args=())
def tripwire(x: torch.Tensor) -> torch.Tensor:
    calls[1] += torch.distributed.is_initialized()  # a rank's calls, not the capture's
    if FAULT == "stage" and calls[1] > 2:  # this process's second step (2 micro-batches)
        _fault_now()
        raise RuntimeError("the stage cannot run")
    return x.clone()


@tripwire.register_fake
def _(x):
    return torch.empty_like(x)


tripwire.register_autograd(lambda ctx, grad: grad)


def loss(out, y):
    # a rank's calls on real values (the start-up also calls it on fake tensors, to find
    # which outputs it reads)
    calls[0] += torch.distributed.is_initialized() and not isinstance(out, FakeTensor)
    if calls[0] > 2 and FAULT in ("loss", "nan", "sigkill", "sigstop"):
        _fault_now()
        if FAULT == "loss":
            raise RuntimeError("the loss cannot be computed")
        if FAULT == "nan":
            return F.mse_loss(out, y) * float("nan")
        os.kill(os.getpid(), signal.SIGKILL if FAULT == "sigkill" else signal.SIGSTOP)
    return F.mse_loss(out, y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(tripwire(torch.tanh(self.a(x))))))


def workload():
    torch.manual_seed(0)
    return Net(), (torch.randn(8, 8),), torch.randn(8, 4), loss
"""

#: orgel run's report for each fault of the workload, and its bound
CLI_FAULTS: dict[str, tuple[str, float]] = {
    "stage": (r"\nrank 0 failed in run: RuntimeError: the stage cannot run \[while running F0\.",
              PROPAGATION_S),
    "loss": (r"\nrank 1 failed in run: RuntimeError: the loss cannot be computed \[while "
             r"running F1\.", PROPAGATION_S),
    "nan": (r"\nrank 1 failed in run: NonFiniteLoss: the loss of micro-batch 0 is nan",
            PROPAGATION_S),
    "sigkill": (r"\nrank 1 died during run \(killed by signal 9\)", PROPAGATION_S),
    "sigstop": (rf"\nrank 0 failed in run: timed out after {TIMEOUT_S:g} s (waiting for .* from|"
                r"sending .* to) rank 1", HANG_S),
}


def workload_file(tmp_path: Path, fault: str) -> tuple[str, Path]:
    """A workload file failing with ``fault`` in its second step; (its spec, the fault's
    time file)."""
    times = tmp_path / "fault-time"
    spec = tmp_path / f"faulty_{fault}.py"
    spec.write_text(FAULTY_WORKLOAD.format(fault=fault, times=str(times),
                                           token=os.urandom(4).hex()))
    return f"{spec}:workload", times


def orgel_run(spec: str, *extra: str) -> list[str]:
    return ["run", spec, "--ranks", "2", "--microbatches", "2", "--steps", "3", "--timeout",
            f"{TIMEOUT_S:g}", *extra]

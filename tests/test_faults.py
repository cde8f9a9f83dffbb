"""Fault injection through the public API: every fault ends the step with one clear report.

Each case starts ``orgel.pipeline`` on 2 local ranks, trains one good step, then
injects a fault on a rank during the second step: an exception in the loss, in
the optimizer, a rank stopped with SIGSTOP (hung). The step must raise at once
(the hung rank: once the configured timeout runs out) with a message naming the
rank and the cause; afterwards no worker process is left and a new pipeline in
the same process trains. ``benchmarks/faults.py`` prints the measured times.

The fault switches on when a file exists (the forked ranks see the same file
system), so the capture and profiling in the calling process never trip it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.runtime.errors import WorkerError

pytestmark = pytest.mark.slow  # starts rank processes

TIMEOUT_S = 6.0


class Injected(RuntimeError):
    """The error a fault raises on purpose."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def faulty_loss(flag: Path) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if flag.exists():
            raise Injected("the loss cannot be computed")
        return F.mse_loss(out, y)

    return loss


def faulty_optimizer(flag: Path) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    class Faulty(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            if flag.exists():
                raise Injected("the optimizer cannot step")
            return super().step(closure)

    return lambda params: Faulty(params, lr=0.1)


def start(flag: Path, fault: str) -> orgel.Pipeline:
    x, y = _batch()
    loss = faulty_loss(flag) if fault == "loss" else F.mse_loss
    optimizer = (faulty_optimizer(flag) if fault == "optimizer"
                 else (lambda p: torch.optim.SGD(p, lr=0.1)))
    return orgel.pipeline(_model(), (x,), y, loss, ranks=2, microbatches=2, optimizer=optimizer,
                          threads=1, timeout_s=TIMEOUT_S)


def inject(pipe: orgel.Pipeline, flag: Path, fault: str) -> tuple[str, float]:
    """Train one good step, inject ``fault``, run a step: (its error message, seconds).

    The seconds count from the injection (:func:`time.monotonic` minus them is when).
    """
    x, y = _batch()
    pipe.step((x,), y)
    if fault == "sigstop":
        os.kill(pipe.worker_pids[1], signal.SIGSTOP)
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
    pipe = start(flag, fault)
    pids = pipe.worker_pids
    try:
        message, seconds = inject(pipe, flag, fault)
        injected = time.monotonic() - seconds
    finally:
        pipe.close()
    return message, seconds, pids, injected


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie no one reaped is gone too
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


@pytest.mark.parametrize("fault", ["loss", "optimizer", "sigstop"])
def test_a_fault_ends_the_step_with_one_report_and_leaves_nothing_behind(
        fault: str, tmp_path: Path) -> None:
    flag = tmp_path / "fault"
    message, seconds, pids, _ = run_fault(flag, fault)
    if fault == "sigstop":  # a hung rank: its peer's receive times out, naming it
        assert f"timed out after {TIMEOUT_S:g} s" in message and "rank 1" in message, message
        assert seconds < TIMEOUT_S + 30, seconds  # the configured timeout, not longer
    else:
        assert f"Injected: the {fault} cannot" in message, message
        assert message.count("Traceback (most recent call last)") == 1, message
        assert seconds < TIMEOUT_S, seconds  # at once: no rank waited for its timeout
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "worker processes were left behind"
    # the process stays usable: a new pipeline trains
    flag.unlink(missing_ok=True)
    with start(flag, "none") as again:
        x, y = _batch()
        assert torch.isfinite(torch.tensor(again.step((x,), y)))


FAULTY_WORKLOAD = """
import torch
import torch.nn.functional as F
from torch import nn

calls = [0]


def loss(out, y):
    calls[0] += 1
    if calls[0] > {after}:  # this process's second step
        raise RuntimeError("the loss cannot be computed")
    return F.mse_loss(out, y)


def workload():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, (torch.randn(8, 8),), torch.randn(8, 4), loss
"""


def test_orgel_run_reports_a_failing_loss_once_and_exits_nonzero(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI: the workload's own error, under a header, with the rank and the action."""
    from orgel.cli import main

    spec = tmp_path / "faulty.py"
    spec.write_text(FAULTY_WORKLOAD.format(after=2))  # 2 micro-batches: the second step fails
    start_s = time.monotonic()
    code = main(["run", f"{spec}:workload", "--ranks", "2", "--microbatches", "2",
                 "--steps", "3", "--timeout", str(TIMEOUT_S)])
    seconds = time.monotonic() - start_s
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"orgel run: {spec}:workload failed\nrank 1 failed in run: RuntimeError: "
                          "the loss cannot be computed [while running F1."), err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert seconds < 60, seconds  # no rank waited out a chain of timeouts


def test_a_port_taken_before_rank_0_binds_it_is_replaced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The local ranks meet on a port that was free when chosen; if another process takes it
    first, orgel chooses another; if every try is taken, the error says so."""
    import socket

    import orgel.runtime.launch as controller
    from orgel.runtime.launch import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(controller, "free_port", lambda: next(ports, None) or free_port())
        flag = Path("/nonexistent/orgel-fault")
        with start(flag, "none") as pipe:  # the first port is taken: started on the second
            x, y = _batch()
            assert torch.isfinite(torch.tensor(pipe.step((x,), y)))
        monkeypatch.setattr(controller, "free_port", lambda: taken)
        with pytest.raises(WorkerError, match="EADDRINUSE"):
            start(flag, "none")


def test_a_disk_that_fills_during_save_commits_nothing_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save on a rank fails with ENOSPC: save raises naming the rank and the cause, the
    previous checkpoint stays the latest, no partial file stays, and the pipeline trains and
    saves again once there is room."""
    import errno

    from orgel.runtime import checkpoint as ckpt

    flag = tmp_path / "disk-full"
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if flag.exists() and getattr(f, "name", "").endswith(".partial"):
            f.write(b"PK\x03\x04 half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)  # before the ranks fork: they inherit it
    root = tmp_path / "ckpt"
    x, y = _batch()
    with start(flag, "none") as pipe:
        pipe.step((x,), y)
        first = pipe.save(root)
        pipe.step((x,), y)
        flag.touch()
        with pytest.raises(ckpt.CheckpointError, match=r"saving the checkpoint of step 2 .* "
                           r"failed on rank \d \(OSError: \[Errno 28\] No space left on device\); "
                           r"nothing was committed and .*step-00000001 is still the latest"):
            pipe.save(root)
        assert ckpt.resolve(root) == first
        assert not list(root.rglob("*.partial")) and not (root / "step-00000002.tmp").exists()
        pipe.step((x,), y)  # the ranks are alive and train on
        flag.unlink()
        assert pipe.save(root).name == "step-00000003"

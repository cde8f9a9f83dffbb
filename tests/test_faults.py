"""Fault injection through the public API and the CLI: every fault ends with one clear report.

Through ``orgel.pipeline`` (2 local ranks, a 6 s timeout): one good step, then a
fault on a rank during the second step: an exception in a stage (a custom op
that raises), in the loss, in the optimizer; a NaN loss (``check_finite``); a
rank killed (SIGKILL) or stopped (SIGSTOP: hung); a rank that skips a tied
parameter's all-reduce (a collective deadlock). Through ``orgel run`` (fresh
rank interpreters): the same faults from inside the workload, a port already
taken, a plan that deadlocks, a plan made for another model. Checkpoints: a
truncated shard, a shard replaced by a pickle with code, a disk that fills
during ``save``.

Each case asserts the message (rank, action, cause, and what to do) and its
bound: 2 s from the fault for an error or a death, the configured timeout
(plus 2 s) for a hung rank or a deadlock; afterwards no worker is left and a new
pipeline in the same process trains. ``benchmarks/faults.py`` prints the times.

The faults switch on when a file exists (the ranks see the same file system),
so the capture and profiling in the calling process never trip them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
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
    calls[0] += torch.distributed.is_initialized()
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


def run_cli_fault(tmp_path: Path, fault: str,
                  capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    """``orgel run`` on a workload that fails with ``fault``: (exit code, stderr, seconds
    from the fault to the command's return)."""
    from orgel.cli import main

    spec, times = workload_file(tmp_path, fault)
    extra = ("--check-finite",) if fault == "nan" else ()
    code = main(orgel_run(spec, *extra))
    return code, capsys.readouterr().err, time.time() - float(times.read_text())


@pytest.mark.parametrize("fault", list(CLI_FAULTS))
def test_orgel_run_reports_a_failing_workload_once_and_exits_nonzero(
        fault: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The workload's own error under a header naming it, with the rank and the action."""
    code, err, seconds = run_cli_fault(tmp_path, fault, capsys)
    pattern, bound = CLI_FAULTS[fault]
    assert code == 1
    assert err.startswith(
        f"orgel run: the workload {tmp_path / f'faulty_{fault}.py'}:workload failed\n"), err
    assert re.search(pattern, err), err
    assert err.count("Traceback (most recent call last)") == (
        1 if fault in ("stage", "loss") else 0), err
    assert seconds < bound, f"{fault}: orgel run returned {seconds:.2f} s after the fault"


def test_a_failed_orgel_run_leaves_no_semaphore_behind(tmp_path: Path) -> None:
    """The ranks are killed when one fails; what their libraries registered (tqdm's lock)
    must not make the resource tracker warn at exit (checked in a process of its own)."""
    import subprocess
    import sys

    spec, _ = workload_file(tmp_path, "sigkill")
    code = f"from orgel.cli import main; raise SystemExit(main({orgel_run(spec)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "died during run (killed by signal 9)" in out.stderr
    assert "leaked semaphore" not in out.stderr, out.stderr[-2000:]


def test_orgel_run_refuses_a_plan_that_deadlocks_or_was_made_for_another_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both are refused before any process starts, saying why and what to do."""
    from orgel.cli import main
    from orgel.plan.balanced import balanced_plan
    from orgel.workload import load_workload

    spec, _ = workload_file(tmp_path, "none")
    work = load_workload(spec)
    model, inputs = work.model, work.inputs
    good = balanced_plan(orgel.capture(model, tuple(t[:4] for t in inputs)), ranks=2,
                         microbatches=2)
    deadlock = good.to_dict()
    deadlock["schedule"] = ["F0.0 B0.0 F0.1 B0.1", "F1.0 F1.1 B1.0 B1.1"]
    (tmp_path / "deadlock.json").write_text(json.dumps(deadlock))
    other = balanced_plan(orgel.capture(nn.Sequential(nn.Linear(8, 4), nn.ReLU(),
                                                      nn.Linear(4, 4)), (inputs[0][:4],)),
                          ranks=2, microbatches=2)
    (tmp_path / "other.json").write_text(other.to_json())

    start_s = time.monotonic()
    assert main(orgel_run(spec, "--plan", str(tmp_path / "deadlock.json"))) == 2
    err = capsys.readouterr().err
    assert "deadlock: rank 0 at position 1 (B0.0) waits for gradient of edge 0->1 micro-batch 0 "\
        "from rank 1, which is stuck at position 1 (F1.1); rank 1 at position 1 (F1.1) waits" \
        in err, err
    assert main(orgel_run(spec, "--plan", str(tmp_path / "other.json"))) == 2
    err = capsys.readouterr().err
    assert "the plan does not match this model" in err and "plan again" in err, err
    assert time.monotonic() - start_s < 30  # no rank was started, no timeout waited out


def test_a_port_taken_before_rank_0_binds_it_is_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The local ranks meet on a port that was free when chosen; if another process takes it
    first, orgel chooses another; if every try is taken, the error says so: through the API
    and through orgel run."""
    import orgel.launch.processes as launch
    from orgel.cli import main

    spec, _ = workload_file(tmp_path, "none")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        real = launch.free_port
        ports = iter([taken])
        monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
        flag = Path("/nonexistent/orgel-fault")
        with start(flag, "none") as pipe:  # the first port is taken: started on the second
            x, y = _batch()
            assert torch.isfinite(torch.tensor(pipe.step((x,), y)))
        ports = iter([taken])
        assert main(orgel_run(spec)) == 0
        capsys.readouterr()
        monkeypatch.setattr(launch, "free_port", lambda: taken)
        with pytest.raises(WorkerError, match="EADDRINUSE"):
            start(flag, "none")
        assert main(orgel_run(spec)) == 1
        assert "EADDRINUSE" in capsys.readouterr().err


# -- checkpoints -------------------------------------------------------------------------------


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
        start_s = time.monotonic()
        with pytest.raises(ckpt.CheckpointError, match=r"saving the checkpoint of step 2 .* "
                           r"failed on rank \d \(OSError: \[Errno 28\] No space left on device\); "
                           r"nothing was committed and .*step-00000001 is still the latest"):
            pipe.save(root)
        assert time.monotonic() - start_s < PROPAGATION_S
        assert ckpt.resolve(root) == first
        assert not list(root.rglob("*.partial")) and not (root / "step-00000002.tmp").exists()
        pipe.step((x,), y)  # the ranks are alive and train on
        flag.unlink()
        assert pipe.save(root).name == "step-00000003"


class Payload:
    """What a pickle with code in it would rebuild."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("damage", ["truncated", "code"])
def test_a_damaged_shard_is_refused_by_load_and_by_the_cli_and_changes_nothing(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A shard cut short, or replaced by a pickle with code in it: ``load`` raises naming the
    file, what is wrong and the last complete checkpoint; no rank's state changed and the
    pipeline trains on; ``orgel checkpoint export`` says the same and exits 2."""
    from orgel.cli import main
    from orgel.runtime import checkpoint as ckpt

    root = tmp_path / "ckpt"
    x, y = _batch()
    with start(tmp_path / "no-fault", "none") as pipe:
        pipe.step((x,), y)
        pipe.step((x,), y)
        shard = pipe.save(root) / "rank1.pt"
        if damage == "truncated":
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        else:
            torch.save({"params": Payload()}, shard)
        before = pipe.state_dict()
        start_s = time.monotonic()
        why = ("is incomplete or corrupt" if damage == "truncated"
               else "holds Python objects that weights_only loading refuses")
        with pytest.raises(ckpt.CheckpointError, match=rf"rank 1 cannot resume: .*rank1\.pt "
                           rf"{why}(.|\n)*No rank's state changed; the pipeline is still at "
                           r"step 2"):
            pipe.load(root)
        assert time.monotonic() - start_s < PROPAGATION_S
        after = pipe.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert torch.isfinite(torch.tensor(pipe.step((x,), y)))
    assert main(["checkpoint", "export", str(root), str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err
    assert "rank1.pt" in err and why in err, err
    assert "Traceback" not in err

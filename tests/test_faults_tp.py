"""A stage that raises under tensor parallelism: a dropped step where every member raised,
the pipeline stopped at once where one member did.

The members of a pipeline rank (``tp=2``) run each action together, meeting in its
collectives. Where all of them raise at the same action (the same data: a loss on a
target out of range), every rank drops the step and the pipeline trains on
(:class:`~orgel.StepError`). Where one member raises alone (its own fault: memory, a
device), its partners wait inside a collective it never joins: the step cannot be
dropped, so the pipeline stops and reports that member's error at once, not after
``timeout_s`` (it waited the whole timeout before, and reported a timed-out
all-reduce instead of the cause).
"""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.launch.errors import StepError, WorkerError
from orgel.runtime.comm import MEMBERS_AGREE_S
from test_faults import _gone

pytestmark = pytest.mark.slow  # starts rank processes

TIMEOUT_S = 30.0
_FLAG = [Path("/nonexistent/orgel-tp-fault")]  # set before the ranks fork


@torch.library.custom_op("orgel_faults_tp::tripwire", mutates_args=())
def tripwire(x: torch.Tensor) -> torch.Tensor:
    """The identity; raises once the flag file exists, on the processes it names."""
    who = _FLAG[0].read_text() if _FLAG[0].exists() else ""
    if who and dist.is_initialized() and who in ("all", str(dist.get_rank())):
        raise RuntimeError(f"the stage cannot run (process {dist.get_rank()})")
    return x.clone()


@tripwire.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


tripwire.register_autograd(lambda ctx, grad: grad)


class Block(nn.Module):
    """An MLP region (split by tensor parallelism) with the tripwire before its sum."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(tripwire(F.gelu(self.up(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def start(flag: Path, model: nn.Module) -> orgel.Pipeline:
    """2 pipeline ranks of 2 tensor-parallel members; the tripwire reads ``flag``."""
    _FLAG[0] = flag
    x, y = _batches()[0]
    return orgel.pipeline(model, (x,), y, F.mse_loss, ranks=4, tp=2, microbatches=2,
                          optimizer=_sgd, threads=1, timeout_s=TIMEOUT_S)


def lone_member_fault(pipe: orgel.Pipeline, flag: Path) -> tuple[WorkerError, float]:
    """Process 1 alone raises in a step (its partner waits in the region's all-reduce): the
    step's error and the seconds it took to come."""
    x, y = _batches()[1]
    flag.write_text("1")
    begin = time.monotonic()
    with pytest.raises(WorkerError) as info:
        pipe.step((x,), y)
    return info.value, time.monotonic() - begin


def test_a_member_that_raises_drops_the_step_with_its_partners_or_stops_the_pipeline_at_once(
        tmp_path: Path) -> None:
    flag = tmp_path / "fault"
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    (x0, y0), (x1, y1) = _batches()
    pipe = start(flag, model)
    pids = pipe.worker_pids
    try:
        assert (pipe.plan.num_ranks, pipe.plan.tp) == (2, 2)
        losses = [pipe.step((x0,), y0)]
        flag.write_text("all")  # every member raises at the same action: a dropped step
        with pytest.raises(StepError, match=r"RuntimeError: the stage cannot run"):
            pipe.step((x1,), y1)
        flag.unlink()
        losses.append(pipe.step((x1,), y1))
        state = pipe.state_dict()
        error, seconds = lone_member_fault(pipe, flag)
    finally:
        pipe.close()
    message = str(error)
    assert not isinstance(error, StepError), message
    assert re.search(r"^rank 1 failed in step: MemberFailure: RuntimeError: the stage cannot "
                     r"run \(process 1\).* tensor-parallel member 1 of pipeline rank 0 alone",
                     message), message
    assert "Traceback (most recent call last)" in message, message
    assert seconds < MEMBERS_AGREE_S + 3.0 < TIMEOUT_S, f"reported after {seconds:.1f} s"
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "worker processes were left behind"

    # the dropped step changed nothing: one process trained on the two good batches
    opt = _sgd(list(reference.parameters()))
    ref_losses = []
    for x, y in _batches():
        opt.zero_grad()
        halves = zip(x.chunk(2), y.chunk(2), strict=True)
        loss = sum(F.mse_loss(reference(xm), ym) / 2 for xm, ym in halves)
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        ref_losses.append(float(loss.detach()))  # type: ignore[union-attr]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


"""Ctrl-C in a training loop: the step the ranks are running finishes, then the loop stops.

A notebook user interrupts a loop of ``pipe.step`` and goes on (evaluates, saves, trains
more). Before, the ranks' answer to the interrupted step was read as the answer to the
next call: every later ``step`` returned the loss of the batch before. Now the first
Ctrl-C is held until the step is done (that batch trained), then raised; a second stops
the ranks at once and the pipeline says so. Each test interrupts a real step on forked
ranks by sending this process SIGINT while the call waits on them, and compares with one
process that trained on every batch the ranks did.
"""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import orgel
from orgel.launch.errors import WorkerError

pytestmark = pytest.mark.slow


class Net(nn.Module):
    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.branch and h.sum() > -1e9:  # a graph break: two graphs, Python between
            h = h + 0
        return self.head(torch.relu(self.b(h)))


@pytest.fixture(autouse=True)
def _python_handler() -> Iterator[None]:
    """Python's own SIGINT handler (a test runner's worker may have another)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(4)]


def _reference(model: nn.Module, batches: list[Any]) -> list[float]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _pipeline(model: nn.Module, loss_fn: Any = F.cross_entropy) -> Any:
    x, y = _batches()[0]
    return orgel.pipeline(model, (x,), y, loss_fn, ranks=2, microbatches=2, schedule="1f1b",
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def _interrupt_while_waiting(pipe: Any, signals: int) -> None:
    """The next call that waits on the ranks gets ``signals`` SIGINTs while it waits."""
    group = pipe._ranks
    collect = group._collect

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        del group._collect  # once
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGINT)
        return collect(*args, **kwargs)

    group._collect = interrupted


def test_ctrl_c_in_a_step_finishes_it_and_the_pipeline_trains_on() -> None:
    torch.manual_seed(0)
    model = Net()
    batches = _batches()
    want = _reference(model, batches)
    with _pipeline(model) as pipe:
        got: list[Any] = [pipe.step(*batches[0])]
        _interrupt_while_waiting(pipe, signals=1)
        with pytest.raises(KeyboardInterrupt):
            pipe.step(*batches[1])  # it trained: its loss is lost, its update is not
        got += ["^C"] + [pipe.step(*b) for b in batches[2:]]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert got == [pytest.approx(want[0], rel=1e-5), "^C",
                   *(pytest.approx(w, rel=1e-5) for w in want[2:])]


def test_a_second_ctrl_c_stops_the_ranks_and_the_pipeline_says_so() -> None:
    torch.manual_seed(0)
    batches = _batches()
    pipe = _pipeline(Net())
    pipe.step(*batches[0])
    _interrupt_while_waiting(pipe, signals=2)
    with pytest.raises(KeyboardInterrupt):
        pipe.step(*batches[1])
    assert pipe.closed
    with pytest.raises(WorkerError, match="stopped half-way by KeyboardInterrupt"):
        pipe.step(*batches[2])
    pipe.close()


def test_ctrl_c_in_a_step_with_graph_breaks_finishes_it() -> None:
    """A forward of several graphs: the interrupt arrives while this process runs a
    micro-batch's loss (its threads and the ranks are in the middle of the step)."""
    torch.manual_seed(0)
    model = Net(branch=True)
    batches = _batches()
    want = _reference(model, batches)
    armed: list[bool] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if armed:
            armed.clear()
            os.kill(os.getpid(), signal.SIGINT)
        return F.cross_entropy(out, y)

    with _pipeline(model, loss_fn) as pipe:
        got: list[Any] = [pipe.step(*batches[0])]
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            pipe.step(*batches[1])
        got += [pipe.step(*b) for b in batches[2:]]
    assert got == [pytest.approx(w, rel=1e-5) for w in [want[0], *want[2:]]]


def test_ctrl_c_in_a_backend_step_finishes_it() -> None:
    """``orgel.backend``: the interrupt arrives while a closure runs in this process."""
    torch.manual_seed(0)
    model = Net()
    batches = _batches()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want = []
    for x, y in batches:  # a closure per micro-batch: each one's backward adds its gradient
        losses = [F.cross_entropy(reference(xs), ys)
                  for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True)]
        for loss in losses:
            loss.backward()
        opt.step()
        opt.zero_grad()
        want.append([float(loss.detach()) for loss in losses])
    armed: list[bool] = []
    with orgel.backend(ranks=2, microbatches=2,
                       optimizer=lambda params: torch.optim.SGD(params, lr=0.1)) as pipe:
        compiled = torch.compile(model, backend=pipe)

        def closure(x: torch.Tensor, y: torch.Tensor) -> float:
            if armed:
                armed.clear()
                os.kill(os.getpid(), signal.SIGINT)
            loss = F.cross_entropy(compiled(x), y)
            loss.backward()
            return float(loss.detach())

        got = [pipe.step(closure, *batches[0])]
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            pipe.step(closure, *batches[1])
        got += [pipe.step(closure, *b) for b in batches[2:]]
    assert got == [pytest.approx(w, rel=1e-5) for w in [want[0], *want[2:]]]


def test_ctrl_c_in_a_save_finishes_the_checkpoint(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = Net()
    batches = _batches()
    with _pipeline(model) as pipe:
        pipe.step(*batches[0])
        _interrupt_while_waiting(pipe, signals=1)
        with pytest.raises(KeyboardInterrupt):
            pipe.save(tmp_path)
        want = pipe.state_dict()
    with orgel.load(tmp_path, Net(), (batches[0][0],), batches[0][1], F.cross_entropy,
                    ranks=2, microbatches=2, schedule="1f1b",
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1)) as again:
        got = again.state_dict()
    assert all(torch.equal(got[k], t) for k, t in want.items())


def test_ctrl_c_in_a_step_that_fails_keeps_the_pipeline() -> None:
    """A step that fails on its own (the loss raises; every rank drops it) while a Ctrl-C
    is held: ``KeyboardInterrupt``, from that error, and the pipeline trains on."""
    torch.manual_seed(0)
    model = Net(branch=True)
    batches = _batches()
    want = _reference(model, [batches[0], *batches[2:]])  # the failed step changed nothing
    armed: list[bool] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if armed:
            armed.clear()
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("a bad batch")
        return F.cross_entropy(out, y)

    with _pipeline(model, loss_fn) as pipe:
        got: list[Any] = [pipe.step(*batches[0])]
        armed.append(True)
        with pytest.raises(KeyboardInterrupt) as caught:
            pipe.step(*batches[1])
        assert "a bad batch" in repr(caught.value.__context__)
        assert not pipe.closed
        got += [pipe.step(*b) for b in batches[2:]]
    assert got == [pytest.approx(w, rel=1e-5) for w in want]

"""Micro-batches whose forwards run other graphs than the captured one train exactly.

A forward of several graphs is captured on one micro-batch; a micro-batch that
takes another branch (or, in transformers 4.57's Mixtral, routes its tokens to
other experts) runs whole in the controller on the ranks' values
(:mod:`orgel.explicit.fallback`). Each test trains a few steps through
``orgel.pipeline`` on 2 forked ranks and compares the losses and every tensor with
one process doing the same, micro-batch by micro-batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import orgel


class MeanBranch(nn.Module):
    """``if h.mean() > 0:`` picks one of two layers: each arm reads its own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.up = nn.Linear(16, 16)
        self.down = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.mean() > 0:  # a graph break: the arm differs per micro-batch
            h = self.up(h)
        else:
            h = self.down(h)
        return self.head(torch.relu(h))


def _rows(model: MeanBranch, up: bool, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` rows whose forward takes the ``up`` arm (or the other)."""
    while True:
        x = torch.randn(n, 8, generator=gen) * 3
        with torch.no_grad():
            if bool(torch.tanh(model.a(x)).mean() > 0) == up:
                return x


def _reference(model: nn.Module, batches: list[tuple[Any, torch.Tensor]], m: int,
               loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
               optimizer: Callable[[Any], torch.optim.Optimizer]) -> list[float]:
    """One process: each step's micro-batches in order, loss / m, then the optimizer."""
    opt = optimizer(list(model.parameters()))
    losses = []
    for inputs, y in batches:
        total = 0.0
        rows = y.shape[0] // m
        for i in range(m):
            part = {k: v[i * rows:(i + 1) * rows] for k, v in inputs.items()}
            loss = loss_fn(model(**part), y[i * rows:(i + 1) * rows]) / m
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _check(model: nn.Module, batches: list[tuple[dict[str, torch.Tensor], torch.Tensor]],
           loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], off: list[list[int]] | None,
           m: int = 2) -> None:
    """Train ``batches`` through orgel.pipeline and in one process; compare everything."""
    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    reference = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    inputs, targets = batches[0]
    losses, left = [], []
    with orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=m,
                        optimizer=optimizer, timeout_s=120.0) as pipe:
        for x, y in batches:
            losses.append(pipe.step(x, y))
            left.append(pipe.off_path)
        got = pipe.state_dict()
    expected = _reference(reference, batches, m, loss_fn, optimizer)
    if off is not None:
        assert left == off
    assert losses == pytest.approx(expected, rel=1e-5)
    want = reference.state_dict()
    assert list(got) == list(want)
    for key, t in want.items():
        assert_close(got[key], t, rtol=1e-5, atol=1e-6, msg=key)
    for key, t in model.state_dict().items():  # the caller's model is left as it was
        assert torch.equal(t, before[key]), key


@pytest.mark.slow
def test_microbatches_taking_either_arm_of_a_branch_train_exactly() -> None:
    torch.manual_seed(0)
    model = MeanBranch()
    gen = torch.Generator().manual_seed(1)
    arms = [(True, False), (False, True), (False, False)]  # captured: micro-batch 0, "up"
    batches = []
    for arms_of_step in arms:
        x = torch.cat([_rows(model, up, 4, gen) for up in arms_of_step])
        batches.append(({"x": x}, torch.randint(0, 4, (8,), generator=gen)))
    # the third step runs both micro-batches in the controller: "up" gets no gradient, and
    # AdamW (weight decay) leaves it alone, as in one process
    _check(model, batches, F.cross_entropy, off=[[1], [0], [0, 1]])

"""The closure runner's replicated arguments: ``replicated=[i]`` hands every closure all of one.

Class weights whose size is the batch size, and a table the closure passes to the compiled
model, reach every closure whole, as in one process; a wrong ``replicated`` and a batch
argument of another size are refused, naming them. The shared helpers come from
``test_runner.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel.transparent.backend as ob
from test_runner import (
    M,
    _backend,
    _fresh_dynamo,  # noqa: F401 - autouse: Dynamo reset before each test
    _sgd,
)

pytestmark = pytest.mark.slow


def test_replicated_arguments_reach_every_closure_whole() -> None:
    """Class weights ``[C]`` whose size is the batch size: ``replicated=[2]`` gives every
    closure all of them (they used to be cut like the batch), as one process does."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    ref_opt = _sgd(list(ref.parameters()))
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])  # 4 classes, a batch of 4
    seen: list[torch.Tensor] = []

    def closure_for(net: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            seen.append(w)
            loss = F.cross_entropy(net(x), y, weight=w) / M
            loss.backward()
            return loss.detach()

        return closure

    with pytest.raises(ValueError, match=r"replicated must be a list of step's argument"):
        ob.backend(replicated="w")  # type: ignore[arg-type]
    pipe = _backend(timeout_s=60,
                      replicated=[2])
    with pytest.raises(ValueError, match=r"positions \[2\] but step got 2"):
        pipe.step(closure_for(model), x, y)  # refused before any closure runs
    compiled = torch.compile(model, backend=pipe)
    try:
        for _ in range(2):
            got = pipe.step(closure_for(compiled), x, y, weights)
            ref_opt.zero_grad()
            want = [closure_for(ref)(xm, ym, weights)
                    for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
            ref_opt.step()
            torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5,
                                       atol=1e-6)
        state = pipe.state_dict()
    finally:
        pipe.close()
    assert all(torch.equal(w, weights) for w in seen)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    other = _backend()
    with pytest.raises(ValueError, match=r"argument 2\[dim 0\].*replicated=\[i"):
        other.step(closure_for(model), x, y, weights[:3])  # 3 rows beside 4: named, refused


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x) + table.sum(0)))  # table: (3, 8), not batched


def test_a_replicated_argument_the_closure_passes_to_the_model_goes_whole() -> None:
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g),
                torch.randn(3, 8, generator=g)) for _ in range(2)]
    model = WithTable()
    ref = copy.deepcopy(model)
    ref_opt = _sgd(list(ref.parameters()))

    def closure_for(net: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(net(x, table), y) / M
            loss.backward()
            return loss.detach()

        return closure

    pipe = _backend(timeout_s=60,
                      replicated=[2])
    compiled = torch.compile(model, backend=pipe)
    try:
        for x, y, table in batches:
            got = pipe.step(closure_for(compiled), x, y, table)
            ref_opt.zero_grad()
            want = [closure_for(ref)(xm, ym, table)
                    for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
            ref_opt.step()
            torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5,
                                       atol=1e-6)
        state = pipe.state_dict()
    finally:
        pipe.close()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)

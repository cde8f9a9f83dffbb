"""Parameters shared between stages train exactly, whatever the sharing pattern and placement.

* ALBERT-like sharing, where several tied parameters are seen in a different
  order on each rank: the tied-gradient all-reduces must be issued in one order
  everywhere (they deadlocked until the timeout).
* Both holders of a tied parameter on one rank (an interleaved plan): the
  object is one parameter there, summed once and stepped once (it was stepped
  with twice its gradient, twice).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from archzoo.check import balanced_check
from orgel.models import ZooWorkload


class CrossShared(nn.Module):
    """Blocks a, b, c, d with a's and b's Linear reused in the opposite order at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.c(h))
        h = torch.tanh(self.d(h))
        h = torch.tanh(self.b(h))  # rank 1 meets b's weights before a's
        return self.a(h)


class LoopShared(nn.Module):
    """Four blocks [a, b, a, c]: stages 0 and 2 of an interleaved plan share ``a`` on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.a, self.b, self.a, self.c):
            x = torch.tanh(layer(x) * 1.5 + 0.1)
        return x


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _workload(model_cls: type[nn.Module]) -> ZooWorkload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ZooWorkload(model_cls(), (torch.randn(4, 8, generator=g),),
                       torch.randn(4, 8, generator=g), _mse)


@pytest.mark.slow
def test_tied_parameters_met_in_different_orders_on_each_rank() -> None:
    outcome = balanced_check("cross_shared", lambda: _workload(CrossShared))
    assert outcome.status == "exact", outcome.line()


@pytest.mark.slow
def test_both_holders_of_a_tied_parameter_on_one_rank() -> None:
    outcome = balanced_check("loop_shared", lambda: _workload(LoopShared),
                             schedule="interleaved", stages_per_rank=2)
    assert outcome.status == "exact", outcome.line()
    assert outcome.worst["a.weight"] <= 1e-6

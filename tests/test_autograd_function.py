"""A model that calls its own ``torch.autograd.Function`` trains as one process.

Quantization-aware training rounds in the forward and passes the gradient straight
through (a straight-through estimator); a gradient-reversal layer flips it. Dynamo
captures such a Function as one higher-order op whose forward and backward are graphs of
their own (constants of the captured graph, not tensors). Measuring, planning and
splitting the model failed on them ("'GraphModule' object has no attribute 'numel'").
Through the real launcher, against one plain process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel

pytestmark = pytest.mark.slow


class RoundStraightThrough(torch.autograd.Function):
    """Round in the forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ReverseGradient(torch.autograd.Function):
    """The identity in the forward; the gradient times ``-scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.scale * grad, None


class QuantizedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 32)
        self.c, self.d = nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = RoundStraightThrough.apply(torch.tanh(self.a(x)) * 4) / 4
        h = torch.relu(self.b(h))
        h = ReverseGradient.apply(torch.tanh(self.c(h)), 0.5)
        return self.d(h)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("options", [{}, {"schedule": "zb-h1"},
                                     {"ranks": 4, "dp": 2, "schedule": "1f1b"}],
                         ids=["planned", "zb-h1", "dp2"])
def test_a_models_own_autograd_function_trains_as_one_process(options: dict[str, Any]) -> None:
    model = QuantizedNet()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(2)]
    one = copy.deepcopy(model)
    opt = _sgd(one.parameters())
    expected = []
    for x, y in batches:
        loss = F.cross_entropy(one(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss.detach()))
    ranks = options.pop("ranks", 2)
    with orgel.pipeline(copy.deepcopy(model), (batches[0][0],), batches[0][1], F.cross_entropy,
                        ranks=ranks, microbatches=2, optimizer=_sgd, threads=1,
                        **options) as pipe:
        losses = [pipe.step((x,), y) for x, y in batches]
        state = pipe.state_dict()
    assert losses == pytest.approx(expected, rel=1e-5)
    for name, value in one.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)

"""A forward with graph breaks is traced by Dynamo once, at capture: its steps compile nothing.

The controller runs the Python between graphs on the code Dynamo compiled at capture; its
graph calls hand the frames after them the ranks' outputs. Those must be the tensors the
frames were compiled for, or Dynamo compiles them again inside the step's micro-batch
threads (seconds per frame of a Hugging Face model, and two threads compiling one frame
can specialise it apart): an output that needed no gradient at capture (a mask, a rotary
table) needs none there, and one laid out otherwise than contiguously (a transposed or an
expanded view) keeps its strides.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import orgel

pytestmark = pytest.mark.slow


class MaskAndViews(nn.Module):
    """Graph 0 returns a trained activation, a mask without gradient (expanded: stride 0)
    and a transposed activation, then a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(6, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        mask = (x[:, :1] > 0).float().expand(-1, 8)
        side = self.b(x).t()
        torch._dynamo.graph_break()
        return self.c(h * mask + side.t())


def test_steps_of_a_forward_with_graph_breaks_compile_no_frame_again() -> None:
    torch.manual_seed(0)
    model = MaskAndViews()
    one = copy.deepcopy(model)
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
               for _ in range(3)]
    with orgel.pipeline(model, (batches[0][0],), batches[0][1], F.cross_entropy, ranks=2,
                        microbatches=2, schedule="1f1b",
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as pipe:
        assert pipe.glue is not None  # captured as several graphs
        compiled = counters["frames"]["ok"]
        for x, y in batches:
            loss = pipe.step((x,), y)
            ref = F.cross_entropy(one(x), y)
            ref.backward()
            opt.step()
            opt.zero_grad()
            assert loss == pytest.approx(ref.item(), rel=1e-5)
        assert counters["frames"]["ok"] == compiled, "a step compiled a frame again"
        state = pipe.state_dict()
    for name, value in one.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)

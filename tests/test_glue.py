"""A forward Dynamo captures as several graphs trains through ``orgel.pipeline`` exactly.

Each model here has graph breaks; ``archzoo.check.orgel_check`` runs it through
the production path (capture joins the graphs, plan, split, spawn, one step
with the Python between graphs in the controller) and compares every tensor
with gradient accumulation in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import orgel
from archzoo.check import orgel_check
from orgel.graph import CaptureError, GraphBreakError, capture, glue
from orgel.models import ZooWorkload
from orgel.runtime.plans import balanced_plan


class BranchEveryMicrobatch(nn.Module):
    """Parameters before and after a branch on the data; each micro-batch may take either."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._branch(torch.tanh(self.a(x)))
        return self.c(self._scaled(F.gelu(self.b(h))))

    def _branch(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # a graph break; each branch reads no parameter
            return h * 2
        return h - 1

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h / (1.0 + float(h.abs().mean().item()))  # another break, a Python float


class SideOutput(nn.Module):
    """Graph 0's output also reaches the loss directly, past the later graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        self.seen += 1
        print_value = h.detach().norm().item()  # a graph break
        assert print_value >= 0
        return self.b(torch.relu(h)), h


def _side_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    logits, h = out
    return F.cross_entropy(logits, y) + 0.1 * h.pow(2).mean()


class ParamBranch(nn.Module):
    """The branch taken reads different parameters: micro-batches must agree on it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.up = nn.Linear(4, 4)
        self.down = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h[0, 0] > 0:
            return self.up(h)
        return self.down(h)


def _branching() -> ZooWorkload:
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    x[4:] = -x[4:].abs() - 3.0  # the second micro-batch takes the other branch
    x[:4] = x[:4].abs() + 3.0
    return ZooWorkload(BranchEveryMicrobatch(), (x,), torch.randint(0, 4, (8,)),
                       F.cross_entropy)


def _side() -> ZooWorkload:
    torch.manual_seed(1)
    return ZooWorkload(SideOutput(), (torch.randn(6, 8),), torch.randint(0, 4, (6,)), _side_loss)


def test_capture_joins_the_graphs_with_exchanges() -> None:
    w = _branching()
    with pytest.raises(GraphBreakError, match="h.sum"):
        capture(w.model, (w.inputs[0][:4],), several=False)
    graph = capture(w.model, (w.inputs[0][:4],))
    assert graph.glue is not None
    # three graphs read parameters (a; b; c); the branches and the float math are glue
    assert len(graph.glue.calls) == 3
    exchanges = [n for n in graph.graph_module.graph.nodes if n.target is glue.exchange]
    assert [n.args[1] for n in exchanges] == [1, 2]
    assert any("several graphs" in note or "3 graphs" in note for note in graph.notes)
    assert {"a.weight", "b.weight", "c.weight"} <= set(graph.params)


@pytest.mark.slow
def test_branches_that_differ_per_microbatch_train_exactly() -> None:
    outcome = orgel_check("branching", _branching)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.slow
def test_recomputed_stages_with_exchanges_train_exactly() -> None:
    def plan_for(w: ZooWorkload) -> object:
        graph = capture(copy.deepcopy(w.model), (w.inputs[0][:2],))
        plan = balanced_plan(graph, ranks=3, microbatches=4)
        plan.recompute = [True] * len(plan.recompute)
        return plan

    outcome = orgel_check("branching", _branching, ranks=3, m=4, plan_for=plan_for)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.slow
def test_an_earlier_graphs_output_in_the_loss_and_a_buffer_train_exactly() -> None:
    outcome = orgel_check("side_output", _side)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.slow
def test_microbatches_on_different_parameter_paths_are_refused() -> None:
    torch.manual_seed(2)
    x = torch.randn(4, 4)
    model = ParamBranch()
    with torch.no_grad():
        first = model.a(x)[0, 0]
    x[2:] = x[:2]
    x[2, :] = -x[2, :]  # flips the sign of h[0, 0] on the second micro-batch
    with torch.no_grad():
        assert (model.a(x[2:])[0, 0] > 0) != (first > 0)
    pipe = orgel.pipeline(model, (x,), torch.randn(4, 4), F.mse_loss, ranks=2, microbatches=2,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), timeout_s=60.0)
    try:
        with pytest.raises(CaptureError, match="micro-batch 1's forward ran another graph"):
            pipe.step((x,), torch.randn(4, 4))
    finally:
        pipe.close()


def test_a_forward_of_several_graphs_is_refused_under_torchrun() -> None:
    from orgel import api

    graph = capture(BranchEveryMicrobatch(), (torch.randn(2, 8),))
    with pytest.raises(GraphBreakError, match="local-spawn mode"):
        api._one_graph_only(graph)


def test_a_plain_rank_engine_refuses_a_split_with_exchanges() -> None:
    from orgel.engine import RankEngine
    from orgel.split import split_plan

    graph = capture(BranchEveryMicrobatch(), (torch.randn(2, 8),))
    plan = balanced_plan(graph, ranks=2, microbatches=1)
    with pytest.raises(CaptureError, match="only through orgel.pipeline"):
        RankEngine(0, plan, split_plan(graph, plan), optimizer=None, loss_fn=F.mse_loss)

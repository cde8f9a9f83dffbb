"""Random draws in a pipeline: each (step, stage, micro-batch) forward draws its own stream.

One process's random stream cannot be replayed across ranks, so orgel gives
every forward of a stage on a micro-batch its own stream, seeded from
``torch.initial_seed()``, the step, the stage and the micro-batch. Dropout masks
therefore differ across micro-batches and steps, do not depend on the schedule
or on which rank runs the stage, and a recomputed stage replays its forward's
masks exactly. With dropout 0 the result is exact (``test_zoo``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.graph import capture
from orgel.launch.errors import WorkerError
from orgel.plan.balanced import balanced_plan
from orgel.runtime.stage import random_stream, stream_seed
from orgel.workload import Workload, microbatches


def test_streams_differ_by_step_stage_and_microbatch_and_repeat() -> None:
    seeds = {stream_seed(0, step, stage, m) for step in range(3) for stage in range(3)
             for m in range(3)}
    assert len(seeds) == 27
    assert stream_seed(5, 1, 2, 3) == stream_seed(5, 1, 2, 3)


def test_a_stream_leaves_the_rank_stream_where_it_was() -> None:
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    cpu = torch.device("cpu")
    with random_stream(11, cpu):
        first = torch.rand(4)
    with random_stream(11, cpu):
        again = torch.rand(4)
    assert torch.equal(first, again)
    assert torch.equal(torch.rand(4), expected)


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.5))
                                      for _ in range(4)])
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(x))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _run(schedule: str, *, recompute: bool | str, lr: float,
         steps: int) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = DropoutMLP()
    x = torch.randn(4, 8).repeat(2, 1)  # both micro-batches hold the same rows
    y = torch.randn(4, 2).repeat(2, 1)
    graph = capture(model, microbatches(Workload(model, (x,), y, _mse), 2)[0][0])
    plan = balanced_plan(graph, ranks=2, microbatches=2, schedule=schedule)
    if recompute:
        plan = dataclasses.replace(plan, recompute=[recompute] * plan.num_stages)
    with orgel.pipeline(model, (x,), y, _mse, ranks=2, microbatches=2, plan=plan,
                        optimizer=lambda p: torch.optim.SGD(p, lr=lr)) as pipe:
        losses = [pipe.step((x,), y) for _ in range(steps)]
        return losses, pipe.state_dict()


@pytest.mark.slow
def test_masks_replayed_by_recompute_and_independent_of_the_schedule() -> None:
    base, state = _run("1f1b", recompute=False, lr=0.1, steps=2)
    for schedule, recompute in (("1f1b", True), ("gpipe", False)):
        losses, other = _run(schedule, recompute=recompute, lr=0.1, steps=2)
        assert losses == base, (schedule, recompute)
        assert all(torch.equal(state[k], other[k]) for k in state), (schedule, recompute)


@pytest.mark.slow
def test_masks_differ_across_steps() -> None:
    losses, _ = _run("1f1b", recompute=False, lr=0.0, steps=2)  # lr 0: the model stays
    assert losses[0] != losses[1]


@pytest.mark.slow
def test_layer_and_selective_recompute_give_the_same_training() -> None:
    """Each layer checkpointed (``"layer"``), or all but the matmul outputs recomputed
    (``"selective"``), with dropout: the same losses and weights, bit for bit, as keeping
    every activation, under 1F1B; ``"layer"`` under ZB-H1 too, whose split backward
    recomputes a layer for its input half and again for its weight half. Torch's selective
    checkpoint allows one backward per region: a split backward is refused, saying so."""
    base, state = _run("1f1b", recompute=False, lr=0.1, steps=2)
    for schedule, policy in (("1f1b", "layer"), ("1f1b", "selective"), ("zb-h1", "layer")):
        losses, other = _run(schedule, recompute=policy, lr=0.1, steps=2)
        assert losses == base, (schedule, policy)
        assert all(torch.equal(state[k], other[k]) for k in state), (schedule, policy)
    with pytest.raises(WorkerError, match="one backward per region"):
        _run("zb-h1", recompute="selective", lr=0.1, steps=1)

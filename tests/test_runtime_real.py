"""The runtime on a really captured and split model: CLIP's towers on different ranks.

Each rank captures examples/clip.py's model, splits it by module (image tower,
text tower, the similarity head) and runs DAG-1F1B with the towers on ranks 0
and 1 at the same time; parameters after two SGD steps equal one process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from orgel.launch.spawn import spawn

pytestmark = pytest.mark.slow  # spawns gloo ranks

M = 2


def _workload() -> Any:
    from orgel.workload import load_workload

    return load_workload("examples/clip.py:workload")


def _assignment(graph: Any) -> dict[str, int]:
    """Image tower -> 0, text tower -> 1, everything after both -> 2 (node order)."""
    stage: dict[str, int] = {}
    for name, node in graph.nodes.items():
        if node.module.startswith("image_tower"):
            stage[name] = 0
        elif node.module.startswith("text_tower"):
            stage[name] = 1
        else:
            seen = {stage[i] for i in node.inputs if i in stage}
            stage[name] = 2 if len(seen) > 1 or 2 in seen else (seen.pop() if seen else 0)
    return stage


def _plan_and_split(workload: Any) -> tuple[Any, Any]:
    from orgel.graph.capture import capture
    from orgel.schedule.families import build_schedule
    from orgel.split.split import split_model
    from orgel.workload import microbatches

    graph = capture(workload.model, microbatches(workload, M)[0][0])
    split = split_model(graph, _assignment(graph))
    plan = build_schedule("dag-1f1b", 2, M, stage_graph=split.stage_graph,
                          placement=[(0,), (1,), (1,)])
    return plan, split


def _rank(rank: int, world: int) -> list[tuple[str, torch.Tensor]]:
    from orgel.runtime.executor import Executor
    from orgel.workload import named_inputs

    workload = _workload()
    plan, split = _plan_and_split(workload)
    ex = Executor(plan, split, loss_fn=workload.loss_fn, timeout=30,
                  optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
    inputs = named_inputs(workload.model, workload.inputs)
    for _ in range(2):
        ex.step(inputs, workload.targets)
    return [(n, p.detach().clone()) for n, p in ex.named_parameters()]


def test_clip_towers_on_two_ranks_equal_one_process() -> None:
    from orgel.workload import microbatches

    workload = _workload()
    plan, split = _plan_and_split(workload)
    assert len({e.src for e in split.stage_graph.edges if e.dst == 2}) == 2  # a real join
    got = [pair for part in spawn(_rank, 2, timeout=60) for pair in part]
    model = copy.deepcopy(workload.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        for inputs, targets in microbatches(workload, M):
            (workload.loss_fn(model(**inputs), targets) / M).backward()
        opt.step()
    want = dict(model.named_parameters())
    assert {n for n, _ in got} == {n for n, p in want.items() if p.requires_grad}
    for name, tensor in got:
        assert (tensor - want[name]).abs().max().item() < 1e-5, name

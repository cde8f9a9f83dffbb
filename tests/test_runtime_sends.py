"""Sends are released as the step goes: the bytes a rank holds in sends stay bounded.

Two gloo ranks run a few steps; each rank reports, per step, the most bytes and
messages its :class:`~orgel.runtime.comm.Transport` had pending at once and the
bytes it sent. From the second step on (receives posted ahead) at most one
action's sends are pending — what the planner's memory model charges
(``orgel.plan.planner.held_sends``), far below holding every send until the
step ends; a byte cap bounds one action's sends further. Losses must not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from orgel.launch.spawn import spawn
from orgel.plan.predict import held_sends
from orgel.runtime.comm import Transport
from orgel.runtime.executor import Executor
from orgel.schedule.comm import derive_comm
from orgel.schedule.ir import Plan, StageGraph, Value
from test_runtime_nets import D, T, _dag, batch, build, ce_loss, clip, sgd, split

pytestmark = pytest.mark.slow  # spawns gloo ranks

ROWS, STEPS = 8, 3
#: stage 0 feeds stage 1 (t0) and stage 2 (i1), both on rank 1: two sends after each F0
TWO_OUT = {"i0": 0, "i1": 0, "t0": 0, "t1": 1, "join": 2, "out": 2}


def with_bytes(plan: Plan, nbytes: int) -> Plan:
    """``plan`` with every value sized ``nbytes`` per micro-batch (the test nets' size)."""
    graph = plan.stage_graph
    edges = tuple(dataclasses.replace(e, values=tuple(Value(v.name, nbytes) for v in e.values))
                  for e in graph.edges)
    return dataclasses.replace(plan, stage_graph=StageGraph(graph.stages, edges))


def _setup(name: str) -> tuple[Any, Plan, str]:
    if name == "two-out":
        split_model = split(clip(), TWO_OUT)
        return split_model, _dag(2, [(0,), (1,), (1,)])(split_model.stage_graph), "clip"
    _, split_model, plan, _ = build(name)
    return split_model, plan, "gpt"


CONFIGS = [("1f1b", None), ("two-out", None), ("two-out", 1)]


def run_all(rank: int, world: int) -> dict[tuple[str, int | None], dict[str, Any]]:
    """Every config of :data:`CONFIGS` in one process group."""
    return {(name, cap): run(rank, name, cap) for name, cap in CONFIGS}


def run(rank: int, name: str, cap: int | None) -> dict[str, Any]:
    """``STEPS`` steps of scenario ``name``; per step: peak pending bytes/messages, sent."""
    split_model, plan, kind = _setup(name)
    ex = Executor(plan, split_model, loss_fn=ce_loss, optimizer_factory=sgd, timeout=20)
    ex.transport.max_pending_bytes = cap
    largest: list[int] = []
    out: dict[str, Any] = {"peak": [], "count": [], "sent": [], "losses": [], "pending": []}
    comm, transport = ex.comm, ex.transport
    original = transport.send

    def send(i: int, tensors: list[Any]) -> None:
        original(i, tensors)
        largest.append(max(s.nbytes for s in transport.pending))

    transport.send = send  # type: ignore[method-assign]
    for _ in range(STEPS):
        inputs, targets = batch(kind, ROWS)
        out["losses"].append(ex.step(inputs, targets))
        out["peak"].append(transport.peak_pending_bytes)
        out["count"].append(transport.peak_pending)
        out["sent"].append(transport.sent_bytes)
        out["pending"].append(len(transport.pending))
    out["largest"] = max(largest)
    per_action = [len(msgs) for msgs in comm.sends_after[rank]]
    out["most_per_action"] = max(per_action)
    return out


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, int | None], list[dict[str, Any]]]:
    per_rank = spawn(run_all, 2, timeout=30)
    return {key: [r[key] for r in per_rank] for key in CONFIGS}


def test_one_action_of_sends_pending_as_the_planner_charges(results: dict) -> None:
    per_rank = results[("1f1b", None)]
    _, plan, _ = _setup("1f1b")
    nbytes = ROWS // plan.microbatches * T * D * 4  # one micro-batch of hidden states, fp32
    held = held_sends(with_bytes(plan, nbytes))
    for rank, got in enumerate(per_rank):
        # first step exchanges shapes: receives are posted just in time, sends held
        assert got["peak"][0] == got["sent"][0] == plan.microbatches * nbytes
        for step in range(1, STEPS):
            assert got["count"][step] == 1  # 1F1B sends one message per action
            assert got["peak"][step] == nbytes == held[rank] < got["sent"][step]
        assert got["pending"] == [0] * STEPS  # nothing outlives the step


def test_byte_cap_waits_for_the_oldest_send_and_keeps_the_losses(results: dict) -> None:
    free, capped = results[("two-out", None)], results[("two-out", 1)]
    assert free[0]["most_per_action"] == 2
    assert max(free[0]["count"][1:]) == 2  # both sends of one F pending together
    assert max(capped[0]["count"][1:]) == 1  # the cap waits for the first before the second
    assert max(capped[0]["peak"][1:]) == capped[0]["largest"]  # a message over the cap still goes
    _, plan, _ = _setup("two-out")
    bound = held_sends(with_bytes(plan, ROWS // plan.microbatches * T * D * 4))
    for rank in range(2):
        assert capped[rank]["losses"] == free[rank]["losses"]
        assert max(free[rank]["peak"][1:]) == bound[rank] < free[rank]["sent"][1]


def test_cap_is_checked_up_front() -> None:
    _, plan, _ = _setup("1f1b")
    with pytest.raises(ValueError, match="max_pending_bytes"):
        Transport(plan, derive_comm(plan), 0, store=None, device=torch.device("cpu"),
                  timeout=1.0, post_ahead=True, max_pending_bytes=-1)

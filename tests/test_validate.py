"""Validation: hand-written schedules that are wrong give exact, located errors."""

from __future__ import annotations

import dataclasses

import pytest

from orgel.schedule import Plan, PlanError, StageGraph, build_schedule, dry_run, validate
from orgel.schedule.comm import derive_comm
from orgel.schedule.text import parse_schedule


def _plan(text: str, *, microbatches: int = 2, graph: StageGraph | None = None,
          placement: list[tuple[int, ...]] | None = None) -> Plan:
    schedule = parse_schedule(text)
    graph = graph or StageGraph.chain(len(schedule))
    placement = placement or [(s,) for s in range(graph.num_stages)]
    return Plan(graph, placement, len(schedule), microbatches, schedule)


def _error(plan: Plan) -> str:
    with pytest.raises(PlanError) as info:
        validate(plan)
    return str(info.value)


GOOD = """
rank0: F0.0 F0.1 B0.0 B0.1
rank1: F1.0 B1.0 F1.1 B1.1
"""


def test_good_hand_written_schedule() -> None:
    validate(_plan(GOOD))


def test_missing_backward() -> None:
    assert _error(_plan("rank0: F0.0 F0.1 B0.0 B0.1\nrank1: F1.0 B1.0 F1.1")) == (
        "rank 1 is missing the backward of stage 1 micro-batch 1: add B1.1 (or I1.1 and W1.1)"
    )


def test_missing_forward() -> None:
    assert _error(_plan("rank0: F0.0 B0.0 B0.1\nrank1: F1.0 B1.0 F1.1 B1.1")) == (
        "rank 0 is missing F0.1 (stage 0 runs on rank 0)"
    )


def test_duplicate() -> None:
    assert _error(_plan("rank0: F0.0 F0.1 F0.0 B0.0 B0.1\nrank1: F1.0 B1.0 F1.1 B1.1")) == (
        "rank 0 at position 2 (F0.0): duplicate, F0.0 already runs at position 0"
    )


def test_w_before_i() -> None:
    plan = _plan("rank0: F0.0 F0.1 B0.0 B0.1\nrank1: F1.0 W1.0 I1.0 F1.1 B1.1")
    assert _error(plan) == (
        "rank 1 at position 1 (W1.0) runs before I1.0 (position 2): W needs I first"
    )


def test_i_without_w() -> None:
    plan = _plan("rank0: F0.0 F0.1 B0.0 B0.1\nrank1: F1.0 I1.0 F1.1 B1.1")
    assert _error(plan) == "rank 1 at position 1 (I1.0): W1.0 is missing"


def test_b_and_i_for_one_microbatch() -> None:
    plan = _plan("rank0: F0.0 F0.1 B0.0 B0.1\nrank1: F1.0 B1.0 I1.0 W1.0 F1.1 B1.1")
    assert _error(plan) == (
        "rank 1 at position 1 (B1.0): I1.0 also runs (position 2); use B, or I and W, not both"
    )


def test_backward_before_forward() -> None:
    plan = _plan("rank0: F0.0 F0.1 B0.0 B0.1\nrank1: B1.0 F1.0 F1.1 B1.1")
    assert _error(plan) == (
        "rank 1 at position 0 (B1.0) runs before F1.0 (position 1): the backward needs "
        "its forward first"
    )


def test_action_on_wrong_rank() -> None:
    plan = _plan("rank0: F0.0 F0.1 B0.0 B0.1 F1.0\nrank1: F1.0 B1.0 F1.1 B1.1")
    assert _error(plan) == (
        "rank 0 at position 4 (F1.0): stage 1 is placed on ranks [1], not on rank 0"
    )


def test_microbatch_and_stage_out_of_range() -> None:
    plan = _plan("rank0: F0.0 F0.1 F0.2 B0.0 B0.1\nrank1: F1.0 B1.0 F1.1 B1.1")
    assert _error(plan) == (
        "rank 0 at position 2 (F0.2): micro-batch 2 is out of range (the plan has 2: 0..1)"
    )
    plan = _plan("rank0: F0.0 F0.1 B0.0 B0.1 F7.0\nrank1: F1.0 B1.0 F1.1 B1.1")
    assert _error(plan) == "rank 0 at position 4 (F7.0): there is no stage 7 (stages are 0..1)"


def test_deadlock_reports_every_stuck_rank() -> None:
    # rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 1's
    # activations, which rank 1 needs before it runs that backward.
    plan = _plan("rank0: F0.0 B0.0 F0.1 B0.1\nrank1: F1.0 F1.1 B1.0 B1.1")
    assert _error(plan) == (
        "deadlock: rank 0 at position 1 (B0.0) waits for gradient of edge 0->1 micro-batch 0 "
        "from rank 1, which is stuck at position 1 (F1.1); rank 1 at position 1 (F1.1) waits "
        "for activations of edge 0->1 micro-batch 1 from rank 0, which is stuck at position "
        "1 (B0.0)"
    )


def test_deadlock_three_ranks() -> None:
    # rank 2 runs micro-batch 1 first; everyone upstream runs micro-batch 0 first.
    plan = _plan("""
        rank0: F0.0 F0.1 B0.0 B0.1
        rank1: F1.0 F1.1 B1.0 B1.1
        rank2: F2.1 B2.1 F2.0 B2.0
    """)
    validate(plan)  # forwards are all sent before anyone waits: no deadlock
    plan = _plan("""
        rank0: F0.0 B0.0 F0.1 B0.1
        rank1: F1.0 B1.0 F1.1 B1.1
        rank2: F2.1 B2.1 F2.0 B2.0
    """)
    assert _error(plan) == (
        "deadlock: rank 0 at position 1 (B0.0) waits for gradient of edge 0->1 micro-batch 0 "
        "from rank 1, which is stuck at position 1 (B1.0); rank 1 at position 1 (B1.0) waits "
        "for gradient of edge 1->2 micro-batch 0 from rank 2, which is stuck at position 0 "
        "(F2.1); rank 2 at position 0 (F2.1) waits for activations of edge 1->2 micro-batch 1 "
        "from rank 1, which is stuck at position 1 (B1.0)"
    )


def test_structure_errors() -> None:
    plan = _plan(GOOD)
    with pytest.raises(PlanError, match="schedule has 2 rank lists but the plan has 3 ranks"):
        validate(dataclasses.replace(plan, num_ranks=3))
    with pytest.raises(PlanError, match="placement names ranks for 1 stages but the stage "
                       "graph has 2"):
        validate(dataclasses.replace(plan, placement=[(0,)]))
    with pytest.raises(PlanError, match=r"stage 1 is placed on ranks \[1, 1\]: list each"):
        validate(dataclasses.replace(plan, placement=[(0,), (1, 1)]))
    with pytest.raises(PlanError, match=r"stage 1 is placed on rank 5, but ranks are 0..1"):
        validate(dataclasses.replace(plan, placement=[(0,), (5,)]))
    with pytest.raises(PlanError, match="stage 0 is placed on no rank"):
        validate(dataclasses.replace(plan, placement=[(), (1,)]))
    with pytest.raises(PlanError, match="recompute has 3 flags but there are 2 stages"):
        validate(dataclasses.replace(plan, recompute=[False] * 3))
    with pytest.raises(PlanError, match="microbatches must be >= 1"):
        validate(dataclasses.replace(plan, microbatches=0))
    cyclic = StageGraph.from_edges(2, [(0, 1), (1, 0)])
    with pytest.raises(PlanError, match="cycle"):
        validate(dataclasses.replace(plan, stage_graph=cyclic))


def test_dry_run_uniform_step_time() -> None:
    # f = 1, b = 2: GPipe and 1F1B both take (m + p - 1)(f + b).
    for name in ("gpipe", "1f1b"):
        plan = build_schedule(name, 4, 8)
        assert dry_run(plan).step_time == (8 + 4 - 1) * 3
        assert dry_run(plan).stuck == []
    plan = build_schedule("1f1b", 3, 2)
    assert dry_run(plan, {"F": 2.0, "B": 3.0}).step_time == (2 + 3 - 1) * 5


def test_large_plan_validates() -> None:
    plan = build_schedule("1f1b", 16, 256)
    validate(plan)
    assert sum(len(a) for a in plan.schedule) == 16 * 256 * 2


def test_local_handover_order() -> None:
    # Stages 0 and 1 share rank 0: no message between them, so list order must do.
    graph = StageGraph.chain(3)
    placement = [(0,), (0,), (1,)]
    validate(_plan("rank0: F0.0 F1.0 B1.0 B0.0\nrank1: F2.0 B2.0", microbatches=1,
                   graph=graph, placement=placement))
    plan = _plan("rank0: F1.0 F0.0 B1.0 B0.0\nrank1: F2.0 B2.0", microbatches=1,
                 graph=graph, placement=placement)
    assert _error(plan) == (
        "rank 0 at position 0 (F1.0) needs activations of edge 0->1 micro-batch 0 from F0.0 "
        "on the same rank, which runs later (position 1)"
    )
    plan = _plan("rank0: F0.0 F1.0 I0.0 B1.0 W0.0\nrank1: F2.0 B2.0", microbatches=1,
                 graph=graph, placement=placement)
    assert _error(plan) == (
        "rank 0 at position 2 (I0.0) needs the gradient of edge 0->1 micro-batch 0 from B1.0 "
        "on the same rank, which runs later (position 3)"
    )


def test_data_parallel_replicas() -> None:
    # DP x PP: each stage on two ranks, every replica runs the 1F1B order of its stage.
    one = build_schedule("1f1b", 2, 4)
    schedule = [one.schedule[0], one.schedule[0], one.schedule[1], one.schedule[1]]
    plan = Plan(StageGraph.chain(2, nbytes=64), [(0, 1), (2, 3)], 4, 4, schedule)
    validate(plan)
    # A replica that drops a micro-batch is named.
    broken = [list(row) for row in schedule]
    broken[3] = [a for a in broken[3] if str(a) != "B1.2"]
    plan = Plan(StageGraph.chain(2), [(0, 1), (2, 3)], 4, 4, broken)
    assert _error(plan) == (
        "rank 3 is missing the backward of stage 1 micro-batch 2: add B1.2 (or I1.2 and W1.2)"
    )


def test_validate_returns_the_derived_communication() -> None:
    plan = build_schedule("interleaved", 2, 4, stages_per_rank=2, nbytes=64)
    assert validate(plan) == derive_comm(plan)

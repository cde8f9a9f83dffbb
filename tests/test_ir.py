"""The Plan IR: action text, schedule text form and JSON round-trips."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from orgel.schedule import (
    Action,
    Costs,
    Link,
    Plan,
    PlanError,
    StageCost,
    StageGraph,
    build_schedule,
)
from orgel.schedule.text import format_schedule, parse_schedule, plan_from_text


@pytest.mark.parametrize("kind", ["F", "B", "I", "W"])
def test_action_round_trip(kind: str) -> None:
    action = Action(kind, 3, 12)
    assert str(action) == f"{kind}3.12"
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["X1.0", "F1", "F.0", "F-1.0", "f1.0", "F1.0.2"])
def test_action_parse_rejects(text: str) -> None:
    with pytest.raises(PlanError, match="cannot parse action"):
        Action.parse(text)


def test_schedule_text_round_trip() -> None:
    text = """
    # two ranks, zero-bubble style
    rank0: F0.0 F0.1 I0.0 W0.0   # trailing comment
    rank1: F1.0 B1.0 F1.1 B1.1

    rank2:
    """
    schedule = parse_schedule(text)
    assert schedule == [
        [Action("F", 0, 0), Action("F", 0, 1), Action("I", 0, 0), Action("W", 0, 0)],
        [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)],
        [],
    ]
    assert format_schedule(schedule) == (
        "rank0: F0.0 F0.1 I0.0 W0.0\nrank1: F1.0 B1.0 F1.1 B1.1\nrank2:"
    )
    assert parse_schedule(format_schedule(schedule)) == schedule


def test_schedule_text_errors_name_line_and_token() -> None:
    with pytest.raises(PlanError, match=r"^line 2 \(rank1\), token 3: cannot parse action 'Q1.1'"):
        parse_schedule("rank0: F0.0\nrank1: F1.0 B1.0 Q1.1\n")
    with pytest.raises(PlanError, match="line 1: expected 'rankN: ACTION"):
        parse_schedule("r0: F0.0")
    with pytest.raises(PlanError, match="line 2: rank0 is written twice"):
        parse_schedule("rank0: F0.0\nrank0: B0.0")
    with pytest.raises(PlanError, match=r"no line for rank\(s\) \[1\]"):
        parse_schedule("rank0: F0.0\nrank2: F2.0")
    with pytest.raises(PlanError, match="has 1 rank lines but the plan has 2 ranks"):
        parse_schedule("rank0: F0.0", num_ranks=2)
    with pytest.raises(PlanError, match="no 'rankN:' lines"):
        parse_schedule("# nothing\n")


def _diamond_plan() -> Plan:
    """Stages 0 -> {1, 2} -> 3; stage 1 data-parallel on two ranks."""
    graph = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)], nbytes=1024)
    costs = Costs(
        stages=[StageCost(fwd=1.0, bwd=2.0, bwd_weight=0.5, params=10, activations=7)] * 4,
        link=Link(latency=0.1, per_mib=0.3),
        links={(0, 1): Link(latency=0.2, per_mib=1.0)},
        action_overhead=0.01,
        memory_per_rank=1 << 30,
    )
    schedule = parse_schedule(
        """
        rank0: F0.0 B0.0
        rank1: F1.0 I1.0 W1.0
        rank2: F1.0 I1.0 W1.0
        rank3: F2.0 B2.0 F3.0 B3.0
        """
    )
    return Plan(
        stage_graph=graph,
        placement=[(0,), (1, 2), (3,), (3,)],
        num_ranks=4,
        microbatches=1,
        schedule=schedule,
        recompute=[False, True, "layer", "selective"],
        costs=costs,
        prediction={"step_time": 12.5},
        meta={"schedule": "hand"},
    )


def test_plan_json_round_trip(tmp_path: Path) -> None:
    plan = _diamond_plan()
    again = Plan.from_dict(plan.to_dict())
    assert again == plan
    assert again.placement[1] == (1, 2)
    assert again.costs is not None and again.costs.links[(0, 1)] == Link(0.2, 1.0)
    assert [(e.src, e.dst, e.nbytes) for e in again.stage_graph.edges] == [
        (0, 1, 1024), (0, 2, 1024), (1, 3, 1024), (2, 3, 1024)
    ]
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert Plan.from_json(plan.to_json()).schedule_text() == plan.schedule_text()


def test_a_recompute_policy_outside_the_four_is_refused() -> None:
    with pytest.raises(PlanError, match="'layer'"):
        dataclasses.replace(_diamond_plan(), recompute=[False, True, "blocks", False])


def test_plan_without_costs_round_trips() -> None:
    plan = dataclasses.replace(_diamond_plan(), costs=None, prediction=None)
    assert Plan.from_dict(plan.to_dict()) == plan


def test_plan_version_mismatch() -> None:
    data = _diamond_plan().to_dict()
    data["version"] = 99
    with pytest.raises(PlanError, match="plan version 99 is not supported: this orgel reads"):
        Plan.from_dict(data)


def test_plan_missing_field_and_bad_json() -> None:
    data = _diamond_plan().to_dict()
    del data["schedule"]
    with pytest.raises(PlanError, match="missing the field 'schedule'"):
        Plan.from_dict(data)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")


def test_plan_from_text_reads_defaults_off_the_text() -> None:
    plan = plan_from_text("""
        # 1F1B on two ranks, written by hand
        rank0: F0.0 F0.1 B0.0 B0.1
        rank1: F1.0 B1.0 F1.1 B1.1
    """, nbytes=32)
    assert plan.num_ranks == 2 and plan.microbatches == 2
    assert plan.placement == [(0,), (1,)]
    assert [(e.src, e.dst, e.nbytes) for e in plan.stage_graph.edges] == [(0, 1, 32)]
    assert plan.meta == {"schedule": "hand-written"}


def test_plan_from_text_with_replicas_and_graph() -> None:
    graph = StageGraph.from_edges(3, [(0, 1), (0, 2)])
    plan = plan_from_text("""
        rank0: F0.0 B0.0
        rank1: F1.0 B1.0
        rank2: F1.0 B1.0 F2.0 B2.0
    """, stage_graph=graph)
    assert plan.placement == [(0,), (1, 2), (2,)]
    with pytest.raises(PlanError, match=r"rank 1 at position 2 \(B1.0\): duplicate, B1.0 "
                       r"already runs at position 1"):
        plan_from_text("rank0: F0.0 B0.0\nrank1: F1.0 B1.0 B1.0")
    with pytest.raises(PlanError, match="no rank runs stage 1: add its actions or pass placement"):
        plan_from_text("rank0: F0.0 B0.0", stage_graph=StageGraph.chain(2))
    with pytest.raises(PlanError, match="the schedule has no actions"):
        plan_from_text("rank0:")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "looped-bfs", "looped",
                                  "zb-h1", "dag-1f1b"])
def test_family_text_round_trip(name: str) -> None:
    plan = build_schedule(name, 2, 4)
    assert parse_schedule(format_schedule(plan.schedule)) == plan.schedule
    again = plan_from_text(plan.schedule_text(), stage_graph=plan.stage_graph)
    assert again.schedule == plan.schedule and again.placement == plan.placement


def test_plan_from_dict_malformed_fields() -> None:
    data = _diamond_plan().to_dict()
    data["schedule"][2] = "F1.0 X1.0"
    with pytest.raises(PlanError, match=r"^schedule of rank 2: cannot parse action 'X1.0'"):
        Plan.from_dict(data)
    data = _diamond_plan().to_dict()
    data["num_ranks"] = "four"
    with pytest.raises(PlanError, match="plan has a malformed field"):
        Plan.from_dict(data)


def test_shard_and_tp_round_trip_and_checks() -> None:
    """A sharded stage and the tensor-parallel degree survive JSON; bad values are refused."""
    from orgel.schedule.validate import _check_structure as validate

    plan = _diamond_plan()
    assert plan.shard == ["none"] * 4 and plan.tp == 1 and plan.world_size == plan.num_ranks
    assert "tp" not in plan.to_dict() and "shard" not in plan.to_dict()["stages"][1]
    plan = dataclasses.replace(plan, shard=[plan.shard[0], "fsdp", *plan.shard[2:]], tp=2)
    again = Plan.from_dict(plan.to_dict())
    assert again == plan and again.sharded(1) and not again.sharded(0)
    assert again.world_size == 2 * plan.num_ranks
    validate(again)
    data = plan.to_dict()
    data["stages"][0]["shard"] = "fsdp"  # stage 0 has one replica
    with pytest.raises(PlanError, match="stage 0 is sharded.*one replica"):
        validate(Plan.from_dict(data))
    data["stages"][0]["shard"] = "zero9"
    with pytest.raises(PlanError, match="'zero9' is not one of none, fsdp"):
        Plan.from_dict(data)
    data["stages"][0]["shard"] = "none"
    data["tp"] = 0
    with pytest.raises(PlanError, match="tp must be an integer >= 1"):
        Plan.from_dict(data)

"""Schedule families: golden pictures, validity over a grid, in-flight micro-batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from orgel.schedule import Action, Plan, PlanError, StageGraph
from orgel.schedule.families import FAMILIES, build_schedule
from orgel.schedule.text import format_schedule, parse_schedule

GOLDEN = Path(__file__).parent / "golden" / "schedules"


def picture(plan: Plan) -> list[str]:
    """Each rank's list without the stage number: ``F0 F1 B0 ...`` reads like a timeline."""
    return [" ".join(f"{a.kind}{a.microbatch}" for a in actions) for actions in plan.schedule]


def in_flight(actions: list[Action]) -> int:
    """Peak of forwards started minus backwards (B or W) finished, in list order."""
    alive = peak = 0
    for a in actions:
        alive += 1 if a.kind == "F" else -1 if a.kind in ("B", "W") else 0
        peak = max(peak, alive)
    return peak


def check_golden(name: str, plan: Plan) -> None:
    expected = (GOLDEN / f"{name}.txt").read_text()
    assert format_schedule(plan.schedule) == format_schedule(parse_schedule(expected))


def test_gpipe_picture() -> None:
    assert picture(build_schedule("gpipe", 3, 4)) == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 F3 B0 B1 B2 B3",
    ]


def test_1f1b_picture() -> None:
    assert picture(build_schedule("1f1b", 4, 6)) == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]


def test_1f1b_fewer_microbatches_than_ranks() -> None:
    assert picture(build_schedule("1f1b", 4, 2)) == [
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ]


def test_1f1b_golden() -> None:
    check_golden("1f1b_4x8", build_schedule("1f1b", 4, 8))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_in_flight_gpipe_and_1f1b(p: int, m: int) -> None:
    gpipe, ofob = build_schedule("gpipe", p, m), build_schedule("1f1b", p, m)
    assert in_flight(gpipe.schedule[0]) == m
    assert [in_flight(a) for a in ofob.schedule] == [min(p - r, m) for r in range(p)]


def test_meta_names_the_family() -> None:
    plan = build_schedule("gpipe", 2, 2, nbytes=64)
    assert plan.meta == {"schedule": "gpipe"}
    assert [e.nbytes for e in plan.stage_graph.edges] == [64]


def test_chain_families_accept_a_stage_graph() -> None:
    graph = StageGraph.from_edges(3, [(0, 1), (1, 2), (0, 2)], nbytes=5)
    plan = build_schedule("1f1b", 3, 4, stage_graph=graph)
    assert plan.stage_graph is graph
    with pytest.raises(PlanError, match="1f1b needs a stage graph with 4 stages, got 3"):
        build_schedule("1f1b", 4, 4, stage_graph=graph)


def test_build_schedule_errors() -> None:
    with pytest.raises(PlanError, match="unknown schedule family 'zz': choose one of"):
        build_schedule("zz", 2, 2)
    with pytest.raises(PlanError, match="'gpipe' does not take that option .* it takes "
                       "stage_graph, nbytes"):
        build_schedule("gpipe", 2, 2, stages_per_rank=2)
    with pytest.raises(PlanError, match="microbatches must be a positive integer, got 0"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(PlanError, match="num_ranks must be a positive integer"):
        build_schedule("gpipe", 0, 2)


def test_registry_names() -> None:
    assert {"gpipe", "1f1b"} <= set(FAMILIES)

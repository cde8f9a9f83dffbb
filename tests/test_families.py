"""Schedule families: golden pictures, validity over a grid, in-flight micro-batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from orgel.schedule import Action, Plan, PlanError, StageGraph, dry_run, validate
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
    assert set(FAMILIES) == {
        "gpipe", "1f1b", "interleaved", "looped-bfs", "looped", "zb-h1", "dag-1f1b", "dualpipev"
    }


@pytest.mark.parametrize(("name", "golden", "options"), [
    ("interleaved", "interleaved_2x2", {"stages_per_rank": 2}),
    ("zb-h1", "zb-h1_4x8", {}),
])
def test_golden(name: str, golden: str, options: dict[str, int]) -> None:
    ranks = 2 if name == "interleaved" else 4
    mbs = 4 if name == "interleaved" else 8
    check_golden(golden, build_schedule(name, ranks, mbs, **options))


def test_dag_1f1b_diamond_golden() -> None:
    graph = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    plan = build_schedule("dag-1f1b", 4, 4, stage_graph=graph)
    check_golden("dag-1f1b_diamond", plan)
    assert plan.meta == {"schedule": "dag-1f1b", "depths": [3, 2, 2, 1]}
    # The two branches start side by side: both F1.0 and F2.0 end at t = 2.
    finish = dry_run(plan).finish
    assert finish[1][0] == finish[2][0] == 2.0


# -- every family is valid over a grid ---------------------------------------------------

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8)]


@pytest.mark.parametrize(("p", "m"), GRID)
def test_one_stage_per_rank_families_valid(p: int, m: int) -> None:
    for name in ("gpipe", "1f1b", "zb-h1", "dag-1f1b"):
        plan = build_schedule(name, p, m, nbytes=16)
        validate(plan)
        assert plan.meta["schedule"] == name
        assert [e.nbytes for e in plan.stage_graph.edges] == [16] * (p - 1)


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("v", [1, 2, 3])
def test_looped_families_valid(p: int, m: int, v: int) -> None:
    bfs = build_schedule("looped-bfs", p, m, stages_per_rank=v)
    assert bfs.placement == [(s % p,) for s in range(p * v)]
    validate(bfs)
    if m % p == 0:
        validate(build_schedule("interleaved", p, m, stages_per_rank=v))
    for b_l in {d for d in (p, m) if m % d == 0}:
        for prefetch in ([0] * p, [1] * p, [p - 1 - i for i in range(p)]):
            plan = build_schedule("looped", p, m, loops=v, loop_microbatches=b_l,
                                  prefetch=prefetch)
            validate(plan)


def test_interleaved_one_chunk_is_1f1b_and_bfs_one_loop_is_gpipe() -> None:
    assert build_schedule("interleaved", 4, 8, stages_per_rank=1).schedule == \
        build_schedule("1f1b", 4, 8).schedule
    assert build_schedule("looped-bfs", 3, 5, stages_per_rank=1).schedule == \
        build_schedule("gpipe", 3, 5).schedule


def test_dag_1f1b_on_a_chain_is_1f1b() -> None:
    for p, m in GRID:
        assert build_schedule("dag-1f1b", p, m).schedule == build_schedule("1f1b", p, m).schedule


def test_looped_bfs_picture() -> None:
    assert picture(build_schedule("looped-bfs", 2, 3, stages_per_rank=2)) == [
        "F0 F1 F2 F0 F1 F2 B0 B1 B2 B0 B1 B2",  # stage 0, then stage 2; back: 2, then 0
        "F0 F1 F2 F0 F1 F2 B0 B1 B2 B0 B1 B2",
    ]
    plan = build_schedule("looped-bfs", 2, 3, stages_per_rank=2)
    assert [a.stage for a in plan.schedule[1]] == [1, 1, 1, 3, 3, 3, 3, 3, 3, 1, 1, 1]


# -- uniform-cost step times (dry run: F = f, B = b, I = b, W = w) -------------------------


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize(("f", "b", "w"), [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (3.0, 2.0, 1.0)])
def test_zb_h1_step_time(p: int, m: int, f: float, b: float, w: float) -> None:
    plan = build_schedule("zb-h1", p, m)
    step = dry_run(plan, {"F": f, "I": b, "W": w}).step_time
    assert step == m * (f + b + w) + (p - 1) * (f + b - w)
    ofob = dry_run(build_schedule("1f1b", p, m), {"F": f, "B": b + w}).step_time
    assert ofob == (m + p - 1) * (f + b + w)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_bubble_shrinks_with_chunks(p: int, v: int) -> None:
    # per-chunk costs f = 1, b = 2: m*v chunks of work plus a (p - 1)(f + b) bubble.
    for m in (p, 2 * p):
        plan = build_schedule("interleaved", p, m, stages_per_rank=v)
        assert dry_run(plan).step_time == (m * v + p - 1) * 3


# -- in-flight micro-batches -------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h1_in_flight_matches_1f1b_peak(p: int, m: int) -> None:
    zb, ofob = build_schedule("zb-h1", p, m), build_schedule("1f1b", p, m)
    zb_flight = [in_flight(a) for a in zb.schedule]
    ofob_flight = [in_flight(a) for a in ofob.schedule]
    assert zb_flight[0] == ofob_flight[0] == min(p, m)
    assert max(zb_flight) == max(ofob_flight) == min(p, m)
    # Later ranks spend 1F1B's peak allowance on deferred W. They must: if the last rank
    # ran F I W per micro-batch (1 in flight), its last F would start at
    # (p-1)f + (m-1)(f+b+w), and the I chain up plus rank 0's last W would end the step at
    # m(f+b+w) + (p-1)(f+b), 1F1B's time, not m(f+b+w) + (p-1)(f+b-w).
    assert zb_flight == [min(p, m)] * p


def test_interleaved_in_flight() -> None:
    # Megatron: rank r holds 2(P - r - 1) + (v - 1)P + 1 chunk-micro-batches at the peak.
    plan = build_schedule("interleaved", 4, 8, stages_per_rank=2)
    assert [in_flight(a) for a in plan.schedule] == [11, 9, 7, 5]


# -- Pfeife's looped schedule (B, N_l, B_l, B_f): the B.2 tuples on 4 devices -------------


def looped_tuple(b: int, n_l: int, b_l: int, b_f: tuple[int, ...]) -> Plan:
    return build_schedule("looped", 4, b, loops=n_l, loop_microbatches=b_l, prefetch=b_f)


def forwards_before_first_backward(plan: Plan) -> list[int]:
    return [next(i for i, a in enumerate(actions) if a.kind == "B")
            for actions in plan.schedule]


def test_looped_gpipe_tuple() -> None:
    plan = looped_tuple(8, 1, 8, (4, 5, 6, 7))
    assert plan.schedule == build_schedule("gpipe", 4, 8).schedule
    assert forwards_before_first_backward(plan) == [8, 8, 8, 8]


def test_looped_dapple_tuple_is_1f1b() -> None:
    plan = looped_tuple(6, 1, 6, (0, 0, 0, 0))
    assert plan.schedule == build_schedule("1f1b", 4, 6).schedule
    assert forwards_before_first_backward(plan) == [4, 3, 2, 1]


def test_looped_megatron_tuple_is_interleaved() -> None:
    plan = looped_tuple(8, 2, 4, (3, 2, 1, 0))
    assert plan.schedule == build_schedule("interleaved", 4, 8, stages_per_rank=2).schedule
    assert forwards_before_first_backward(plan) == [11, 9, 7, 5]


def test_looped_pipedream_tuple_clamps_loop_batch() -> None:
    # (7, 1, 8, ...): B_l = 8 > B = 7 is read as B_l = B (see looped's docstring).
    plan = looped_tuple(7, 1, 8, (0, 1, 1, 0))
    assert plan.schedule == looped_tuple(7, 1, 7, (0, 1, 1, 0)).schedule
    assert plan.meta["loop_microbatches"] == 7
    assert forwards_before_first_backward(plan) == [4, 4, 3, 1]
    assert plan.schedule != build_schedule("1f1b", 4, 7).schedule  # ranks 1, 2 prefetch one


def test_looped_terapipe_tuple() -> None:
    plan = looped_tuple(8, 2, 4, (0, 1, 2, 3))
    assert forwards_before_first_backward(plan) == [8, 8, 8, 8]
    assert picture(plan)[0] == (
        "F0 F1 F2 F3 F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B0 F4 B1 F5 B2 F6 B3 F7 "
        "B4 B5 B6 B7 B4 B5 B6 B7"
    )


def test_looped_bfs_tuple() -> None:
    # As printed, 20 of 32 forwards run before the first backward ...
    plan = looped_tuple(8, 4, 4, (4, 5, 6, 7))
    assert forwards_before_first_backward(plan) == [20, 20, 20, 20]
    # ... and with B_l = B the same prefetch gives the pure breadth-first schedule.
    bfs = looped_tuple(8, 4, 8, (4, 5, 6, 7))
    assert bfs.schedule == build_schedule("looped-bfs", 4, 8, stages_per_rank=4).schedule


def test_looped_figure_3() -> None:
    plan = looped_tuple(8, 2, 4, (2, 2, 1, 0))
    assert forwards_before_first_backward(plan) == [10, 9, 7, 5]
    assert plan.meta == {"schedule": "looped", "loops": 2, "loop_microbatches": 4,
                         "prefetch": [2, 2, 1, 0]}


# -- option errors -----------------------------------------------------------------------


def test_family_option_errors() -> None:
    with pytest.raises(PlanError, match=r"interleaved needs microbatches to be a multiple of "
                       r"num_ranks \(4\), got 6: use e.g. 8"):
        build_schedule("interleaved", 4, 6)
    with pytest.raises(PlanError, match="stages_per_rank must be a positive integer, got 0"):
        build_schedule("looped-bfs", 2, 2, stages_per_rank=0)
    with pytest.raises(PlanError, match=r"loop_microbatches \(3\) must divide microbatches "
                       r"\(8\); use one of \[1, 2, 4, 8\]"):
        build_schedule("looped", 2, 8, loop_microbatches=3)
    with pytest.raises(PlanError, match=r"prefetch must list 2 counts >= 0 \(one per rank\), "
                       r"got \(1,\)"):
        build_schedule("looped", 2, 8, prefetch=(1,))
    with pytest.raises(PlanError, match=r"prefetch must list 2 counts >= 0 .*got 3"):
        build_schedule("looped", 2, 8, prefetch=3)
    with pytest.raises(PlanError, match="looped needs a stage graph with 4 stages, got 2"):
        build_schedule("looped", 2, 4, loops=2, stage_graph=StageGraph.chain(2))
    with pytest.raises(PlanError, match="dag-1f1b: the stage graph has 4 stages for 3 ranks"):
        build_schedule("dag-1f1b", 3, 2, stage_graph=StageGraph.chain(4))
    with pytest.raises(PlanError, match=r"placement of stage 1 is \[5\]"):
        build_schedule("dag-1f1b", 2, 2, stage_graph=StageGraph.chain(2),
                       placement=[(0,), (5,)])


def test_looped_prefetch_that_deadlocks_is_rejected() -> None:
    # The last rank wants 6 forwards before its first backward; rank 2 stops after 2
    # to wait for a gradient: every stuck rank is named.
    with pytest.raises(PlanError) as info:
        looped_tuple(8, 1, 8, (0, 0, 0, 5))
    assert str(info.value) == (
        "deadlock: rank 0 at position 4 (B0.0) waits for gradient of edge 0->1 micro-batch 0 "
        "from rank 1, which is stuck at position 3 (B1.0); "
        "rank 1 at position 3 (B1.0) waits for gradient of edge 1->2 micro-batch 0 "
        "from rank 2, which is stuck at position 2 (B2.0); "
        "rank 2 at position 2 (B2.0) waits for gradient of edge 2->3 micro-batch 0 "
        "from rank 3, which is stuck at position 2 (F3.2); "
        "rank 3 at position 2 (F3.2) waits for activations of edge 2->3 micro-batch 2 "
        "from rank 2, which is stuck at position 2 (B2.0) "
        "(looped with B=8, N_l=1, B_l=8, B_f=(0, 0, 0, 5) cannot run: use loop_microbatches "
        ">= num_ranks, or change prefetch so that a rank never prefetches more than the rank "
        "before it sends)"
    )
    # Loop groups smaller than the pipeline leave too few forwards in flight.
    with pytest.raises(PlanError, match="^deadlock: .* use loop_microbatches >= num_ranks"):
        build_schedule("looped", 4, 4, loops=3, loop_microbatches=1)


def test_dag_1f1b_several_stages_per_rank_and_replicas() -> None:
    graph = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    plan = build_schedule("dag-1f1b", 3, 4, stage_graph=graph,
                          placement=[(0,), (1,), (1,), (2,)])
    # Both branches share rank 1: they alternate, each as 1F1B with depth 2.
    assert [str(a) for a in plan.schedule[1][:6]] == ["F1.0", "F1.1", "F2.0", "F2.1", "B1.0",
                                                      "B2.0"]
    chain = build_schedule("dag-1f1b", 3, 4, stage_graph=StageGraph.chain(3),
                           placement=[(0,), (1, 2), (0,)])
    assert chain.schedule[1] == chain.schedule[2]  # replicas run the same order
    skip = StageGraph.from_edges(4, [(0, 1), (1, 2), (2, 3), (0, 3)])
    assert build_schedule("dag-1f1b", 4, 6, stage_graph=skip).meta["depths"] == [4, 3, 2, 1]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "dag-1f1b"])
def test_one_stage_per_rank_families_on_dags(name: str) -> None:
    diamond = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)], nbytes=8)
    for m in (1, 2, 4, 8):
        plan = build_schedule(name, 4, m, stage_graph=diamond)
        assert plan.stage_graph is diamond


def test_dag_1f1b_random_dags_are_valid() -> None:
    # Random DAGs (edges go from lower to higher index), random placements with
    # replicas and shared ranks: every schedule validates and no stage holds more
    # micro-batches than its depth.
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(2, 6)
        edges = {(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.4}
        graph = StageGraph.from_edges(n, sorted(edges))
        ranks = rng.randint(1, n)
        placement = [tuple(sorted(rng.sample(range(ranks), rng.randint(1, min(2, ranks)))))
                     for _ in range(n)]
        m = rng.randint(1, 6)
        plan = build_schedule("dag-1f1b", ranks, m, stage_graph=graph, placement=placement)
        validate(plan)
        depth = plan.meta["depths"]
        for actions in plan.schedule:
            for s in {a.stage for a in actions}:
                assert in_flight([a for a in actions if a.stage == s]) == min(depth[s], m)

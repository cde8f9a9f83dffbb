"""The simulator: Pfeife's Figure 2, closed-form schedule times, memory, comm and DAG cases."""

from __future__ import annotations

import dataclasses

import pytest

from orgel.schedule import Costs, Link, Plan, PlanError, StageCost, StageGraph
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import TiedWeight
from orgel.schedule.text import parse_schedule
from orgel.sim import CompiledPlan, simulate


def make_plan(graph: StageGraph, placement: list[tuple[int, ...]], text: str,
              costs: Costs, recompute: list[bool] | None = None) -> Plan:
    schedule = parse_schedule(text)
    microbatches = 1 + max(a.microbatch for actions in schedule for a in actions)
    return Plan(graph, placement, len(schedule), microbatches, schedule,
                recompute=recompute or [], costs=costs)


def test_pfeife_figure_2() -> None:
    # Two nodes (v1 on device 1, v2 on device 2), two mini-batches; v1 = 15, v2 = 10,
    # communication 1, backward = 2 x forward. The figure's text: v2+2 waits for both
    # v2+1 and e+2 and starts at 31.
    plan = make_plan(
        StageGraph.chain(2, nbytes=1), [(0,), (1,)],
        "rank0: F0.0 F0.1 B0.0 B0.1\nrank1: F1.0 F1.1 B1.0 B1.1",
        Costs([StageCost(15, 30), StageCost(10, 20)], link=Link(latency=1)),
    )
    result = simulate(plan)
    starts = {e.label: e.start for e in result.timeline.events if e.track == "compute"}
    assert starts["F1.1"] == 31
    # In -> v1+1 -> v1+2 -> e+2 -> v2+2 -> v2-1 -> e-1 -> v1-1 -> v1-2 -> Out
    assert result.step_time == 15 + 15 + 1 + 10 + 20 + 1 + 30 + 30 == 122
    assert [(e.rank, e.label) for e in result.critical_path] == [
        (0, "F0.0"), (0, "F0.1"), (0, "act e0 mb1 ->r1"), (1, "F1.1"), (1, "B1.0"),
        (1, "grad e0 mb0 ->r0"), (0, "B0.0"), (0, "B0.1"),
    ]
    assert sum(e.duration for e in result.critical_path) == result.step_time


@pytest.mark.parametrize("p,m", [(4, 8), (3, 5), (2, 1), (4, 4)])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.5, 2.5)])
@pytest.mark.parametrize("family", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_closed_form(family: str, p: int, m: int, f: float, b: float) -> None:
    plan = build_schedule(family, p, m)
    result = simulate(plan, Costs.uniform(p, f, b))
    assert result.step_time == pytest.approx((m + p - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 3), (4, 12, 3)])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.5, 2.5)])
def test_interleaved_closed_form(p: int, m: int, v: int, f: float, b: float) -> None:
    plan = build_schedule("interleaved", p, m, stages_per_rank=v)
    result = simulate(plan, Costs.uniform(p * v, f / v, b / v))
    assert result.step_time == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)


@pytest.mark.parametrize("p,m", [(4, 8), (3, 6), (4, 4)])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5)])
def test_zb_h1_closed_form(p: int, m: int, f: float, b: float, w: float) -> None:
    # b is the input-grad (I) time, w the weight-grad (W) time
    plan = build_schedule("zb-h1", p, m)
    result = simulate(plan, Costs.uniform(p, f, b + w, bwd_weight=w))
    assert result.step_time == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))


def test_inflight_gpipe_keeps_all_microbatches_1f1b_keeps_p() -> None:
    costs = Costs.uniform(4, 1.0, 2.0, activations=100)
    gpipe = simulate(build_schedule("gpipe", 4, 8), costs)
    one_f_one_b = simulate(build_schedule("1f1b", 4, 8), costs)
    assert gpipe.peak_inflight == [8, 8, 8, 8]
    assert one_f_one_b.peak_inflight == [4, 3, 2, 1]
    assert gpipe.peak_memory[0] == 8 * 100
    assert one_f_one_b.peak_memory == [400, 300, 200, 100]


def test_memory_hand_computed() -> None:
    # stage0 on rank0: static 100 + 100 (grads) + 50 (optimizer), keeps 10, temporary 3
    # stage1 on rank1: static 1000 + 1000, keeps 20, temporary 5; edge of 7 bytes, latency 1
    costs = Costs(
        [StageCost(1, 2, params=100, optimizer=50, activations=10, temporary=3),
         StageCost(1, 2, params=1000, activations=20, temporary=5)],
        link=Link(latency=1),
    )
    plan = make_plan(StageGraph.chain(2, nbytes=7), [(0,), (1,)],
                     "rank0: F0.0 F0.1 B0.0 B0.1\nrank1: F1.0 B1.0 F1.1 B1.1", costs)
    result = simulate(plan)
    # rank0: F0.0 0-1, F0.1 1-2, B0.0 6-8, B0.1 9-11; rank1: F1.0 2-3, B1.0 3-5,
    # F1.1 5-6, B1.1 6-8; the gradient of mb1 arrives at 9.
    assert result.step_time == 11
    # Gradients exist from a stage's first backward on (the runtime drops them
    # before each step). rank0 peaks while B0.0 runs: params and optimizer (150)
    # + the gradients it makes (100) + two kept forwards (20) + temporary 3 = 273
    # (the gap before it holds 150 + 20 + the gradient of mb0 in flight, 7).
    # rank1 peaks while B1.0 runs: 2000 with its gradients + kept 20 + temporary
    # 5 + the activations of mb1 received 2-3 and waiting for F1.1 (7).
    assert result.peak_memory == [273, 2032]
    assert result.peak_inflight == [2, 1]
    assert CompiledPlan(plan).evaluate()[1].tolist() == [273, 2032]
    # gloo posts every receive at the step's start into buffers kept across steps:
    # two gradients (14) on rank0 all the time, and two activations (14) on rank1,
    # instead of each message from its transfer to its receiving action.
    kept = simulate(plan, receives_kept=True)
    assert kept.peak_memory == [273 + 14, 2032 - 7 + 14]
    assert CompiledPlan(plan).evaluate(receives_kept=True)[1].tolist() == [287, 2039]


def test_recompute_keeps_inputs_and_pays_forward_again() -> None:
    costs = Costs(
        [StageCost(1, 2, params=100, optimizer=50, activations=10, temporary=3),
         StageCost(1, 2, params=1000, activations=20, temporary=5)],
        link=Link(latency=1),
    )
    plan = make_plan(StageGraph.chain(2, nbytes=7), [(0,), (1,)],
                     "rank0: F0.0 F0.1 B0.0 B0.1\nrank1: F1.0 B1.0 F1.1 B1.1", costs,
                     recompute=[False, True])
    result = simulate(plan)
    # B1.x take 1 + 2: rank1 F1.0 2-3, B1.0 3-6, F1.1 6-7, B1.1 7-10; B0.1 11-13.
    assert result.step_time == 13
    # rank1 during B1.0: kept input 7 + temporary 5 + rebuilt activations 20 + mb1's
    # activations waiting in the receive buffer 7.
    assert result.peak_memory[1] == 2000 + 7 + 5 + 20 + 7


def test_comm_latency_shifts_step_time() -> None:
    # 1F1B on 2 ranks, 2 micro-batches, f=1 b=2, every message takes 0.5:
    # rank1 F1.0 1.5-2.5, B1.0 2.5-4.5, F1.1 4.5-5.5, B1.1 5.5-7.5; grad of mb1
    # reaches rank0 at 8, B0.1 8-10. Two extra hops on the critical path: 9 + 2 x 0.5.
    plan = build_schedule("1f1b", 2, 2, nbytes=1)
    result = simulate(plan, Costs.uniform(2, 1.0, 2.0, latency=0.5))
    assert result.step_time == 10
    labels = [e.label for e in result.critical_path]
    assert labels == ["F0.0", "act e0 mb0 ->r1", "F1.0", "B1.0", "F1.1", "B1.1",
                      "grad e0 mb1 ->r0", "B0.1"]


def test_link_bandwidth_per_pair() -> None:
    plan = build_schedule("gpipe", 2, 1, nbytes=1 << 20)
    costs = Costs.uniform(2, 1.0, 2.0)
    costs.links[(0, 1)] = Link(latency=0.25, per_mib=2.0)  # forward direction only
    assert simulate(plan, costs).step_time == 6 + 2.25


def test_diamond_branches_overlap() -> None:
    graph = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    costs = Costs.uniform(4, 1.0, 2.0)
    apart = make_plan(graph, [(0,), (1,), (2,), (3,)],
                      "rank0: F0.0 B0.0\nrank1: F1.0 B1.0\nrank2: F2.0 B2.0\n"
                      "rank3: F3.0 B3.0", costs)
    result = simulate(apart)
    starts = {e.label: e.start for e in result.timeline.events}
    assert starts["F1.0"] == starts["F2.0"] == 1
    assert starts["B1.0"] == starts["B2.0"] == 5
    assert result.step_time == 9
    together = make_plan(graph, [(0,), (1,), (1,), (2,)],
                         "rank0: F0.0 B0.0\nrank1: F1.0 F2.0 B1.0 B2.0\nrank2: F3.0 B3.0",
                         costs)
    assert simulate(together).step_time == 12


def test_data_parallel_stage_halves_work_and_all_reduces() -> None:
    # stage1 on ranks 1 and 2: each replica does half; then a ring all-reduce of
    # 1 MiB of gradients over 2 ranks: 2 x (2-1) steps of 0.5 MiB at 4 ms/MiB = 4.
    costs = Costs([StageCost(1, 2), StageCost(2, 4, params=1 << 20, activations=10)],
                  link=Link(per_mib=4.0))
    plan = make_plan(StageGraph.chain(2), [(0,), (1, 2)],
                     "rank0: F0.0 B0.0\nrank1: F1.0 B1.0\nrank2: F1.0 B1.0", costs)
    result = simulate(plan)
    events = {(e.rank, e.label): e for e in result.timeline.events}
    assert (events[(1, "F1.0")].start, events[(1, "F1.0")].end) == (1, 2)
    assert (events[(2, "B1.0")].start, events[(2, "B1.0")].end) == (2, 4)
    assert (events[(1, "allreduce s1")].start, events[(1, "allreduce s1")].end) == (4, 8)
    assert result.step_time == 8
    assert result.critical_path[-1].label == "allreduce s1"
    assert result.peak_memory == [0, 2 * (1 << 20) + 5, 2 * (1 << 20) + 5]


def test_tied_weights_all_reduce() -> None:
    costs = Costs.uniform(2, 1.0, 2.0)
    costs.link = Link(latency=0.5)
    plan = dataclasses.replace(build_schedule("1f1b", 2, 2), tied=[TiedWeight("w", (0, 1), 64)])
    result = simulate(plan, costs)
    # last backward on rank0 ends at 9; ring of 2: 2 steps of 32 bytes at 0.5 each
    assert result.step_time == 9 + 1
    data = plan.to_dict()
    data["tied_weights"] = [{"stages": [0, 1]}]
    with pytest.raises(PlanError, match=r"tied_weights\[0\] must look like"):
        Plan.from_dict(data)
    data["tied_weights"] = [{"name": "w", "stages": [0, 2], "nbytes": 64}]
    with pytest.raises(PlanError, match="needs at least two of the 2 stages"):
        Plan.from_dict(data)


def test_tied_bytes_leave_a_replicated_stage_all_reduce() -> None:
    # stage1 on ranks 1 and 2 holds 1 MiB of gradients, 0.25 MiB of which is a
    # weight tied with stage0: the runtime reduces the tied weight over ranks
    # 0-2 and the rest (0.75 MiB) over the stage's replicas, never both.
    costs = Costs([StageCost(1, 2), StageCost(2, 4, params=1 << 20)], link=Link(per_mib=4.0))
    plan = make_plan(StageGraph.chain(2), [(0,), (1, 2)],
                     "rank0: F0.0 B0.0\nrank1: F1.0 B1.0\nrank2: F1.0 B1.0", costs)
    plan = dataclasses.replace(plan, tied=[TiedWeight("w", (0, 1), 1 << 18)])
    events = {(e.rank, e.label): e for e in simulate(plan).timeline.events}
    stage = events[(1, "allreduce s1")]
    assert stage.end - stage.start == pytest.approx(2 * 1 * 4.0 * 0.375)  # 0.75 MiB / 2
    tied = events[(0, "allreduce tied0")]
    assert tied.end - tied.start == pytest.approx(2 * 2 * 4.0 * (0.25 / 3), rel=1e-3)


def test_deadlock_is_reported() -> None:
    plan = make_plan(StageGraph.chain(2), [(0,), (1,)],
                     "rank0: F0.0 B0.0 F0.1 B0.1\nrank1: F1.0 F1.1 B1.0 B1.1",
                     Costs.uniform(2, 1.0, 2.0))
    with pytest.raises(PlanError, match="deadlock: rank 0 at position 1 \\(B0.0\\)"):
        simulate(plan)  # validate's dry run says it first
    with pytest.raises(PlanError, match="deadlocks: rank 0 at position 1 \\(B0.0\\)"):
        simulate(plan, check=False)  # the op graph has a cycle
    with pytest.raises(PlanError, match="waiting for a message from rank 1"):
        CompiledPlan(plan)


def test_missing_costs_say_what_to_pass() -> None:
    plan = build_schedule("gpipe", 2, 2)
    with pytest.raises(PlanError, match="pass costs="):
        simulate(plan)
    with pytest.raises(PlanError, match="one StageCost per stage"):
        simulate(plan, Costs.uniform(3, 1.0, 2.0))
    with pytest.raises(PlanError, match="times must be >= 0"):
        simulate(plan, Costs.uniform(2, -1.0, 2.0))
    # bwd_weight matters only to stages that run I/W
    assert simulate(plan, Costs.uniform(2, 1.0, 2.0, bwd_weight=3.0)).step_time == 9
    with pytest.raises(PlanError, match="bwd_weight <= bwd"):
        simulate(build_schedule("zb-h1", 2, 2), Costs.uniform(2, 1.0, 2.0, bwd_weight=3.0))


def test_split_backward_and_overhead() -> None:
    # one rank, one stage: F, I (bwd - wgrad) and W (wgrad), each plus overhead
    costs = Costs([StageCost(1.0, 3.0, bwd_weight=1.0, activations=8)], action_overhead=0.25)
    plan = make_plan(StageGraph.chain(1), [(0,)], "rank0: F0.0 I0.0 F0.1 W0.0 I0.1 W0.1",
                     costs)
    result = simulate(plan)
    durations = [e.duration for e in result.timeline.on(0)]
    assert durations == [1.25, 2.25, 1.25, 1.25, 2.25, 1.25]
    assert result.step_time == 9.5
    assert result.busy == [1.0]
    assert result.peak_inflight == [2]  # W frees, I does not


@pytest.mark.parametrize("family", ["gpipe", "1f1b"])
def test_compiled_evaluate_matches_simulate(family: str) -> None:
    import random

    rng = random.Random(7)
    plan = build_schedule(family, 4, 6, nbytes=3 << 19)
    compiled = CompiledPlan(plan)
    assert compiled.num_ops >= 64  # exercises the straight-line path
    for _ in range(5):
        costs = Costs(
            [StageCost(rng.uniform(0.5, 2), rng.uniform(1, 4), params=rng.randrange(1000),
                       activations=rng.randrange(1000), temporary=rng.randrange(100))
             for _ in range(4)],
            link=Link(latency=rng.uniform(0, 0.5), per_mib=rng.uniform(0, 1)),
        )
        step, peak = compiled.evaluate(costs)
        full = simulate(plan, costs, compiled=compiled)
        assert step == pytest.approx(full.step_time, abs=1e-9)
        assert peak.tolist() == full.peak_memory
    # per-stage arrays override the costs' durations
    uniform = Costs.uniform(4, 1.0, 2.0)
    step, _ = compiled.evaluate(uniform, fwd=[2.0] * 4, bwd=[4.0] * 4,
                                edge_bytes=[0, 0, 0])
    assert step == pytest.approx((6 + 4 - 1) * 6.0)


def test_dag_1f1b_diamond_overlaps_branches() -> None:
    graph = StageGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    plan = build_schedule("dag-1f1b", 4, 4, stage_graph=graph)
    result = simulate(plan, Costs.uniform(4, 1.0, 2.0))
    starts = {e.label: e.start for e in result.timeline.events}
    for m in range(4):
        assert starts[f"F1.{m}"] == starts[f"F2.{m}"]  # the two branches run side by side
    # a chain of three stages' worth of fill and drain: (m + 3 - 1)(f + b)
    assert result.step_time == (4 + 3 - 1) * 3


def test_data_parallel_consumer_gets_its_rows() -> None:
    # stage0 on rank0 sends 2 MiB per micro-batch to stage1 on ranks 1 and 2: each
    # replica receives its half (1 MiB = 1 ms at 1 ms/MiB), both at once.
    costs = Costs([StageCost(1, 2), StageCost(2, 4)], link=Link(per_mib=1.0))
    plan = make_plan(StageGraph.chain(2, nbytes=2 << 20), [(0,), (1, 2)],
                     "rank0: F0.0 B0.0\nrank1: F1.0 B1.0\nrank2: F1.0 B1.0", costs)
    result = simulate(plan)
    comm = sorted((e.label, e.start, e.end) for e in result.timeline.events
                  if e.track == "comm")
    assert comm == [("act e0 mb0 ->r1", 1, 2), ("act e0 mb0 ->r2", 1, 2),
                    ("grad e0 mb0 ->r0", 5, 6), ("grad e0 mb0 ->r0", 5, 6)]
    # F0 1, send 1, F1 1, B1 2, gradients 1, B0 2
    assert result.step_time == 8


def test_evaluate_follows_new_links_and_edge_bytes() -> None:
    compiled = CompiledPlan(build_schedule("gpipe", 2, 1, nbytes=1 << 20))
    base = Costs.uniform(2, 1.0, 2.0)
    assert compiled.evaluate(base)[0] == 6
    slow = Costs.uniform(2, 1.0, 2.0)
    slow.links = {(0, 1): Link(per_mib=2.0), (1, 0): Link(per_mib=1.0)}
    assert compiled.evaluate(slow)[0] == 6 + 2 + 1
    assert compiled.evaluate(slow, edge_bytes=[2 << 20])[0] == 6 + 4 + 2
    assert compiled.evaluate(slow)[0] == 6 + 2 + 1
    assert compiled.evaluate(base)[0] == 6


def test_gradients_exist_from_the_first_backward() -> None:
    # Two stages on one rank: stage0 holds 1000 bytes of parameters, stage1 none
    # but a 5000-byte temporary. F1.0 and B1.0 peak at 1000 + kept 200 + 5000,
    # before B0.0 makes stage0's gradients (the runtime drops them before each
    # step); counted from the step's start they would add 1000 there.
    costs = Costs([StageCost(1, 2, params=1000, activations=100),
                   StageCost(1, 2, activations=100, temporary=5000)])
    plan = make_plan(StageGraph.chain(2), [(0,), (0,)], "rank0: F0.0 F1.0 B1.0 B0.0", costs)
    assert simulate(plan).peak_memory == [6200]
    # The step still ends holding every gradient: a floor of params + grads.
    idle = make_plan(StageGraph.chain(2), [(0,), (0,)], "rank0: F0.0 F1.0 B1.0 B0.0",
                     Costs([StageCost(1, 2, params=1000), StageCost(1, 2)]))
    assert simulate(idle).peak_memory == [2000]


def test_weight_kept_lives_from_i_to_w() -> None:
    # One stage on one rank, zero-bubble order F0 F1 I0 I1 W0 W1: activations (10)
    # live from F to W; what I keeps for W (100) lives from I to W only, so the
    # peak is 2 x 10 + 2 x 100 during I1..W0, not counted from F on.
    plan = make_plan(StageGraph.chain(1), [(0,)], "rank0: F0.0 F0.1 I0.0 I0.1 W0.0 W0.1",
                     Costs([StageCost(1, 2, activations=10, weight_kept=100)]))
    assert simulate(plan).peak_memory == [220]
    plain = make_plan(StageGraph.chain(1), [(0,)], "rank0: F0.0 I0.0 W0.0 F0.1 I0.1 W0.1",
                      Costs([StageCost(1, 2, activations=10, weight_kept=100)]))
    assert simulate(plain).peak_memory == [110]
    again = Costs.from_dict(plan.costs.to_dict())
    assert again.stages[0].weight_kept == 100


def test_first_backward_frees_activations_as_it_makes_gradients() -> None:
    # One stage, GPipe order F0 F1 B0 B1: params 1000 (grads 1000), activations
    # 300 per micro-batch. B0 holds both micro-batches' activations and makes the
    # gradients: 1000 + 600 + 1000 counted in full; the overlap (200) is what
    # freeing B0's own activations as it goes saves. Then B1: 300 + 2000.
    def peak(overlap: int, text: str) -> int:
        costs = Costs([StageCost(1, 2, params=1000, activations=300, grad_overlap=overlap)])
        return simulate(make_plan(StageGraph.chain(1), [(0,)], text, costs)).peak_memory[0]

    gpipe = "rank0: F0.0 F0.1 B0.0 B0.1"
    assert (peak(0, gpipe), peak(200, gpipe)) == (2600, 2400)
    # A split backward's W frees its graph only when it ends: no overlap there.
    split = "rank0: F0.0 F0.1 I0.0 I0.1 W0.0 W0.1"
    assert peak(200, split) == peak(0, split) == 2600
    again = Costs.from_dict(Costs([StageCost(1, 2, grad_overlap=7)]).to_dict())
    assert again.stages[0].grad_overlap == 7

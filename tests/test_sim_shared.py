"""Ranks that share a host's cores: the step is at least their compute spread over the cores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from orgel.costs.blocks import BlockCosts, chain_split, stage_costs
from orgel.costs.fields import CostsFileError
from orgel.plan.planner import plan
from orgel.plan.predict import end_of_step
from orgel.profile import workload as profile_mod
from orgel.schedule.costs import Costs, Link
from orgel.schedule.families import build_schedule
from orgel.sim import simulate
from orgel.sim.sharing import mean_overlap, shared_step


def chain(fwd: list[float], *, cores: float | None) -> BlockCosts:
    return BlockCosts(fwd=fwd, bwd=[2.0 * f for f in fwd], wgrad=[f for f in fwd],
                      params=[1 << 20] * len(fwd), activations=[1 << 16] * len(fwd),
                      output=[1 << 12] * len(fwd), temporary=[0] * len(fwd),
                      edges=[(i, i + 1) for i in range(len(fwd) - 1)],
                      link=Link(latency=0.01, per_mib=0.01), action_overhead=0.05,
                      optimizer_ms=[0.5] * len(fwd), cores=cores)


def one_f_one_b(bc: BlockCosts, points: tuple[int, ...], ranks: int, mb: int) -> Costs:
    return stage_costs(bc, chain_split(points, bc.num_blocks))


def test_shared_step_counts_only_ranks_beyond_the_cores() -> None:
    assert shared_step(100.0, 4, None) == 0.0  # own devices
    assert shared_step(100.0, 2, 2.0) == 0.0  # a core each: the schedule decides
    assert shared_step(100.0, 4, 2.0) == pytest.approx(50.0)
    assert shared_step(90.0, 4, 1.5) == pytest.approx(60.0)


def test_mean_overlap_counts_the_intervals_open_during_each() -> None:
    start = np.array([0.0, 0.0, 1.0, 3.0])
    end = np.array([2.0, 4.0, 3.0, 4.0])
    # [0,2]: itself and [0,4] all along, [1,3] half of it; touching ends do not overlap
    assert list(mean_overlap(start, end)) == pytest.approx([2.5, 2.25, 2.5, 2.0])


@pytest.mark.parametrize("cores", [None, 4.0, 2.0, 1.0])
def test_ranks_on_fewer_cores_slow_down_by_how_many_compute_at_once(
        cores: float | None) -> None:
    bc = chain([1.0] * 8, cores=cores)
    costs = one_f_one_b(bc, (2, 4, 6), 4, 8)
    p = build_schedule("1f1b", 4, 8)
    alone = simulate(p, Costs(stages=costs.stages, link=costs.link,
                              action_overhead=costs.action_overhead))
    shared = simulate(p, costs)
    compute = sum(e.duration for e in alone.timeline.events if e.kind in "FBIW")
    if cores is None or cores >= 4:
        assert shared.step_time == pytest.approx(alone.step_time)
        return
    # at least the compute spread over the cores, at most every action 4 / cores slower
    assert compute / cores - 1e-9 <= shared.step_time < alone.step_time * 4 / cores
    assert shared.step_time > 1.2 * alone.step_time
    stretched = [e.duration for e in shared.timeline.events if e.kind in "FBIW"]
    assert max(stretched) <= 4 / cores * max(e.duration for e in alone.timeline.events) + 1e-9


def test_on_crowded_cores_a_bubble_is_where_the_other_ranks_run() -> None:
    # An uneven chain: the equal split leaves one rank far behind, the balanced
    # split removes it. With a core per rank balance wins by the imbalance; with
    # 4 ranks on 1 core the ranks that wait give the core to the one behind.
    fwd = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0, 4.0]
    p = build_schedule("1f1b", 4, 8)
    ratio = {}
    for cores in (None, 2.0, 1.0):
        bc = chain(fwd, cores=cores)
        equal = simulate(p, one_f_one_b(bc, (2, 4, 6), 4, 8)).step_time
        balanced = simulate(p, one_f_one_b(bc, (4, 6, 7), 4, 8))
        ratio[cores] = equal / balanced.step_time
        if cores == 1.0:  # one core: the balanced plan keeps it busy all the step
            compute = sum(1.0 + 2.0 for _ in range(8)) * sum(fwd) + 32 * 2 * 0.05
            assert balanced.step_time == pytest.approx(compute, rel=0.02)
    assert ratio[None] > 1.5
    assert ratio[None] > ratio[2.0] > ratio[1.0]
    assert ratio[1.0] < 1.1


def test_the_optimizer_steps_take_turns_on_shared_cores() -> None:
    # 4 ranks x 4 blocks x 0.5 ms of optimizer each: 2 ms at once, 4 ms on 2 cores
    ends = {}
    for cores in (None, 2.0):
        bc = chain([1.0] * 16, cores=cores)
        ends[cores] = end_of_step(bc, plan(bc, 4, 4, planner="uniform-layers").plan)
    fixed = 2 * 2 * 0.01  # two all-reduce rounds of the link's latency
    assert ends[None] == pytest.approx(fixed + 2.0)
    assert ends[2.0] == pytest.approx(fixed + 4.0)


def test_the_planner_predicts_no_gain_from_balance_when_the_cores_bind() -> None:
    fwd = [1.0] * 12 + [6.0] * 2  # a heavy head on the last blocks
    free = plan(chain(fwd, cores=None), 4, 8)
    crowded = plan(chain(fwd, cores=1.0), 4, 8)
    assert free.baselines["uniform-layers"] > 1.3 * free.step_time
    assert crowded.baselines["uniform-layers"] < 1.1 * crowded.step_time


def test_cores_round_trip_through_the_costs_file(tmp_path: object) -> None:
    bc = chain([1.0, 2.0], cores=1.5)
    again = BlockCosts.from_dict(json.loads(json.dumps(bc.to_dict())))
    assert again.cores == 1.5
    assert stage_costs(again, [[0], [1]]).cores == 1.5
    assert Costs.from_dict(stage_costs(again, [[0], [1]]).to_dict()).cores == 1.5
    assert "cores" not in chain([1.0], cores=None).to_dict()
    with pytest.raises(CostsFileError, match="'cores' must be a positive number"):
        chain([1.0], cores=0.0)


def test_the_profile_gives_cpu_ranks_the_cores_over_their_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile_mod.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert profile_mod.shared_cores(torch.device("cpu"), 1) == 2.0
    assert profile_mod.shared_cores(torch.device("cpu"), 2) == 1.0
    gpus = float(max(1, torch.cuda.device_count()))  # ranks beyond the GPUs share them
    assert profile_mod.shared_cores(torch.device("cuda"), 1) == gpus

"""The scorer's memory floor never exceeds the simulated peak, so pruning by it is exact."""

from __future__ import annotations

import numpy as np
import pytest

from orgel.costs.blocks import BlockCosts, chain_split
from orgel.plan.floor import memory_floor, stage_peak_alive
from orgel.plan.scorer import Scorer
from orgel.plan.templates import build_template, template_specs
from orgel.schedule.costs import Link


def table(n: int = 12) -> BlockCosts:
    fwd = [1.0 + (i % 3) * 0.5 for i in range(n)]
    return BlockCosts(fwd=fwd, bwd=[2.1 * f for f in fwd], wgrad=[0.9 * f for f in fwd],
                      params=[(1 << 22) + i * 4096 for i in range(n)],
                      activations=[(1 << 21) * (1 + i % 3) for i in range(n)],
                      output=[1 << 18] * n, temporary=[1 << 16] * n,
                      edges=[*[(i, i + 1) for i in range(n - 1)], (0, 5)],
                      link=Link(latency=0.01, per_mib=0.05), optimizer_factor=4.0)


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "zb-h1", "interleaved", "looped-bfs"])
def test_floor_is_below_the_simulated_peak(family: str) -> None:
    costs = table()
    scorer = Scorer(costs, memory=None)
    rng = np.random.default_rng(1)
    for spec in template_specs(3, 6, costs.num_blocks, max_loops=2, families=[family]):
        t = build_template(spec, 3, 6)
        if t is None:
            continue
        n = t.num_stages
        for _ in range(4):
            points = tuple(sorted(int(x) for x in rng.choice(np.arange(1, 12), n - 1,
                                                              replace=False)))
            recompute = tuple(bool(x) for x in rng.integers(0, 2, n))
            score = scorer.score_chain(t, points, recompute)
            graph = scorer._graph_for(chain_split(points, costs.num_blocks), t)
            edge_bytes = np.array([e.nbytes for e in graph.edges], dtype=np.int64)
            stages = scorer.chain_stage_costs(points, split=t.splits_backward)
            alive = stage_peak_alive(t.base.schedule, n)
            floor = memory_floor(alive, t.placement, t.base.num_ranks, stages,
                                 [(e.src, e.dst) for e in graph.edges], edge_bytes, recompute)
            assert (floor <= score.peak_memory + 1).all()
            assert floor.max() > 0


def test_pruned_candidates_are_the_ones_that_do_not_fit() -> None:
    costs = table()
    free = Scorer(costs, memory=None)
    t = build_template(template_specs(3, 6, 12, max_loops=1, families=["1f1b"])[0], 3, 6)
    assert t is not None
    peak = free.score_chain(t, (4, 8)).peak_memory.max()
    tight = Scorer(costs, memory=int(peak) - 1)
    assert not tight.score_chain(t, (4, 8)).feasible
    roomy = Scorer(costs, memory=int(peak))
    got = roomy.score_chain(t, (4, 8))
    assert got.feasible and roomy.pruned == 0
    assert got.step_time == free.score_chain(t, (4, 8)).step_time


def test_a_templates_arrays_are_its_own_when_another_had_its_id() -> None:
    """The scorer caches per-template arrays (each stage's most micro-batches alive, the rank
    shares) by the template's id; a template freed and a new one given its id must not get
    the old arrays (orgel plan of a 70B model on 64 ranks failed: "operands could not be
    broadcast together with shapes (42,) (41,)")."""
    costs = table()
    scorer = Scorer(costs, memory=1 << 40)
    specs = template_specs(3, 6, 12, max_loops=2, families=["1f1b", "interleaved"])
    small, large = (build_template(s, 3, 6) for s in specs[:2])
    assert small is not None and large is not None and small.num_stages != large.num_stages
    # as if ``small`` had been freed and ``large`` made at its address
    scorer._arrays[("alive", id(large))] = (small, stage_peak_alive(small.base.schedule,
                                                                    small.num_stages))
    scorer._arrays[("share", id(large))] = (small, scorer._share_matrix(small))
    points = tuple(range(2, 12, 12 // large.num_stages))[:large.num_stages - 1]
    assert scorer.score_chain(large, points).peak_memory.max() > 0
    assert scorer._share_matrix(large).shape == (large.num_stages, large.base.num_ranks)

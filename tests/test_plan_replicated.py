"""Data-parallel replicas priced from one pipeline equal the simulation of every rank."""

from __future__ import annotations

import pytest

from orgel.costs.blocks import BlockCosts, chain_split
from orgel.costs.tied import TiedGroup
from orgel.plan.predict import replicated
from orgel.plan.replicated import replica_step
from orgel.plan.scorer import Scorer
from orgel.plan.templates import build_template, template_specs
from orgel.schedule.costs import Link
from orgel.sim import simulate


def table(n: int = 12, *, tied: bool = False, node_ranks: int | None = 4,
          cores: float | None = None) -> BlockCosts:
    """An uneven chain with a skip edge, on nodes of ``node_ranks`` ranks with a slow link."""
    fwd = [1.0 + (i % 3) * 0.5 for i in range(n)]
    groups = [TiedGroup((0, n - 1), 1 << 22, "emb")] if tied else []
    return BlockCosts(fwd=fwd, bwd=[2.1 * f for f in fwd], wgrad=[0.9 * f for f in fwd],
                      params=[(1 << 22) + i * 4096 for i in range(n)],
                      activations=[(1 << 20) * (1 + i % 2) for i in range(n)],
                      output=[1 << 18] * n, temporary=[1 << 16] * n,
                      edges=[*[(i, i + 1) for i in range(n - 1)], (0, 4)],
                      link=Link(latency=0.01, per_mib=0.01), node_ranks=node_ranks,
                      node_link=Link(latency=0.05, per_mib=0.2), tied=groups, cores=cores)


@pytest.mark.parametrize("family", ["1f1b", "zb-h1", "interleaved"])
@pytest.mark.parametrize(("ranks", "dp", "tied", "cores"),
                         [(4, 2, False, None), (4, 3, True, None), (2, 4, False, None),
                          (4, 2, False, 3.0)])
def test_replica_step_equals_the_full_simulation(family: str, ranks: int, dp: int,
                                                 tied: bool, cores: float | None) -> None:
    costs = table(tied=tied, cores=cores)  # cores: all ranks take turns on 3
    scorer = Scorer(costs.scaled(1.0 / dp), memory=None)
    spec = next(s for s in template_specs(ranks, 8, costs.num_blocks, max_loops=2,
                                          families=[family]) if s.family == family)
    template = build_template(spec, ranks, 8)
    assert template is not None
    n = template.num_stages
    points = tuple(round(costs.num_blocks * (i + 1) / n) for i in range(n - 1))
    single = scorer.to_plan(template, chain_split(points, costs.num_blocks))
    whole = replicated(single, dp, costs, None)
    got = replica_step(single, whole)
    assert got is not None
    full = simulate(whole)
    assert got[0] == pytest.approx(full.step_time, rel=1e-9)
    assert list(got[1]) == pytest.approx(full.peak_memory, abs=dp * n * 4)  # rounding of shares
    assert len(got[1]) == ranks * dp


@pytest.mark.parametrize("family", ["1f1b", "zb-h1"])
def test_replicated_step_peaks_as_predict_reports(family: str) -> None:
    """What the planner checks against the cap is what ``predict`` reports: with the sends
    a rank holds and the step's end on the replicated placement (the gradients' flat copy
    for the all-reduce), which one replica's simulation leaves out."""
    from orgel.plan.predict import predict
    from orgel.plan.replicated import replicated_step

    costs = table()
    scorer = Scorer(costs.scaled(0.5), memory=None)
    spec = next(s for s in template_specs(2, 4, costs.num_blocks, max_loops=1,
                                          families=[family]) if s.family == family)
    template = build_template(spec, 2, 4)
    assert template is not None
    single = scorer.to_plan(template, chain_split((6,), costs.num_blocks))
    whole = replicated(single, 2, costs, None)
    step, peak = replicated_step(single, whole, costs)
    want = predict(whole, costs)
    assert list(peak) == pytest.approx(want.peak_memory, abs=64)
    assert max(peak) > max(simulate(whole).peak_memory)  # more than the simulation alone


def test_replicas_on_different_links_are_simulated_in_full() -> None:
    # 3-rank pipelines on 4-rank nodes: replica 1's first hop crosses a node, replica 0's not
    costs = table()
    scorer = Scorer(costs.scaled(0.5), memory=None)
    template = build_template(template_specs(3, 6, 12, max_loops=1, families=["1f1b"])[0], 3, 6)
    assert template is not None
    single = scorer.to_plan(template, chain_split((4, 8), 12))
    assert replica_step(single, replicated(single, 2, costs, None)) is None


@pytest.mark.parametrize(("dp", "shard"), [(2, "none"), (4, "fsdp")])
def test_the_search_and_the_report_count_one_peak(dp: int, shard: str) -> None:
    """A backward frees its micro-batch's activations as it makes the gradients: a
    replica frees its share of them. The search prices a replicated plan from one
    replica's pipeline, the report simulates every replica: one figure (issue 36: 77.2
    against 82.8 GiB for the 405B 1024-GPU row, where large gradients meet activations)."""
    from orgel.plan.predict import predict
    from orgel.plan.replicated import replicated_step

    n = 8  # activations four times the parameters: the backward's overlap is its share's
    costs = BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n, params=[1 << 20] * n,
                       activations=[1 << 22] * n, output=[1 << 16] * n, temporary=[0] * n,
                       edges=[(i, i + 1) for i in range(n - 1)],
                       link=Link(latency=0.01, per_mib=0.01))
    scorer = Scorer(costs.scaled(1.0 / dp), memory=None)
    # as many micro-batches as ranks: rank 0 peaks in its first backward
    spec = next(s for s in template_specs(2, 2, n, max_loops=1, families=["1f1b"]))
    template = build_template(spec, 2, 2)
    assert template is not None
    single = scorer.to_plan(template, chain_split((4,), n))
    whole = replicated(single, dp, costs, None, shard)
    _, peak = replicated_step(single, whole, costs)
    assert list(peak) == pytest.approx(predict(whole, costs).peak_memory, abs=64)

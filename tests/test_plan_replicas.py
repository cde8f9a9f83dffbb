"""Replicas: dp=1 never replicates the whole pipeline, max_replicas, micro-batch rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orgel.costs.blocks import BlockCosts
from orgel.plan import auto_plan, plan
from orgel.plan.replicas import StageSpec, replica_counts, spread_replicas
from orgel.profile.workload import capture_workload
from orgel.workload import Workload


def diamond(params: int = 1 << 10) -> BlockCosts:
    """Two branches between a head and a tail; cheap parameters (replicas are cheap)."""
    fwd = [1.0, 4.0, 4.0, 4.0, 4.0, 1.0]
    return BlockCosts(fwd=fwd, bwd=[2 * f for f in fwd], wgrad=list(fwd), params=[params] * 6,
                      activations=[1 << 20] * 6, output=[1 << 16] * 6, temporary=[0] * 6,
                      edges=[(0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 5)])


def chain(n: int = 6) -> BlockCosts:
    """A chain with one heavy block, so replicating that stage pays."""
    fwd = [1.0] * n
    fwd[n // 2] = 12.0
    return BlockCosts(fwd=fwd, bwd=[2 * f for f in fwd], wgrad=list(fwd), params=[1 << 10] * n,
                      activations=[1 << 20] * n, output=[1 << 16] * n, temporary=[0] * n,
                      edges=[(0, 1), (0, 2), *[(i, i + 1) for i in range(1, n - 1)]])


def replicated(placement: list[tuple[int, ...]]) -> bool:
    return all(len(r) > 1 for r in placement)


@pytest.mark.parametrize("planner", ["graph", "auto"])
def test_dp1_never_replicates_the_whole_pipeline(planner: str) -> None:
    # With cheap parameters, pure data parallelism is the fastest layout ...
    free = plan(diamond(), 2, 4, planner=planner, dp=None)
    assert free.plan.placement == [(0, 1)]
    # ... but dp=1 means no replication of the whole pipeline: a real pipeline.
    got = plan(diamond(), 2, 4, planner=planner, dp=1)
    assert not replicated(got.plan.placement)
    assert got.plan.num_stages >= 2


def test_intra_stage_replicas_allowed_unless_max_replicas_1() -> None:
    got = plan(chain(), 3, 6, planner="graph")
    counts = sorted(len(r) for r in got.plan.placement)
    assert counts[0] == 1 and counts[-1] == 2  # the heavy stage gets two ranks
    pure = plan(chain(), 3, 6, planner="graph", max_replicas=1)
    assert all(len(r) == 1 for r in pure.plan.placement)


def test_replicas_divide_the_microbatch_rows() -> None:
    # 3 rows per micro-batch: 2 replicas cannot split it, so the heavy stage gets none
    # (3 replicas would leave no rank for the other stages).
    got = plan(chain(), 3, 6, planner="graph", rows=3)
    assert all(3 % len(r) == 0 for r in got.plan.placement)
    assert max(len(r) for r in got.plan.placement) != 2
    assert replica_counts(4, rows=6) == [1, 2, 3] and replica_counts(4, max_replicas=2) == [1, 2]
    # dp as well: dp=None skips degrees that do not divide the rows.
    assert plan(diamond(), 2, 4, dp=None, rows=3).plan.placement != [(0, 1)]
    assert plan(diamond(), 2, 4, dp=None, rows=4).plan.placement == [(0, 1)]


def test_spread_replicas_jumps_to_an_allowed_count() -> None:
    bc = chain()
    stages = [StageSpec((0, 1, 2), 1), StageSpec((3,), 1), StageSpec((4, 5), 1)]
    out = spread_replicas(bc, stages, 6, 8, all_ranks=True, counts=[1, 3], pure_dp=False)
    assert sorted(s.replicas for s in out) == [1, 1, 3]
    out = spread_replicas(bc, [StageSpec(tuple(range(6)), 1)], 2, 8, all_ranks=True,
                           pure_dp=False)
    assert [s.replicas for s in out] == [1]  # the only stage stays on one rank


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_replicas"):
        plan(diamond(), 2, 4, max_replicas=0)
    with pytest.raises(ValueError, match="rows"):
        plan(diamond(), 2, 4, rows=0)
    with pytest.raises(ValueError, match="cannot split 3-row"):
        plan(diamond(), 2, 4, dp=2, rows=3)


@pytest.mark.slow
def test_auto_plan_pure_pipeline_and_rows_from_the_workload() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 2))
    w = Workload(model, (torch.randn(6, 8),), torch.randn(6, 2), nn.functional.mse_loss)
    w, graph = capture_workload(w, 2)  # 3-row micro-batches
    p = auto_plan(w, graph, ranks=2, microbatches=2, blocks=4)  # default: pure pipeline
    assert all(len(r) == 1 for r in p.placement) and p.num_ranks == 2
    # Rows come from the workload: no stage on both ranks (3 rows do not split in 2).
    p = auto_plan(w, graph, ranks=2, microbatches=2, blocks=4, planner="graph",
                  max_replicas=None)
    assert all(len(r) == 1 for r in p.placement)

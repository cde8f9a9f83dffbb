"""Tied weights in the cost model: attach_split records them; the simulator adds the all-reduce.

The planner's scorer derives the same groups from the cost table's ``tied``
field (:mod:`orgel.costs.tied`); the last test checks the two agree.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from orgel.costs.blocks import chain_split
from orgel.costs.tied import tied_groups
from orgel.graph.blocks import coarsen
from orgel.models import build
from orgel.plan import attach_split, plan_workload
from orgel.plan.scorer import Scorer
from orgel.plan.templates import one_f_one_b, v_shape
from orgel.plan.workload import tied_weights
from orgel.profile.workload import capture_workload, profile_graph
from orgel.schedule.costs import Link
from orgel.schedule.ir import Plan
from orgel.sim import simulate
from orgel.split import split_plan
from orgel.workload import Workload


@pytest.fixture(scope="module")
def tied_plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """A tied-embedding GPT planned as 1F1B on 2 ranks: embedding on rank 0, LM head on rank 1."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ORGEL_CACHE", str(tmp_path_factory.mktemp("cache")))
    try:
        w = Workload(*build("tied", batch_size=4, seed=0, n_layers=2, d_model=32))
        result = plan_workload(w, ranks=2, microbatches=2, blocks=4, link=False,
                               progress=False, planner="uniform-time")
    finally:
        mp.undo()
    return result.plan


def test_meta_lists_the_embedding_stages_and_bytes(tied_plan: Plan) -> None:
    assert tied_plan.placement == [(0,), (1,)]
    [group] = tied_plan.tied
    assert group.name in ("tok_emb.weight", "lm_head.weight")
    assert group.stages == (0, 1)
    assert group.nbytes == 128 * 32 * 4  # vocab x d_model float32
    again = Plan.from_json(tied_plan.to_json())  # plain data: survives the plan file
    assert again.tied == tied_plan.tied
    # a plan file written when the groups lived in its meta still reads
    data = json.loads(tied_plan.to_json())
    data["meta"]["tied_weights"] = data.pop("tied_weights")
    assert Plan.from_dict(data).tied == tied_plan.tied


def test_simulated_step_grows_by_the_all_reduce(tied_plan: Plan) -> None:
    p = copy.deepcopy(tied_plan)
    assert p.costs is not None
    p.costs.link = Link(latency=0.5, per_mib=4.0)
    untied = dataclasses.replace(p, tied=[])
    nbytes = p.tied[0].nbytes
    ring = 2 * (2 - 1) * p.costs.link.time(nbytes // 2)  # ring all-reduce on 2 ranks
    # 1F1B ends with stage 0's last backward; the all-reduce waits for it.
    assert simulate(p).step_time == pytest.approx(simulate(untied).step_time + ring)


def test_stages_on_one_rank_need_no_all_reduce(tied_plan: Plan) -> None:
    w = Workload(*build("tied", batch_size=4, seed=0, n_layers=2, d_model=32))
    _, graph = capture_workload(w, 2)
    split = split_plan(graph, tied_plan)
    assert len(split.tied) == 1
    assert tied_weights(split, [(0,), (0,)]) == []
    assert tied_weights(split, [(0,), (1,)]) == tied_plan.tied


@pytest.mark.parametrize("shape", ["1f1b", "v"])
def test_scorer_and_split_agree_on_tied_weights(shape: str, tmp_path: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path))
    w = Workload(*build("tied", batch_size=4, seed=0, n_layers=2, d_model=32))
    w, graph = capture_workload(w, 2)
    costs = profile_graph(w, graph, microbatches=2, blocks=6, link=False, progress=False,
                          repeats=1, warmup=0)
    bg = coarsen(graph, 6)
    assert [list(b.nodes) for b in bg.blocks] == costs.nodes  # the profiler's blocks
    costs.tied = tied_groups(graph, bg)
    assert [g.name for g in costs.tied] == ["tok_emb.weight"]
    [group] = costs.tied
    n = costs.num_blocks
    assert group.blocks == (1, n - 1)  # block 0 makes the positions; the embedding is next
    if shape == "1f1b":
        template, blocks = one_f_one_b(2, 2), chain_split([n // 2], n)
    else:  # V: stages 0 and 3 (embedding and head) on rank 0
        template, blocks = v_shape(2, 2), chain_split([2, 3, n - 1], n)
    p = Scorer(costs).to_plan(template, blocks)
    attached = attach_split(p, graph, costs)
    # the scorer's groups (from the cost table) are the split's (from its modules)
    assert attached.tied == p.tied
    assert bool(p.tied) == (shape == "1f1b")

"""Tied weights while planning: the cost table's groups, the scorer's all-reduce, the choice."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orgel.costs.blocks import BlockCosts, stage_costs
from orgel.costs.fields import CostsFileError
from orgel.costs.tied import TiedGroup, plan_tied_weights, tied_groups
from orgel.graph.blocks import coarsen
from orgel.models import build
from orgel.plan.graph import graph_plan
from orgel.plan.planner import InfeasibleError, plan
from orgel.plan.predict import predict
from orgel.plan.scorer import Scorer
from orgel.plan.templates import Template, one_f_one_b, v_shape
from orgel.profile.workload import capture_workload
from orgel.schedule.costs import Link
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Plan, TiedWeight
from orgel.sim import simulate
from orgel.workload import Workload

MIB = 1 << 20
EMB = 60 * MIB  # the tied parameter


def table(*, tied: bool = True, per_mib: float = 0.5) -> BlockCosts:
    """Six blocks in a chain; blocks 0 and 5 share a large parameter; a slow link."""
    n = 6
    return BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n,
                      params=[EMB + 4 * MIB] + [4 * MIB] * 4 + [EMB + 4 * MIB],
                      activations=[MIB] * n, output=[MIB] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)],
                      link=Link(latency=0.05, per_mib=per_mib),
                      tied=[TiedGroup((0, 5), EMB, "tok_emb.weight")] if tied else [])


def ranks_of(p: Plan, stages: list[int]) -> set[int]:
    return {r for s in stages for r in p.placement[s]}


def holder_stages(p: Plan) -> list[int]:
    return [s for s, st in enumerate(p.stage_graph.stages) if {0, 5} & set(st.blocks)]


def test_planner_keeps_tied_stages_on_one_rank() -> None:
    # Without the group, the best plan splits blocks 0 and 5 over both ranks ...
    other = plan(table(tied=False), 2, 4).plan
    assert len(ranks_of(other, holder_stages(other))) == 2
    # ... with it, that would add a 60 MiB all-reduce on a slow link: the planner
    # picks a schedule that hosts both tied stages on one rank (V-shaped here).
    result = plan(table(), 2, 4)
    p = result.plan
    assert len(ranks_of(p, holder_stages(p))) == 1
    assert not p.tied
    # What the planner predicted is what the simulator says of the returned plan.
    assert result.sim is not None
    end = p.prediction["end_of_step"]  # type: ignore[index]
    assert result.sim.step_time == pytest.approx(simulate(p).step_time + end)


def test_planner_prices_the_all_reduce_when_it_splits_the_tied_blocks() -> None:
    # One rank per stage with 1F1B only: the tied stages must sit on two ranks.
    bc = table(per_mib=0.05)
    result = plan(bc, 2, 4, planner="uniform-time")
    p = result.plan
    holders = holder_stages(p)
    assert len(ranks_of(p, holders)) == 2
    assert p.tied == [TiedWeight("tok_emb.weight", tuple(holders), EMB)]
    assert result.sim is not None
    end = p.prediction["end_of_step"]  # type: ignore[index]
    assert result.sim.step_time == pytest.approx(simulate(p).step_time + end)
    without = dataclasses.replace(p, tied=[])
    assert simulate(p).step_time > simulate(without).step_time + bc.link.time(EMB // 2)


def test_counting_the_tied_weight_once_per_rank_lets_a_v_fit() -> None:
    # 285 MiB per rank: only a V (embedding and head stages on rank 0, the weight
    # held once there) fits; counted twice, nothing does.
    result = plan(table(), 2, 4, memory=285 * MIB)
    p = result.plan
    assert len(ranks_of(p, holder_stages(p))) == 1
    assert result.sim is not None and max(result.sim.peak_memory) <= 285 * MIB
    with pytest.raises(InfeasibleError):
        plan(table(tied=False), 2, 4, memory=285 * MIB)


@pytest.mark.parametrize("family", ["1f1b", "interleaved"])
def test_score_equals_simulate_of_to_plan(family: str) -> None:
    bc = table()
    scorer = Scorer(bc)
    opts = {"stages_per_rank": 2} if family == "interleaved" else {}
    tmpl = Template(family, family, opts, build_schedule(family, 2, 4, **opts))
    points = (1, 3, 5) if family == "interleaved" else (3,)
    blocks = [range(a, b) for a, b in zip((0, *points), (*points, 6), strict=True)]
    score = scorer.score_chain(tmpl, points)
    p = scorer.to_plan(tmpl, blocks)
    [group] = p.tied
    assert group == TiedWeight("tok_emb.weight", (0, len(blocks) - 1), EMB)
    assert score.step_time == pytest.approx(simulate(p).step_time)
    # predict adds the sends a rank holds, as the scorer does
    assert list(score.peak_memory) == pytest.approx(predict(p, bc).peak_memory)
    # score_split (any assignment) agrees with score_chain.
    assert scorer.score_split(tmpl, [list(b) for b in blocks]).step_time == \
        pytest.approx(score.step_time)
    # The all-reduce is in it: the same candidate without the group is faster by
    # at least one ring step (2 x (ranks - 1) chunks of nbytes / ranks).
    plain = Scorer(table(tied=False)).score_chain(tmpl, points)
    assert score.step_time >= plain.step_time + 2 * bc.link.time(EMB // 2) - 1e-9


def test_tied_parameter_counts_once_per_rank() -> None:
    bc = table()
    # Both tied blocks in one stage: the parameter is held once.
    one = stage_costs(bc, [range(0, 6)]).stages[0]
    assert one.params == sum(bc.params) - EMB
    # Two stages on one rank share the Parameter: the later stage leaves it out.
    split = [range(0, 3), range(3, 6)]
    same = stage_costs(bc, split, placement=[(0,), (0,)])
    apart = stage_costs(bc, split, placement=[(0,), (1,)])
    assert same.stages[1].params == apart.stages[1].params - EMB
    assert same.stages[1].static_bytes == apart.stages[1].static_bytes - 4 * EMB
    # V-shape: stages 0 and 3 on rank 0; the scorer's peak counts the weight once there.
    tmpl = v_shape(2, 4)
    scorer = Scorer(bc)
    blocks = [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    p = scorer.to_plan(tmpl, blocks)
    assert not p.tied
    assert p.costs is not None and p.costs.stages[3].params == 4 * MIB
    assert list(scorer.score_chain(tmpl, (1, 3, 5)).peak_memory) == \
        pytest.approx(predict(p, bc).peak_memory)


def test_plan_tied_weights_leaves_out_groups_on_one_rank() -> None:
    bc = table()
    blocks = [range(0, 3), range(3, 6)]
    assert plan_tied_weights(bc, blocks, [(0,), (0,)]) == []
    assert plan_tied_weights(bc, blocks, [(0,), (1,)]) == [
        TiedWeight("tok_emb.weight", (0, 1), EMB)]
    # non-range splits too
    assert plan_tied_weights(bc, [[0, 1, 2], [3, 4, 5]], [(0,), (1,)])[0].stages == (0, 1)


def test_untied_table_scores_as_before() -> None:
    bc = table(tied=False)
    tmpl = one_f_one_b(2, 4)
    p = Scorer(bc).to_plan(tmpl, [range(0, 3), range(3, 6)])
    assert not p.tied
    assert Scorer(bc).score_chain(tmpl, (3,)).step_time == pytest.approx(simulate(p).step_time)


# -- costs file --------------------------------------------------------------------


def test_costs_file_round_trip_and_scaling(tmp_path: object) -> None:
    bc = table()
    again = BlockCosts.from_dict(json.loads(json.dumps(bc.to_dict())))
    assert again.tied == bc.tied
    assert bc.to_dict()["tied"] == [{"blocks": [0, 5], "nbytes": EMB, "name": "tok_emb.weight"}]
    assert "tied" not in table(tied=False).to_dict()
    assert bc.scaled(2.0).tied == bc.tied  # bytes of a parameter do not scale with rows


@pytest.mark.parametrize("tied,message", [
    ([{"blocks": [0, 9], "nbytes": 8}], "outside 0..5"),
    ([{"blocks": [2, 2], "nbytes": 8}], "at least 2 different blocks"),
    ([{"blocks": [0, 5], "nbytes": -1}], "non-negative integer"),
    ([{"blocks": [0, 5], "nbytes": 1.5}], "non-negative integer"),
    ([{"blocks": [0, 5]}], "'blocks'"),
    ([{"blocks": [0, 5], "nbytes": 8, "size": 3}], "'blocks'"),
    ({"blocks": [0, 5]}, "must be a list"),
    ([{"blocks": [0, 5], "nbytes": EMB * 2}], "exceeds the params of block(s) [0, 5]"),
])
def test_costs_file_validation(tied: object, message: str) -> None:
    data = table(tied=False).to_dict()
    data["tied"] = tied
    with pytest.raises(CostsFileError) as info:
        BlockCosts.from_dict(data)
    assert message in str(info.value)


# -- from a captured graph ---------------------------------------------------------


@pytest.mark.parametrize("name,expected", [("tied", 1), ("gpt", 0)])
def test_tied_groups_of_the_gpt_zoo_models(name: str, expected: int) -> None:
    w = Workload(*build(name, batch_size=2, seed=0, n_layers=2, d_model=32))
    _, graph = capture_workload(w, 1)
    bg = coarsen(graph, 6)
    groups = tied_groups(graph, bg)
    assert len(groups) == expected
    if expected:
        [g] = groups
        assert g.name in ("tok_emb.weight", "lm_head.weight")
        assert g.nbytes == 128 * 32 * 4  # vocab x d_model float32
        # the embedding's block and the LM head's (the last block)
        assert [bg.blocks[b].name for b in g.blocks] == ["tok_emb", "lm_head"]
        assert g.blocks[-1] == len(bg.blocks) - 1


# -- the graph planner -------------------------------------------------------------


def test_graph_planner_scores_the_tied_all_reduce() -> None:
    # A branch (1 and 2 both read 0, 3 joins them); blocks 0 and 5 share a parameter.
    n = 6
    bc = BlockCosts(fwd=[1.0] * n, bwd=[2.0] * n, wgrad=[1.0] * n,
                    params=[EMB + 4 * MIB] + [4 * MIB] * 4 + [EMB + 4 * MIB],
                    activations=[MIB] * n, output=[MIB] * n, temporary=[0] * n,
                    edges=[(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (4, 5)],
                    link=Link(latency=0.05, per_mib=0.05),
                    tied=[TiedGroup((0, 5), EMB, "tok_emb.weight")])
    scorer = Scorer(bc)
    g = graph_plan(scorer, 2, 4, max_replicas=1)
    assert g is not None
    p = g.plan
    holders = holder_stages(p)
    if len(ranks_of(p, holders)) > 1:
        assert p.tied == [TiedWeight("tok_emb.weight", tuple(holders), EMB)]
    else:
        assert not p.tied
    assert g.score.step_time == pytest.approx(simulate(p).step_time)
    # The same layout scored without the group is cheaper by the all-reduce, if any.
    untied = Scorer(dataclasses.replace(bc, tied=[]))
    blocks = [list(st.blocks) for st in p.stage_graph.stages]
    plain = untied.score_split(g.template, blocks).step_time
    assert (g.score.step_time > plain) == bool(p.tied)


def test_tight_memory_still_finds_the_v_shape() -> None:
    # At 300 MiB the screening's representative for two stages per rank
    # (interleaved) splits the tied stages and pays the all-reduce; a V placement
    # of the same group (DAG 1F1B or DualPipeV) keeps them on one rank and must
    # still be found.
    result = plan(table(), 2, 4, memory=300 * MIB, planner="beam")
    p = result.plan
    assert len(ranks_of(p, holder_stages(p))) == 1
    label = p.meta.get("schedule_label", "")
    assert label.startswith("v-shape") or label == "dualpipev", label


def test_profiled_table_carries_the_tied_groups(tmp_path: object,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from orgel.profile.workload import profile_workload

    monkeypatch.setenv("ORGEL_CACHE", str(tmp_path))
    w = Workload(*build("tied", batch_size=2, seed=0, n_layers=2, d_model=32))
    costs = profile_workload(w, microbatches=1, blocks=4, link=False, repeats=1, warmup=1,
                             progress=False)
    assert [g.name for g in costs.tied] == ["tok_emb.weight"]
    assert costs.tied[0].blocks[-1] == costs.num_blocks - 1  # the LM head's block

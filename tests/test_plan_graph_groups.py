"""The graph planner's branch groups, spare-rank layouts and its fast dynamic program."""

from __future__ import annotations

import random

import pytest

from orgel.costs.blocks import BlockCosts, stage_graph
from orgel.plan import graph as G
from orgel.plan.graph import graph_plan
from orgel.plan.replicas import score_layouts, stage_layout
from orgel.plan.scorer import Scorer
from orgel.plan.sp import Leaf, Parallel, Series, SPTree, TreeCosts, branch_groups, decompose
from orgel.plan.templates import Template
from orgel.schedule.costs import Link
from orgel.schedule.families import build_schedule
from orgel.schedule.validate import validate

MiB = 1 << 20


def fan(count: int, length: int, join: float, tail: int) -> BlockCosts:
    """``count`` input branches of ``length`` unit blocks, a join of ``join`` units,
    then ``tail`` unit blocks (CANDLE-Uno's shape)."""
    edges: list[tuple[int, int]] = []
    n, ends = 0, []
    for _ in range(count):
        for i in range(length):
            if i:
                edges.append((n - 1, n))
            n += 1
        ends.append(n - 1)
    work = [1.0] * n + [join] + [1.0] * tail
    edges += [(e, n) for e in ends]
    edges += [(n + i, n + i + 1) for i in range(tail)]
    total = len(work)
    return BlockCosts(fwd=[w / 3 for w in work], bwd=[2 * w / 3 for w in work],
                      wgrad=[w / 3 for w in work], params=[MiB] * total,
                      activations=[MiB] * total, output=[MiB] * total, temporary=[0] * total,
                      edges=edges, link=Link(0.01, 0.01))


def branch_of(length: int, count: int) -> dict[int, int]:
    return {b: b // length for b in range(length * count)}


def test_branch_groups_balance_work_and_keep_a_topological_order() -> None:
    par = Parallel((Series((Leaf(0), Leaf(1), Leaf(2))), Series((Leaf(3), Leaf(4))),
                    Leaf(5), Series((Leaf(6), Leaf(7), Leaf(8)))))
    weight = {id(c): float(len(c.blocks)) for c in par.children}
    groups = branch_groups(par, 2, lambda c: weight[id(c)])
    # Heaviest first to the lightest group: 3 | 3, then 2 -> first, 1 -> second.
    assert [len(g.blocks) for g in groups] == [5, 4]
    assert all(isinstance(g, Series) and g.linearised for g in groups)
    # Branch after branch; the one holding the largest block (a folded join) last.
    assert groups[1].blocks == (5, 6, 7, 8)
    assert groups[0].blocks == (0, 1, 2, 3, 4)
    # Every block exactly once.
    assert sorted(b for g in groups for b in g.blocks) == list(range(9))
    assert branch_groups(par, 4, lambda c: weight[id(c)]) == list(
        sorted(par.children, key=lambda c: -weight[id(c)]))
    with pytest.raises(ValueError, match="groups must be in 1..4"):
        branch_groups(par, 5, lambda c: 1.0)


def test_more_branches_than_ranks_get_stages_that_span_branches() -> None:
    # 3 branches of 4 units on 2 ranks: whole branches give 8 + 4 (+ join) units per
    # rank, stages cut across branches 6 + 6.
    bc = fan(3, 4, 0.5, 0)
    scorer = Scorer(bc)
    plain = graph_plan(scorer, 2, 8, grouped=False, max_replicas=1)
    grouped = graph_plan(scorer, 2, 8, max_replicas=1)
    assert plain is not None and grouped is not None
    validate(grouped.plan)
    owner = branch_of(4, 3)
    spans = [len({owner[b] for b in st.blocks if b in owner})
             for st in grouped.plan.stage_graph.stages]
    assert max(spans) >= 2 and any(0 < len(
        [b for b in st.blocks if b in owner]) % 4 for st in grouped.plan.stage_graph.stages)
    assert grouped.score.step_time < 0.9 * plain.score.step_time


def test_spare_ranks_buy_a_shallower_layout() -> None:
    # CANDLE-Uno in units: 7 branches x 4, a join of 7, 3 top blocks, on 8 ranks. The
    # fewest ranks at the join's bound cut all branches as one 4-deep pipeline; the
    # ranks that leaves idle let the branches run as several shallower groups.
    bc = fan(7, 4, 7.0, 3)
    tree = decompose(bc.num_blocks, bc.edges)
    totals = TreeCosts(bc)
    bound = 7.0 + 1e-6
    tight = G._DP(bc, totals, 8, 32, None, bound, counts=[1], grouped=True).solve(tree)
    assert tight is not None and tight.devices < 8
    wide = G._DP(bc, totals, 8, 32, None, bound, counts=[1], grouped=True,
                 spare=8 - tight.devices).solve(tree)
    assert wide is not None
    assert wide.devices <= 8 and wide.depth < tight.depth
    assert wide.slowest <= bound
    scorer = Scorer(bc)
    result = graph_plan(scorer, 8, 32)
    assert result is not None
    validate(result.plan)
    blocks, placement = stage_layout(bc, list(tight.stages))
    deep = build_schedule("dag-1f1b", 8, 32, stage_graph=stage_graph(bc, blocks),
                          placement=placement)
    deep_score = scorer.score_split(Template("dag-1f1b", "dag-1f1b", {}, deep), blocks)
    assert result.score.step_time < deep_score.step_time


def random_costs(seed: int) -> BlockCosts:
    rng = random.Random(seed)
    n = rng.randint(3, 24)
    edges = [(a, b) for b in range(1, n) for a in rng.sample(range(b), min(b, rng.randint(1, 2)))]
    return BlockCosts(
        fwd=[rng.uniform(0.1, 3) for _ in range(n)], bwd=[rng.uniform(0.2, 6) for _ in range(n)],
        wgrad=[0.0] * n, params=[rng.randint(0, 50) * MiB for _ in range(n)],
        activations=[rng.randint(0, 50) * MiB for _ in range(n)], output=[MiB] * n,
        temporary=[rng.randint(0, 20) * MiB for _ in range(n)], edges=edges,
        action_overhead=0.01, memory_per_rank=rng.choice([None, 2 << 30, 1 << 30]))


class _NotOne(list[int]):
    """Counts ``[1]`` that do not compare equal to ``[1]``: forces the general DP path."""

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


def solve(bc: BlockCosts, tree: SPTree, ranks: int, bound: float, *, general: bool,
          totals: TreeCosts | None = None) -> tuple[tuple[int, int], float] | None:
    dp = G._DP(bc, totals or TreeCosts(bc), ranks, 4, bc.memory_per_rank, bound, counts=[1],
               grouped=True)
    if general:
        dp.counts = _NotOne([1])
    sol = dp.solve(tree)
    return None if sol is None else (sol.key, sol.slowest)


def test_single_rank_window_matches_the_general_dynamic_program() -> None:
    feasible = 0
    for seed in range(60):
        bc = random_costs(seed)
        tree = decompose(bc.num_blocks, bc.edges)
        for bound in (2.0, 6.0, 20.0):
            for ranks in (2, 4, 8):
                fast = solve(bc, tree, ranks, bound, general=False)
                assert fast == solve(bc, tree, ranks, bound, general=True), (seed, bound, ranks)
                feasible += fast is not None
    assert feasible > 100  # the comparison covers real solutions, not only failures


def test_solutions_reused_across_bounds_are_as_good() -> None:
    for seed in range(40):
        bc = random_costs(seed)
        tree = decompose(bc.num_blocks, bc.edges)
        shared = TreeCosts(bc)
        for bound in (30.0, 12.0, 6.0, 3.0):  # a binary search's falling bounds
            reused = solve(bc, tree, 4, bound, general=False, totals=shared)
            fresh = solve(bc, tree, 4, bound, general=False)
            assert (reused is None) == (fresh is None), (seed, bound)
            if reused is not None and fresh is not None:
                assert reused[0] == fresh[0] and reused[1] <= bound


def test_zero_bubble_dag_plan_beats_dag_1f1b_and_gives_way_when_memory_is_short() -> None:
    bc = fan(3, 2, 1.0, 2)
    scorer = Scorer(bc)
    result = graph_plan(scorer, 4, 8, max_replicas=1)
    assert result is not None
    assert result.template.options.get("split_backward") is True
    plan = result.plan
    validate(plan)  # the I/W split schedule passes the dry run
    assert any(a.kind == "W" for actions in plan.schedule for a in actions)
    blocks = [list(st.blocks) for st in plan.stage_graph.stages]
    base = build_schedule("dag-1f1b", 4, 8, stage_graph=plan.stage_graph,
                          placement=plan.placement)
    plain = scorer.score_split(Template("dag-1f1b", "dag-1f1b", {}, base), blocks)
    assert result.score.step_time < plain.step_time
    # W held back keeps activations (and the gradients I leaves for W) longer: with
    # memory between what plain DAG 1F1B and its rewrite need, the layout falls back.
    bc.weight_kept = [16 * MiB] * bc.num_blocks
    need = Scorer(bc).score_split(Template("dag-1f1b", "dag-1f1b", {}, base), blocks)
    zb = Scorer(bc).score_split(result.template, blocks)
    assert max(zb.peak_memory) > max(need.peak_memory) + MiB
    tight = Scorer(bc, memory=int(max(need.peak_memory)) + MiB)
    layout = tuple((tuple(b), len(r)) for b, r in zip(blocks, plan.placement, strict=True))
    got = score_layouts(tight, {layout: result.bound}, 4, 8, counts=[1], pure_dp=True,
                        zero_bubble=True, top=1)
    assert got is not None
    score, template = got[0], got[1]
    assert not template.options.get("split_backward")
    assert score.feasible and max(score.peak_memory) <= tight.memory

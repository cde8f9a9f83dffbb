"""Graph-plan stage layouts: replica counts, spare ranks, rank ids, estimate and scoring."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from orgel.costs.blocks import BlockCosts, stage_graph
from orgel.plan.scorer import Score, Scorer
from orgel.plan.templates import Template
from orgel.plan.transforms import split_backward
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import PlanError


@dataclass(frozen=True)
class StageSpec:
    """One stage of a graph plan: its blocks and how many ranks replicate it."""

    blocks: tuple[int, ...]
    replicas: int


def spread_replicas(bc: BlockCosts, stages: list[StageSpec], ranks: int, microbatches: int,
                     *, all_ranks: bool, counts: Collection[int] | None = None,
                     pure_dp: bool = True) -> list[StageSpec]:
    """Give spare ranks to stages as replicas, one at a time, where it helps most.

    The gain of one more replica of a stage is the compute it saves over the
    step minus the longer gradient all-reduce it adds. ``all_ranks`` hands out
    every spare rank to the slowest stages regardless; otherwise a rank whose
    best gain is not positive stays idle. A stage only grows to the next count
    in ``counts`` (all when None) that the spare ranks can pay for; without
    ``pure_dp`` the last single-rank stage is never replicated.
    """
    stages = list(stages)
    allowed = sorted(set(counts)) if counts is not None else list(range(1, ranks + 1))

    def grown(j: int) -> int | None:
        """The next allowed replica count of stage ``j`` the spare ranks can pay for."""
        r = stages[j].replicas
        if not pure_dp and r == 1 and sum(s.replicas == 1 for s in stages) == 1:
            return None
        return next((c for c in allowed if r < c <= r + spare), None)

    work = [sum(bc.fwd[b] + bc.bwd[b] for b in s.blocks) for s in stages]
    params = [sum(bc.params[b] for b in s.blocks) for s in stages]

    def reduce(i: int, r: int) -> float:
        return 2 * (r - 1) * bc.link.time(params[i] // r) if r > 1 else 0.0

    spare = ranks - sum(s.replicas for s in stages)
    while spare > 0:
        growable = [j for j in range(len(stages)) if grown(j) is not None]
        if not growable:
            break
        if all_ranks:
            i = max(growable, key=lambda j: work[j] / stages[j].replicas)
        else:
            def gain(j: int) -> float:
                r, n = stages[j].replicas, grown(j) or stages[j].replicas
                saved = microbatches * (work[j] / r - work[j] / n)
                return (saved - (reduce(j, n) - reduce(j, r))) / (n - r)
            i = max(growable, key=gain)
            if gain(i) <= 0:
                break
        new = grown(i) or stages[i].replicas
        spare -= new - stages[i].replicas
        stages[i] = StageSpec(stages[i].blocks, new)
    return stages


def replica_counts(ranks: int, *, max_replicas: int | None = None,
                   rows: int | None = None) -> list[int]:
    """Replica counts a stage may have: at most ``max_replicas``, dividing ``rows``."""
    top = ranks if max_replicas is None else min(ranks, max_replicas)
    return [r for r in range(1, top + 1) if rows is None or rows % r == 0]


def estimate_step(bc: BlockCosts, key: tuple[tuple[tuple[int, ...], int], ...],
                  microbatches: int) -> float:
    """A quick step estimate to rank layouts: (m + depth - 1) x slowest stage + all-reduce."""
    times, reduces, owner = [], [], {}
    for i, (blocks, r) in enumerate(key):
        work = sum(bc.fwd[b] + bc.bwd[b] for b in blocks)
        times.append(work / r + 2 * bc.action_overhead)
        params = sum(bc.params[b] for b in blocks)
        reduces.append(2 * (r - 1) * bc.link.time(params // r) if r > 1 else 0.0)
        for b in blocks:
            owner[b] = i
    succ: dict[int, set[int]] = {}
    for a, b in bc.edges:
        if owner[a] != owner[b]:
            succ.setdefault(owner[a], set()).add(owner[b])
    depth: dict[int, int] = {}

    def longest(i: int) -> int:
        if i not in depth:
            depth[i] = 1 + max((longest(j) for j in succ.get(i, ())), default=0)
        return depth[i]

    deepest = max(longest(i) for i in range(len(key)))
    return (microbatches + deepest - 1) * max(times) + max(reduces)


def stage_layout(bc: BlockCosts, stages: list[StageSpec]
                 ) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """Stages in topological order with consecutive rank ids: (blocks per stage, placement)."""
    blocks = [list(s.blocks) for s in stages]
    order = stage_graph(bc, blocks).topological_order()
    out_blocks, placement, next_rank = [], [], 0
    for s in order:
        out_blocks.append(blocks[s])
        r = stages[s].replicas
        placement.append(tuple(range(next_rank, next_rank + r)))
        next_rank += r
    return out_blocks, placement


Layout = tuple[tuple[tuple[int, ...], int], ...]  # ((blocks, replicas) per stage)


def score_layouts(scorer: Scorer, found: dict[Layout, float], ranks: int, microbatches: int,
                  *, counts: Collection[int], pure_dp: bool, zero_bubble: bool, top: int
                  ) -> tuple[Score, Template, list[list[int]], list[StageSpec], float] | None:
    """The fastest feasible schedule over the ``top`` most promising layouts.

    Each found layout (mapped to the bound it was found at) is tried as found
    and with its spare ranks spread (:func:`spread_replicas`); they are ranked
    by :func:`estimate_step` and the best ``top`` get DAG 1F1B, or first its
    zero-bubble rewrite. Returns (score, template, blocks per stage, stages, bound).
    """
    bc = scorer.bc
    chosen: tuple[Score, Template, list[list[int]], list[StageSpec], float] | None = None
    layouts: dict[tuple[tuple[tuple[int, ...], int], ...], float] = {}
    for key, bound in found.items():
        # As found (spare ranks idle: a replica of a stage off the bottleneck buys
        # nothing and adds an all-reduce), and with spare ranks spread.
        options = [[StageSpec(b, r) for b, r in key]]
        for all_ranks in (True, False):
            options.append(spread_replicas(bc, options[0], ranks, microbatches,
                                           all_ranks=all_ranks, counts=counts,
                                           pure_dp=pure_dp))
        for spread in options:
            if not pure_dp and all(s.replicas > 1 for s in spread):
                continue  # every stage replicated: data parallelism, asked for with dp
            layouts.setdefault(tuple((s.blocks, s.replicas) for s in spread), bound)
    ranked = sorted(layouts, key=lambda k: estimate_step(bc, k, microbatches))[:top]
    for key in ranked:
        bound = layouts[key]
        stages = [StageSpec(b, r) for b, r in key]
        try:
            blocks, placement = stage_layout(bc, stages)
            graph = stage_graph(bc, blocks)
            base = build_schedule("dag-1f1b", ranks, microbatches, stage_graph=graph,
                                  placement=placement)
        except PlanError:
            continue
        # The zero-bubble rewrite first: it fills the cool-down with W, so plain DAG
        # 1F1B is only scored when the rewrite does not fit memory (or cannot be built).
        templates = []
        if zero_bubble:
            try:
                templates.append(Template("dag-1f1b + zero bubble", "dag-1f1b",
                                          {"split_backward": True}, split_backward(base)))
            except PlanError:
                pass
        templates.append(Template("dag-1f1b", "dag-1f1b", {}, base))
        for template in templates:
            score = scorer.score_split(template, blocks)
            if not score.feasible:
                continue
            if chosen is None or score.step_time < chosen[0].step_time:
                chosen = (score, template, blocks, stages, bound)
            break
    return chosen

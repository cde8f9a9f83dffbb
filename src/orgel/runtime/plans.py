"""Simple Plans to run until the planner hands one over: a balanced chain, replicated for dp.

:func:`balanced_plan` cuts a captured graph's nodes (in their order, so every
stage is convex) into ``pipeline x stages_per_rank`` stages of about equal
FLOPs and schedules them with a family; :func:`replicate` turns a Plan for
``P`` ranks into one for ``P x dp`` ranks where every stage has ``dp``
data-parallel replicas (rank ``r + P*d`` runs rank ``r``'s actions on its share
of the rows).
"""

from __future__ import annotations

from typing import Any

from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Plan, PlanError

#: families whose stages loop over the ranks several times (option name for that count)
LOOPED = {"interleaved": "stages_per_rank", "looped-bfs": "stages_per_rank", "looped": "loops"}


def balanced_assignment(graph: Any, stages: int) -> dict[str, int]:
    """Node name -> stage, contiguous in node order, about equal FLOPs per stage.

    The nodes between the first and last reader of a buffer the forward
    updates in place (a BatchNorm used twice) stay in one stage.
    """
    from orgel.graph.blocks import cuts_a_span, writer_spans
    from orgel.split.assign import stages_from_cuts
    from orgel.split.points import balanced_points

    names = list(graph.nodes)
    weights = [max(1.0, float(getattr(graph.nodes[n], "flops", 0) or 0)) for n in names]
    spans = writer_spans(graph, {n: i for i, n in enumerate(names)})
    units: list[list[int]] = []  # runs of nodes that no cut may divide
    for i in range(len(names)):
        if units and cuts_a_span(spans, i):
            units[-1].append(i)
        else:
            units.append([i])
    try:
        points = list(balanced_points([sum(weights[i] for i in u) for u in units], stages))
    except ValueError as exc:
        raise PlanError(f"{exc}; use fewer ranks or stages per rank") from None
    per_unit = stages_from_cuts(len(units), points)
    return {names[i]: stage for u, stage in zip(units, per_unit, strict=True) for i in u}


def balanced_plan(graph: Any, *, ranks: int, microbatches: int, schedule: str = "1f1b",
                  dp: int = 1, stages_per_rank: int = 2, **options: Any) -> Plan:
    """Split ``graph`` evenly and schedule it with family ``schedule`` on ``ranks`` ranks."""
    from orgel.split.split import split_model

    if dp < 1 or ranks % dp:
        raise PlanError(f"--dp {dp} must divide --ranks {ranks}")
    pipeline = ranks // dp
    per_rank = stages_per_rank if schedule in LOOPED else 1
    if schedule in LOOPED:
        options[LOOPED[schedule]] = per_rank
    split = split_model(graph, balanced_assignment(graph, pipeline * per_rank))
    plan = build_schedule(schedule, pipeline, microbatches, stage_graph=split.stage_graph,
                          **options)
    plan.meta["planner"] = "balanced chain (FLOPs in node order)"
    return replicate(plan, dp) if dp > 1 else plan


def replicate(plan: Plan, dp: int) -> Plan:
    """The same pipeline on ``dp`` replica groups: stage ``s`` on ``r + P*d`` for each d."""
    p = plan.num_ranks
    placement = [tuple(sorted(r + p * d for r in ranks for d in range(dp)))
                 for ranks in plan.placement]
    schedule = [list(plan.schedule[r % p]) for r in range(p * dp)]
    meta = dict(plan.meta, dp=dp)
    return Plan(plan.stage_graph, placement, p * dp, plan.microbatches, schedule,
                list(plan.recompute), plan.costs, None, meta, tied=list(plan.tied))

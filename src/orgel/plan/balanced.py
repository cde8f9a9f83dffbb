"""A simple Plan to run until the planner hands one over: a balanced chain, replicated for dp.

:func:`balanced_plan` cuts a captured graph's nodes (in their order, so every
stage is convex) into ``pipeline x stages_per_rank`` stages of about equal
FLOPs, schedules them with a family and, for ``dp > 1``, replicates the
pipeline (:func:`orgel.plan.transforms.replicate`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from orgel.plan.transforms import replicate
from orgel.schedule.families import build_schedule
from orgel.schedule.ir import Plan, PlanError

#: families whose stages loop over the ranks several times (option name for that count)
LOOPED = {"interleaved": "stages_per_rank", "looped-bfs": "stages_per_rank", "looped": "loops"}
#: families with a fixed number of stages per rank
TWO_PER_RANK = {"dualpipev": 2}


def balanced_plan(graph: Any, *, ranks: int, microbatches: int, schedule: str = "1f1b",
                  dp: int = 1, stages_per_rank: int = 2, **options: Any) -> Plan:
    """Split ``graph`` evenly and schedule it with family ``schedule`` on ``ranks`` ranks."""
    from orgel.split.assign import balanced_assignment
    from orgel.split.split import split_model

    if dp < 1 or ranks % dp:
        raise PlanError(f"--dp {dp} must divide --ranks {ranks}")
    pipeline = ranks // dp
    per_rank = stages_per_rank if schedule in LOOPED else TWO_PER_RANK.get(schedule, 1)
    if schedule in LOOPED:
        options[LOOPED[schedule]] = per_rank
    try:
        assignment = balanced_assignment(graph, pipeline * per_rank)
    except ValueError as exc:
        raise PlanError(f"{exc}; use fewer ranks or stages per rank") from None
    split = split_model(graph, assignment)
    plan = build_schedule(schedule, pipeline, microbatches, stage_graph=split.stage_graph,
                          **options)
    plan = dataclasses.replace(plan, meta={**plan.meta,
                                           "planner": "balanced chain (FLOPs in node order)"})
    return replicate(plan, dp) if dp > 1 else plan

"""Schedule rewrites the planners try on top of a family's schedule.

:func:`split_backward` turns a 1F1B-style schedule over any stage DAG into a
zero-bubble one in the manner of ZB-H1: every full backward ``B`` becomes its
input-grad half ``I`` (which is all the upstream stage waits for) and the
weight-grad half ``W`` is put off by ``lag`` backwards of the same stage, so
the ``W`` work fills the idle slots while gradients travel upstream; the
leftover ``W`` run at the end, where the cool-down bubble was. A stage's lag is
its depth in the stage DAG minus one (the warm-up forwards it runs), as in
ZB-H1 for a chain. Activations live until ``W``, so memory grows with the lag;
the simulator decides whether that pays.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from orgel.schedule.ir import Action, Plan
from orgel.schedule.validate import validate


def stage_depths(plan: Plan) -> list[int]:
    """Stages on the longest path from each stage to a sink, counting both ends."""
    graph = plan.stage_graph
    depth = [1] * graph.num_stages
    for s in reversed(graph.topological_order()):
        for i in graph.consumers(s):
            depth[s] = max(depth[s], depth[graph.edges[i].dst] + 1)
    return depth


def stage_heights(plan: Plan) -> list[int]:
    """Stages on the longest path from a source to each stage, not counting it."""
    graph = plan.stage_graph
    height = [0] * graph.num_stages
    for s in graph.topological_order():
        for i in graph.consumers(s):
            d = graph.edges[i].dst
            height[d] = max(height[d], height[s] + 1)
    return height


def split_backward(plan: Plan, lags: list[int] | None = None) -> Plan:
    """``plan`` with each ``B`` split into ``I`` now and ``W`` later (see the module docstring).

    ``lags[s]`` is how many later backwards of stage ``s`` run before its
    deferred ``W`` (default: the stages upstream of it). Raises PlanError if the
    result does not validate.
    """
    if lags is None:
        lags = stage_heights(plan)
    schedule: list[list[Action]] = []
    for actions in plan.schedule:
        pending: dict[int, deque[Action]] = {}
        out: list[Action] = []
        for a in actions:
            if a.kind != "B":
                out.append(a)
                continue
            out.append(Action("I", a.stage, a.microbatch))
            queue = pending.setdefault(a.stage, deque())
            queue.append(Action("W", a.stage, a.microbatch))
            if len(queue) > lags[a.stage]:
                out.append(queue.popleft())
        # Leftover weight gradients fill the cool-down, oldest first.
        rest = sorted((w for q in pending.values() for w in q), key=lambda w: w.microbatch)
        out.extend(rest)
        schedule.append(out)
    meta = dict(plan.meta)
    meta["schedule"] = f"{plan.meta.get('schedule', 'custom')}+zb"
    out_plan = dataclasses.replace(plan, schedule=schedule, recompute=list(plan.recompute),
                                   prediction=None, meta=meta, tied=list(plan.tied),
                                   shard=list(plan.shard))
    validate(out_plan)
    return out_plan

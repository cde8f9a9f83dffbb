"""Plans for real models: profile, plan, then bind the plan to the captured graph.

A plan found on a block cost table names blocks; the runtime splits the
captured op graph by *nodes* and sends values by the names the split gives
them. :func:`attach_split` fills every stage's nodes (its blocks' nodes, in
graph order), splits the graph by the plan and takes the split's stage graph
(edge values named and sized as the runtime will send them), then re-simulates.
:func:`auto_plan` is the hook ``orgel.pipeline`` calls when no plan is given.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from orgel.plan.planner import PlanResult, plan, predict
from orgel.profile.costs import BlockCosts
from orgel.schedule.ir import Plan, StageGraph
from orgel.schedule.validate import validate
from orgel.sim import simulate


def attach_split(p: Plan, opgraph: Any, costs: BlockCosts | None = None) -> Plan:
    """``p`` with stage nodes and the named edges of the split of ``opgraph`` by it."""
    from orgel.split import split_plan

    if not all(s.nodes for s in p.stage_graph.stages):
        raise ValueError("the plan's stages list no graph nodes: plan from a profiled "
                         "workload (its cost table knows each block's nodes)")
    split = split_plan(opgraph, p)
    stages = tuple(replace(st, name=p.stage_graph.stages[i].name,
                           blocks=p.stage_graph.stages[i].blocks)
                   for i, st in enumerate(split.stage_graph.stages))
    out = Plan(StageGraph(stages, split.stage_graph.edges), p.placement, p.num_ranks,
               p.microbatches, p.schedule, list(p.recompute), p.costs, None, dict(p.meta))
    validate(out)
    if costs is not None:
        predict(out, costs)
    else:
        sim = simulate(out)
        out.prediction = {k: v for k, v in sim.to_dict().items() if k != "critical_path"}
    return out


def plan_workload(workload: Any, *, ranks: int, microbatches: int, blocks: int = 32,
                  memory: int | None = None, planner: str = "auto", dp: int | None = 1,
                  link: bool = True, progress: bool = True, **options: Any) -> PlanResult:
    """Profile ``workload`` (``"file.py:fn"`` or a Workload) and plan it, runnable as is."""
    from orgel.profile.workload import capture_workload, profile_graph

    w, opgraph = capture_workload(workload, microbatches)
    costs = profile_graph(w, opgraph, microbatches=microbatches, blocks=blocks, link=link,
                          progress=progress)
    if isinstance(workload, str):
        costs.meta["workload"] = workload
    result = plan(costs, ranks, microbatches, memory=memory, planner=planner, dp=dp, **options)
    result.plan = attach_split(result.plan, opgraph)
    result.sim = predict(result.plan, costs)
    return result


def auto_plan(workload: Any, graph: Any, *, ranks: int, microbatches: int,
              memory: int | None = None, dp: int = 1, blocks: int = 32) -> Plan:
    """The planner's plan for an already captured workload (``orgel.pipeline``'s hook)."""
    from orgel.profile.workload import profile_graph

    costs = profile_graph(workload, graph, microbatches=microbatches, blocks=blocks,
                          progress=False)
    result = plan(costs, ranks, microbatches, memory=memory, dp=dp)
    return attach_split(result.plan, graph, costs)

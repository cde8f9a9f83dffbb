"""Plans for real models: profile, plan, then bind the plan to the captured graph.

A plan found on a block cost table names blocks; the runtime splits the
captured op graph by *nodes* and sends values by the names the split gives
them. :func:`attach_split` fills every stage's nodes (its blocks' nodes, in
graph order), splits the graph by the plan and takes the split's stage graph
(edge values named and sized as the runtime will send them), then re-simulates.
:func:`auto_plan` is the hook ``orgel.pipeline`` calls when no plan is given.

Both profile with the intra-op thread count the ranks will train with
(:func:`orgel.profile.workload.rank_threads`), with the other ``ranks - 1``
ranks' work running meanwhile (:mod:`orgel.profile.contention`), and tell the
planner a
micro-batch's row count, so it never gives a stage replicas that cannot split
a micro-batch evenly.
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


def microbatch_rows(workload: Any, microbatches: int) -> int | None:
    """Rows of one micro-batch along the workload's batch dimension (None: no tensor input)."""
    import torch

    from orgel.workload import microbatches as split_batches

    first, _ = split_batches(workload, microbatches)[0]
    values = first.values() if isinstance(first, dict) else first
    for t in values:
        if isinstance(t, torch.Tensor) and t.dim() > workload.batch_dim:
            return int(t.shape[workload.batch_dim])
    return None


def plan_workload(workload: Any, *, ranks: int, microbatches: int, blocks: int = 32,
                  memory: int | None = None, planner: str = "auto", dp: int | None = 1,
                  link: bool = True, progress: bool = True, threads: int | None = None,
                  **options: Any) -> PlanResult:
    """Profile ``workload`` (``"file.py:fn"`` or a Workload) and plan it, runnable as is.

    ``threads``: intra-op threads per rank to profile with (default: what a
    local group of ``ranks`` gives each rank). ``options`` go to
    :func:`~orgel.plan.planner.plan` (e.g. ``max_replicas=1`` for a pure
    pipeline); ``rows`` defaults to the workload's micro-batch rows.
    """
    from orgel.profile.workload import capture_workload, profile_graph, rank_threads

    w, opgraph = capture_workload(workload, microbatches)
    costs = profile_graph(w, opgraph, microbatches=microbatches, blocks=blocks, link=link,
                          progress=progress, threads=threads or rank_threads(ranks),
                          contention=ranks - 1)
    if isinstance(workload, str):
        costs.meta["workload"] = workload
    options.setdefault("rows", microbatch_rows(w, microbatches))
    result = plan(costs, ranks, microbatches, memory=memory, planner=planner, dp=dp, **options)
    result.plan = attach_split(result.plan, opgraph)
    result.sim = predict(result.plan, costs)
    return result


def auto_plan(workload: Any, graph: Any, *, ranks: int, microbatches: int,
              memory: int | None = None, dp: int = 1, blocks: int = 32,
              max_replicas: int | None = 1, rows: int | None = None,
              threads: int | None = None, planner: str = "auto") -> Plan:
    """The planner's plan for an already captured workload (``orgel.pipeline``'s hook).

    ``dp=1``: the whole pipeline is not replicated. ``max_replicas`` (default
    1: a pure pipeline, every stage on one rank) caps a stage's intra-stage
    replicas: ``orgel.pipeline`` runs stages captured with fixed shapes and
    needs every stage to have the same replica count, which with ``dp=1`` leaves
    one; pass ``None`` to let the graph planner give some stages more ranks
    where the runtime allows it.
    ``rows`` (default: the workload's micro-batch rows) limits replica counts
    to its divisors. ``threads``: intra-op threads each rank trains with
    (default :func:`~orgel.profile.workload.rank_threads` of ``ranks``).
    """
    from orgel.profile.workload import profile_graph, rank_threads

    costs = profile_graph(workload, graph, microbatches=microbatches, blocks=blocks,
                          progress=False, threads=threads or rank_threads(ranks),
                          contention=ranks - 1)
    if rows is None:
        rows = microbatch_rows(workload, microbatches)
    result = plan(costs, ranks, microbatches, memory=memory, dp=dp, planner=planner,
                  max_replicas=max_replicas, rows=rows)
    return attach_split(result.plan, graph, costs)

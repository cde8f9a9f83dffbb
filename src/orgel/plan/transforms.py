"""Rewrites of a Plan: each a pure function that returns a new Plan (a Plan is a value).

* :func:`replicate`: the same pipeline on ``dp`` replica groups (data parallel);
* :func:`with_tp`: every pipeline rank run by ``tp`` processes (tensor parallel),
  :func:`pipeline_ranks` the check of the numbers asked for;
* :func:`mark_sharded`: the replicas of every replicated stage shard its state (FSDP);
* :func:`with_recompute`: which stages recompute their activations;
* :func:`forward_plan`/:func:`check_forward`: the forwards only, for evaluation;
* :func:`split_backward`: zero-bubble, described next.

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
from collections.abc import Sequence
from typing import Any

from orgel.graph.tensor_parallel import tp_regions
from orgel.schedule.comm import CommPlan, derive_comm
from orgel.schedule.ir import Action, Plan, PlanError
from orgel.schedule.validate import dry_run, validate


class TensorParallelError(ValueError):
    """A tensor-parallel degree that cannot run this plan or model; the message says why."""


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


def replicate(plan: Plan, dp: int) -> Plan:
    """The same pipeline on ``dp`` replica groups: stage ``s`` on ``r + P*d`` for each d."""
    p = plan.num_ranks
    placement = [tuple(sorted(r + p * d for r in ranks for d in range(dp)))
                 for ranks in plan.placement]
    schedule = [list(plan.schedule[r % p]) for r in range(p * dp)]
    meta = dict(plan.meta, dp=dp)
    return dataclasses.replace(plan, placement=placement, num_ranks=p * dp, schedule=schedule,
                               recompute=list(plan.recompute), prediction=None, meta=meta,
                               tied=list(plan.tied), shard=list(plan.shard))


def with_recompute(plan: Plan, recompute: Sequence[bool | str]) -> Plan:
    """``plan`` with stage ``s`` recomputing its activations as ``recompute[s]`` says
    (:data:`orgel.schedule.ir.RECOMPUTE`)."""
    flags = [x if isinstance(x, str) else bool(x) for x in recompute]
    if len(flags) != plan.num_stages:
        raise PlanError(f"recompute names {len(flags)} stages, the plan has {plan.num_stages}")
    return dataclasses.replace(plan, recompute=flags)


def runnable_recompute(plan: Plan) -> Plan:
    """``plan`` with the planner's ``"layer"`` and ``"selective"`` choices where the runtime
    can run them: ``"selective"`` in a schedule that splits the stage's backward takes
    ``"layer"`` (torch's selective checkpoint runs one backward per region)."""
    split = {a.stage for actions in plan.schedule for a in actions if a.kind == "I"}
    out: list[bool | str] = []
    for s, policy in enumerate(plan.recompute):
        if policy == "selective" and s in split:
            policy = "layer"
        out.append(policy)
    return plan if out == list(plan.recompute) else with_recompute(plan, out)


def mark_sharded(plan: Plan, shard: str) -> Plan:
    """``plan`` with every stage of two or more replicas marked ``shard`` ("none": as it is)."""
    if shard == "none":
        return plan
    marked = [shard if len(plan.placement[s]) > 1 else "none"
              for s in range(plan.num_stages)]
    if not any(m != "none" for m in marked):
        raise ValueError(f"shard={shard!r} but the plan gives no stage two or more replicas "
                         "(nothing to shard): pass dp=2 or more, or shard='none'")
    return dataclasses.replace(plan, shard=marked)


def pipeline_ranks(ranks: int, tp: int, dp: int = 1) -> int:
    """The pipeline ranks ``ranks`` processes make with ``tp`` each; ValueError for a ``tp``
    that does not divide ``ranks``, or a ``dp`` that does not divide the pipeline ranks."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tp must be a positive int (processes per pipeline rank), "
                                  f"got {tp!r}")
    if ranks % tp:
        raise TensorParallelError(f"tp={tp} does not divide ranks={ranks}: ranks counts every "
                                  f"process, tp of them per pipeline rank; pass ranks="
                                  f"{(ranks // tp + 1) * tp} or a tp that divides {ranks}")
    if (ranks // tp) % dp:
        raise TensorParallelError(f"dp={dp} does not divide the {ranks // tp} pipeline ranks "
                                  f"of ranks={ranks} with tp={tp}: each data-parallel replica "
                                  f"is a pipeline rank of tp processes; pass ranks="
                                  f"{dp * tp} (or a multiple) or dp that divides {ranks // tp}")
    return ranks // tp


def with_tp(plan: Plan, tp: int, graph: Any, sequence_parallel: bool = False) -> Plan:
    """``plan`` run with ``tp`` processes per pipeline rank (``plan.tp`` set), checked
    against the captured ``graph`` (an :class:`~orgel.graph.opgraph.OpGraph`);
    ``sequence_parallel``: the values between the split layers cut along the sequence (a
    plan's own ``sequence_parallel`` stays on)."""
    if tp == 1:
        if sequence_parallel:
            raise TensorParallelError("sequence_parallel=True cuts what the tensor-parallel "
                                      "members hold whole along the sequence: give tp > 1")
        if plan.tp > 1:
            raise TensorParallelError(f"the plan is for tp={plan.tp} processes per pipeline "
                                      f"rank: pass tp={plan.tp}")
        return plan
    if plan.tp not in (1, tp):
        raise TensorParallelError(f"the plan is for tp={plan.tp} but tp={tp}: make them agree")
    if graph is not None and not tp_regions(graph.graph_module):
        raise TensorParallelError(
            "tp > 1 found no region to split in this model: tensor parallelism splits "
            "linear layers that read one input and feed one linear layer (attention, MLP; "
            "orgel.graph.tensor_parallel.tp_regions); pass tp=1")
    return dataclasses.replace(plan, tp=tp,
                               sequence_parallel=plan.sequence_parallel or sequence_parallel)


def forward_plan(plan: Plan, split: Any) -> Plan:
    """``plan`` with only its ``F`` actions (same order, ranks, placement) over the stages of
    ``split`` (a :class:`~orgel.split.types.SplitModel`, usually the eval-mode one).

    Raises :class:`PlanError` when the eval split's stage graph needs a value
    before this order produces it (the eval-mode forward moved work against the
    training order).
    """
    schedule = [[a for a in actions if a.kind == "F"] for actions in plan.schedule]
    forward = Plan(stage_graph=split.stage_graph, placement=list(plan.placement),
                   num_ranks=plan.num_ranks, microbatches=plan.microbatches, schedule=schedule,
                   meta={"forward_only": True})
    for r, actions in enumerate(schedule):
        at = {(a.stage, a.microbatch): p for p, a in enumerate(actions)}
        for e in split.stage_graph.edges:
            for m in range(plan.microbatches):
                src, dst = at.get((e.src, m)), at.get((e.dst, m))
                if src is not None and dst is not None and src > dst:
                    raise PlanError(f"evaluation: rank {r} runs F{e.dst}.{m} before "
                                    f"F{e.src}.{m}, whose values it reads in eval mode")
    return forward


def check_forward(plan: Plan, split: Any) -> tuple[Plan, CommPlan]:
    """The forward-only plan of ``split`` and its messages; :class:`PlanError` if it cannot run."""
    forward = forward_plan(plan, split)
    comm = derive_comm(forward)
    stuck = dry_run(forward, comm=comm).stuck
    if stuck:
        raise PlanError(f"evaluation: the forwards of the plan cannot all run in eval "
                        f"mode (ranks {sorted({r for r, _ in stuck})} wait forever)")
    return forward, comm

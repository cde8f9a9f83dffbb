"""What a plan is predicted to cost, and the plans the planners derive from one.

:func:`predict` simulates a plan as the runtime runs it: the step adds
:func:`end_of_step` (setup, loss all-reduce, optimizer), the memory the sends the
runtime holds (:func:`held_sends`) and the optimizer's peak; :func:`predicted` also
returns the plan with that prediction. :func:`replicated` is a plan for ``dp`` replica
groups priced again per whole micro-batch; :func:`labelled` names its template.
"""

from __future__ import annotations

import dataclasses
import math

from orgel.costs.blocks import BlockCosts, reported_peak, stage_costs, stage_graph
from orgel.costs.tied import plan_tied_weights
from orgel.plan.templates import Template
from orgel.plan.transforms import replicate
from orgel.schedule.ir import Plan
from orgel.schedule.validate import validate
from orgel.sim import SimResult, simulate
from orgel.sim.compiled import CompiledPlan
from orgel.sim.sharing import shared_step


def end_of_step(costs: BlockCosts, p: Plan) -> float:
    """ms every step pays outside its actions: setup, loss all-reduce, optimizer.

    The runtime sets up the step (gradients cleared, batch split, receives
    posted), and after its last action all-reduces the step's loss (and
    gradient norm) over every rank, then each rank steps its optimizer over
    its own parameters; the slowest rank's step ends the step. None of it is
    an action, so the simulator leaves it out. The profiler measures the
    per-step part through the runtime on two ranks (``costs.step_overhead``:
    one all-reduce round; more ranks add ``log2`` rounds of the link's
    latency) and each block's optimizer step (``costs.optimizer_ms``; else
    ``optimizer_ms_per_mib`` of the rank's parameters). Ranks that share
    ``costs.cores`` take turns at their optimizer steps too.
    """
    ranks = p.num_ranks
    rounds = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    fixed = costs.step_overhead
    if fixed is None:
        fixed = 2 * rounds * costs.link.latency
    else:
        fixed = float(fixed) + 2 * max(0, rounds - 1) * costs.link.latency
    per_block = costs.optimizer_ms
    per_rank_ms = [0.0] * ranks
    if per_block and all(st.blocks for st in p.stage_graph.stages):
        for s, placed in enumerate(p.placement):
            ms = sum(float(per_block[b]) for b in p.stage_graph.stages[s].blocks)
            for r in placed:
                per_rank_ms[r] += ms
    elif p.costs is not None and costs.optimizer_ms_per_mib > 0:
        for s, placed in enumerate(p.placement):
            for r in placed:
                per_rank_ms[r] += costs.optimizer_ms_per_mib * p.costs.stages[s].params / (1 << 20)
    # every rank steps at once: on shared cores, the slowest rank or all of them spread out
    return fixed + max(max(per_rank_ms), shared_step(sum(per_rank_ms), ranks, costs.cores))


def held_sends(p: Plan) -> list[int]:
    """Bytes each rank may hold in sends at once: the most it sends after one action.

    ``orgel.runtime.comm`` waits for a send once the sender's next action has
    run (gloo, with every receive posted at the step's start; NCCL drops
    sends as they complete), so at most one action's sent tensors are alive
    beyond what the simulator counts. The first step of a new input shape
    (the shape exchange) still holds every send until it ends; it is not
    the steady state this predicts.
    """
    grads = None if p.costs is None else p.costs.edge_grad_bytes
    return [int(b) for b in CompiledPlan(p).held_send_bytes(grad_bytes=grads)]


def predict(p: Plan, costs: BlockCosts) -> SimResult:
    """Simulate ``p`` as the runtime will run it (``p`` is left as it is: see :func:`predicted`).

    The step time adds :func:`end_of_step`; peak memory
    counts the sends the runtime may hold at once (:func:`held_sends`),
    on gloo (``costs.receives_posted_ahead``) the receive buffers it keeps,
    and the optimizer step.
    """
    compiled = CompiledPlan(p, comm=validate(p))  # one compile: simulation and sends
    sim = simulate(p, compiled=compiled, check=False, receives_kept=costs.receives_posted_ahead)
    end = end_of_step(costs, p)
    sim.step_time += end
    held = compiled.held_send_bytes(
        grad_bytes=None if p.costs is None else p.costs.edge_grad_bytes)
    if p.costs is None:
        sim.peak_memory = [a + int(b) for a, b in zip(sim.peak_memory, held, strict=True)]
    else:  # as the search counts it (the scorer, orgel.plan.replicated)
        peak = reported_peak(costs, p.costs, p.placement, sim.peak_memory, held)
        sim.peak_memory = [int(round(x)) for x in peak]
    return sim


def with_prediction(p: Plan, sim: SimResult, end_of_step: float | None = None) -> Plan:
    """``p`` with ``sim``'s summary as its prediction (and ``end_of_step`` ms, when given)."""
    prediction = {k: v for k, v in sim.to_dict().items() if k != "critical_path"}
    if end_of_step is not None:
        prediction["end_of_step"] = end_of_step
    return dataclasses.replace(p, prediction=prediction)


def predicted(p: Plan, costs: BlockCosts) -> tuple[Plan, SimResult]:
    """:func:`predict` ``p``; the plan with that prediction, and the simulation."""
    sim = predict(p, costs)
    return with_prediction(p, sim, end_of_step(costs, p)), sim


def replicated(p: Plan, dp: int, costs: BlockCosts, memory: int | None,
               shard: str = "none") -> Plan:
    """``p`` on ``dp`` replica groups, with whole-micro-batch stage costs again; every
    stage's replicas shard (FSDP) when ``shard == "fsdp"``."""
    out = replicate(p, dp)
    split = any(a.kind == "I" for actions in out.schedule for a in actions)
    blocks = [list(s.blocks) for s in out.stage_graph.stages]
    # p's edges carry a replica's share of a micro-batch; each replica's messages take
    # their share of the whole micro-batch's edges (not a share of the share)
    priced = stage_costs(costs, blocks, split=split, placement=out.placement)
    priced.memory_per_rank = memory
    return dataclasses.replace(out, stage_graph=stage_graph(costs, blocks), costs=priced,
                               # a tie inside one stage is summed there (its replicas
                               # all-reduce it with the stage): only ties across stages
                               tied=[t for t in plan_tied_weights(costs, blocks, out.placement)
                                     if len(set(t.stages)) > 1],
                               shard=[shard] * out.num_stages)


def labelled(p: Plan, template: Template) -> Plan:
    """``p`` with the schedule template it was made from named in its meta."""
    return dataclasses.replace(p, meta={**p.meta, "schedule_label": template.label,
                                        "schedule_options": dict(template.options)})

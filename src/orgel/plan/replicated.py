"""A data-parallel plan priced from one replica: its pipeline simulated once, plus the all-reduces.

``dp`` replicas of a pipeline (:func:`orgel.plan.transforms.replicate`: replica
``k`` of rank ``r`` is rank ``r + P k``) run the same actions on the same
share of every micro-batch and never message one another, so where every
replica's messages take the same links their timelines are one timeline. The
only ops that join them are the gradient all-reduces (a stage over its
replicas; a tied weight over every rank that holds it), and nothing waits for
an all-reduce: each starts when the last backward of its stages has ended on
all its ranks and the step ends with the last of them. So the replicated
step is the pipeline's step or the latest ``last backward + all-reduce``,
whichever is later, and every replica's memory is the pipeline's: exactly
what simulating all ``P x dp`` ranks gives (:func:`orgel.sim.simulate`), at
the cost of ``P`` ranks. When the replicas' links differ (a pipeline that
does not fill whole nodes), :func:`replica_step` says so and the caller
simulates in full.

A stage whose replicas shard (FSDP) reduce-scatters instead of all-reducing,
and gathers its parameters over its replicas before its first forward on
each rank: every replica gathers at once over the same ring, so adding the
gather to that forward in the one simulated pipeline is again exact.
"""

from __future__ import annotations

import numpy as np

from orgel.costs.blocks import BlockCosts, reported_peak
from orgel.schedule.costs import Costs
from orgel.schedule.ir import Plan
from orgel.sim.allreduce import allreduce_time, plan_allreduces, plan_gathers
from orgel.sim.compiled import CompiledPlan, StageArrays


def same_links(single: Plan, costs: Costs, dp: int) -> bool:
    """Whether every replica's messages take the links replica 0's take."""
    p = single.num_ranks
    pairs = {(a, b) for a in range(p) for b in range(p) if a != b}
    for a, b in pairs:
        first = costs.link_between(a, b)
        if any(costs.link_between(a + p * k, b + p * k) != first for k in range(1, dp)):
            return False
    return True


def replicated_step(single: Plan, replicated: Plan, bc: BlockCosts
                    ) -> tuple[float, np.ndarray]:
    """``(step_time, peak_memory[rank])`` of ``replicated``: from one simulation of
    ``single`` (:func:`replica_step`), or of ``replicated`` in full where the replicas'
    links differ; the peak with the sends held and gloo's receive buffers, at least the
    step's end on the replicated placement (its gradients' flat copy for the all-reduce or
    reduce-scatter, which one replica's pipeline does not make): what
    :func:`orgel.plan.predict.predict` reports, counted by the same
    :func:`~orgel.costs.blocks.reported_peak`."""
    got = replica_step(single, replicated, receives_kept=bc.receives_posted_ahead,
                       held_sends=True)
    if got is None:
        from orgel.sim import simulate

        cp = CompiledPlan(replicated)
        sim = simulate(replicated, compiled=cp, receives_kept=bc.receives_posted_ahead)
        grads = None if replicated.costs is None else replicated.costs.edge_grad_bytes
        got = sim.step_time, np.asarray(sim.peak_memory) + cp.held_send_bytes(grad_bytes=grads)
    if replicated.costs is None:
        return got
    # the sends are in got already
    return got[0], reported_peak(bc, replicated.costs, replicated.placement, got[1], 0)


def replica_step(single: Plan, replicated: Plan, *, receives_kept: bool = False,
                 held_sends: bool = False) -> tuple[float, np.ndarray] | None:
    """``(step_time, peak_memory[rank])`` of ``replicated`` from one simulation of ``single``.

    ``single`` is the pipeline (``P`` ranks, costs of its share of a
    micro-batch); ``replicated`` is it on ``dp`` replica groups (whole
    micro-batch costs, every stage on ``dp`` ranks). None when the replicas'
    links differ (simulate ``replicated`` in full then). ``held_sends``: the peak counts the
    sends a rank may hold at once, as :func:`orgel.plan.predict.predict` does (the full
    simulation, which this equals without it, does not).
    """
    p, total = single.num_ranks, replicated.num_ranks
    if total % p or single.costs is None or replicated.costs is None:
        return None
    dp = total // p
    link_costs = replicated.costs
    if not link_costs.uniform_links and not same_links(single, link_costs, dp):
        return None
    # a sharded stage gathers its parameters over its replicas from the step's start (its
    # first F waits): replica 0's gathers, priced on the replicas' links
    cp = CompiledPlan(single, gathers=plan_gathers(replicated))
    costs, arrays = cp.stage_arrays(None)
    alone = cp.durations(costs, arrays, gathers=link_costs)
    # every replica computes what replica 0 does at the same time, on cores they may share
    dur, end, least = cp.shared_timeline(link_costs, alone, copies=dp)
    nc, nm = cp.num_compute, cp.num_messages
    step = max(float(end[:nc + nm].max()) if nc + nm else 0.0, least)
    # the replicated plan's all-reduces, each after the last backward of its stages
    grads = StageArrays.from_costs(link_costs, replicated.num_stages).grads
    groups, last = plan_allreduces(replicated)
    for group, preds in zip(groups, last, strict=True):
        ready = max((float(end[int(cp.rank_start[r % p]) + pos]) for r, pos in preds),
                    default=0.0)
        step = max(step, ready + allreduce_time(group, link_costs, grads))
    peak = cp.peak_memory(arrays, dur, end, receives_kept=receives_kept,
                          grad_bytes=costs.edge_grad_bytes)
    if held_sends:  # the sends a rank may hold at once, as predict counts them (a
        # replica's messages carry its share, as the single pipeline's do)
        peak = peak + cp.held_send_bytes(grad_bytes=costs.edge_grad_bytes)
    return step, np.tile(peak, dp)

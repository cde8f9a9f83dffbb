"""Gradient all-reduces of a plan: which ranks sum which stage's gradients, when, and how long.

A stage on several ranks (its replicas) all-reduces its gradients among them
once each has run its last backward of the stage; a tied weight group that
spans ranks does the same for the tied parameter. The ring model prices one.
A stage whose replicas shard its state (``plan.shard[s] == "fsdp"``)
reduce-scatters its gradients instead (half the ring steps), and gathers its
parameters once per step before its first forward on each rank
(:func:`plan_gathers`, :func:`gather_time`): the forward waits for it.
Shared by the compiled simulator (:mod:`orgel.sim.compiled`) and the pricing
of data-parallel replicas (:mod:`orgel.plan.replicated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orgel.costs.mesh import ring_time
from orgel.schedule.costs import Costs
from orgel.schedule.ir import Plan


@dataclass(frozen=True)
class AllReduce:
    """A gradient all-reduce among ``ranks`` (a data-parallel stage or a tied weight group).

    ``stages`` are the stages whose gradients it sums; ``nbytes`` is ``None`` for
    a stage's own gradients (read from its costs, less ``tied_bytes``: the
    runtime reduces a tied weight's gradient in its own group, not the stage's)
    or a fixed byte count for a tied weight group.
    """

    ranks: tuple[int, ...]
    stages: tuple[int, ...]
    nbytes: int | None
    label: str
    tied_bytes: int = 0
    scatter: bool = False  # a sharded (FSDP) stage's reduce-scatter: half the ring steps


def plan_allreduces(plan: Plan) -> tuple[list[AllReduce], list[list[tuple[int, int]]]]:
    """The gradient all-reduces of ``plan`` and what each waits for.

    One per stage on several ranks (its replicas) and one per tied weight group
    spanning ranks; each waits for the last ``B``/``W`` of its stages on each
    of its ranks, given as ``(rank, position in the rank's list)``.
    """
    groups: list[AllReduce] = []
    tied_groups: list[AllReduce] = []
    for i, group in enumerate(plan.tied):
        ranks = tuple(sorted({r for s in group.stages for r in plan.placement[s]}))
        if len(ranks) > 1:
            tied_groups.append(AllReduce(ranks, group.stages, group.nbytes,
                                         f"allreduce tied{i}"))
    for s, ranks in enumerate(plan.placement):
        if len(ranks) > 1:
            tied = sum(int(g.nbytes or 0) for g in tied_groups if s in g.stages)
            sharded = plan.sharded(s)
            groups.append(AllReduce(tuple(ranks), (s,), None,
                                    f"{'reduce-scatter' if sharded else 'allreduce'} s{s}",
                                    tied, scatter=sharded))
    groups += tied_groups
    last_of: dict[tuple[int, int], int] = {}  # (rank, stage) -> position of its last B/W
    needed = {(r, s) for g in groups for r in g.ranks for s in g.stages}
    for r in {r for r, _ in needed}:
        for pos, a in enumerate(plan.schedule[r]):
            if a.kind in ("B", "W"):
                last_of[(r, a.stage)] = pos
    preds: list[list[tuple[int, int]]] = []
    for g in groups:
        ps = []
        for r in g.ranks:
            positions = [last_of[(r, s)] for s in g.stages if (r, s) in last_of]
            if positions:
                ps.append((r, max(positions)))
        preds.append(ps)
    return groups, preds


def allreduce_time(g: AllReduce, costs: Costs, grads: np.ndarray) -> float:
    """Ring all-reduce: 2(n-1) steps of nbytes/n over the slowest ring link
    (a reduce-scatter, ``g.scatter``: n-1 steps).

    ``grads``: gradient bytes per stage (a stage's own all-reduce reads it).
    """
    if g.nbytes is None:
        nbytes = max(0, int(grads[g.stages[0]]) - g.tied_bytes)
    else:
        nbytes = g.nbytes
    return _ring(g.ranks, nbytes, costs, steps=1 if g.scatter else 2)


def _ring(ranks: tuple[int, ...], nbytes: int, costs: Costs, *, steps: int) -> float:
    """:func:`~orgel.costs.mesh.ring_time` over ``ranks`` in a ring, on its slowest link."""
    n = len(ranks)
    if n < 2:
        return 0.0
    ring = [costs.link_between(ranks[i], ranks[(i + 1) % n]) for i in range(n)]
    slowest = max(ring, key=lambda lk: lk.time(nbytes // n))
    return ring_time(slowest, nbytes, n, steps=steps)


def plan_gathers(plan: Plan) -> list[tuple[int, tuple[int, ...], list[tuple[int, int]]]]:
    """The parameter all-gathers of ``plan``'s sharded stages: ``(stage, ranks, firsts)``.

    ``firsts`` lists ``(rank, position)`` of the stage's first ``F`` on each
    of its ranks: the runtime starts the gather at the step's start
    (:meth:`orgel.runtime.sharding.Sharding.begin`) and that ``F`` waits for it (FSDP2's
    pre-forward hook).
    """
    out = []
    for s, ranks in enumerate(plan.placement):
        if len(ranks) < 2 or not plan.sharded(s):
            continue
        firsts = []
        for r in ranks:
            pos = next((i for i, a in enumerate(plan.schedule[r])
                        if a.kind == "F" and a.stage == s), None)
            if pos is not None:
                firsts.append((r, pos))
        out.append((s, tuple(ranks), firsts))
    return out


def gather_time(ranks: tuple[int, ...], nbytes: int, costs: Costs) -> float:
    """Ring all-gather of ``nbytes`` over ``ranks``: n-1 steps of nbytes/n, slowest link."""
    return _ring(ranks, nbytes, costs, steps=1)

"""Which rank runs which part of a schedule: the busiest channels on the fastest links.

:func:`channel_traffic` counts a plan's messages per (sender, receiver),
:func:`best_ranks` finds the renaming of ranks with the least traffic x link time,
and :func:`renamed` is the plan with its ranks renamed (no rank's work changes).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from orgel.schedule.comm import derive_comm
from orgel.schedule.ir import Plan


def channel_traffic(plan: Plan) -> np.ndarray:
    """[src, dst] micro-batch shares of the messages ``plan`` sends on each channel."""
    out = np.zeros((plan.num_ranks, plan.num_ranks))
    for m in derive_comm(plan).messages:
        start, stop, parts = m.part
        out[m.src_rank, m.dst_rank] += (stop - start) / parts
    return out


def best_ranks(traffic: np.ndarray, times: np.ndarray) -> tuple[int, ...]:
    """The renaming ``perm`` (rank ``r`` becomes ``perm[r]``) with the least traffic x time.

    Every permutation up to 6 ranks (720); beyond, pair swaps from the identity
    while one helps. Ties keep the identity (the first permutation tried).
    """
    n = len(traffic)
    src, dst = np.nonzero(traffic)
    weight = traffic[src, dst]
    if n <= 6:
        perms = np.array(list(itertools.permutations(range(n))))
        cost = (times[perms[:, src], perms[:, dst]] * weight).sum(axis=1)
        return tuple(int(r) for r in perms[int(np.argmin(cost))])
    perm = np.arange(n)
    best = float((times[perm[src], perm[dst]] * weight).sum())
    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(n), 2):
            trial = perm.copy()
            trial[a], trial[b] = perm[b], perm[a]
            cost = float((times[trial[src], trial[dst]] * weight).sum())
            if cost < best - 1e-12:
                perm, best, improved = trial, cost, True
    return tuple(int(r) for r in perm)


def renamed(plan: Plan, perm: tuple[int, ...]) -> Plan:
    """``plan`` with rank ``r`` renamed ``perm[r]`` (placement and action lists move)."""
    schedule: list[list[Any]] = [[] for _ in perm]
    for r, actions in enumerate(plan.schedule):
        schedule[perm[r]] = list(actions)
    placement = [tuple(perm[r] for r in ranks) for ranks in plan.placement]
    meta = dict(plan.meta, ranks_renamed=list(perm))
    return dataclasses.replace(plan, placement=placement, schedule=schedule, meta=meta)

"""Replica counts of graph-plan stages: which counts are allowed, and where spare ranks go."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from orgel.profile.costs import BlockCosts


@dataclass(frozen=True)
class StageSpec:
    """One stage of a graph plan: its blocks and how many ranks replicate it."""

    blocks: tuple[int, ...]
    replicas: int


def spread_replicas(bc: BlockCosts, stages: list[StageSpec], ranks: int, microbatches: int,
                     *, all_ranks: bool, counts: Collection[int] | None = None,
                     pure_dp: bool = True) -> list[StageSpec]:
    """Give spare ranks to stages as replicas, one at a time, where it helps most.

    The gain of one more replica of a stage is the compute it saves over the
    step minus the longer gradient all-reduce it adds. ``all_ranks`` hands out
    every spare rank to the slowest stages regardless; otherwise a rank whose
    best gain is not positive stays idle. A stage only grows to the next count
    in ``counts`` (all when None) that the spare ranks can pay for; without
    ``pure_dp`` the last single-rank stage is never replicated.
    """
    stages = list(stages)
    allowed = sorted(set(counts)) if counts is not None else list(range(1, ranks + 1))

    def grown(j: int) -> int | None:
        """The next allowed replica count of stage ``j`` the spare ranks can pay for."""
        r = stages[j].replicas
        if not pure_dp and r == 1 and sum(s.replicas == 1 for s in stages) == 1:
            return None
        return next((c for c in allowed if r < c <= r + spare), None)

    work = [sum(bc.fwd[b] + bc.bwd[b] for b in s.blocks) for s in stages]
    params = [sum(bc.params[b] for b in s.blocks) for s in stages]

    def reduce(i: int, r: int) -> float:
        return 2 * (r - 1) * bc.link.time(params[i] // r) if r > 1 else 0.0

    spare = ranks - sum(s.replicas for s in stages)
    while spare > 0:
        growable = [j for j in range(len(stages)) if grown(j) is not None]
        if not growable:
            break
        if all_ranks:
            i = max(growable, key=lambda j: work[j] / stages[j].replicas)
        else:
            def gain(j: int) -> float:
                r, n = stages[j].replicas, grown(j) or stages[j].replicas
                saved = microbatches * (work[j] / r - work[j] / n)
                return (saved - (reduce(j, n) - reduce(j, r))) / (n - r)
            i = max(growable, key=gain)
            if gain(i) <= 0:
                break
        new = grown(i) or stages[i].replicas
        spare -= new - stages[i].replicas
        stages[i] = StageSpec(stages[i].blocks, new)
    return stages


def replica_counts(ranks: int, *, max_replicas: int | None = None,
                   rows: int | None = None) -> list[int]:
    """Replica counts a stage may have: at most ``max_replicas``, dividing ``rows``."""
    top = ranks if max_replicas is None else min(ranks, max_replicas)
    return [r for r in range(1, top + 1) if rows is None or rows % r == 0]

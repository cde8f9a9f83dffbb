"""A lower bound of a candidate's peak memory per rank, from its schedule and stage costs alone.

The scorer rules out a candidate whose bound exceeds the memory per rank
before compiling or simulating it; at the scale of hundreds of ranks and
micro-batches most splits without recompute, and most recompute flags turned
off, fail this way, and the simulator never sees them. The bound never
exceeds the simulated peak (:mod:`orgel.sim.memory`), so nothing that fits is
ruled out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from orgel.costs.recompute import policy_effects
from orgel.schedule.costs import StageCost


def stage_peak_alive(schedule: list[list[Any]], num_stages: int) -> np.ndarray:
    """Per stage, the most micro-batches whose kept bytes it holds at once on a rank.

    A forward adds one, the backward (or ``W``) that frees it takes one away,
    counted along each rank's action list: a fact of the schedule alone.
    """
    out = np.zeros(num_stages, dtype=np.int64)
    for actions in schedule:
        alive: dict[int, int] = {}
        for a in actions:
            if a.kind == "F":
                alive[a.stage] = alive.get(a.stage, 0) + 1
                out[a.stage] = max(out[a.stage], alive[a.stage])
            elif a.kind in ("B", "W"):
                alive[a.stage] = alive.get(a.stage, 0) - 1
    return out


def memory_floor(alive: np.ndarray, placement: list[tuple[int, ...]], num_ranks: int,
                 stages: list[StageCost], edges: list[tuple[int, int]],
                 edge_bytes: np.ndarray, recompute: tuple[bool | str, ...]) -> np.ndarray:
    """A lower bound of every rank's peak bytes, without simulating.

    At the moment a stage holds its most micro-batches (``alive``, from
    :func:`stage_peak_alive`) its rank holds at least their kept bytes
    (activations, or with recompute what its policy keeps:
    :func:`orgel.costs.recompute.policy_effects`) on top of the weights and optimizer
    state of every stage it hosts (gradients come later). The simulator's peak is never below it.
    """
    n = len(stages)
    early = np.array([st.static_bytes - st.grad_bytes for st in stages], dtype=np.float64)
    acts = np.array([st.activations for st in stages], dtype=np.float64)
    if any(recompute):
        dst = np.array([d for _, d in edges], dtype=np.int64)
        inputs = np.bincount(dst, weights=edge_bytes, minlength=n)
        acts = policy_effects(recompute, np.array([st.fwd for st in stages]), acts, inputs,
                              [st.recompute for st in stages])[1]
    host = np.zeros((num_ranks, n))
    share = np.zeros(n)
    for s, ranks in enumerate(placement):
        host[list(ranks), s] = 1.0
        share[s] = 1.0 / len(ranks)
    kept = alive * acts * share
    return host @ early + (host * kept).max(axis=1, initial=0.0)

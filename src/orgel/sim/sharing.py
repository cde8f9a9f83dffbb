"""Ranks that share a host's cores: how crowded each action is, and the least step.

:meth:`orgel.sim.compiled.CompiledPlan.shared_timeline` times a schedule whose ranks
share fewer cores than there are ranks (processor sharing) with these two pieces.
"""

from __future__ import annotations

import numpy as np


def mean_overlap(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For each interval, the mean number of the intervals (itself included) open during it."""
    n = len(start)
    t = np.concatenate([start, end])
    delta = np.concatenate([np.ones(n), -np.ones(n)])
    order = np.lexsort((delta, t))  # at equal times an interval closes before one opens
    ts = t[order]
    count = np.cumsum(delta[order])
    area = np.concatenate([[0.0], np.cumsum(count[:-1] * np.diff(ts))])
    inside = np.interp(end, ts, area) - np.interp(start, ts, area)
    length = end - start
    return np.where(length > 0, inside / np.where(length > 0, length, 1.0), 1.0)


def shared_step(compute_ms: float, ranks: int, cores: float | None) -> float:
    """The least step of ``ranks`` ranks that share ``cores`` processors (0 if they do not).

    A schedule's longest path times each action as if its rank had a core to
    itself. When more ranks than cores compute, they take turns, but a rank
    waiting in a bubble gives its core to the others: the step cannot beat
    the compute of every rank (``compute_ms``) spread over the cores, and on a
    crowded host it approaches that. (Charging every action a fixed crowding
    factor instead counts each bubble as lost time, though the bubble is where
    the other ranks run.)
    """
    if cores is None or cores >= ranks:
        return 0.0
    return compute_ms / max(cores, 1e-9)

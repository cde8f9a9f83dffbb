"""Longest path through an op DAG: a plain loop, and the same loop compiled to straight-line code.

Both take ``preds[v]`` (the ops ``v`` waits for), a topological ``order`` and
``durations``, and return the end time of every op: an op starts when its
last predecessor ends (time 0 without predecessors).

The topology of a plan is fixed while its costs change, so for repeated
evaluation :func:`make_straight_line` writes the loop out as Python code
with one statement per op and every end time in a local variable::

    e0 = d[0]
    e1 = e0 + d[1]
    t = e1
    if e5 > t: t = e5
    e2 = t + d[2]

which runs two to four times faster than the loop (no inner loop, no list of
predecessors to walk). :class:`LevelPath` is the vectorised alternative: ops
grouped by depth, one numpy step per level. Pipeline schedules are deep and
narrow (hundreds of levels of a few ops each), so it loses to the
straight-line code at every size we measured, and to the plain loop below a
few thousand ops; ``benchmarks/simulator_speed.py`` prints all three.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

#: Ops per generated helper function: CPython compiles and runs very long
#: functions slower, so the straight-line code is cut into chunks that pass
#: the end times on in a list.
_CHUNK = 2000


def longest_path(
    preds: Sequence[Sequence[int]], order: Sequence[int], durations: Sequence[float]
) -> list[float]:
    """End time of every op, by one pass over ``order``."""
    end = [0.0] * len(preds)
    for v in order:
        start = 0.0
        for u in preds[v]:
            if end[u] > start:
                start = end[u]
        end[v] = start + durations[v]
    return end


_CACHE: dict[tuple[int, bytes], Callable[[list[float]], list[float]]] = {}
_CACHE_SIZE = 16
_CACHE_OPS = 400_000


def straight_line_for(
    preds: Sequence[Sequence[int]], order: Sequence[int]
) -> Callable[[list[float]], list[float]]:
    """:func:`make_straight_line`, shared between equal topologies (a small cache).

    A planner that rebuilds the same schedule for new split points gets the
    same predecessor lists, so it compiles once.
    """
    # a digest, not the tuples themselves: a cache of big topologies would otherwise
    # keep millions of small tuples alive for the garbage collector to walk
    flat = np.fromiter((u for p in preds for u in p), dtype=np.int64)
    sizes = np.fromiter((len(p) for p in preds), dtype=np.int64, count=len(preds))
    key = (len(preds), hashlib.blake2b(sizes.tobytes() + flat.tobytes(), digest_size=20).digest())
    fn = _CACHE.get(key)
    if fn is None:
        fn = make_straight_line(preds, order)
        # a few big topologies hold as much as many small ones: bound the ops kept too
        while _CACHE and (len(_CACHE) >= _CACHE_SIZE
                          or sum(k[0] for k in _CACHE) + key[0] > _CACHE_OPS):
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = fn
    return fn


def make_straight_line(
    preds: Sequence[Sequence[int]], order: Sequence[int]
) -> Callable[[list[float]], list[float]]:
    """Compile :func:`longest_path` for this topology into straight-line Python.

    The returned function takes the durations as a list and returns the end
    times as a list, equal to ``longest_path(preds, order, durations)``.
    """
    n = len(preds)
    chunks = [list(order[i:i + _CHUNK]) for i in range(0, len(order), _CHUNK)] or [[]]
    source: list[str] = []
    for c, ops in enumerate(chunks):
        # Each chunk reads the ends it needs from `end`, computes its own ops in
        # locals and writes them back; durations are read from `d` once each.
        mine = set(ops)
        needed = sorted({u for v in ops for u in preds[v] if u not in mine})
        body = [f"def _chunk{c}(d, end):"]
        body += [f"    e{u} = end[{u}]" for u in needed]
        for v in ops:
            ps = preds[v]
            if not ps:
                body.append(f"    e{v} = d[{v}]")
            elif len(ps) == 1:
                body.append(f"    e{v} = e{ps[0]} + d[{v}]")
            else:
                body.append(f"    t = e{ps[0]}")
                body += [f"    if e{u} > t: t = e{u}" for u in ps[1:]]
                body.append(f"    e{v} = t + d[{v}]")
        body += [f"    end[{v}] = e{v}" for v in ops]
        source += body
    source.append("def _run(d):")
    source.append(f"    end = [0.0] * {n}")
    source += [f"    _chunk{c}(d, end)" for c in range(len(chunks))]
    source.append("    return end")
    namespace: dict[str, object] = {}
    exec(compile("\n".join(source), "<orgel.sim straight-line>", "exec"), namespace)  # noqa: S102
    run = namespace["_run"]
    assert callable(run)
    return run  # type: ignore[return-value]


class LevelPath:
    """Level-synchronous longest path: ops grouped by depth, one numpy max per level."""

    def __init__(self, preds: Sequence[Sequence[int]], order: Sequence[int]) -> None:
        n = len(preds)
        depth = [0] * n
        for v in order:
            for u in preds[v]:
                if depth[u] + 1 > depth[v]:
                    depth[v] = depth[u] + 1
        by_level: list[list[int]] = [[] for _ in range(max(depth, default=-1) + 1)]
        for v in order:
            by_level[depth[v]].append(v)
        self.n = n
        # Padded predecessor matrix per level; index n is a sentinel that ends at 0.
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []
        for ops in by_level:
            width = max(1, max(len(preds[v]) for v in ops))
            pad = np.full((len(ops), width), n, dtype=np.int64)
            for i, v in enumerate(ops):
                pad[i, : len(preds[v])] = preds[v]
            self.levels.append((np.array(ops, dtype=np.int64), pad))

    def __call__(self, durations: np.ndarray) -> np.ndarray:
        """End time of every op (same result as :func:`longest_path`)."""
        end = np.zeros(self.n + 1)
        for ops, pad in self.levels:
            end[ops] = end[pad].max(axis=1) + durations[ops]
        return end[: self.n]

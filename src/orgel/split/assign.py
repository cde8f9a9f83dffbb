"""Simple stage assignments: balanced contiguous cuts, and random valid ones for testing.

Both cut a topological order of the blocks (or nodes) into contiguous runs, so
every stage is convex and the stages form a DAG. The planners search much
better assignments; these are the baseline and the fuzzing source.
"""

from __future__ import annotations

import random

from orgel.graph.blocks import BlockGraph
from orgel.graph.opgraph import OpGraph


def _units(graph: BlockGraph | OpGraph) -> tuple[list[int], dict[int, list[int]]]:
    """Unit ids in order and each unit's predecessors (blocks, or nodes by position)."""
    if isinstance(graph, BlockGraph):
        units = graph.order()
        preds = {b: graph.predecessors(b) for b in units}
        return units, preds
    names = list(graph.nodes)
    position = {n: i for i, n in enumerate(names)}
    preds = {
        i: sorted({position[s] for s in graph.nodes[n].inputs if s in position})
        for i, n in enumerate(names)
    }
    return list(range(len(names))), preds


def _check(num_stages: int, available: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > available:
        raise ValueError(
            f"cannot make {num_stages} stages from {available} blocks (or nodes); ask for fewer "
            "stages or more blocks"
        )


def stages_from_cuts(count: int, cuts: list[int]) -> list[int]:
    """Stage of each of ``count`` units in order, given sorted cut positions.

    A cut at ``c`` starts a new stage at unit ``c``: ``stages_from_cuts(5, [2, 4])``
    is ``[0, 0, 1, 1, 2]``.
    """
    stages: list[int] = []
    stage = 0
    for i in range(count):
        while stage < len(cuts) and i >= cuts[stage]:
            stage += 1
        stages.append(stage)
    return stages


def balanced_assignment(graph: BlockGraph | OpGraph, num_stages: int, *,
                        weight: str = "flops") -> list[int]:
    """The stage of each unit (a block of a BlockGraph; a node of an OpGraph, in node order):
    contiguous runs with about equal ``weight``, ``"flops"`` or ``"params"`` (parameter bytes).

    In an op graph the nodes between the first and last reader of a buffer the forward
    updates in place (a BatchNorm used twice) stay in one stage, and so does a tuple with
    its items (:func:`orgel.graph.blocks.unsplit_spans`); blocks already do.
    """
    from orgel.graph.blocks import cuts_a_span, unsplit_spans
    from orgel.split.points import balanced_points

    if weight not in ("flops", "params"):
        raise ValueError(f"weight must be 'flops' or 'params', got {weight!r}")
    if isinstance(graph, BlockGraph):
        w = [float(max(b.flops if weight == "flops" else b.param_bytes, 1)) for b in graph.blocks]
        units = [[i] for i in range(len(w))]
    else:
        names = list(graph.nodes)
        w = [float(max(_node_weight(graph, n, weight), 1)) for n in names]
        spans = unsplit_spans(graph, {n: i for i, n in enumerate(names)})
        units = []  # runs of nodes that no cut may divide
        for i in range(len(names)):
            if units and cuts_a_span(spans, i):
                units[-1].append(i)
            else:
                units.append([i])
    _check(num_stages, len(units))
    per_unit = stages_from_cuts(len(units), list(balanced_points(
        [sum(w[i] for i in u) for u in units], num_stages)))
    out = [0] * len(w)
    for unit, stage in zip(units, per_unit, strict=True):
        for i in unit:
            out[i] = stage
    return out


def _node_weight(graph: OpGraph, name: str, weight: str) -> float:
    node = graph.nodes[name]
    if weight == "flops":
        return float(getattr(node, "flops", 0) or 0)
    return float(sum(graph.tensor_bytes(p) for p in node.params))


def random_assignment(
    graph: BlockGraph | OpGraph, num_stages: int, *, seed: int = 0
) -> list[int]:
    """A random valid assignment: a random topological order cut at random points.

    For a BlockGraph one stage per block, for an OpGraph one per node (in node order).
    """
    units, preds = _units(graph)
    _check(num_stages, len(units))
    rng = random.Random(seed)
    indegree = {u: len(preds[u]) for u in units}
    succ: dict[int, list[int]] = {u: [] for u in units}
    for u in units:
        for p in preds[u]:
            succ[p].append(u)
    ready = [u for u in units if indegree[u] == 0]
    order: list[int] = []
    while ready:
        u = ready.pop(rng.randrange(len(ready)))
        order.append(u)
        for v in succ[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    cuts = sorted(rng.sample(range(1, len(order)), num_stages - 1))
    stage_of = dict(zip(order, stages_from_cuts(len(order), cuts), strict=True))
    return [stage_of[u] for u in units]

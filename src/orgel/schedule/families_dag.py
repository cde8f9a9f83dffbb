"""1F1B over a DAG of stages (GraphPipe §6): warm-up depth from the stage graph.

In a chain, stage ``i`` of ``n`` runs ``n - i`` forwards before its first
backward. In a DAG a stage may feed several branches, so its depth is the
number of stages on the *longest* path from it to a sink (a loss stage has
depth 1): that many micro-batches must be in flight before its first gradient
can come back. Each stage then alternates backward and forward and drains
(backward as early as possible). Branches that do not depend on each other run
concurrently on their own ranks::

        ┌─ 1 ─┐         depth: 0 → 3, 1 → 2, 2 → 2, 3 → 1
    0 ──┤     ├── 3
        └─ 2 ─┘

When a rank hosts several stages, their per-stage orders are merged by a list
scheduler with unit costs (``F`` = 1, ``B`` = 2): the rank runs whichever of its
stages' next actions can start first (ties: backward first, then stage index),
so a rank never waits on one stage while another could run.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from orgel.schedule.families_common import check_counts, finish
from orgel.schedule.ir import Action, Plan, PlanError, StageGraph

_COST = {"F": 1.0, "B": 2.0}


def stage_depths(graph: StageGraph) -> list[int]:
    """Stages on the longest path from each stage to a sink, counting both ends."""
    depth = [1] * graph.num_stages
    for s in reversed(graph.topological_order()):
        for i in graph.consumers(s):
            depth[s] = max(depth[s], depth[graph.edges[i].dst] + 1)
    return depth


def _stage_order(stage: int, depth: int, microbatches: int) -> list[Action]:
    """1F1B for one stage: ``depth`` forwards, then backward/forward, then drain."""
    forwards = [Action("F", stage, m) for m in range(microbatches)]
    k = min(depth, microbatches)
    actions = forwards[:k]
    for m in range(microbatches):
        actions.append(Action("B", stage, m))
        if k + m < microbatches:
            actions.append(forwards[k + m])
    return actions


def _merge(graph: StageGraph, placement: list[tuple[int, ...]], num_ranks: int,
           orders: list[list[Action]]) -> list[list[Action]]:
    """Interleave the per-stage orders on each rank by earliest possible start.

    A list scheduler over a heap: each (rank, stage) head whose dependencies
    are done sits in the heap keyed by (start, backward first, stage, rank).
    A rank's free time only grows, so a popped key that is stale is pushed back
    with its new start (lazy update). O(actions log actions).
    """
    producers = [[graph.edges[i].src for i in graph.producers(s)] for s in range(graph.num_stages)]
    consumers = [[graph.edges[i].dst for i in graph.consumers(s)] for s in range(graph.num_stages)]
    # An action counts as done once every replica of its stage has run it.
    runs: dict[Action, int] = {}
    latest: dict[Action, float] = {}
    blocked: dict[Action, list[tuple[int, int]]] = {}
    head: dict[tuple[int, int], int] = {}
    free = [0.0] * num_ranks
    heap: list[tuple[float, int, int, int]] = []
    schedule: list[list[Action]] = [[] for _ in range(num_ranks)]

    def offer(r: int, s: int) -> None:
        """Put the head of (r, s) in the heap if its dependencies are done."""
        pos = head[(r, s)]
        if pos == len(orders[s]):
            return
        a = orders[s][pos]
        ready = 0.0
        for other in producers[s] if a.kind == "F" else consumers[s]:
            dep = Action(a.kind, other, a.microbatch)
            if runs.get(dep, 0) < len(placement[other]):
                blocked.setdefault(dep, []).append((r, s))
                return
            ready = max(ready, latest[dep])
        heapq.heappush(heap, (max(free[r], ready), 0 if a.kind == "B" else 1, s, r))

    for s, ranks in enumerate(placement):
        for r in ranks:
            head[(r, s)] = 0
            offer(r, s)
    while heap:
        start, prio, s, r = heapq.heappop(heap)
        if free[r] > start:  # the rank got busier since this was pushed
            heapq.heappush(heap, (free[r], prio, s, r))
            continue
        a = orders[s][head[(r, s)]]
        head[(r, s)] += 1
        free[r] = start + _COST[a.kind]
        schedule[r].append(a)
        runs[a] = runs.get(a, 0) + 1
        latest[a] = max(latest.get(a, 0.0), free[r])
        offer(r, s)
        if runs[a] == len(placement[s]):
            for waiter in blocked.pop(a, []):
                offer(*waiter)
    if any(head[key] < len(orders[key[1]]) for key in head):
        # Per-stage 1F1B orders always make progress; guard against a bad graph.
        raise PlanError("dag-1f1b: no stage can make progress (internal error)")
    return schedule


def dag_1f1b(num_ranks: int, microbatches: int, *, stage_graph: StageGraph | None = None,
             placement: Sequence[Sequence[int]] | None = None, nbytes: int = 0) -> Plan:
    """1F1B over the stage DAG ``stage_graph`` (default: a chain, one stage per rank).

    ``placement[s]`` lists the ranks of stage ``s`` (default ``[(0,), (1,), …]``,
    which needs as many stages as ranks). On a chain with one stage per rank
    this is exactly ``1f1b``.
    """
    check_counts(num_ranks, microbatches)
    if nbytes < 0:
        raise PlanError(f"nbytes must be >= 0, got {nbytes}")
    graph = StageGraph.chain(num_ranks, nbytes) if stage_graph is None else stage_graph
    graph.check()
    if placement is None:
        if graph.num_stages != num_ranks:
            raise PlanError(
                f"dag-1f1b: the stage graph has {graph.num_stages} stages for {num_ranks} "
                "ranks; pass placement=[ranks of stage 0, ...] or one stage per rank"
            )
        places: list[tuple[int, ...]] = [(s,) for s in range(num_ranks)]
    else:
        places = [tuple(int(r) for r in ranks) for ranks in placement]
        if len(places) != graph.num_stages:
            raise PlanError(
                f"dag-1f1b: placement lists {len(places)} stages but the stage graph has "
                f"{graph.num_stages}"
            )
        for s, ranks in enumerate(places):
            if not ranks or len(set(ranks)) != len(ranks) or \
                    any(not 0 <= r < num_ranks for r in ranks):
                raise PlanError(
                    f"dag-1f1b: placement of stage {s} is {list(ranks)}; give distinct ranks "
                    f"in 0..{num_ranks - 1}"
                )
    depth = stage_depths(graph)
    orders = [_stage_order(s, depth[s], microbatches) for s in range(graph.num_stages)]
    schedule = _merge(graph, places, num_ranks, orders)
    meta = {"schedule": "dag-1f1b", "depths": depth}
    return finish(graph, places, num_ranks, microbatches, schedule, meta)

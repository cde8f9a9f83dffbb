"""The stage graph of a Plan: the stages, the values between them, and its error type.

Part of the Plan IR (:mod:`orgel.schedule.ir`, which re-exports every name here): a
:class:`StageGraph` is the DAG of :class:`Stage` s whose :class:`Edge` s carry named
:class:`Value` s (bytes per whole micro-batch).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple


class PlanError(ValueError):
    """A Plan (or a part of one) is malformed or cannot run.

    The message names what is wrong and where (rank, position, action).
    """


class Value(NamedTuple):
    """A named tensor that crosses a stage boundary; ``nbytes`` per micro-batch.

    ``grad``: whether a gradient comes back for it. Integer ids, masks and
    values that depend on nothing trained (position tables) carry none; an edge
    whose values all carry none has no gradient messages (:mod:`orgel.schedule.comm`).
    """

    name: str
    nbytes: int
    grad: bool = True

    def to_json(self) -> list[Any]:
        """``[name, nbytes]``, with ``false`` after them for a value without gradient."""
        return [self.name, self.nbytes] if self.grad else [self.name, self.nbytes, False]

    @classmethod
    def from_json(cls, data: Any) -> Value:
        """Read :meth:`to_json`'s list (a plan written without the flag: gradients)."""
        if not isinstance(data, list | tuple) or len(data) not in (2, 3) or (
                len(data) == 3 and not isinstance(data[2], bool)):
            raise PlanError(f"an edge value must look like [name, bytes] or [name, bytes, "
                            f"false] (false: it carries no gradient), got {data!r}")
        return cls(str(data[0]), int(data[1]), data[2] if len(data) == 3 else True)


@dataclass(frozen=True)
class Edge:
    """Values produced by stage ``src`` and consumed by stage ``dst``."""

    src: int
    dst: int
    values: tuple[Value, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values)

    @property
    def carries_grad(self) -> bool:
        """Whether gradients go back along the edge: one of its values carries one.

        An edge without values (a synthetic dependency) counts as carrying one.
        """
        return not self.values or any(v.grad for v in self.values)

    @property
    def grad_nbytes(self) -> int:
        """Bytes of the gradients that go back: those of the values that carry one."""
        return sum(v.nbytes for v in self.values if v.grad)


@dataclass(frozen=True)
class Stage:
    """One node of the stage graph.

    ``nodes`` names the graph nodes (fx node names) the stage computes and
    ``blocks`` the coarsened blocks; both are empty for synthetic plans.
    ``model_inputs`` are the model's own inputs the stage reads (by name: they
    are fed from the data on every rank that hosts the stage, never sent).
    ``model_outputs`` are the model outputs it produces; the stage that produces
    them computes the loss.
    """

    name: str = ""
    nodes: tuple[str, ...] = ()
    blocks: tuple[int, ...] = ()
    model_inputs: tuple[str, ...] = ()
    model_outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageGraph:
    """Stages are the nodes of a DAG; edges carry named values with byte sizes.

    A chain is the special case (:meth:`chain`); branches, joins and skip edges
    (stage 0 → stage 5) are normal. At most one edge per (src, dst) pair: all
    values from one stage to another travel on that edge.
    """

    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def chain(cls, num_stages: int, nbytes: int = 0) -> StageGraph:
        """A chain 0 → 1 → … → n-1, each edge one value ``act`` of ``nbytes``."""
        stages = tuple(Stage(name=f"stage{i}") for i in range(num_stages))
        edges = tuple(
            Edge(i, i + 1, (Value(f"act{i}", nbytes),)) for i in range(num_stages - 1)
        )
        return cls(stages, edges)

    @classmethod
    def from_edges(
        cls, num_stages: int, edges: list[tuple[int, int]], nbytes: int = 0
    ) -> StageGraph:
        """A DAG from ``(src, dst)`` pairs, each edge one value of ``nbytes``."""
        stages = tuple(Stage(name=f"stage{i}") for i in range(num_stages))
        return cls(
            stages,
            tuple(Edge(s, d, (Value(f"s{s}_to_s{d}", nbytes),)) for s, d in edges),
        )

    @cached_property
    def _adjacency(self) -> tuple[list[list[int]], list[list[int]]]:
        """Edge indices into and out of each stage, built once (the graph is frozen)."""
        into: list[list[int]] = [[] for _ in range(self.num_stages)]
        out: list[list[int]] = [[] for _ in range(self.num_stages)]
        for i, e in enumerate(self.edges):
            if 0 <= e.dst < self.num_stages:
                into[e.dst].append(i)
            if 0 <= e.src < self.num_stages:
                out[e.src].append(i)
        return into, out

    def producers(self, stage: int) -> list[int]:
        """Indices (into ``edges``) of the edges that feed ``stage``."""
        return list(self._adjacency[0][stage])

    def consumers(self, stage: int) -> list[int]:
        """Indices (into ``edges``) of the edges that leave ``stage``."""
        return list(self._adjacency[1][stage])

    def sources(self) -> list[int]:
        return [s for s in range(self.num_stages) if not self.producers(s)]

    def sinks(self) -> list[int]:
        return [s for s in range(self.num_stages) if not self.consumers(s)]

    def topological_order(self) -> list[int]:
        """Stages in a topological order (ties broken by index); raises on a cycle."""
        indegree = [0] * self.num_stages
        for e in self.edges:
            indegree[e.dst] += 1
        ready = [s for s in range(self.num_stages) if indegree[s] == 0]
        heapq.heapify(ready)
        order: list[int] = []
        outgoing = self._adjacency[1]
        while ready:
            s = heapq.heappop(ready)
            order.append(s)
            for i in outgoing[s]:
                d = self.edges[i].dst
                indegree[d] -= 1
                if indegree[d] == 0:
                    heapq.heappush(ready, d)
        if len(order) != self.num_stages:
            placed = set(order)
            stuck = [s for s in range(self.num_stages) if s not in placed]
            raise PlanError(f"stage graph has a cycle through stages {stuck}")
        return order

    def check(self) -> None:
        """Raise :class:`PlanError` unless this is a well-formed DAG."""
        if self.num_stages == 0:
            raise PlanError("stage graph has no stages")
        seen: set[tuple[int, int]] = set()
        for i, e in enumerate(self.edges):
            for end in (e.src, e.dst):
                if not 0 <= end < self.num_stages:
                    raise PlanError(
                        f"edge {i} ({e.src}->{e.dst}) names stage {end}, but there are "
                        f"only {self.num_stages} stages"
                    )
            if e.src == e.dst:
                raise PlanError(f"edge {i} is a self-loop on stage {e.src}")
            if (e.src, e.dst) in seen:
                raise PlanError(
                    f"two edges {e.src}->{e.dst}: put all values between two stages "
                    "on one edge"
                )
            seen.add((e.src, e.dst))
            for v in e.values:
                if v.nbytes < 0:
                    raise PlanError(f"edge {e.src}->{e.dst} value {v.name!r} has negative bytes")
        self.topological_order()



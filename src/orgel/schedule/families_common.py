"""Helpers shared by the schedule family generators: option checks and plan assembly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from orgel.schedule.ir import Action, Plan, PlanError, StageGraph
from orgel.schedule.validate import validate

#: A schedule family: ``(num_ranks, microbatches, **options) -> Plan``.
Family = Callable[..., Plan]


def check_counts(num_ranks: int, microbatches: int) -> None:
    """Raise :class:`PlanError` unless both counts are positive integers."""
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise PlanError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")


def resolve_graph(stage_graph: StageGraph | None, num_stages: int, nbytes: int,
                  family: str) -> StageGraph:
    """The given stage graph (checked to have ``num_stages`` stages) or a chain."""
    if nbytes < 0:
        raise PlanError(f"nbytes must be >= 0, got {nbytes}")
    if stage_graph is None:
        return StageGraph.chain(num_stages, nbytes)
    if stage_graph.num_stages != num_stages:
        raise PlanError(
            f"{family} needs a stage graph with {num_stages} stages, got "
            f"{stage_graph.num_stages}: pass one with that many stages or change num_ranks"
        )
    return stage_graph


def finish(stage_graph: StageGraph, placement: Sequence[tuple[int, ...]], num_ranks: int,
           microbatches: int, schedule: list[list[Action]], meta: dict[str, Any],
           hint: str = "") -> Plan:
    """Assemble the Plan and validate it (a generator bug or a bad option fails here).

    ``hint`` is appended to a validation error to say which option to change.
    """
    plan = Plan(stage_graph=stage_graph, placement=list(placement), num_ranks=num_ranks,
                microbatches=microbatches, schedule=schedule, meta=meta)
    try:
        validate(plan)
    except PlanError as exc:
        if not hint:
            raise
        raise PlanError(f"{exc} ({hint})") from None
    return plan

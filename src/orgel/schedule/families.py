"""Schedule families: generators that return a validated Plan, and their registry.

Every generator takes ``num_ranks`` and ``microbatches`` first and keyword-only
options after, checks the options up front, and returns a Plan whose ``meta``
names the family and its parameters. ``build_schedule(name, ...)`` looks a
family up in :data:`FAMILIES`.

Pictures, for 4 ranks and 8 micro-batches (``F``/``B`` of micro-batch ``n``)::

    gpipe  rank0: F F F F F F F F B B B B B B B B      all forwards, then all backwards
    1f1b   rank0: F F F F B F B F B F B F B B B B      warm-up, one-forward-one-backward,
           rank3: F B F B F B F B F B F B F B F B      cool-down
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orgel.schedule.ir import Action, Plan, PlanError, StageGraph

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


def finish(stage_graph: StageGraph, placement: list[tuple[int, ...]], num_ranks: int,
           microbatches: int, schedule: list[list[Action]], meta: dict[str, Any]) -> Plan:
    """Assemble the Plan and validate it (a generator bug or a bad option fails here)."""
    from orgel.schedule.validate import validate

    plan = Plan(stage_graph=stage_graph, placement=placement, num_ranks=num_ranks,
                microbatches=microbatches, schedule=schedule, meta=meta)
    validate(plan)
    return plan


def gpipe(num_ranks: int, microbatches: int, *, stage_graph: StageGraph | None = None,
          nbytes: int = 0) -> Plan:
    """GPipe: every rank runs all forwards, then all backwards (in micro-batch order)."""
    check_counts(num_ranks, microbatches)
    graph = resolve_graph(stage_graph, num_ranks, nbytes, "gpipe")
    mbs = range(microbatches)
    schedule = [
        [Action("F", r, m) for m in mbs] + [Action("B", r, m) for m in mbs]
        for r in range(num_ranks)
    ]
    placement = [(r,) for r in range(num_ranks)]
    return finish(graph, placement, num_ranks, microbatches, schedule, {"schedule": "gpipe"})


def one_f_one_b(num_ranks: int, microbatches: int, *, stage_graph: StageGraph | None = None,
                nbytes: int = 0) -> Plan:
    """1F1B (PipeDream-flush / DAPPLE): warm-up forwards, then alternate, then drain.

    Rank ``r`` of ``p`` runs ``min(p - r - 1, m)`` warm-up forwards, so at most
    ``min(p - r, m)`` micro-batches have activations alive at once.
    """
    check_counts(num_ranks, microbatches)
    graph = resolve_graph(stage_graph, num_ranks, nbytes, "1f1b")
    schedule = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, microbatches)
        actions = [Action("F", r, m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            actions += [Action("F", r, warmup + m), Action("B", r, m)]
        actions += [Action("B", r, m) for m in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    placement = [(r,) for r in range(num_ranks)]
    return finish(graph, placement, num_ranks, microbatches, schedule, {"schedule": "1f1b"})


#: name -> generator; extended below by the other family modules.
FAMILIES: dict[str, Family] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def build_schedule(name: str, num_ranks: int, microbatches: int, **options: Any) -> Plan:
    """Build the schedule family ``name`` (see :data:`FAMILIES`) as a validated Plan."""
    family = FAMILIES.get(name)
    if family is None:
        raise PlanError(
            f"unknown schedule family {name!r}: choose one of {', '.join(sorted(FAMILIES))}"
        )
    try:
        return family(num_ranks, microbatches, **options)
    except TypeError as exc:
        # An unknown keyword is a user error: say which options the family takes.
        if "unexpected keyword argument" not in str(exc):
            raise
        import inspect

        accepted = [
            p.name for p in inspect.signature(family).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        raise PlanError(
            f"schedule family {name!r} does not take that option ({exc}); it takes "
            f"{', '.join(accepted) or 'no options'}"
        ) from None

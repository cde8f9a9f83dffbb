"""Schedule families: generators that return a validated Plan, and their registry.

Every generator takes ``num_ranks`` and ``microbatches`` first and keyword-only
options after, checks the options up front, and returns a Plan whose ``meta``
names the family and its parameters. ``build_schedule(name, ...)`` looks a
family up in :data:`FAMILIES`.

``dualpipev`` (two stages per rank in a V) lives in :mod:`orgel.schedule.families_dualpipe`.
The looped families (``interleaved``, ``looped-bfs``, ``looped``) live in
:mod:`orgel.schedule.families_looped`, ``dag-1f1b`` in
:mod:`orgel.schedule.families_dag`.

Pictures, for 4 ranks and 8 micro-batches::

    gpipe  rank0: F F F F F F F F B B B B B B B B      all forwards, then all backwards
    1f1b   rank0: F F F F B F B F B F B F B B B B      warm-up, one-forward-one-backward,
           rank3: F B F B F B F B F B F B F B F B      cool-down
"""

from __future__ import annotations

from typing import Any

from orgel.schedule.families_common import Family, check_counts, finish, resolve_graph
from orgel.schedule.families_dag import dag_1f1b
from orgel.schedule.families_dualpipe import dualpipev
from orgel.schedule.families_looped import interleaved, looped, looped_bfs
from orgel.schedule.ir import Action, Plan, PlanError, StageGraph


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


def zb_h1(num_ranks: int, microbatches: int, *, stage_graph: StageGraph | None = None,
          nbytes: int = 0) -> Plan:
    """Zero-bubble H1 (Qi et al. 2023): backward split into ``I`` and ``W``.

    ``I`` (input gradient) is on the critical path and sent upstream at once;
    ``W`` (weight gradient) is deferred to fill bubbles. Every rank keeps at
    most ``min(p, m)`` micro-batches whose ``W`` has not run, the peak of 1F1B
    (on its first rank); later ranks use that allowance to defer ``W`` in the
    warm-up, which is what lets upstream ranks start their ``I`` early. A
    micro-batch waiting only for ``W`` holds less memory than one waiting for
    ``B``, so the peak memory stays 1F1B's. With uniform costs the step takes
    ``m (f + b + w) + (p - 1) (f + b - w)`` (``b`` the ``I`` time) for ``m >= p``::

        rank0: F F F F I W F I W F I W F I W F I W I W I W I W
        rank3: F I F I F I F I W F I W F I W F I W F I W W W W
    """
    check_counts(num_ranks, microbatches)
    p, m = num_ranks, microbatches
    graph = resolve_graph(stage_graph, p, nbytes, "zb-h1")
    limit = min(p, m)
    schedule = []
    for r in range(p):
        forwards = min(p - r, m)  # as 1F1B: p - r forwards before the first backward
        weights = 0
        actions = [Action("F", r, k) for k in range(forwards)]
        for k in range(m):
            actions.append(Action("I", r, k))
            if forwards < m:
                if forwards - weights >= limit:  # at the cap: free one before the next F
                    actions.append(Action("W", r, weights))
                    weights += 1
                actions.append(Action("F", r, forwards))
                forwards += 1
            elif k < m - 1 and weights <= k:
                # Draining: one W fills the wait for the next I from downstream.
                actions.append(Action("W", r, weights))
                weights += 1
        actions += [Action("W", r, k) for k in range(weights, m)]
        schedule.append(actions)
    placement = [(r,) for r in range(p)]
    return finish(graph, placement, p, m, schedule, {"schedule": "zb-h1"})


#: name -> generator.
FAMILIES: dict[str, Family] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "looped-bfs": looped_bfs,
    "looped": looped,
    "zb-h1": zb_h1,
    "dag-1f1b": dag_1f1b,
    "dualpipev": dualpipev,
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

"""Looped schedule families: each rank hosts ``v`` stages of a chain, stage ``s`` on rank ``s % P``.

The model is cut into ``P * v`` stages and a micro-batch's forward *loops* over
the ranks ``v`` times (stage 0 on rank 0, …, stage P-1 on rank P-1, stage P on
rank 0 again, …). Three families:

* ``interleaved``: Megatron-LM's interleaved 1F1B (depth-first: groups of ``P``
  micro-batches go through every loop before the next group starts);
* ``looped-bfs``: breadth-first (Lamy-Poirier): every micro-batch goes through a
  loop before any starts the next loop, then backwards in reverse loop order;
* ``looped``: Pfeife's parameterised looped 1F1B ``(B, N_l, B_l, B_f)``, which
  covers GPipe, 1F1B, interleaved, BFS and prefetching variants in one form.
"""

from __future__ import annotations

from collections.abc import Sequence

from orgel.schedule.families_common import check_counts, finish, resolve_graph
from orgel.schedule.ir import Action, Plan, PlanError, StageGraph


def _check_loops(name: str, value: int, option: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}: {option} must be a positive integer, got {value!r}")


def _one_f_one_b_merge(forwards: list[Action], backwards: list[Action],
                       first_backward_after: int) -> list[Action]:
    """``first_backward_after`` forwards, then backward/forward alternately, then drain."""
    k = min(first_backward_after, len(forwards))
    actions = forwards[:k]
    rest = forwards[k:]
    for i, b in enumerate(backwards):
        actions.append(b)
        if i < len(rest):
            actions.append(rest[i])
    return actions


def interleaved(num_ranks: int, microbatches: int, *, stages_per_rank: int = 2,
                stage_graph: StageGraph | None = None, nbytes: int = 0) -> Plan:
    """Megatron-LM interleaved 1F1B with ``v = stages_per_rank`` model chunks per rank.

    Micro-batches go in groups of ``P`` (so ``microbatches`` must be a multiple of
    ``P``): the group runs chunk 0, then chunk 1, …; backwards run the chunks in
    reverse. Rank ``r`` runs ``2 (P - r - 1) + (v - 1) P`` warm-up forwards,
    then one forward one backward, then drains; with ``v = 1`` it is ``1f1b``.
    """
    check_counts(num_ranks, microbatches)
    _check_loops("interleaved", stages_per_rank, "stages_per_rank")
    p, v, m = num_ranks, stages_per_rank, microbatches
    if m % p:
        raise PlanError(
            f"interleaved needs microbatches to be a multiple of num_ranks ({p}), got {m}: "
            f"use e.g. {-(-m // p) * p}"
        )
    graph = resolve_graph(stage_graph, p * v, nbytes, "interleaved")
    total = m * v

    def forward(r: int, k: int) -> Action:
        chunk = (k % (p * v)) // p
        return Action("F", chunk * p + r, (k // (p * v)) * p + k % p)

    def backward(r: int, k: int) -> Action:
        chunk = v - 1 - (k % (p * v)) // p
        return Action("B", chunk * p + r, (k // (p * v)) * p + k % p)

    schedule = []
    for r in range(p):
        # Megatron runs plain 1F1B for one chunk; the doubled term is interleaving's.
        warmup = min(p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * p, total)
        actions = [forward(r, k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(r, warmup + k), backward(r, k)]
        actions += [backward(r, k) for k in range(total - warmup, total)]
        schedule.append(actions)
    placement = [(s % p,) for s in range(p * v)]
    meta = {"schedule": "interleaved", "stages_per_rank": v}
    return finish(graph, placement, p, m, schedule, meta)


def looped_bfs(num_ranks: int, microbatches: int, *, stages_per_rank: int = 2,
               stage_graph: StageGraph | None = None, nbytes: int = 0) -> Plan:
    """Breadth-first looped schedule: all forwards of a loop before the next loop starts.

    Rank ``r`` runs ``F`` of stage ``r`` for every micro-batch, then of stage
    ``P + r``, …; then backwards from the last loop to the first. With one
    stage per rank it is GPipe.
    """
    check_counts(num_ranks, microbatches)
    _check_loops("looped-bfs", stages_per_rank, "stages_per_rank")
    p, v, m = num_ranks, stages_per_rank, microbatches
    graph = resolve_graph(stage_graph, p * v, nbytes, "looped-bfs")
    schedule = [
        [Action("F", c * p + r, mb) for c in range(v) for mb in range(m)]
        + [Action("B", c * p + r, mb) for c in reversed(range(v)) for mb in range(m)]
        for r in range(p)
    ]
    placement = [(s % p,) for s in range(p * v)]
    meta = {"schedule": "looped-bfs", "stages_per_rank": v}
    return finish(graph, placement, p, m, schedule, meta)


def looped(num_ranks: int, microbatches: int, *, loops: int = 1,
           loop_microbatches: int | None = None, prefetch: Sequence[int] | None = None,
           stage_graph: StageGraph | None = None, nbytes: int = 0) -> Plan:
    """Pfeife's looped 1F1B with parameters ``(B, N_l, B_l, B_f)``.

    ``B = microbatches``, ``N_l = loops`` (stages per rank), ``B_l =
    loop_microbatches`` (micro-batches that go through all loops together;
    default ``B``) and ``B_f = prefetch`` (one count per rank; default zeros).
    Each rank's forwards run group by group (``B_l`` micro-batches), loop by
    loop; its backwards run group by group, loops in reverse. Rank ``i`` (0 is
    the first) runs ``(N_l - 1) B_l + (P - i) + B_f[i]`` forwards before its
    first backward (at most all of them), then alternates backward and
    forward, then drains.

    Reading of the paper's B.2 tuples (4 ranks): GPipe (8,1,8,(4,5,6,7)) runs
    all 8 forwards first; DAPPLE (6,1,6,(0,0,0,0)) is 1F1B; Megatron
    (8,2,4,(3,2,1,0)) is interleaved 1F1B. PipeDream's (7,1,8,(0,1,1,0)) has
    ``B_l = 8 > B = 7``, which no group can hold: we take ``B_l = min(B_l, B)``
    (with one loop ``B_l`` only sets the group size, which does not change the
    order). Otherwise ``B_l`` must divide ``B``. BFS's (8,4,4,(4,5,6,7)) taken
    literally runs 20 of 32 forwards first (group 0 through all loops, plus
    group 1's first loop); with ``B_l = 8`` the same ``B_f`` gives the pure
    breadth-first order of ``looped-bfs``.
    """
    check_counts(num_ranks, microbatches)
    _check_loops("looped", loops, "loops")
    p, m, n_l = num_ranks, microbatches, loops
    b_l = m if loop_microbatches is None else loop_microbatches
    _check_loops("looped", b_l, "loop_microbatches")
    b_l = min(b_l, m)
    if m % b_l:
        raise PlanError(
            f"looped: loop_microbatches ({b_l}) must divide microbatches ({m}); "
            f"use one of {[d for d in range(1, m + 1) if m % d == 0]}"
        )
    b_f = [0] * p if prefetch is None else prefetch
    if not isinstance(b_f, Sequence) or len(b_f) != p or \
            any(not isinstance(x, int) or x < 0 for x in b_f):
        raise PlanError(
            f"looped: prefetch must list {p} counts >= 0 (one per rank), got {b_f!r}"
        )
    b_f = list(b_f)
    graph = resolve_graph(stage_graph, p * n_l, nbytes, "looped")
    groups = range(m // b_l)
    schedule = []
    for i in range(p):
        forwards = [Action("F", loop * p + i, g * b_l + j)
                    for g in groups for loop in range(n_l) for j in range(b_l)]
        backwards = [Action("B", loop * p + i, g * b_l + j)
                     for g in groups for loop in reversed(range(n_l)) for j in range(b_l)]
        first = (n_l - 1) * b_l + (p - i) + b_f[i]
        schedule.append(_one_f_one_b_merge(forwards, backwards, first))
    placement = [(s % p,) for s in range(p * n_l)]
    meta = {"schedule": "looped", "loops": n_l, "loop_microbatches": b_l, "prefetch": b_f}
    hint = (f"looped with B={m}, N_l={n_l}, B_l={b_l}, B_f={tuple(b_f)} cannot run: "
            "use loop_microbatches >= num_ranks, or change prefetch so that a rank never "
            "prefetches more than the rank before it sends")
    return finish(graph, placement, p, m, schedule, meta, hint)

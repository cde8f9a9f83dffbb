"""Validation of a Plan before anything runs: structure, completeness, order, no deadlock.

:func:`validate` checks, in this order, and raises :class:`PlanError` at the
first problem with a message naming the rank, position and action:

1. the stage graph is a DAG; placement covers every stage with distinct,
   in-range ranks; one action list per rank; one recompute flag per stage;
2. every action names a stage its rank hosts and a micro-batch in range;
3. on every rank hosting a stage, each micro-batch has ``F`` and either ``B``
   or ``I`` then ``W``, each exactly once, never ``B`` together with ``I``/``W``,
   and the backward halves come after the forward (``F`` < ``B``/``I`` < ``W``);
   values handed over on one rank (no message) are produced before they are used;
4. a dry run (:func:`dry_run`): every rank executes its list in order and an
   action runs only once the messages it needs (:mod:`orgel.schedule.comm`) were
   sent. If ranks get stuck, every stuck rank is reported with what it waits for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from orgel.schedule.comm import CommPlan, derive_comm, describe, replica_pairs
from orgel.schedule.ir import Action, Plan, PlanError

#: Default duration of each action kind in a dry run (uniform units).
UNIT_DURATIONS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass
class DryRun:
    """Result of executing every rank's list in order with derived messages.

    ``finish[r][p]`` is when the action at position ``p`` of rank ``r`` ends
    (with the given durations and zero-cost messages), ``nan`` if it never ran;
    ``stuck`` lists ``(rank, position)`` of ranks that could not finish.
    """

    finish: list[list[float]]
    stuck: list[tuple[int, int]]
    comm: CommPlan

    @property
    def step_time(self) -> float:
        """When the last action ends."""
        return max((t for row in self.finish for t in row), default=0.0)


def dry_run(plan: Plan, durations: dict[str, float] | None = None,
            comm: CommPlan | None = None) -> DryRun:
    """Execute the schedule symbolically; linear in actions plus messages.

    Assumes the action lists are well formed (checks 1-3 of :func:`validate`).
    """
    cost = UNIT_DURATIONS if durations is None else durations
    comm = derive_comm(plan) if comm is None else comm
    schedule = plan.schedule
    messages = comm.messages
    waiting = [[len(msgs) for msgs in row] for row in comm.recvs_before]
    ready_at = [[0.0] * len(row) for row in schedule]
    finish = [[float("nan")] * len(row) for row in schedule]
    ptr = [0] * len(schedule)
    clock = [0.0] * len(schedule)
    queue = deque(range(len(schedule)))
    while queue:
        r = queue.popleft()
        actions = schedule[r]
        p = ptr[r]
        while p < len(actions) and waiting[r][p] == 0:
            end = max(clock[r], ready_at[r][p]) + cost[actions[p].kind]
            finish[r][p] = clock[r] = end
            for i in comm.sends_after[r][p]:
                msg = messages[i]
                dst, at = msg.dst_rank, msg.recv_pos
                ready_at[dst][at] = max(ready_at[dst][at], end)
                waiting[dst][at] -= 1
                if waiting[dst][at] == 0 and ptr[dst] == at:
                    queue.append(dst)
            p += 1
        ptr[r] = p
    stuck = [(r, ptr[r]) for r in range(len(schedule)) if ptr[r] < len(schedule[r])]
    return DryRun(finish, stuck, comm)


def validate(plan: Plan) -> CommPlan:
    """Raise :class:`PlanError` unless ``plan`` is complete and runs without deadlock.

    Returns the plan's derived communication (:func:`derive_comm`), which the dry
    run needed anyway, so callers such as the simulator need not derive it again.
    """
    _check_structure(plan)
    positions = [_check_rank(plan, r, actions) for r, actions in enumerate(plan.schedule)]
    _check_local_edges(plan, positions)
    comm = derive_comm(plan)
    result = dry_run(plan, comm=comm)
    if result.stuck:
        raise PlanError(_deadlock_message(plan, result))
    return comm


def _check_structure(plan: Plan) -> None:
    graph = plan.stage_graph
    graph.check()
    if plan.num_ranks < 1:
        raise PlanError(f"num_ranks must be >= 1, got {plan.num_ranks}")
    if plan.microbatches < 1:
        raise PlanError(f"microbatches must be >= 1, got {plan.microbatches}")
    if len(plan.schedule) != plan.num_ranks:
        raise PlanError(
            f"the schedule has {len(plan.schedule)} rank lists but the plan has "
            f"{plan.num_ranks} ranks: write one line per rank (an idle rank gets 'rankN:')"
        )
    if len(plan.placement) != graph.num_stages:
        raise PlanError(
            f"placement names ranks for {len(plan.placement)} stages but the stage graph "
            f"has {graph.num_stages}: give every stage its ranks"
        )
    for s, ranks in enumerate(plan.placement):
        if not ranks:
            raise PlanError(f"stage {s} is placed on no rank: give it at least one")
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"stage {s} is placed on ranks {list(ranks)}: list each rank once")
        for r in ranks:
            if not 0 <= r < plan.num_ranks:
                raise PlanError(
                    f"stage {s} is placed on rank {r}, but ranks are 0..{plan.num_ranks - 1}"
                )
    if len(plan.recompute) != graph.num_stages:
        raise PlanError(
            f"recompute has {len(plan.recompute)} flags but there are {graph.num_stages} "
            "stages: give one per stage"
        )
    if len(plan.shard) != graph.num_stages:
        raise PlanError(f"shard has {len(plan.shard)} entries but there are "
                        f"{graph.num_stages} stages: give one per stage")
    for s, ranks in enumerate(plan.placement):
        if plan.sharded(s) and len(ranks) < 2:
            raise PlanError(f"stage {s} is sharded ('fsdp') but has one replica (rank "
                            f"{ranks[0]}): place it on two ranks or more, or set its shard "
                            "to 'none'")


def _check_rank(plan: Plan, r: int, actions: list[Action]) -> dict[Action, int]:
    """Checks 2 and 3 for one rank; returns each action's position."""
    num_stages = plan.stage_graph.num_stages
    where: dict[Action, int] = {}
    for p, a in enumerate(actions):
        at = f"rank {r} at position {p} ({a})"
        if not 0 <= a.stage < num_stages:
            raise PlanError(f"{at}: there is no stage {a.stage} (stages are 0..{num_stages - 1})")
        if r not in plan.placement[a.stage]:
            raise PlanError(
                f"{at}: stage {a.stage} is placed on ranks {list(plan.placement[a.stage])}, "
                f"not on rank {r}"
            )
        if not 0 <= a.microbatch < plan.microbatches:
            raise PlanError(
                f"{at}: micro-batch {a.microbatch} is out of range (the plan has "
                f"{plan.microbatches}: 0..{plan.microbatches - 1})"
            )
        if a in where:
            raise PlanError(f"{at}: duplicate, {a} already runs at position {where[a]}")
        where[a] = p
    for s in plan.stages_on(r):
        for m in range(plan.microbatches):
            f, b = where.get(Action("F", s, m)), where.get(Action("B", s, m))
            i, w = where.get(Action("I", s, m)), where.get(Action("W", s, m))
            if f is None:
                raise PlanError(f"rank {r} is missing F{s}.{m} (stage {s} runs on rank {r})")
            if b is not None and (i is not None or w is not None):
                other = f"I{s}.{m}" if i is not None else f"W{s}.{m}"
                raise PlanError(
                    f"rank {r} at position {b} (B{s}.{m}): {other} also runs (position "
                    f"{i if i is not None else w}); use B, or I and W, not both"
                )
            if b is None and i is None and w is None:
                raise PlanError(
                    f"rank {r} is missing the backward of stage {s} micro-batch {m}: "
                    f"add B{s}.{m} (or I{s}.{m} and W{s}.{m})"
                )
            if b is None and (i is None or w is None):
                have, lack = (f"I{s}.{m}", f"W{s}.{m}") if w is None else (f"W{s}.{m}", f"I{s}.{m}")
                pos = i if w is None else w
                raise PlanError(f"rank {r} at position {pos} ({have}): {lack} is missing")
            back, back_pos = (f"B{s}.{m}", b) if b is not None else (f"I{s}.{m}", i)
            assert back_pos is not None
            if back_pos < f:
                raise PlanError(
                    f"rank {r} at position {back_pos} ({back}) runs before F{s}.{m} "
                    f"(position {f}): the backward needs its forward first"
                )
            if w is not None and i is not None and w < i:
                raise PlanError(
                    f"rank {r} at position {w} (W{s}.{m}) runs before I{s}.{m} "
                    f"(position {i}): W needs I first"
                )
    return where


def _check_local_edges(plan: Plan, positions: list[dict[Action, int]]) -> None:
    """Values handed over on one rank (no message) need the producer to run first.

    An edge whose producer and consumer replicas share a rank carries no message
    (see :mod:`orgel.schedule.comm`), so the dry run cannot see it: check the
    list order instead. ``F`` of the consumer after ``F`` of the producer, and
    the producer's ``B``/``I`` after the consumer's.
    """
    graph = plan.stage_graph
    for e in graph.edges:
        src_ranks, dst_ranks = plan.placement[e.src], plan.placement[e.dst]
        by_src, _ = replica_pairs(len(src_ranks), len(dst_ranks), 0)
        for j, r in enumerate(src_ranks):
            if not any(dst_ranks[k] == r for k, _, _ in by_src[j]):
                continue
            where = positions[r]
            for m in range(plan.microbatches):
                f_src, f_dst = where[Action("F", e.src, m)], where[Action("F", e.dst, m)]
                if f_dst < f_src:
                    raise PlanError(
                        f"rank {r} at position {f_dst} (F{e.dst}.{m}) needs activations of "
                        f"edge {e.src}->{e.dst} micro-batch {m} from F{e.src}.{m} on the same "
                        f"rank, which runs later (position {f_src})"
                    )
                b_src = _backward_at(where, e.src, m)
                b_dst = _backward_at(where, e.dst, m)
                if b_src[1] < b_dst[1]:
                    raise PlanError(
                        f"rank {r} at position {b_src[1]} ({b_src[0]}) needs the gradient of "
                        f"edge {e.src}->{e.dst} micro-batch {m} from {b_dst[0]} on the same "
                        f"rank, which runs later (position {b_dst[1]})"
                    )


def _backward_at(where: dict[Action, int], stage: int, m: int) -> tuple[Action, int]:
    """The ``B`` or ``I`` of (stage, m) and its position (present: checked before)."""
    b = Action("B", stage, m)
    if b in where:
        return b, where[b]
    i = Action("I", stage, m)
    return i, where[i]


def _deadlock_message(plan: Plan, result: DryRun) -> str:
    comm = result.comm
    at = {r: p for r, p in result.stuck}
    parts = []
    for r, p in result.stuck:
        waits = []
        for i in comm.recvs_before[r][p]:
            msg = comm.messages[i]
            src, sp = msg.src_rank, at.get(msg.src_rank)
            if sp is not None and sp <= msg.send_pos:  # not sent yet: its sender is stuck
                waits.append(f"{describe(plan, msg)} from rank {src}, which is stuck at "
                             f"position {sp} ({plan.schedule[src][sp]})")
        shown = "; and for ".join(waits[:3])
        if len(waits) > 3:
            shown += f" (and {len(waits) - 3} more messages)"
        parts.append(f"rank {r} at position {p} ({plan.schedule[r][p]}) waits for {shown}")
    return "deadlock: " + "; ".join(parts)

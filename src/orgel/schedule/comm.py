"""Sends and receives derived from a Plan: which messages, on which channel, in which order.

A schedule names only compute actions. Every cross-rank edge of the stage graph
implies messages, derived here once, identically for the simulator and the
runtime:

* activations: after ``F(u, m)`` on a rank hosting producer stage ``u``, the
  values of every edge ``u -> s`` go to the ranks hosting ``s``; they must
  arrive before ``F(s, m)`` there;
* gradients: after ``B(s, m)`` (or its input half ``I(s, m)``) on a rank hosting
  ``s``, the gradients of every edge ``u -> s`` go back to the ranks hosting
  ``u``; they must arrive before ``B(u, m)``/``I(u, m)`` there. Only the values
  that carry a gradient (``Value.grad``) send one, and an edge none of whose
  values does (a mask, integer ids, a position table) has no gradient message
  at all: nothing is sent, received or waited for, and ``B(u, m)`` does not
  depend on ``B(s, m)`` through it.

An edge whose producer and consumer replicas share a rank carries no message.
A stage on ``n`` ranks is data-parallel inside the stage: replica ``k`` takes
rows ``[k/n, (k+1)/n)`` of each micro-batch, and between a producer on ``n``
ranks and a consumer on ``n'`` ranks each overlapping replica pair exchanges
exactly the overlap, written ``part = (start, stop, parts)`` with
``parts = lcm(n, n')`` (``(0, 1, 1)`` is the whole micro-batch).

Messages on one (sender, receiver) channel are ordered by the sender's action
order (ties: edge index, then part), so receivers can post receives in that
order; NCCL-style in-order matching then never deadlocks when the dry run of
:func:`orgel.schedule.validate.validate` succeeds. Cost: one pass over the
actions with dict lookups, O(actions x edges-per-stage x replica pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import NamedTuple

from orgel.schedule.ir import Action, Plan, PlanError


class Message(NamedTuple):
    """One point-to-point transfer of an edge's values (or their gradients)."""

    src_rank: int
    dst_rank: int
    edge: int  # index into plan.stage_graph.edges
    microbatch: int
    grad: bool  # False: activations (after the producer's F); True: gradients (after B/I)
    part: tuple[int, int, int]  # rows [start/parts, stop/parts) of the micro-batch
    nbytes: int  # edge bytes (gradients: of the values that carry one) x share
    send_pos: int  # position in schedule[src_rank] of the action that produces it
    recv_pos: int  # position in schedule[dst_rank] of the first action that needs it


@dataclass
class CommPlan:
    """All messages of a Plan, indexed by channel and by action.

    ``channels[(src, dst)]`` lists message indices in send order (== receive
    order); ``sends_after[rank][pos]`` the messages sent right after that
    action; ``recvs_before[rank][pos]`` those that must arrive before it.
    """

    messages: list[Message]
    channels: dict[tuple[int, int], list[int]]
    sends_after: list[list[list[int]]]
    recvs_before: list[list[list[int]]]


# (other replica index, part, nbytes) for each replica index on this side of an edge.
_Pairs = dict[int, list[tuple[int, tuple[int, int, int], int]]]


def replica_pairs(n_src: int, n_dst: int, nbytes: int) -> tuple[_Pairs, _Pairs]:
    """Overlapping replica pairs of an edge, keyed by producer and by consumer replica.

    ``by_src[j]`` lists ``(k, part, nbytes)`` for each consumer replica ``k`` whose
    rows overlap producer replica ``j``'s; ``by_dst[k]`` the same from the other side.
    """
    parts = lcm(n_src, n_dst)
    by_src: _Pairs = {j: [] for j in range(n_src)}
    by_dst: _Pairs = {k: [] for k in range(n_dst)}
    step_src, step_dst = parts // n_src, parts // n_dst
    for j in range(n_src):
        lo_j, hi_j = j * step_src, (j + 1) * step_src
        for k in range(lo_j // step_dst, (hi_j - 1) // step_dst + 1):
            lo, hi = max(lo_j, k * step_dst), min(hi_j, (k + 1) * step_dst)
            part = (lo, hi, parts)
            share = nbytes * (hi - lo) // parts
            by_src[j].append((k, part, share))
            by_dst[k].append((j, part, share))
    return by_src, by_dst


def describe(plan: Plan, message: Message) -> str:
    """Human words for a message: ``gradient of edge 1->2 micro-batch 0``."""
    edge = plan.stage_graph.edges[message.edge]
    what = "gradient" if message.grad else "activations"
    text = f"{what} of edge {edge.src}->{edge.dst} micro-batch {message.microbatch}"
    start, stop, parts = message.part
    if parts != 1:
        text += f" rows [{start}/{parts}, {stop}/{parts})"
    return text


def derive_comm(plan: Plan) -> CommPlan:
    """Derive every message of ``plan`` (see the module docstring for the rules).

    Expects each needed action present once (``validate`` checks that first);
    raises :class:`PlanError` when an action runs on a rank that does not host
    its stage or a message has no action on the receiving rank that needs it.
    """
    graph = plan.stage_graph
    schedule = plan.schedule
    num_ranks = len(schedule)
    replica = [{r: k for k, r in enumerate(ranks)} for ranks in plan.placement]
    out_edges: list[list[int]] = [[] for _ in range(graph.num_stages)]
    in_edges: list[list[int]] = [[] for _ in range(graph.num_stages)]
    fwd_pairs: list[_Pairs] = []
    bwd_pairs: list[_Pairs] = []
    for i, e in enumerate(graph.edges):
        out_edges[e.src].append(i)
        in_edges[e.dst].append(i)
        n_src, n_dst = len(plan.placement[e.src]), len(plan.placement[e.dst])
        fwd_pairs.append(replica_pairs(n_src, n_dst, e.nbytes)[0])
        bwd_pairs.append(replica_pairs(n_src, n_dst, e.grad_nbytes)[1])

    # Where each receiving action sits: (stage, microbatch) -> position, per rank.
    f_at: list[dict[tuple[int, int], int]] = [{} for _ in range(num_ranks)]
    b_at: list[dict[tuple[int, int], int]] = [{} for _ in range(num_ranks)]
    for r, actions in enumerate(schedule):
        for p, a in enumerate(actions):
            if a.kind == "F":
                f_at[r].setdefault((a.stage, a.microbatch), p)
            elif a.kind in ("B", "I"):
                b_at[r].setdefault((a.stage, a.microbatch), p)

    messages: list[Message] = []
    channels: dict[tuple[int, int], list[int]] = {}
    sends_after: list[list[list[int]]] = [[[] for _ in actions] for actions in schedule]
    recvs_before: list[list[list[int]]] = [[[] for _ in actions] for actions in schedule]

    def emit(src: int, dst: int, edge: int, a: Action, grad: bool,
             part: tuple[int, int, int], nbytes: int, send_pos: int, need_stage: int) -> None:
        at = (b_at if grad else f_at)[dst].get((need_stage, a.microbatch))
        if at is None:
            need = (f"B{need_stage}.{a.microbatch} or I{need_stage}.{a.microbatch}" if grad
                    else f"F{need_stage}.{a.microbatch}")
            raise PlanError(
                f"rank {src} at position {send_pos} ({a}) sends "
                f"{'gradient' if grad else 'activations'} of edge "
                f"{graph.edges[edge].src}->{graph.edges[edge].dst} to rank {dst}, "
                f"but rank {dst} never runs {need}"
            )
        index = len(messages)
        messages.append(Message(src, dst, edge, a.microbatch, grad, part, nbytes, send_pos, at))
        channels.setdefault((src, dst), []).append(index)
        sends_after[src][send_pos].append(index)
        recvs_before[dst][at].append(index)

    for r, actions in enumerate(schedule):
        for p, a in enumerate(actions):
            if not 0 <= a.stage < graph.num_stages:
                raise PlanError(
                    f"rank {r} at position {p} ({a}) names stage {a.stage}, but there are "
                    f"only {graph.num_stages} stages"
                )
            k = replica[a.stage].get(r)
            if k is None:
                raise PlanError(
                    f"rank {r} at position {p} ({a}) runs stage {a.stage}, which is placed "
                    f"on ranks {list(plan.placement[a.stage])}"
                )
            if a.kind == "F":
                for i in out_edges[a.stage]:
                    dst_stage = graph.edges[i].dst
                    dst_ranks = plan.placement[dst_stage]
                    for other, part, nbytes in fwd_pairs[i][k]:
                        dst = dst_ranks[other]
                        if dst != r:
                            emit(r, dst, i, a, False, part, nbytes, p, dst_stage)
            elif a.kind in ("B", "I"):
                for i in in_edges[a.stage]:
                    if not graph.edges[i].carries_grad:
                        continue
                    src_stage = graph.edges[i].src
                    src_ranks = plan.placement[src_stage]
                    for other, part, nbytes in bwd_pairs[i][k]:
                        dst = src_ranks[other]
                        if dst != r:
                            emit(r, dst, i, a, True, part, nbytes, p, src_stage)
    return CommPlan(messages, channels, sends_after, recvs_before)

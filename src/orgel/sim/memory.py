"""Peak memory per rank of a simulated schedule, swept with numpy in one pass.

What a rank holds at a time ``t`` (bytes):

* static: params + grads + optimizer state of every stage it hosts (a
  data-parallel replica holds the whole stage's weights);
* kept activations: every forward ``F(s, m)`` allocates, at its start, the
  bytes stage ``s`` keeps for backward (its ``activations``, or with recompute
  only its inputs, the bytes of its incoming edges), freed at the end of
  ``B(s, m)`` or ``W(s, m)``;
* receive buffers: a message's bytes from the start of its transfer until the
  receiving action starts (the action then owns them);
* the running action's ``temporary`` (plus, for a recomputed stage's ``B``/``I``,
  the activations it rebuilds).

A replica of a stage on ``n`` ranks keeps ``1/n`` of the activation and
temporary bytes; a message already carries only its share of rows.

A rank runs its actions one after the other, so kept activations and
temporaries change only at action boundaries in list order: a cumulative sum
gives them for every action ("run" slots) and every idle gap before an action
("gap" slots) without sorting events. Only receive buffers depend on the
timing of other ranks; each covers a contiguous range of slots, found by
binary search in the rank's (sorted) start and end times and added with a
difference array. The peak of a rank is the largest slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MemoryLayout:
    """Topology-only facts for the memory sweep (built once per compiled plan)."""

    op_rank: np.ndarray
    op_stage: np.ndarray
    is_alloc: np.ndarray  # F: allocates kept activations
    is_free: np.ndarray  # B or W: frees them
    is_rebuild: np.ndarray  # B or I of a recomputed stage: rebuilds activations
    first_of_rank: np.ndarray  # per op: index of its rank's first op
    rank_start: np.ndarray
    nonempty: np.ndarray  # ranks with at least one action
    host: np.ndarray  # [rank, stage] 1.0 where the rank hosts the stage
    peak_inflight: np.ndarray  # per rank: most forwards alive at once

    @classmethod
    def build(
        cls,
        op_rank: np.ndarray,
        op_stage: np.ndarray,
        op_kind: np.ndarray,
        rank_start: np.ndarray,
        placement: list[tuple[int, ...]],
        recompute: list[bool],
    ) -> MemoryLayout:
        """Precompute masks and the in-flight counts from the action lists."""
        num_ranks = len(rank_start) - 1
        is_alloc = op_kind == 0
        is_free = (op_kind == 1) | (op_kind == 3)
        rc = np.array(recompute, dtype=bool)[op_stage] if len(op_stage) else is_alloc
        is_rebuild = rc & ((op_kind == 1) | (op_kind == 2))
        first = rank_start[:-1][op_rank] if len(op_rank) else op_rank
        host = np.zeros((num_ranks, len(placement)))
        for s, ranks in enumerate(placement):
            host[list(ranks), s] = 1.0
        nonempty = np.flatnonzero(rank_start[1:] > rank_start[:-1])
        layout = cls(op_rank, op_stage, is_alloc, is_free, is_rebuild, first, rank_start,
                     nonempty, host, np.zeros(num_ranks, dtype=np.int64))
        counts = _per_action(layout, is_alloc.astype(np.int64), is_free.astype(np.int64))
        inflight = np.zeros(num_ranks, dtype=np.int64)
        if len(nonempty):
            inflight[nonempty] = np.maximum.reduceat(counts[0], rank_start[nonempty])
        object.__setattr__(layout, "peak_inflight", inflight)
        return layout


def _per_action(
    layout: MemoryLayout, alloc: np.ndarray, free: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Amount alive while each action runs, and in the gap just before it."""
    net = alloc - free
    before = np.cumsum(net) - net  # alive before each op, counting from the first rank
    before = before - before[layout.first_of_rank]  # ... and from this rank's first op
    return before + alloc, before


def peak_memory(
    layout: MemoryLayout,
    *,
    keep: np.ndarray,
    activations: np.ndarray,
    temporary: np.ndarray,
    static: np.ndarray,
    share: np.ndarray,
    compute_start: np.ndarray,
    compute_end: np.ndarray,
    msg_start: np.ndarray,
    msg_dst: np.ndarray,
    msg_recv: np.ndarray,
    msg_bytes: np.ndarray,
) -> np.ndarray:
    """Peak bytes per rank (int64); arguments are per stage, per op or per message."""
    static_rank = layout.host @ static
    peak = static_rank.copy()
    n = len(layout.op_rank)
    if n == 0:
        return np.rint(peak).astype(np.int64)
    st = layout.op_stage
    keep_op = keep[st] * share[st]
    alloc = np.where(layout.is_alloc, keep_op, 0.0)
    free = np.where(layout.is_free, keep_op, 0.0)
    temp = temporary[st] * share[st] + np.where(
        layout.is_rebuild, activations[st] * share[st], 0.0
    )
    alive_run, alive_gap = _per_action(layout, alloc, free)
    base = static_rank[layout.op_rank]
    run = base + alive_run + temp
    gap = base + alive_gap
    if len(msg_bytes):
        run, gap = _add_buffers(layout, run, gap, compute_start, compute_end, msg_start,
                                msg_dst, msg_recv, msg_bytes.astype(np.float64))
    slots = np.maximum(run, gap)
    starts = layout.rank_start[layout.nonempty]
    peak[layout.nonempty] = np.maximum(peak[layout.nonempty], np.maximum.reduceat(slots, starts))
    return np.rint(peak).astype(np.int64)


def _add_buffers(
    layout: MemoryLayout,
    run: np.ndarray,
    gap: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    msg_start: np.ndarray,
    msg_dst: np.ndarray,
    msg_recv: np.ndarray,
    msg_bytes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Add each receive buffer to the run and gap slots it overlaps on its receiver."""
    n = len(run)
    # One sorted key over all ranks: a rank's times lie in [r*span, r*span + horizon).
    span = 2.0 * float(max(end.max(), msg_start.max(), 0.0)) + 1.0
    offset = layout.op_rank * span
    key_t = msg_start + msg_dst * span
    # Run slot j holds the buffer if the transfer starts before j ends and j < receiver.
    lo_run = np.searchsorted(end + offset, key_t, side="right")
    # Gap slot j (before j) holds it if the transfer starts before j starts, j <= receiver.
    lo_gap = np.searchsorted(start + offset, key_t, side="right")
    w_run = np.where(lo_run < msg_recv, msg_bytes, 0.0)
    w_gap = np.where(lo_gap <= msg_recv, msg_bytes, 0.0)
    d_run = np.bincount(lo_run, w_run, n + 2) - np.bincount(msg_recv, w_run, n + 2)
    d_gap = np.bincount(lo_gap, w_gap, n + 2) - np.bincount(msg_recv + 1, w_gap, n + 2)
    return run + np.cumsum(d_run)[:n], gap + np.cumsum(d_gap)[:n]

"""Peak memory per rank of a simulated schedule, swept with numpy in one pass.

What a rank holds at a time ``t`` (bytes):

* static: params + grads + optimizer state of every stage it hosts (a
  data-parallel replica holds the whole stage's weights);
* kept activations: every forward ``F(s, m)`` allocates, at its start, the
  bytes stage ``s`` keeps for backward (its ``activations``, or with recompute
  only its inputs, the bytes of its incoming edges), freed at the end of
  ``B(s, m)`` or ``W(s, m)``; with a split backward, ``I(s, m)`` allocates
  what it keeps for ``W(s, m)`` (``weight_kept``, when given), freed at the
  end of ``W(s, m)``;
* receive buffers: a message's bytes from the start of its transfer until the
  receiving action starts (the action then owns them);
* the running action's ``temporary`` (plus, for a recomputed stage's ``B``/``I``,
  the activations it rebuilds: all of them, or with ``"layer"`` one layer's; see
  :mod:`orgel.costs.recompute`). With recompute a forward keeps what its policy keeps.

A replica of a stage on ``n`` ranks keeps ``1/n`` of the activation and
temporary bytes; a message already carries only its share of rows.

A rank runs its actions one after the other, so kept activations and
temporaries change only at action boundaries in list order: a cumulative sum
gives them for every "slot" of the rank without sorting events. The slots of
a rank alternate: the gap before action 0, action 0 running, the gap before
action 1, ... Their end times (start of the next action, end of this one)
are sorted, so the slots a receive buffer covers are one contiguous range:
from the first slot ending after the transfer starts up to the gap before the
receiving action. One binary search finds them and a difference array adds
them. The peak of a rank is its largest slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MemoryLayout:
    """Topology-only facts for the memory sweep (built once per compiled plan)."""

    op_stage: np.ndarray
    net_sign: np.ndarray  # per op: +1 for F (allocates), -1 for B/W (frees), else 0
    is_alloc: np.ndarray  # per op: 1.0 for F
    temp_index: np.ndarray  # per op: stage, or stage + S for a recomputed B/I
    first_of_rank: np.ndarray  # per op: index of its rank's first op
    op_rank: np.ndarray
    slot_rank: np.ndarray  # per slot (2 per op): its rank
    slot_starts: np.ndarray  # first slot of each nonempty rank
    nonempty: np.ndarray  # ranks with at least one action
    host: np.ndarray  # [rank, stage] 1.0 where the rank hosts the stage
    peak_inflight: np.ndarray  # per rank: most forwards alive at once
    late_sign: np.ndarray | None = None  # per op: +1 for I (allocates), -1 for W, else 0
    is_late: np.ndarray | None = None  # per op: 1.0 for I
    first_grad: np.ndarray | None = None  # per op: 1.0 for its stage's first B/W on its rank
    first_whole: np.ndarray | None = None  # first_grad, where that op is a whole B (not W)

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
        num_ranks, num_stages = len(rank_start) - 1, len(placement)
        is_alloc = (op_kind == 0).astype(np.float64)
        net_sign = is_alloc - ((op_kind == 1) | (op_kind == 3))
        rebuild = np.array(recompute, dtype=bool)[op_stage] & ((op_kind == 1) | (op_kind == 2))
        host = np.zeros((num_ranks, num_stages))
        for s, ranks in enumerate(placement):
            host[list(ranks), s] = 1.0
        nonempty = np.flatnonzero(rank_start[1:] > rank_start[:-1])
        first_grad = np.zeros(len(op_kind))
        seen: set[tuple[int, int]] = set()
        for i in np.flatnonzero((op_kind == 1) | (op_kind == 3)):
            key = (int(op_rank[i]), int(op_stage[i]))
            if key not in seen:
                seen.add(key)
                first_grad[i] = 1.0
        layout = cls(
            op_stage=op_stage, net_sign=net_sign, is_alloc=is_alloc,
            temp_index=op_stage + num_stages * rebuild,
            first_of_rank=rank_start[:-1][op_rank], op_rank=op_rank,
            slot_rank=np.repeat(op_rank, 2), slot_starts=2 * rank_start[nonempty],
            nonempty=nonempty, host=host, peak_inflight=np.zeros(num_ranks, dtype=np.int64),
            late_sign=(op_kind == 2).astype(np.float64) - (op_kind == 3),
            is_late=(op_kind == 2).astype(np.float64), first_grad=first_grad,
            first_whole=first_grad * (op_kind == 1),
        )
        inflight = np.zeros(num_ranks, dtype=np.int64)
        if len(nonempty):
            run, _ = layout.alive(np.ones(num_stages))
            inflight[nonempty] = np.maximum.reduceat(run, rank_start[nonempty]).round()
        object.__setattr__(layout, "peak_inflight", inflight)
        return layout

    def alive(self, alloc_per_stage: np.ndarray, *,
              late: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Kept bytes while each action runs, and in the gap just before it.

        ``late``: bytes allocated by each ``I`` and freed by its ``W`` (what the
        input half keeps for the weight half) instead of ``F`` to ``B``/``W``.
        """
        alloc = alloc_per_stage[self.op_stage]
        sign, starts = self.net_sign, self.is_alloc
        if late and self.late_sign is not None and self.is_late is not None:
            sign, starts = self.late_sign, self.is_late
        net = alloc * sign
        before = np.cumsum(net) - net  # alive before each op, counting from rank 0's first op
        before -= before[self.first_of_rank]  # ... and from its own rank's first op
        return before + alloc * starts, before


def peak_memory(
    layout: MemoryLayout,
    *,
    keep: np.ndarray,
    rebuilt: np.ndarray,
    temporary: np.ndarray,
    static: np.ndarray,
    share: np.ndarray,
    compute_start: np.ndarray,
    compute_end: np.ndarray,
    msg_start: np.ndarray,
    msg_recv: np.ndarray,
    msg_bytes: np.ndarray,
    weight_kept: np.ndarray | None = None,
    grads: np.ndarray | None = None,
    grad_overlap: np.ndarray | None = None,
) -> np.ndarray:
    """Peak bytes per rank (int64); arguments are per stage, per op or per message.

    ``msg_recv`` is the receiving action's op index (which also names the rank).
    ``rebuilt`` (per stage): what a recomputed stage's ``B``/``I`` rebuilds on top of its
    ``temporary`` (0 for a stage that keeps its activations).
    ``weight_kept`` (per stage, optional): bytes a split backward's ``I`` keeps
    for its ``W``, alive from the start of ``I`` to the end of ``W`` (not in
    ``keep``: counted from ``F`` on they over-state a zero-bubble schedule's
    peak, whose ``I`` of a micro-batch comes well after its ``F``).
    ``grads`` (per stage, optional; part of ``static``): the runtime drops the
    parameters' gradients before each step, so a stage's gradients exist from
    its first ``B``/``W`` on a rank, not from the step's start (a GPipe step
    peaks before any backward). The step ends with all of ``static``.
    ``grad_overlap`` (per stage, optional): what that first ``B`` holds less
    than its micro-batch's activations plus all the gradients (autograd frees
    the one as it makes the other; a ``W`` frees its graph only at its end, so
    it gets none); a replica's own, which makes all the gradients from its share of
    the activations (``StageCost.grad_overlap``).
    """
    static_rank = layout.host @ static
    n = len(layout.op_stage)
    if n == 0:
        return np.rint(static_rank).astype(np.int64)
    run, gap = layout.alive(keep * share)
    early = static_rank
    if grads is not None and layout.first_grad is not None:
        early = layout.host @ (static - grads)
        made = grads[layout.op_stage] * layout.first_grad
        before = np.cumsum(made) - made
        before -= before[layout.first_of_rank]
        during = made
        if grad_overlap is not None and layout.first_whole is not None:
            # only a whole B frees activations as it goes; a W releases its graph at its end
            during = made - grad_overlap[layout.op_stage] * layout.first_whole
        run, gap = run + before + during, gap + before
    if weight_kept is not None and layout.late_sign is not None:
        late_run, late_gap = layout.alive(weight_kept * share, late=True)
        run, gap = run + late_run, gap + late_gap
    temp = np.concatenate([temporary * share, (temporary + rebuilt) * share])
    base = early[layout.op_rank]
    slots = np.empty(2 * n)
    slots[0::2] = gap + base
    slots[1::2] = run + base + temp[layout.temp_index]
    if len(msg_bytes):
        # Slot ends, interleaved and sorted per rank; ranks kept apart by an offset.
        ends = np.empty(2 * n)
        ends[0::2] = compute_start
        ends[1::2] = compute_end
        span = 2.0 * float(compute_end.max()) + 1.0
        ends += layout.slot_rank * span
        keys = msg_start + layout.op_rank[msg_recv] * span
        first = np.searchsorted(ends, keys, side="right")
        last = 2 * msg_recv  # the gap before the receiving action
        weight = np.where(first <= last, msg_bytes, 0.0)
        diff = np.bincount(first, weight, 2 * n + 2) - np.bincount(last + 1, weight, 2 * n + 2)
        slots += np.cumsum(diff[: 2 * n])
    peak = static_rank
    peak[layout.nonempty] = np.maximum(
        peak[layout.nonempty], np.maximum.reduceat(slots, layout.slot_starts)
    )
    return np.rint(peak).astype(np.int64)

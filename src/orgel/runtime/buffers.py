"""Buffers a replicated stage's forwards update (BatchNorm statistics), averaged over its replicas.

Each replica of a stage runs its own rows of every micro-batch
(:func:`orgel.batching.replica_rows`) through its own copy of the stage, so the
buffers its forwards update in place (``StageModule.written``: BatchNorm's
``running_mean``, ``running_var`` and ``num_batches_tracked``, any such buffer)
follow those rows only and drift apart between replicas. At the end of every
training step call, after the step is known to stand (a dropped step has put
them back), each of them is set to its mean over the stage's replicas:
floating-point buffers to the mean, integer ones to the floor of the mean
(``num_batches_tracked`` is equal on every replica: each runs every
micro-batch), bool ones to "any replica's is True". So every replica holds one
value, and ``pipe.state_dict()``, ``copy_to``, checkpoints and evaluation read
the same statistics whichever replica they come from.

BatchNorm's updates are affine with the same coefficients on every replica
(momentum, or ``1/num_batches_tracked``), so averaging after every call gives
what averaging once per optimizer step (``accumulate=k``) would, up to rounding.
The one-process equivalent: each replica's shares run through its own copy of
the module's buffers, and the copies are averaged at the end of the step
(``tests/test_batchnorm_dp.py`` states it in code). Cost: one all-reduce per
replica set and dtype per step, of the written buffers' bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from orgel.runtime.stage import StageInfo
from orgel.schedule.ir import Plan

Wait = Callable[[Any, str], None]


class ReplicaBuffers:
    """The written buffers of this rank's replicated stages, by replica set, and their average."""

    def __init__(self, plan: Plan, stages: dict[int, StageInfo],
                 groups: dict[tuple[int, ...], Any]) -> None:
        """``groups``: the process group of each replica set this rank is in (the gradient
        sums' groups, :class:`orgel.runtime.optim.GradSync`)."""
        self.sets: list[tuple[tuple[int, ...], Any, list[torch.Tensor]]] = []
        by_set: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
        for s, info in sorted(stages.items()):
            rset = plan.placement[s]
            if len(rset) < 2:
                continue
            held = by_set.setdefault(rset, {})
            for name in info.stage.written:
                b = info.stage.module.get_buffer(name)
                held.setdefault(id(b), b)  # a buffer two stages share: once
        for rset, held in sorted(by_set.items()):
            if held:
                self.sets.append((rset, groups[rset], list(held.values())))

    def average(self, wait: Wait) -> None:
        """Set every written buffer of a replicated stage to its mean over the replicas.

        All sums are launched (every rank in the same order: replica sets, then
        dtypes by name) before any is waited on; ``wait(work, what)`` waits with
        the step's timeout.
        """
        pending: list[tuple[Any, torch.Tensor, list[torch.Tensor], int, str]] = []
        for rset, group, buffers in self.sets:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for b in buffers:
                by_dtype.setdefault(b.dtype, []).append(b)
            for dtype, same in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
                flat = torch.cat([b.detach().reshape(-1) for b in same])
                op = dist.ReduceOp.MAX if dtype == torch.bool else dist.ReduceOp.SUM
                if dtype == torch.bool:
                    flat = flat.to(torch.uint8)
                work = dist.all_reduce(flat, op=op, group=group, async_op=True)
                pending.append((work, flat, same, len(rset),
                                f"the buffers of ranks {list(rset)} ({dtype})"))
        with torch.no_grad():
            for work, flat, same, n, what in pending:
                wait(work, what)
                if flat.is_floating_point() or flat.is_complex():
                    flat = flat / n
                elif same[0].dtype != torch.bool:
                    flat = flat.div(n, rounding_mode="floor")
                offset = 0
                for b in same:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()

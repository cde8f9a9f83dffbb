"""Gradients across ranks after the backward work: replicas, tied copies, global norm.

The loss of each micro-batch (and loss replica) is multiplied by its share of the
batch (:mod:`orgel.lossweights`; ``1 / (microbatches x loss replicas)`` for a mean over
rows) so that every replica's gradient is a *partial sum* of the whole-batch
gradient: summing over a stage's replicas gives exactly what one device with
the whole batch computes (the mean-reduced loss convention). Hence:

* data-parallel replicas of a stage all-reduce (sum) their gradients over the
  group of the stage's ranks, one flat bucket per distinct replica set,
  launched as soon as the rank's last backward of those stages is done; a
  stage the plan shards (FSDP2, :mod:`orgel.runtime.sharding`) is not in a
  bucket: its reduce-scatter sums them;
* tied parameters (one tensor used by several stages) sum the partial
  gradients of every copy on every rank (replicas included) and give each copy
  the total, so the copies stay equal after the optimizer step;
* the global gradient norm counts each parameter once (replica 0, first copy;
  a sharded stage's every replica, for its own shard) and is all-reduced with
  the step's loss in one small collective;
* a parameter without a gradient stays without one, as in one process: a frozen
  one (``requires_grad=False``) takes part in no sum, and every sum carries one
  flag per parameter (whether the rank has a gradient for it), so one that no
  replica's or copy's backward reached keeps ``.grad`` None and the optimizer
  skips it (no weight decay, no moment update);
* with tensor parallelism every sum runs per plane (member ``t`` of each rank, the
  same parts): a DTensor parameter's gradient is first laid out as the parameter
  (:func:`~orgel.runtime.tensor_parallel.settle_grads`), then its own part is summed;
* a step call that only accumulates (``accumulate=k``) reduces nothing but its
  loss: the sums above are linear, so the ``k``-th call reduces the k calls'
  gradients at once.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from orgel.launch.errors import CommFailure, transport_reason
from orgel.runtime.sharding import is_sharded, like_param, own_part
from orgel.runtime.stage import StageInfo
from orgel.runtime.tensor_parallel import plane_group, settle_grads
from orgel.schedule.ir import Plan
from orgel.split.types import SplitModel


def _pack(grads: list[torch.Tensor | None], params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One flat tensor to sum across ranks: each gradient (zeros where there is none; of a
    DTensor, this process's own part), then one flag per gradient, 1 where there is one."""
    parts = [own_part(torch.zeros_like(own_part(p)) if g is None else g).reshape(-1)
             for g, p in zip(grads, params, strict=True)]
    flags = torch.tensor([float(g is not None) for g in grads], dtype=parts[0].dtype,
                         device=parts[0].device)
    return torch.cat([*parts, flags])


@torch.no_grad()
def _unpack(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> None:
    """Set each ``params[i]``'s gradient to its part of a summed :func:`_pack` (a DTensor
    parameter's: its own part, laid out as the parameter), or to None where no rank had a
    gradient for it."""
    flags = flat[-len(params):].tolist()
    offset = 0
    for p, flag in zip(params, flags, strict=True):
        n = own_part(p).numel()
        if flag > 0:
            g = flat[offset:offset + n].view_as(own_part(p))
            if p.grad is None:
                p.grad = like_param(p, g.to(p.dtype).clone())
            else:
                own_part(p.grad).copy_(g)
        else:
            p.grad = None
        offset += n


def trainable(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters a backward can give a gradient (frozen ones take part in no sum)."""
    return [p for p in params if p.requires_grad]


class GradSync:
    """Creates the process groups (collectively, same order on every rank) and reduces."""

    def __init__(self, plan: Plan, split: SplitModel, rank: int, stages: dict[int, StageInfo],
                 *, ranks: list[int], world_group: Any, timeout: float,
                 device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.nccl = dist.get_backend() == "nccl"  # gloo reduces CUDA tensors too (staged)
        # each object once: stages on one rank that share a tied parameter hold one object
        self.all_params = list({id(p): p for _, info in sorted(stages.items())
                                for p in info.params}.values())
        self.timeout = timeout
        self.world_group = world_group
        #: alone in the group the step's sums run over (one process, no tp): they are
        #: this rank's own values
        self.alone = dist.get_world_size(world_group) == 1
        # qualified name -> local copies; which copy counts for the norm
        self.tied: dict[str, list[torch.nn.Parameter]] = {}
        tied_names = set(split.tied)
        tied_ids: set[int] = set()
        holders: dict[str, list[int]] = {name: [] for name in sorted(tied_names)}
        for s, st in enumerate(split.stages):
            for qual in st.param_names.values():
                if qual in tied_names:
                    holders[qual].append(s)
        # a tie whose every stage is FSDP-sharded (over as many replicas: check_sharded) sums
        # its gradient shards replica by replica: replica k of each such stage holds the
        # same rows of every copy (FSDP2 shards dimension 0 in replica order)
        sharded_ties = {name for name in tied_names
                        if holders[name] and all(plan.sharded(s) for s in holders[name])}
        def fsdp_holds(s: int, p: torch.nn.Parameter) -> bool:
            """Whether FSDP2 holds ``p`` sharded (and reduces it); it leaves a 0-dim
            parameter of a sharded stage whole (:mod:`orgel.runtime.sharding`)."""
            return plan.sharded(s) and is_sharded(p)

        self.norm_params: list[torch.nn.Parameter] = []
        for s, info in sorted(stages.items()):
            named = dict(info.stage.module.named_parameters())
            for local, p in named.items():
                qual = info.stage.param_names.get(local, "")
                if qual in tied_names:
                    self.tied.setdefault(qual, []).append(p)
                    tied_ids.add(id(p))
                    if holders[qual][0] == s and (info.replica == 0 or qual in sharded_ties):
                        self.norm_params.append(p)
                elif info.replica == 0 or fsdp_holds(s, p):  # each shard once
                    self.norm_params.append(p)
        # data-parallel buckets: every rank calls new_group for every set, in order
        replica_sets = sorted({r for r in plan.placement if len(r) > 1})
        self.dp: dict[tuple[int, ...], tuple[Any, list[torch.nn.Parameter]]] = {}
        for rset in replica_sets:
            group = plane_group(plan, [ranks[r] for r in rset])
            if rank in rset:
                params = [p for s, info in sorted(stages.items())
                          if plan.placement[s] == rset
                          for p in info.params if id(p) not in tied_ids
                          and not fsdp_holds(s, p)]  # what FSDP2 does not reduce
                self.dp[rset] = (group, params)
        self.tied_groups: dict[str, Any] = {}
        for name in sorted(tied_names):
            # one group of every copy's holders; a sharded tie: one per replica index
            sets = ([sorted({plan.placement[s][k] for s in holders[name]})
                     for k in range(len(plan.placement[holders[name][0]]))]
                    if name in sharded_ties else
                    [sorted({r for s in holders[name] for r in plan.placement[s]})])
            for tranks in sets:
                group = (plane_group(plan, [ranks[r] for r in tranks]) if len(tranks) > 1
                         else None)
                if name in self.tied and rank in tranks:
                    self.tied_groups[name] = group
        self.pending: list[tuple[str, Any, torch.Tensor, list[torch.nn.Parameter]]] = []
        self.found_inf = False  # the last step's gradients held an inf/NaN (loss scaling)
        self.failed = False  # a rank's work raised in the last step: every rank drops it
        #: the step's sums left on the device by :meth:`finish`, for :meth:`read`
        self.later: torch.Tensor | None = None

    def launch_replicas(self, rset: tuple[int, ...]) -> None:
        """Start the sum over the replicas of ``rset``'s stages (asynchronous)."""
        group, held = self.dp[rset]
        params = trainable(held)
        if not params:
            return
        settle_grads(params)  # tensor parallel: each member's part laid out as its parameter
        flat = _pack([p.grad for p in params], params)
        work = dist.all_reduce(flat, group=group, async_op=True)
        self.pending.append((f"data-parallel gradients of ranks {list(rset)}", work, flat, params))

    def _wait(self, work: Any, what: str) -> None:
        if self.nccl:
            work.wait()  # NCCL: stream-ordered; the process group's watchdog bounds it
            return
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - re-raised with what was waited for
            text = str(exc)
            timed_out = "imed out" in text
            message = (f"timed out after {self.timeout:g} s in the all-reduce of {what}"
                       if timed_out else
                       f"lost a peer in the all-reduce of {what}: {transport_reason(exc)}")
            raise CommFailure(message, peer=None, what=what, timed_out=timed_out) from exc

    def reduce_loss(self, loss: torch.Tensor, failed: bool = False) -> float:
        """The step's loss summed over the ranks, and whether any rank's work raised
        (:attr:`failed`), nothing else: a call that accumulates."""
        total = torch.stack([loss.detach().double().reshape(()).to(self.device),
                             torch.tensor(float(failed), dtype=torch.float64,
                                          device=self.device)])
        if not self.alone:
            self._wait(dist.all_reduce(total, group=self.world_group, async_op=True),
                       "the step's loss")
        value, flag = total.tolist()  # one copy to the host: on a GPU, one wait
        self.failed = flag > 0
        return float(value)

    def finish(self, loss: torch.Tensor, max_norm: float | None,
               scaler: Any = None, failed: bool = False,
               graded: bool = True) -> tuple[float, float]:
        """Complete every reduction, clip by global norm; return ``(loss, grad norm)``.

        The norm (before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it) is
        computed on every step: the loop reports it (``pipe.grad_norm``).
        With a :class:`orgel.runtime.scaler.LossScaler` the gradients are unscaled
        before the norm, the inf/NaN verdict of every rank is summed with the loss,
        and :attr:`found_inf` says whether the step must be skipped (then nothing is
        clipped, and the scale backs off). ``failed``: this rank's work raised this
        step; summed with the loss too, :attr:`failed` says whether any rank's did
        (then nothing is clipped and the scale stays: every rank drops the step).
        ``graded``: this rank back-propagated a loss since the last optimizer step;
        where no rank did (closures that never called ``backward``), every gradient
        is set to None: the backward of the other stages ran from zeros, and one
        process would hold no gradient at all.
        """
        for what, work, flat, params in self.pending:
            self._wait(work, what)
            _unpack(flat, params)
        self.pending = []
        # Every rank launches the tied sums in one order (by name), all before waiting
        # on any: a rank that waited on its first would block a peer whose first differs.
        sums: list[tuple[str, Any, torch.Tensor, list[torch.nn.Parameter]]] = []
        for name in sorted(self.tied):
            # a Parameter two stages on this rank share is one copy: autograd summed it
            copies = trainable(list({id(p): p for p in self.tied[name]}.values()))
            if not copies:
                continue  # frozen: every copy on every rank is (they are one parameter)
            grads = [p.grad for p in copies if p.grad is not None]
            total = _pack([torch.stack([own_part(g) for g in grads]).sum(0) if grads else None],
                          copies[:1])
            group = self.tied_groups.get(name)
            work = None if group is None else dist.all_reduce(total, group=group, async_op=True)
            sums.append((name, work, total, copies))
        for name, work, total, copies in sums:
            if work is not None:
                self._wait(work, f"the tied parameter {name!r}")
            for p in copies:
                _unpack(total, [p])
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        found = zero if scaler is None else scaler.unscale_(self.all_params).double()
        # one pass over every gradient, each counted once (replica 0, first tied copy)
        norms = _norms([own_part(p.grad) for p in self.norm_params if p.grad is not None])
        local_sq = torch.stack(norms).double().pow(2).sum() if norms else zero
        summary = torch.stack([loss.detach().double().reshape(()).to(self.device), local_sq,
                               found, zero + float(failed), zero + float(graded)])
        if self.alone and scaler is None and max_norm is None:
            # nothing before the optimizer step needs these numbers (failed and graded are
            # this process's own): they are read after it (:meth:`read`), so that on a GPU
            # the host launches the optimizer while the device still runs the backward
            self.found_inf, self.failed = False, failed
            if failed:  # the step is dropped: nothing to read
                return math.nan, math.nan
            if not graded:
                for p in self.all_params:
                    p.grad = None
            self.later = summary
            return math.nan, math.nan
        if not self.alone:
            self._wait(dist.all_reduce(summary, group=self.world_group, async_op=True),
                       "the step's loss and gradient norm")
        # one copy to the host: on a GPU, one wait for the step's work instead of five
        total_loss, sq, inf, any_failed, any_graded = summary.tolist()
        self.found_inf = inf > 0
        self.failed = any_failed > 0
        if self.failed:
            return total_loss, float("nan")
        if not any_graded > 0:  # no loss had a gradient: none exists
            for p in self.all_params:
                p.grad = None
        if scaler is not None:
            scaler.update(self.found_inf)
        norm = sq ** 0.5
        if max_norm is not None and not self.found_inf:
            coef = max_norm / (norm + 1e-6)
            if not coef >= 1.0:  # NaN too: clip_grad_norm_ scales every gradient by it
                for group in _by_kind([p.grad for p in self.all_params
                                       if p.grad is not None]).values():
                    torch._foreach_mul_([g for _, g in group], coef)
        return total_loss, norm

    def read(self, loss: float, norm: float) -> tuple[float, float]:
        """``(loss, grad norm)`` as :meth:`finish` returned them, or, where it left them on
        the device (:attr:`later`), copied to the host now (once: one wait)."""
        if self.later is None:
            return loss, norm
        later, self.later = self.later, None
        total_loss, sq = later[:2].tolist()
        return total_loss, sq ** 0.5


def _by_kind(tensors: list[torch.Tensor]) -> dict[tuple[Any, ...], list[tuple[int, Any]]]:
    """``tensors`` (with their positions) by device, dtype and kind (DTensor or plain):
    the groups one ``torch._foreach_*`` call takes."""
    groups: dict[tuple[Any, ...], list[tuple[int, Any]]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype, type(t)), []).append((i, t))
    return groups


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each of ``tensors``, in order, one ``torch._foreach_norm`` per group
    of alike tensors (as ``clip_grad_norm_`` computes them: on a GPU one launch, not one
    per parameter)."""
    out: list[Any] = [None] * len(tensors)
    for group in _by_kind(tensors).values():
        for (i, _), n in zip(group, torch._foreach_norm([t for _, t in group]), strict=True):
            out[i] = n
    return out

"""The executor's backward actions: ``B`` (full backward), ``I`` (input gradients), ``W``.

Each output's gradient is the sum over its consumers, local (handed over on
this rank) and remote (received); ``B`` runs autograd from the loss and those
gradients to the stage's input leaves and parameters, ``I`` only to the input
leaves, keeping what ``W`` needs for the weights (:mod:`orgel.backward`).
A recomputed stage runs its forward again first, on the forward's own random
stream. The input gradients go out as the action's sends, or stay on this rank
for a producer stage it hosts.

:class:`BackwardActions` is a base of :class:`orgel.runtime.executor.Executor`;
the attributes and methods it reads are the executor's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from orgel.backward import WeightWork, input_backward, weight_backward
from orgel.runtime.compiled import compiled_input_backward
from orgel.runtime.optimizer import OptimizerLoop
from orgel.runtime.scaler import LossScaler
from orgel.runtime.stage import Run, StageInfo, part_rows, replayed
from orgel.schedule.comm import _Pairs
from orgel.schedule.ir import Action, Plan


class BackwardActions:
    """The ``B``, ``I`` and ``W`` actions of the executor (a base of it)."""

    # the executor's attributes and methods these actions read
    plan: Plan
    rank: int
    stages: dict[int, StageInfo]
    pairs: list[tuple[_Pairs, _Pairs]]
    msg_index: dict[tuple[int, int, int, int, bool, tuple[int, int, int]], int]
    act_dim: int
    loop: OptimizerLoop
    scaler: LossScaler | None
    scale_seed: bool
    compiled: dict[int, Any] | None
    side_leaves: Callable[[int], dict[str, torch.Tensor]] | None
    _runs: dict[tuple[int, int], Run]
    _inbox: dict[int, list[torch.Tensor]]
    _local_grads: dict[tuple[int, int], dict[str, torch.Tensor]]
    _in_grads: dict[str, torch.Tensor]
    _unreached: set[str]
    reach_flags: bool
    _rows: Callable[[torch.Tensor, tuple[int, int, int], StageInfo], torch.Tensor]
    _carries_grad: Callable[[str, torch.Tensor], bool]
    _draws: Callable[[int, int], Any]
    _compute: Callable[[StageInfo, list[Any], int],
                       tuple[tuple[torch.Tensor, ...], torch.Tensor | None]]

    def _output_grads(self, info: StageInfo, m: int) -> dict[str, torch.Tensor]:
        """Each output's gradient: the sum over its consumers (local and remote)."""
        run = self._runs[(info.index, m)]
        pieces: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        for e in info.out_edges:
            edge = self.plan.stage_graph.edges[e]
            if not edge.carries_grad:  # no message and nothing handed over: no gradient
                continue
            floats = [v.name for v in edge.values
                      if self._carries_grad(v.name, run.outputs[info.out_index[v.name]])]
            for k, part, _ in self.pairs[e][0][info.replica]:
                dst = self.plan.placement[edge.dst][k]
                grads: list[torch.Tensor | None]
                if dst == self.rank:  # (a value no gradient reached is left out)
                    local = self._local_grads[(e, m)]
                    consumer = self.stages[edge.dst]
                    grads = [None if n not in local else self._rows(local[n], part, consumer)
                             for n in floats]
                else:
                    got = self._inbox.pop(self.msg_index[(dst, self.rank, e, m, True, part)])
                    # with reach flags the last tensor says which a gradient reached
                    grads = ([g if r else None for g, r in zip(got[:-1], got[-1].tolist(),
                                                               strict=True)]
                             if self.reach_flags else list(got))
                for name, g in zip(floats, grads, strict=True):
                    if g is None:
                        continue
                    value = run.outputs[info.out_index[name]]
                    if part == (0, 1, 1) or value.dim() <= self.act_dim:
                        # the whole value (a scalar has no rows to cut)
                        pieces.setdefault(name, []).append((-1, -1, g))
                        continue
                    start, stop = part_rows(part, info.replica, info.replicas,
                                            value.shape[self.act_dim])
                    pieces.setdefault(name, []).append((start, stop, g))
            self._local_grads.pop((e, m), None)
        result: dict[str, torch.Tensor] = {}
        for name, parts in pieces.items():
            if len(parts) == 1 and parts[0][0] == -1:
                result[name] = parts[0][2]
                continue
            total = torch.zeros_like(run.outputs[info.out_index[name]])
            for start, stop, g in parts:
                target = total if start == -1 else total.narrow(self.act_dim, start,
                                                                stop - start)
                target.add_(g)
            result[name] = total
        return result

    def _backward(self, a: Action) -> None:
        """``B``: full backward; ``I``: input gradients only, keeping the graph for ``W``."""
        info, m = self.stages[a.stage], a.microbatch
        run = self._runs[(a.stage, m)]
        out_grads = self._output_grads(info, m)
        if info.recompute:  # the forward's own stream again: the same dropout masks
            with self._draws(a.stage, m), torch.enable_grad(), replayed(info, run):
                run.outputs, run.loss = self._compute(info, run.args, m)
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if run.loss is not None and run.loss.requires_grad:
            self.loop.graded += 1
            roots.append(run.loss)
            grads.append(self.loop.loss_gradient(
                run.loss, self.scaler.scale if self.scaler is not None and self.scale_seed
                else None))
        for name, g in out_grads.items():
            out = run.outputs[info.out_index[name]]
            if out.requires_grad:
                roots.append(out)
                grads.append(g)
        leaves = {n: t for n, t in run.leaves.items() if t.requires_grad}
        if self.side_leaves is not None:  # made by the forward; not a stage input
            leaves.update(self.side_leaves(m))
        if a.kind == "B":
            if roots:
                torch.autograd.backward(roots, grads)
            got = {n: t.grad for n, t in leaves.items()}
            del self._runs[(a.stage, m)]
        elif self.compiled is not None:  # the compiled graphs' own input and weight halves
            computed, run.work = compiled_input_backward(roots, grads, list(leaves.values()))
            run.outputs = tuple(t.detach() for t in run.outputs)
        else:
            computed = [None] * len(leaves)
            if roots:
                computed, run.work = input_backward(roots, grads, list(leaves.values()),
                                                    [p for p in info.stage.module.parameters()
                                                     if p.requires_grad])
            run.outputs = tuple(t.detach() for t in run.outputs)
        if a.kind == "I":
            got = dict(zip(leaves, computed, strict=True))
        self._in_grads = {n: g if g is not None else torch.zeros_like(leaves[n])
                          for n, g in got.items()}
        # (with reach flags, zeros that stand for no gradient: the messages say which)
        self._unreached = {n for n, g in got.items() if g is None} if self.reach_flags \
            else set()
        for e in info.in_edges:
            edge = self.plan.stage_graph.edges[e]
            if edge.carries_grad and any(self.plan.placement[edge.src][j] == self.rank
                                         for j, _, _ in self.pairs[e][1][info.replica]):
                self._local_grads[(e, m)] = {v.name: self._in_grads[v.name]
                                             for v in edge.values if v.name in self._in_grads
                                             and v.name not in self._unreached}

    def _weight(self, a: Action) -> None:
        """``W``: weight gradients from what ``I`` kept (see :mod:`orgel.backward`)."""
        run = self._runs.pop((a.stage, a.microbatch))
        if isinstance(run.work, WeightWork):
            weight_backward(run.work)
        elif run.work is not None:  # a compiled stage's weight halves
            run.work()

"""The executor's forward action ``F``, and the micro-batches it reads.

A step's batch is cut into micro-batches by the workload's own rule
(:func:`orgel.batching.split_microbatches`), each with its loss weight
(:mod:`orgel.lossweights`). ``F`` gathers its inputs, from the messages it
received and the outputs of stages this rank hosts (a replicated stage's rows
put together), as detached leaves with ``requires_grad``; takes this replica's
share of the model inputs; runs the stage (or its compiled graphs,
:mod:`orgel.runtime.compiled`) on the forward's own random stream; and on the
loss stage computes the weighted loss (and keeps the model's outputs when asked,
:mod:`orgel.runtime.outputs`).

:class:`ForwardActions` is a base of :class:`orgel.runtime.executor.Executor`;
the attributes and methods it reads are the executor's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from orgel.batching import (
    TARGETS,
    BatchDim,
    batch_rows,
    dim_of,
    replica_rows,
    share,
    split_microbatches,
)
from orgel.launch.devices import move
from orgel.lossweights import Rule, Weight, batch_weights, checked_weigh
from orgel.runtime.compiled import CompiledStage, SegmentedStage, compiled_stage
from orgel.runtime.outputs import Share, keep
from orgel.runtime.stage import Run, StageInfo, random_stream, stream_seed
from orgel.schedule.comm import _Pairs
from orgel.schedule.ir import Action, Plan
from orgel.split.types import SplitModel


def as_activation(leaf: torch.Tensor) -> torch.Tensor:
    """What a stage takes for the leaf that holds a received value: a view of it, where it
    carries a gradient, so that under autocast it is cast as the activation it is in one
    process.

    Autocast keeps one cast of a leaf that requires a gradient for its whole region (its
    cache is for weights): on the leaf itself, ``k_proj`` and ``v_proj`` would share one
    bfloat16 copy, and their gradients would be summed in bfloat16 before the cast back,
    where one process casts the value for each and sums the float32 gradients (a Qwen2 cut
    between ``q_proj`` and ``k_proj`` trained to other weights under bf16-mixed). A view is
    no cache's; its gradient reaches the leaf as it is.
    """
    return leaf.view_as(leaf) if leaf.requires_grad else leaf


class ForwardActions:
    """The ``F`` action of the executor and the step's micro-batches (a base of it)."""

    # the executor's attributes and methods the forward reads
    plan: Plan
    split: SplitModel
    rank: int
    member: int
    training: bool
    device: torch.device
    stages: dict[int, StageInfo]
    pairs: list[tuple[_Pairs, _Pairs]]
    msg_index: dict[tuple[int, int, int, int, bool, tuple[int, int, int]], int]
    act_dim: int
    batch_dim: BatchDim
    replicated: tuple[str, ...]
    loss_fn: Callable[[Any, Any], Any]
    loss_rule: Rule
    check_finite: bool
    with_loss: bool
    seed: int
    steps_done: int
    compiled: dict[int, CompiledStage | SegmentedStage] | None
    kept: dict[int, Share] | None
    fetch_inputs: Callable[[int], dict[str, torch.Tensor]] | None
    on_microbatch: Callable[[int], None] | None
    _fetched: set[int]
    _weights: dict[tuple[int, int], Weight]
    _runs: dict[tuple[int, int], Run]
    _inbox: dict[int, list[torch.Tensor]]
    _loss: torch.Tensor
    _rows: Callable[[torch.Tensor, tuple[int, int, int], StageInfo], torch.Tensor]
    _carries_grad: Callable[[str, torch.Tensor], bool]

    def _take_batch(self, inputs: dict[str, Any], targets: Any) -> dict[str, Any]:
        """Cut this step's batch into its micro-batches; the first one's inputs.

        The workload's own rule (:func:`orgel.batching.split_microbatches`): what has
        the batch size along its batch dimension is cut, the rest goes whole.
        """
        parts = split_microbatches({k: move(v, self.device) for k, v in inputs.items()},
                                   move(targets, self.device), self.plan.microbatches,
                                   self.batch_dim, self.replicated, self.plan.row_unit)
        self._inputs = [p for p, _ in parts]
        self._fetched = set()
        self._targets = [t for _, t in parts]
        # each micro-batch's rows (a smaller last batch's differ)
        self._mb_rows = [batch_rows(p, t, self.batch_dim, self.replicated) for p, t in parts]
        self._weights = batch_weights(self.loss_rule, self._inputs, self._targets,
                                      len(self.plan.placement[self.split.loss_stage]),
                                      self.batch_dim, self.replicated)
        return parts[0][0]

    def _forward(self, a: Action) -> None:
        info, m = self.stages[a.stage], a.microbatch
        if self.fetch_inputs is not None and info.stage.model_inputs and m not in self._fetched:
            fetched = {k: v.to(self.device) for k, v in self.fetch_inputs(m).items()}
            self._inputs[m] = {**self._inputs[m], **fetched}  # stand-ins give the rest's sizes
            self._fetched.add(m)
        leaves: dict[str, torch.Tensor] = {}
        for e in info.in_edges:
            edge = self.plan.stage_graph.edges[e]
            pieces: list[list[torch.Tensor]] = []
            for j, part, _ in self.pairs[e][1][info.replica]:
                src = self.plan.placement[edge.src][j]
                if src == self.rank:
                    producer = self.stages[edge.src]
                    outs = self._runs[(edge.src, m)].outputs
                    pieces.append([self._rows(outs[producer.out_index[v.name]].detach(), part,
                                              producer) for v in edge.values])
                else:
                    pieces.append(self._inbox.pop(self.msg_index[(src, self.rank, e, m, False,
                                                                  part)]))
            for k, v in enumerate(edge.values):
                t = (pieces[0][k] if len(pieces) == 1
                     else torch.cat([p[k] for p in pieces], dim=self.act_dim))
                leaves[v.name] = t.detach().requires_grad_(self.training
                                                           and self._carries_grad(v.name, t))
        stage = info.stage
        args = [as_activation(leaves[n]) if n in leaves else self._model_input(info, m, n)
                for n in stage.inputs]
        run = Run(args, leaves, ())
        if info.recompute and stage.written:
            run.buffers = {n: stage.module.get_buffer(n).clone() for n in stage.written}
        with self._draws(a.stage, m), torch.set_grad_enabled(self.training
                                                             and not info.recompute):
            run.outputs, run.loss = self._compute(info, args, m)
        if run.loss is not None and self.member == 0:  # summed over every process: once
            self._loss = self._loss + run.loss.detach()
        self._runs[(a.stage, m)] = run

    def _model_input(self, info: StageInfo, m: int, name: str) -> Any:
        """This replica's share of micro-batch ``m``'s model input ``name``, or a size of one
        (symbolic capture)."""
        size = info.stage.sizes.get(name)
        if size is not None:  # each rank reads the size off the micro-batch, no message
            return int(self._model_input(info, m, size[0]).shape[size[1]])
        mb = self._inputs[m]
        if name in self.replicated:
            return mb[name]
        return share(mb[name], info.replica, info.replicas, dim_of(self.batch_dim, name),
                     self._mb_rows[m])

    def _draws(self, stage: int, m: int) -> Any:
        """The random stream of stage ``stage``'s forward on micro-batch ``m`` this step."""
        return random_stream(stream_seed(self.seed, self.steps_done, stage, m), self.device)

    def _compute(self, info: StageInfo, args: list[Any],
                 m: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        if self.on_microbatch is not None:
            self.on_microbatch(m)
        if self.compiled is None:
            out = info.run(*args)
        else:
            runner = self.compiled.get(info.index)
            if runner is None:
                runner = self.compiled[info.index] = compiled_stage(
                    info.stage.module, self.plan.recompute[info.index], info.stage.layers)
            out = runner(*args)
        outputs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        if len(outputs) != len(info.stage.outputs):
            raise ValueError(f"stage {info.index} returned {len(outputs)} tensors but declares "
                             f"{len(info.stage.outputs)} outputs {info.stage.outputs}")
        if not info.is_loss:
            return outputs, None
        model_outs = [outputs[info.out_index[n]] for n in self.split.output_names]
        if self.kept is not None and self.member == 0:  # asked for: a copy on the CPU (a
            # recompute replaces it); tensor parallel: every member holds them, member 0 keeps
            start, stop = replica_rows(self._mb_rows[m], info.replica, info.replicas)
            self.kept[m] = keep(m, info.replica, stop - start, self.act_dim, model_outs)
        if not self.with_loss:
            return outputs, None
        targets = share(self._targets[m], info.replica, info.replicas,
                        dim_of(self.batch_dim, TARGETS), self._mb_rows[m])
        loss = self.loss_fn(self.split.unflatten_outputs(model_outs), targets)
        return outputs, checked_weigh(loss, self._weights[(m, info.replica)], model_outs,
                                      check_finite=self.check_finite, m=m,
                                      where=f"stage {info.index}")

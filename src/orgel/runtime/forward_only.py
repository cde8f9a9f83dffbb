"""Evaluation on one rank: the plan's forwards only, in eval mode, with no trace left behind.

:class:`ForwardOnly` runs the eval-mode stages (:mod:`orgel.split.evaluation`) of
this rank over a whole batch the way one process runs ``model.eval(); with
torch.no_grad(): loss_fn(model(x), y)``: BatchNorm reads its running statistics,
dropout is off, nothing records gradients, no optimizer steps and no buffer is
updated. The schedule is the training plan's ``F`` actions in the plan's order
(:func:`orgel.plan.transforms.forward_plan`), with their activation messages only, derived once; the
stage modules hold the training stages' own parameters and buffers, so each
evaluation reads the current trained values. The training state is left as it
was: the executor's step count, random streams and gradients are not touched.

It reuses the executor's forward (receiving, replica rows, the loss of each
micro-batch, kept outputs) with its own plan, stages and transport, and
``training = False``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from orgel.graph.measure import place
from orgel.runtime.comm import Transport
from orgel.runtime.executor import Executor, _signature
from orgel.runtime.outputs import Share
from orgel.runtime.sharding import Sharding
from orgel.runtime.stage import Run, StageInfo
from orgel.runtime.tensor_parallel import implicit_replication, shard_eval_stages
from orgel.schedule.comm import CommPlan, replica_pairs
from orgel.schedule.ir import Plan
from orgel.split.evaluation import share_weights
from orgel.split.types import SplitModel


class ForwardOnly(Executor):
    """The forward-only pass of one rank, next to its training :class:`Executor`."""

    training = False

    def __init__(self, executor: Executor, split: SplitModel, plan: Plan,
                 comm: CommPlan) -> None:
        # deliberately not Executor.__init__: no optimizer, no gradient sync, and the
        # training executor's options, device and random base seed as they are;
        # ``plan`` and ``comm``: the forwards of the executor's plan over ``split``
        # (orgel.plan.transforms.check_forward)
        self.owner = executor
        self.plan, self.split, self.comm = plan, split, comm
        self.rank, self.device = executor.rank, executor.device
        self.member = executor.member  # tensor parallel: member 0 counts the loss
        self.process = executor.process
        self.loss_fn, self.batch_dim = executor.loss_fn, executor.batch_dim
        self.act_dim = executor.act_dim
        self.replicated, self.seed = executor.replicated, executor.seed
        self.check_finite, self.timeout = executor.check_finite, executor.timeout
        self.dynamic_shapes = executor.dynamic_shapes
        self.compiled = None if executor.compiled is None else {}  # the eval graphs' own
        self.actions = plan.schedule[self.rank]
        share_weights(split, executor.split, plan.stages_on(self.rank))
        self.stages = {s: StageInfo.build(plan, split, s, self.rank)
                       for s in plan.stages_on(self.rank)}
        for info in self.stages.values():
            place(info.stage.module, self.device)  # its constants; the weights are there
            info.stage.module.eval()
        if getattr(executor, "tp_meshes", None):  # the regions split as the training stages'
            shard_eval_stages(split, self.stages, executor.tp_meshes)
        self.msg_index = {(m.src_rank, m.dst_rank, m.edge, m.microbatch, m.grad, m.part): i
                          for i, m in enumerate(comm.messages)
                          if self.rank in (m.src_rank, m.dst_rank)}
        self.pairs = [replica_pairs(len(plan.placement[e.src]), len(plan.placement[e.dst]), 0)
                      for e in plan.stage_graph.edges]
        own = executor.transport
        self.transport = Transport(plan, comm, self.rank, store=own.store, device=self.device,
                                   timeout=own.timeout, ranks=own.ranks,
                                   post_ahead=own.post_ahead, group=own.group,
                                   nccl=own.nccl)
        if dist.get_backend() == "nccl":  # every rank builds it with its engine: collective
            self.transport.warm_up()
        self.loss_rule, self._weights = executor.loss_rule, {}
        self.dispatch = {"F": self._forward}
        self.reduce_after: dict[int, list[tuple[int, ...]]] = {}
        self.sharding = Sharding.empty()
        self.fetch_inputs = None
        self.on_microbatch = None
        self.before_reduce = None
        self.on_drop = None
        self.kept = None
        self.with_loss = True
        self.events = []
        self._signature = None
        # a rank's own error (a loss_fn that needs the targets it was not given) drops the
        # pass on every rank, as it drops a training step; nothing accumulates here
        self.abandon_on_error, self._failed, self._final = executor.abandon_on_error, None, True

    def _draws(self, stage: int, m: int) -> Any:
        """A forward that draws in eval mode: the training step's stream, which is not advanced."""
        return self.owner._draws(stage, m)

    def run(self, inputs: dict[str, Any], targets: Any, *, loss: bool,
            outputs: bool) -> tuple[float | None, list[Share]]:
        """Evaluate the whole batch: the mean loss (every rank; None without ``loss``) and this
        rank's shares of the outputs (empty unless ``outputs`` and it hosts the loss stage).
        FSDP-sharded stages read their weights whole (gathered for the pass)."""
        with self.owner.sharding.gathered(), implicit_replication():
            return self._run(inputs, targets, loss=loss, outputs=outputs)

    def _run(self, inputs: dict[str, Any], targets: Any, *, loss: bool,
             outputs: bool) -> tuple[float | None, list[Share]]:
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self.events = []
        # the training stages' tensors as they are now (a load or a move may have replaced them)
        share_weights(self.split, self.owner.split, list(self.stages))
        self.kept = {} if outputs else None
        self.with_loss = loss
        self._take_batch(inputs, targets)
        signature = _signature(inputs)
        self._runs: dict[tuple[int, int], Run] = {}
        self._inbox: dict[int, list[torch.Tensor]] = {}
        self._in_grads: dict[str, torch.Tensor] = {}
        self._loss = torch.zeros((), device=self.device)
        self._failed = None
        self.transport.begin(exchange_shapes=self.dynamic_shapes or signature != self._signature)
        pos, action = -1, None
        try:
            with torch.no_grad():
                for pos, action in enumerate(self.actions):
                    self._execute(pos, action)
                    if not self._read_here(action.stage):  # sent already: free it now
                        self._runs.pop((action.stage, action.microbatch), None)
                pos, action = len(self.actions), None
                self.transport.finish()
                # the summed loss and how many ranks failed, in one all-reduce
                total = torch.stack([self._loss.reshape(()).float(), torch.tensor(
                    float(self._failed is not None), device=self.device)])
                if loss or self.abandon_on_error:
                    dist.all_reduce(total)
        except Exception as exc:
            raise self._stopped(exc, pos, action, "evaluating,", "end of evaluation",
                                "the end of the evaluation (sends, loss reduction)") from exc
        self._runs, self._inbox = {}, {}
        if float(total[1]) > 0:  # some rank's own work raised: every rank drops the pass
            self.kept = None
            raise self._abandoned()
        self._signature = signature
        kept = [] if self.kept is None else [self.kept[k] for k in sorted(self.kept)]
        self.kept = None
        return (float(total[0]) if loss else None), kept

    def _read_here(self, stage: int) -> bool:
        """Whether a stage on this rank reads ``stage``'s outputs (handed over, no message)."""
        edges = self.plan.stage_graph.edges
        return any(self.rank in self.plan.placement[edges[i].dst]
                   for i in self.stages[stage].out_edges)

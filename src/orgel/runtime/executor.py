"""The per-rank executor: interpret this rank's action list of a Plan, exactly.

Every rank (SPMD) builds an :class:`Executor` from the same Plan and SplitModel
and calls :meth:`Executor.step` with the same batch. The rank walks its action
list; for each action it waits for the messages that must arrive before it
(posted ahead by :class:`~orgel.runtime.comm.Transport`), runs it through one
dispatch table from action kind to method (``F``, ``B``, ``I``, ``W``; the
forward: :mod:`orgel.runtime.forward_actions`, the backward ones:
:mod:`orgel.runtime.backward_actions`), then sends what the action produced.
After the list: wait for the sends, reduce gradients across replicas and tied
copies, clip by the global norm, average the buffers that
replicated stages updated (BatchNorm statistics: :mod:`orgel.runtime.buffers`),
step the optimizer and its schedule (with ``accumulate=k``, only every ``k``-th
call does this, but the buffers are averaged on every call; see
:mod:`orgel.runtime.optimizer`).
A stage the plan shards (FSDP2 over its replicas) reduce-scatters its gradients
right after the rank's last backward of it instead (:mod:`orgel.runtime.sharding`).

Boundary protocol: received (or locally handed over) activations become
detached leaves with ``requires_grad``; an output's gradient is the sum over
its consumers; the loss of each micro-batch (and each loss replica's share of it) is
multiplied by its weight, its share of the whole batch's loss-bearing items
(:mod:`orgel.lossweights`: ``loss_rule``; ``"rows"``, the default, is
``1 / (microbatches x loss replicas)``), so the weighted losses sum to the whole
batch's. A value that carries no gradient (the split's ``requires_grad``, the plan's
``Value.grad``: masks, integer ids, position tables) sends none back, and an edge of only
such values has no gradient message (:func:`~orgel.runtime.messages.check_gradient_values`
holds the plan to the split).

A dropped step (``abandon_on_error``, set by :class:`orgel.worker.engine.RankEngine`):
when an action's own work raises (a loss on a target out of range, a stage on a
bad input), the rank records its error in the rendezvous store and runs the rest
of its list with the messages only (placeholders for its sends, no compute), so
every posted receive meets its send. The step's closing all-reduce carries a
"failed" flag: every rank then drops the step (no optimizer step, gradients and
updated buffers put back) and raises :class:`~orgel.launch.errors.StepAbandoned`
with the first error. A communication failure, a dead or hung rank, or an error
at the end of the step still ends the pipeline (:class:`StepFailure`), and so does
a tensor-parallel member's error that its partners did not share (they wait inside a
collective it never joins: :meth:`~orgel.runtime.comm.Transport.members_failed_alike`,
:class:`~orgel.launch.errors.MemberFailure`). The dropping itself:
:mod:`orgel.runtime.dropped`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from orgel.batching import BatchDim, single_dim
from orgel.graph.measure import place
from orgel.launch.errors import MemberFailure, StepAbandoned, StepFailure, is_comm_error
from orgel.lossweights import Rule, Weight
from orgel.runtime import tensor_parallel as tp
from orgel.runtime.backward_actions import BackwardActions
from orgel.runtime.buffers import ReplicaBuffers
from orgel.runtime.comm import Transport
from orgel.runtime.compiled import CompiledStage, SegmentedStage
from orgel.runtime.dropped import DroppedStep
from orgel.runtime.forward_actions import ForwardActions
from orgel.runtime.messages import check_gradient_values, message_shapes, reach_mask
from orgel.runtime.optim import GradSync
from orgel.runtime.optimizer import (
    LearningRate,
    NamedParameters,
    OptimizerFactory,
    OptimizerLoop,
    SchedulerFactory,
)
from orgel.runtime.outputs import Share
from orgel.runtime.scaler import LossScaler
from orgel.runtime.sequence_parallel import split_stages
from orgel.runtime.sharding import Sharding, check_sharded
from orgel.runtime.stage import Run, StageInfo, part_rows, run_stages_as_planned
from orgel.runtime.trace import Event
from orgel.schedule.comm import derive_comm, replica_pairs
from orgel.schedule.ir import Action, Plan
from orgel.schedule.validate import validate
from orgel.split.types import SplitModel


class Executor(ForwardActions, BackwardActions, DroppedStep):
    """Runs one rank's part of ``plan`` over the stages of ``split``.

    Keyword options: ``loss_fn(outputs, targets)`` (required), ``rank`` (default:
    this process's rank), ``optimizer_factory`` (``lambda params: torch.optim.X(params,
    ...)``, built over this rank's parameters as :class:`~orgel.runtime.optimizer.NamedParameters`;
    ``None``: gradients only), ``scheduler`` (``optimizer -> LRScheduler``, stepped after
    every optimizer step) or ``lr`` (``step -> learning rate``), ``accumulate`` (the
    optimizer steps on every k-th call; each call's loss counts ``1/k``),
    ``max_grad_norm`` (clip by the global norm over all ranks), ``timeout``
    (seconds for every wait), ``device``, ``dynamic_shapes`` (exchange shapes every
    step), ``batch_dim`` (an int, or a dict by input name and ``"targets"``:
    :func:`orgel.batching.dim_of`), ``store`` (rendezvous store; default: the process group's),
    ``post_ahead`` (post every receive at the step's start; default: yes for gloo, no for
    NCCL, whose pair streams match in order, so receives go just in time in channel order),
    ``check_finite`` (fail the step at the first non-finite loss; costs a sync per loss),
    ``loss_rule`` (how the micro-batches' losses weigh: :mod:`orgel.lossweights`),
    ``seed`` (the base of every forward's random stream; default ``torch.initial_seed()``),
    ``replicated`` (names of model inputs that are not batched: every micro-batch and
    replica gets them whole), ``extra_params`` (parameters of no stage that this rank
    keeps and steps, by original name: code outside every graph trains them, and
    ``before_reduce`` adds their gradients), ``loss_scaling`` (float16: one loss scale
    for the whole pipeline, :mod:`orgel.runtime.scaler`; a dict gives GradScaler's options;
    :attr:`skipped` says whether the last step was skipped for an inf/NaN gradient),
    ``compile`` (run every stage through Inductor-compiled forward and backward graphs,
    the backward in an input and a weight half for ``I``/``W``:
    :mod:`orgel.runtime.compiled`).

    Hooks a driver may set (the closure runner does): ``fetch_inputs(m)`` returns
    micro-batch ``m``'s model inputs when its first forward that reads them runs
    (the step's ``inputs`` then only give shapes); ``on_microbatch(m)`` runs right
    before a stage computes micro-batch ``m`` (its forward or a recompute);
    ``verdict()`` after the action list, before the gradient sums: an error (the driver's
    own work for this step failed) makes every rank drop the step as if an action had
    raised it, None lets it go on; ``on_drop()`` runs as this rank's own work fails in a step
    being dropped; ``before_reduce()`` after the backward work, before the gradient sums;
    ``after_optimizer()`` after the optimizer step; ``side_leaves(m)``: leaves that the
    forward of micro-batch ``m`` made itself (the first anchor of a forward's exchanges)
    and whose backward path an ``I`` must walk although no input or parameter needs it.
    ``reach_flags = True`` (every rank alike, before the first step): each gradient message
    also carries which of its values a gradient reached (:func:`orgel.runtime.messages.
    reach_mask`), for a loss known only as it runs (the closures' own): a value no gradient
    reached gives its producer None, as in one process, where it would give zeros.

    ``step(..., outputs=True)`` also keeps the model's outputs on the loss stage's
    ranks (:attr:`kept`, :mod:`orgel.runtime.outputs`).
    """

    #: whether forwards record autograd graphs (:mod:`orgel.runtime.forward_only`: no)
    training = True
    #: this process's member of its pipeline rank (tensor parallel; 0 without)
    member = 0

    def __init__(self, plan: Plan, split: SplitModel, *, loss_fn: Callable[[Any, Any], Any],
                 rank: int | None = None, optimizer_factory: OptimizerFactory | None = None,
                 max_grad_norm: float | None = None, timeout: float = 60.0,
                 device: torch.device | str | None = None, dynamic_shapes: bool = False,
                 batch_dim: BatchDim = 0, store: Any = None, check_plan: bool = True,
                 post_ahead: bool | None = None, check_finite: bool = False,
                 seed: int | None = None, replicated: tuple[str, ...] = (),
                 extra_params: dict[str, torch.nn.Parameter] | None = None,
                 loss_scaling: bool | dict[str, Any] = False,
                 scheduler: SchedulerFactory | None = None, lr: LearningRate | None = None,
                 accumulate: int = 1, compile: bool = False,
                 loss_rule: Rule = "rows") -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: start the ranks with "
                               "orgel.runtime.spawn or torchrun and init_process_group first")
        if len(split.stages) != plan.num_stages:
            raise ValueError(f"the plan has {plan.num_stages} stages but the split has "
                             f"{len(split.stages)}: split the model for this plan")
        if dist.get_world_size() != plan.world_size:
            raise ValueError(f"the plan needs {plan.world_size} processes but the process group "
                             f"has {dist.get_world_size()}: start {plan.world_size} ranks")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        check_gradient_values(plan, split)
        # validate derives the communication for its dry run; keep that one
        comm = validate(plan) if check_plan else derive_comm(plan)
        self.plan, self.split, self.loss_fn = plan, split, loss_fn
        # tensor parallel: this process is member ``member`` of pipeline rank ``rank``
        self.process = process = dist.get_rank()
        self.rank, self.member = plan.pipeline_rank_of(process), plan.tp_member_of(process)
        if rank is not None:
            self.rank = rank
        backend = dist.get_backend()
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                      else torch.device("cpu"))
        self.device = torch.device(device)
        self.max_grad_norm, self.timeout = max_grad_norm, timeout
        self.dynamic_shapes, self.batch_dim = dynamic_shapes, batch_dim
        # values between stages are cut along one dimension (replicated stages only)
        act_dim = single_dim(batch_dim)
        if act_dim is None and any(len(r) > 1 for r in plan.placement):
            raise ValueError(f"batch_dim={batch_dim!r} gives inputs different batch dimensions, "
                             "but the plan replicates stages, whose values between stages are "
                             "cut along one dimension: give one int batch_dim, or a plan "
                             "without replicated stages")
        self.act_dim = 0 if act_dim is None else act_dim
        self.check_finite = check_finite
        #: by stage: its compiled graphs (``compile``; made at the stage's first forward)
        self.compiled: dict[int, CompiledStage | SegmentedStage] | None = {} if compile else None
        self.actions = plan.schedule[self.rank]
        self.stages = {s: StageInfo.build(plan, split, s, self.rank)
                       for s in plan.stages_on(self.rank)}
        for info in self.stages.values():
            place(info.stage.module, self.device)
        #: each stage's mesh of the pipeline rank's members (tensor parallel; {} without)
        self.tp_meshes: dict[int, Any] = {}
        dp_meshes = None
        if plan.tp > 1:
            self.tp_meshes, dp_meshes = tp.shard_stages(plan, split, self.stages, self.device)
            if plan.sequence_parallel:
                split_stages(self.stages, self.tp_meshes)
        check_sharded(plan, split)
        # FSDP2 over the replicas of the plan's sharded stages (:mod:`orgel.runtime.sharding`);
        # with tp, over each plane's replicas, on the DTensors of the TP split (2-D)
        self.sharding = Sharding(plan, self.stages, self.rank, ranks=list(range(plan.num_ranks)),
                                 device=self.device, actions=self.actions, meshes=dp_meshes)
        run_stages_as_planned(plan, self.stages)  # the regions split, the stages sharded
        self.comm = comm
        self.msg_index = {(m.src_rank, m.dst_rank, m.edge, m.microbatch, m.grad, m.part): i
                          for i, m in enumerate(self.comm.messages)
                          if self.rank in (m.src_rank, m.dst_rank)}
        self.pairs = [replica_pairs(len(plan.placement[e.src]), len(plan.placement[e.dst]), 0)
                      for e in plan.stage_graph.edges]
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        # plan rank -> process, in this process's plane
        ranks = [plan.process_of(r, self.member) for r in range(plan.num_ranks)]
        self.transport = Transport(plan, self.comm, self.rank, store=store, device=self.device,
                                   timeout=timeout, ranks=ranks,
                                   post_ahead=backend != "nccl" if post_ahead is None
                                   else post_ahead, nccl=backend == "nccl")
        if backend == "nccl":
            self.transport.warm_up()
        self.sync = GradSync(plan, split, self.rank, self.stages, ranks=ranks, world_group=None,
                             timeout=timeout, device=self.device)
        # parameters of no stage that this rank steps (code outside every graph trains them)
        self.extra_params = dict(extra_params or {})
        for p in self.extra_params.values():
            self.sync.all_params.append(p)
            self.sync.norm_params.append(p)
        if plan.tp > 1:  # the norm over every process counts each parameter once (a whole
            # one, a stage's or an extra one every member holds, on member 0)
            self.sync.norm_params = tp.norm_params(self.sync.norm_params, self.member)
        # BatchNorm statistics of replicated stages: averaged over the replicas every step
        self.buffers = ReplicaBuffers(plan, self.stages,
                                      {rset: group for rset, (group, _) in self.sync.dp.items()})
        # the driver's hooks (see the class docstring)
        self.fetch_inputs: Callable[[int], dict[str, torch.Tensor]] | None = None
        self.on_microbatch: Callable[[int], None] | None = None
        self.verdict: Callable[[], Exception | None] | None = None
        self.on_drop: Callable[[], None] | None = None
        self.before_reduce: Callable[[], None] | None = None
        self.side_leaves: Callable[[int], dict[str, torch.Tensor]] | None = None
        self.after_optimizer: Callable[[], None] | None = None
        self.reach_flags = False
        self._fetched: set[int] = set()
        self.reduce_after: dict[int, list[tuple[int, ...]]] = {}
        for rset in self.sync.dp:
            last = max(p for p, a in enumerate(self.actions)
                       if plan.placement[a.stage] == rset and a.kind in ("B", "W"))
            self.reduce_after.setdefault(last, []).append(rset)
        self.loop = OptimizerLoop(self.named_for_optimizer(), optimizer_factory,
                                  scheduler=scheduler, lr=lr, accumulate=accumulate)
        self.optimizer = self.loop.optimizer
        options = loss_scaling if isinstance(loss_scaling, dict) else {}
        self.scaler = LossScaler(self.device, **options) if loss_scaling else None
        #: whether the loss stage starts its backward from the loss scale (False: the
        #: driver's backward scaled the gradients it hands over, as a forward of several
        #: graphs' controller does; the ranks still unscale, skip and update)
        self.scale_seed = True
        self.skipped = False  # the last step's gradients held an inf/NaN: no optimizer step
        # each piece's share of the batch (orgel.lossweights)
        self.loss_rule = loss_rule
        self._weights: dict[tuple[int, int], Weight] = {}
        self.dispatch: dict[str, Callable[[Action], None]] = {
            "F": self._forward, "B": self._backward, "I": self._backward, "W": self._weight,
        }
        self.events: list[Event] = []
        self.grad_norm: float | None = None  # the last optimizer step's (None: no step yet)
        # random draws (dropout): one stream per (seed, step, stage, micro-batch); torch's
        # initial seed is what the user set with torch.manual_seed, and no draw consumes it
        self.seed = torch.initial_seed() if seed is None else seed
        self.replicated = tuple(replicated)
        self.steps_done = 0  # step calls (each has its own random streams)
        self._final = True
        self._signature: Any = None
        #: a rank's own error in an action ends the step on every rank, which drop it and
        #: train on (:meth:`_drop_step`); False: it stops the step at once (StepFailure)
        self.abandon_on_error = False
        self._failed: tuple[BaseException, str] | None = None  # this step's own error, where
        self.kept: dict[int, Share] | None = None  # by micro-batch, when step keeps outputs
        self.with_loss = True  # whether the loss stage runs loss_fn

    # -- public -------------------------------------------------------------------

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters (every hosted stage, in stage order), each object once.

        Two stages on one rank that share a tied parameter hold the same object:
        the optimizer must see it once, or it would step it twice.
        """
        return self.sync.all_params

    def compile_seconds(self) -> float:
        """Seconds this pass's compiled stages spent compiling (0 without ``compile``)."""
        return sum(runner.compile_s for runner in (self.compiled or {}).values())

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """``(qualified name in the original model, parameter)`` for this rank's stages."""
        for _, info in sorted(self.stages.items()):
            for local, p in info.stage.module.named_parameters():
                yield info.stage.param_names.get(local, f"stage{info.index}.{local}"), p
        yield from self.extra_params.items()

    def named_for_optimizer(self) -> NamedParameters:
        """:meth:`parameters` with their original names: what the optimizer factory gets."""
        name_of: dict[int, str] = {}
        for name, p in self.named_parameters():
            name_of.setdefault(id(p), name)
        return NamedParameters((name_of[id(p)], p) for p in self.parameters())

    def step(self, inputs: dict[str, Any], targets: Any, *, outputs: bool = False) -> float:
        """Run forward and backward of the whole batch; return its mean loss (every rank).

        The optimizer (and its schedule) steps on every ``accumulate``-th call,
        after the gradient reductions and clipping; the calls between only add
        to the gradients. ``outputs``: keep this rank's shares of the model's
        outputs in :attr:`kept`.
        """
        with tp.implicit_replication():  # DTensor stages (tp > 1); the caller's setting after
            return self._step(inputs, targets, outputs=outputs)

    def _step(self, inputs: dict[str, Any], targets: Any, *, outputs: bool) -> float:
        self.kept = {} if outputs else None
        self._t0 = time.perf_counter()
        self._wall0 = time.time()
        self.events = []
        self.loop.begin()
        self.sharding.begin()
        self._final = self.loop.final  # this call reduces, clips and steps
        self._take_batch(inputs, targets)
        signature = _signature(inputs)
        exchange = self.dynamic_shapes or signature != self._signature
        if exchange and self._signature is not None and not self.dynamic_shapes:
            known = message_shapes(self.plan, self.split, self.comm, self.rank,
                                   self._inputs, reach_flags=self.reach_flags)
            if known is not None:  # every rank computes them alike: no exchange
                self.transport.set_shapes(known)
                exchange = False
        self._runs: dict[tuple[int, int], Run] = {}
        self._inbox: dict[int, list[torch.Tensor]] = {}
        self._local_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._in_grads: dict[str, torch.Tensor] = {}
        self._unreached: set[str] = set()
        self._loss = torch.zeros((), device=self.device)
        self._failed = None
        self._keep_written()  # a dropped step puts them back
        self.transport.begin(exchange_shapes=exchange)
        pos, action = -1, None
        try:
            for pos, action in enumerate(self.actions):
                self._execute(pos, action)
            pos, action = len(self.actions), None
            start = self._now()
            self.transport.finish()
            self._event("wait", "sends", start)
            start = self._now()
            problem = self.verdict() if self.verdict is not None else None
            if problem is not None and self._failed is None:
                self._fail_action(problem, "the driver's part of the step")
            if self.before_reduce is not None:
                self.before_reduce()
                # the gradients it adds join the replicas' sums: launched only now
                for rset in sorted(self.sync.dp) if self._final else ():
                    self.sync.launch_replicas(rset)
            failed = self._failed is not None
            if not self._final:  # accumulating: the gradients stay where they are
                loss = self.sync.reduce_loss(self._loss, failed)
                if self.sync.failed:
                    raise self._drop_step()
                self.buffers.average(self.sync._wait)
                self.loop.finish()
            else:
                if self.plan.tp > 1:  # each member's gradients laid out as its parameters
                    tp.settle_grads(self.sync.all_params)
                loss, norm = self.sync.finish(self._loss, self.max_grad_norm, self.scaler,
                                              failed, graded=self.loop.graded > 0)
                if self.sync.failed:
                    raise self._drop_step()
                self.buffers.average(self.sync._wait)
                self.skipped = self.sync.found_inf
                self._event("sync", "gradients", start)
                start = self._now()
                self.loop.finish(skipped=self.skipped)
                loss, norm = self.sync.read(loss, norm)
                self.grad_norm = norm
                self._event("optim", "optimizer", start)
                if self.after_optimizer is not None:
                    self.after_optimizer()
        except StepAbandoned:
            raise
        except Exception as exc:
            raise self._stopped(exc, pos, action, "running", "end of step",
                                "the end of the step (sends, gradient reduction, "
                                "optimizer)") from exc
        self._signature = signature
        self._runs, self._inbox, self._local_grads = {}, {}, {}
        self.steps_done += 1
        return loss

    def _stopped(self, exc: Exception, pos: int, action: Action | None, doing: str, end: str,
                 end_detail: str) -> StepFailure:
        """This rank's error that ends the pass (at ``action``, or at its ``end``): the
        peers waiting on the store (shape exchange) are told now, not at their timeout."""
        where = (f"{action} (position {pos} of {len(self.actions)})" if action is not None
                 else end_detail)
        self.transport.announce_failure(f"rank {self.rank} failed "
                                        f"({type(exc).__name__}, reported above)")
        return StepFailure(f"rank {self.rank}: {exc} [while {doing} {where}]",
                           rank=self.rank, action=str(action or end), cause=exc)

    # -- the action loop ----------------------------------------------------------

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _event(self, kind: str, name: str, start: float, peer: int | None = None) -> None:
        self.events.append(Event(self.rank, kind, name, self._wall0 + start,
                                 self._wall0 + self._now(), peer))

    def _execute(self, pos: int, action: Action) -> None:
        for i in self.comm.recvs_before[self.rank][pos]:
            start = self._now()
            self._inbox[i] = self.transport.recv(i)
            self._event("wait", f"recv {action}", start, self.comm.messages[i].src_rank)
        if self._failed is None:
            start = self._now()
            try:
                self.dispatch[action.kind](action)
            except Exception as exc:
                if not self.abandon_on_error or is_comm_error(exc):
                    raise
                if self.plan.tp > 1 and not self.transport.members_failed_alike(
                        pos, self.plan.processes_of(self.rank), self.process):
                    raise MemberFailure(
                        f"{type(exc).__name__}: {exc} (raised on tensor-parallel member "
                        f"{self.member} of pipeline rank {self.rank} alone, while its partners "
                        f"ran on into a collective it never joins: the step cannot be dropped, "
                        f"the pipeline stops; resume from the last checkpoint)") from exc
                self._fail_action(exc, f"{action} (position {pos} of {len(self.actions)})")
            else:
                self._event(action.kind, str(action), start)
        for i in self.comm.sends_after[self.rank][pos]:
            self._send(i)  # a placeholder while the step is being dropped
        self._in_grads, self._unreached = {}, set()
        early = self._final and self.before_reduce is None  # (else once they are added)
        for rset in self.reduce_after.get(pos, ()) if early else ():
            self.sync.launch_replicas(rset)
        self.sharding.after(pos, self._final, self._failed is not None)

    def _carries_grad(self, name: str, t: torch.Tensor) -> bool:
        """Whether value ``name`` sends a gradient back (the split says; default: floats)."""
        if not (t.is_floating_point() or t.is_complex()):
            return False
        return self.split.requires_grad.get(name, True)

    def _outgoing(self, i: int) -> list[torch.Tensor]:
        """The tensors of message ``i``, sliced to its rows, right after its action."""
        msg = self.comm.messages[i]
        edge = self.plan.stage_graph.edges[msg.edge]
        if not msg.grad:
            info = self.stages[edge.src]
            outputs = self._runs[(edge.src, msg.microbatch)].outputs
            tensors = [outputs[info.out_index[v.name]].detach() for v in edge.values]
        else:
            info = self.stages[edge.dst]
            names = [v.name for v in edge.values if v.name in self._in_grads]
            tensors = [self._in_grads[n] for n in names]
            if self.reach_flags:
                return [*(self._rows(t, msg.part, info) for t in tensors),
                        reach_mask(names, self._unreached, self.device)]
        return [self._rows(t, msg.part, info) for t in tensors]

    def _rows(self, t: torch.Tensor, part: tuple[int, int, int], info: StageInfo) -> torch.Tensor:
        if part == (0, 1, 1) or t.dim() <= self.act_dim:  # whole: no rows to share (a scalar)
            return t
        start, stop = part_rows(part, info.replica, info.replicas, t.shape[self.act_dim])
        return t.narrow(self.act_dim, start, stop - start)

def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in sorted(value.items()))
    return None

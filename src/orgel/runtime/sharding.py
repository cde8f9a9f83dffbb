"""FSDP2 inside a stage: its data-parallel replicas shard its parameters, gradients and state.

A stage the plan marks ``shard[s] == "fsdp"`` (:meth:`orgel.schedule.ir.Plan.sharded`)
runs on several ranks, each replica taking its share of every micro-batch's
rows, as any replicated stage does. Instead of a whole copy of the weights per
replica and orgel's all-reduce of the gradients (:mod:`orgel.runtime.optim`), its
module goes through torch's own ``torch.distributed.fsdp.fully_shard`` over the
group of the stage's ranks: each replica keeps ``1/n`` of every parameter (a
``DTensor`` sharded on dimension 0), of its gradient and of the optimizer state
built over it. The rest is what ``torch.distributed.pipelining`` does with FSDP2:

* the weights are gathered once per step, started at the step's start on every rank of
  the stage (:meth:`Sharding.begin`; its first forward waits for it), and kept
  whole for the step's micro-batches (``reshard_after_forward=False``; during the
  step ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``,
  ``set_is_last_backward(False)``): each micro-batch's backward (``B``, or ``I``
  then ``W``) adds into the whole weights' gradients, and a recompute finds the
  weights there;
* after the rank's last backward of the stage in the step (on the optimizer
  stepping call only, with ``accumulate=k``) :meth:`Sharding.reduce` turns the
  flags on and runs each FSDP parameter group's ``post_backward``: one
  reduce-scatter (a plain SUM: orgel's gradients are partial sums already, the
  loss carries its share of the batch, :mod:`orgel.lossweights`; see
  :mod:`orgel.runtime.optim`),
  then the weights are resharded;
* the global gradient norm counts every replica's local shard once
  (:func:`own_part`), and a parameter or optimizer state leaves a rank whole
  (:func:`full_tensor`, a gather over the stage's ranks that every replica makes)
  and comes back as the shard of this rank (:func:`shard_like`), so state dicts
  and checkpoints hold full tensors under the model's own names and resume on
  any mesh.

With tensor parallelism (``plan.tp > 1``) each replica is a pipeline rank of ``tp``
processes: FSDP2 runs over each plane's replicas (member ``t`` of each), on the
``"dp"`` dimension of a 2-D mesh whose ``"tp"`` dimension the stage's TP DTensors live
on (:func:`orgel.runtime.tensor_parallel.shard_stages` makes both).

A tied parameter (an input embedding and the LM head that reuses it) on sharded stages
trains when every stage holding it is sharded over as many replicas: replica ``k`` of
each holds the same rows of its copy, and the copies' gradient shards are summed
replica by replica after the reduce-scatter (:class:`orgel.runtime.optim.GradSync`).

With tensor parallelism as well, that sum holds on every plane: tensor parallelism splits
no tied parameter (:func:`orgel.runtime.tensor_parallel.parallelize`), so each member holds
its replica's rows of every copy whole.

What it refuses (:func:`check_sharded`, before any rank starts): a tied parameter whose
copies are not sharded alike (a sharded and a whole copy, other replica counts). A tied
input embedding that a given plan shards so is refused before any capture
(:func:`check_tied_sharding`): the model's parameters show it. float16 loss scaling
unscales and checks each rank's gradient shards (:class:`orgel.runtime.scaler.LossScaler`);
the inf/NaN verdict is every rank's.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from orgel.guard import quiet
from orgel.schedule.ir import SHARDS, Plan


def check_shard_option(shard: Any, dp: int) -> None:
    """Raise ValueError unless ``shard`` is one of :data:`SHARDS` and fits ``dp``."""
    if shard not in SHARDS:
        raise ValueError(f"shard must be one of {', '.join(repr(s) for s in SHARDS)}, "
                         f"got {shard!r}")
    if shard == "fsdp" and dp < 2:
        raise ValueError("shard='fsdp' shards a stage's state over its data-parallel "
                         "replicas, but dp=1 gives every stage one replica: pass dp=2 or "
                         "more (ranks divisible by dp), or shard='none'")


def check_sharded(plan: Plan, split: Any) -> None:
    """Raise ValueError for what a sharded stage cannot do (see the module docstring)."""
    sharded = [s for s in range(plan.num_stages) if plan.sharded(s)]
    if not sharded:
        return
    tied = set(getattr(split, "tied", ()) or ())
    for s in sharded:
        names = set(split.stages[s].param_names.values())
        for name in sorted(names & tied):
            holders = [t for t, stage in enumerate(split.stages)
                       if name in stage.param_names.values()]
            if not _shards_align(plan, holders):
                raise ValueError(_tied_refusal(s, name))


def _shards_align(plan: Plan, holders: list[int]) -> bool:
    """Whether the copies of a tied parameter on ``holders`` are sharded alike: every stage
    FSDP-sharded over as many replicas (then replica k of each holds the same rows, and the
    gradient shards sum replica by replica: :class:`orgel.runtime.optim.GradSync`, on
    every tensor-parallel plane alike; see the module docstring)."""
    return (all(plan.sharded(t) for t in holders)
            and len({len(plan.placement[t]) for t in holders}) == 1)


def _tied_refusal(stage: int, name: str, also: str = "") -> str:
    return (f"stage {stage} is FSDP-sharded but holds the tied parameter {name!r} (one tensor "
            f"several stages use{also}): orgel sums a tied parameter's gradient shards only "
            "where every stage holding it is sharded over as many replicas. Shard every "
            "stage that holds it alike (or none), or untie the weights")


def tied_embedding(model: torch.nn.Module) -> tuple[str, str] | None:
    """The input embedding's weight and the output layer's name for it where one Parameter is
    both (an ``nn.Embedding``'s and another module's, as a tied LM head); else None."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(
                (f"{prefix}.{local}" if prefix else local, module))
    for found in owners.values():
        embedding = [n for n, m in found if isinstance(m, torch.nn.Embedding)]
        head = [n for n, m in found if not isinstance(m, torch.nn.Embedding)]
        if embedding and head:
            return embedding[0], head[0]
    return None


def check_tied_sharding(model: torch.nn.Module, plan: Plan) -> None:
    """Refuse, before any capture, a tied input embedding and output layer that a given
    ``plan`` puts on stages sharded unlike each other: the embedding runs in the first
    stage and the layer tied to it in the last, so a pipeline of two or more stages holds
    the tie on two stages, which :func:`check_sharded` refuses once the graph is split
    unless both are sharded alike. (The planner's plans shard every stage alike.)"""
    ends = [s for s in (0, plan.num_stages - 1) if plan.sharded(s)]
    if plan.num_stages < 2 or not ends or _shards_align(plan, [0, plan.num_stages - 1]):
        return
    tie = tied_embedding(model)
    if tie is not None:
        name, other = tie
        raise ValueError(_tied_refusal(ends[0], name, f": the input embedding, also {other!r} "
                                                      "at the end of the model"))


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter, gradient or optimizer state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def own_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of ``t`` (a DTensor's local shard; any other tensor itself)."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined, no-any-return]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor gathered over its mesh (every rank of it must call this,
    in the same order); any other tensor itself."""
    if is_sharded(t):
        # a parameter sharded over a 2-D mesh (tp x fsdp) is gathered in two all-gathers,
        # which DTensor warns about once per process: a checkpoint's or state_dict's one
        # gather, not the step's; the user has nothing to change
        with quiet("torch.distributed.tensor._redistribute", logging.ERROR):
            return t.detach().full_tensor()  # type: ignore[attr-defined, no-any-return]
    return t


def like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this process's part) as ``p`` holds it: a DTensor of ``p``'s mesh and
    placements where ``p`` is one (tensor parallel), else ``local`` itself."""
    if not is_sharded(p):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=p.shape, stride=p.stride())


def shard_like(like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as ``like`` holds it: this rank's shard where ``like`` is
    a DTensor of the same shape (cut locally, no communication); else ``value`` itself."""
    if not is_sharded(like) or is_sharded(value) or tuple(value.shape) != tuple(like.shape):
        return value
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = like.device_mesh, like.placements  # type: ignore[attr-defined]
    return distribute_tensor(value.detach().to(like.device, like.dtype), mesh, placements,
                             src_data_rank=None)


class Sharding:
    """This rank's FSDP2-sharded stages: wraps them, and keeps their gather and reduce per step.

    Every rank builds one (collectively: every rank creates the process group of
    each sharded replica set, in one order); ranks without a sharded stage hold
    none. Build it after the stage modules are on their device and before
    anything collects their parameters (the optimizer, :class:`~orgel.runtime.optim.GradSync`).
    """

    def __init__(self, plan: Plan, stages: dict[int, Any], rank: int, *, ranks: list[int],
                 device: torch.device, actions: list[Any],
                 meshes: dict[tuple[int, ...], Any] | None = None) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.modules: dict[int, Any] = {}
        sets = sorted({plan.placement[s] for s in range(plan.num_stages) if plan.sharded(s)})
        for rset in sets:
            # tensor parallel: ``meshes`` gives the "dp" mesh of each sharded set (its
            # plane's replicas; :func:`orgel.runtime.tensor_parallel.shard_stages`)
            if meshes is None:
                group = dist.new_group([ranks[r] for r in rset])
            if rank not in rset:
                continue
            mesh = meshes[rset] if meshes is not None else DeviceMesh.from_group(group,
                                                                                 device.type)
            for s in sorted(stages):
                if plan.placement[s] != rset or not plan.sharded(s):
                    continue
                module = stages[s].stage.module
                # FSDP2 shards no 0-dim parameter (CLIP's logit_scale): it stays whole on
                # every replica, and its gradient is summed with the unsharded ones (GradSync)
                scalars = {p for p in module.parameters() if p.dim() == 0}
                fully_shard(module, mesh=mesh, reshard_after_forward=False,
                            ignored_params=scalars or None)
                _inputs_as_they_are(module)
                _quiet_view_outputs(type(module).__name__)
                # a plain SUM: every replica's gradient is a partial sum already
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
                stages[s].params = list(module.parameters())  # the sharded DTensors
                self.modules[s] = module
        #: the sharded stages in the order of their first forward on this rank: the order
        #: :meth:`begin` starts their all-gathers in
        self.gather_order: list[int] = list(dict.fromkeys(
            a.stage for a in actions if a.kind == "F" and a.stage in self.modules))
        #: action position -> the sharded stages whose last backward (B or W) it is
        self.reduce_after: dict[int, list[int]] = {}
        for s in self.modules:
            last = max(p for p, a in enumerate(actions)
                       if a.stage == s and a.kind in ("B", "W"))
            self.reduce_after.setdefault(last, []).append(s)

    @classmethod
    def empty(cls) -> Sharding:
        """One that shards nothing and reduces nothing (a forward-only pass's)."""
        made = cls.__new__(cls)
        made.modules, made.reduce_after, made.gather_order = {}, {}, []
        return made

    def stages(self) -> list[int]:
        """The sharded stages on this rank."""
        return sorted(self.modules)

    def begin(self) -> None:
        """Start a step call: keep the weights gathered, and sum gradients locally, until
        :meth:`reduce`; and start gathering every sharded stage's weights now, in the order
        of their first forwards, without waiting (each stage's first forward waits for its
        own, in FSDP2's pre-forward hook). A rank whose first forward waits for its input
        gathers meanwhile, as ``torch.distributed.pipelining`` unshards ahead of a stage's
        first forward, instead of the pipeline's ranks gathering one after another in the
        warm-up. A stage still gathered (an accumulating call) gathers nothing."""
        from torch.distributed.fsdp import fully_shard

        for module in self.modules.values():
            # what FSDP2's pre-forward hook does at a stage's first forward: its root state,
            # which a compiled stage (no hook runs) otherwise lacks at the step's reduce
            fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]
            module.set_requires_gradient_sync(False)
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
        for s in self.gather_order:
            self.modules[s].unshard(async_op=True)

    def after(self, pos: int, final: bool, failed: bool = False) -> None:
        """After the action at ``pos``: reduce the stages whose last backward it was
        (``final``: the call that steps the optimizer; the others only accumulate).
        ``failed``: this rank's work raised this step (it is being dropped)."""
        if final:
            for s in self.reduce_after.get(pos, ()):
                self.reduce(s, failed)

    def reduce(self, s: int, failed: bool = False) -> None:
        """Reduce-scatter stage ``s``'s whole gradients into its shards' ``.grad``, and
        reshard its weights (every replica of the stage calls this, once per step).

        ``failed``: this rank's work raised and skipped the stage's backward; it
        reduce-scatters zeros for what it has no gradient of, so that its peers'
        reduce-scatter meets it (the step is dropped afterwards on every rank).
        """
        from torch.distributed.fsdp import fully_shard

        module = self.modules[s]
        if failed:
            for fsdp_param in _fsdp_params(module):
                if not hasattr(fsdp_param, "_unsharded_param"):
                    continue  # never gathered here: nothing to meet the peers with
                whole = fsdp_param.unsharded_param
                if (whole.requires_grad and whole.grad is None
                        and fsdp_param.unsharded_accumulated_grad is None):
                    whole.grad = torch.zeros_like(whole)
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for each in state._state_ctx.all_states:
            for group in _param_groups(each):
                group.post_backward()
        # waits for the reduction and resets the per-step state, as pipelining does
        state._root_post_backward_final_callback()
        module.reshard()

    def accumulating(self) -> set[int]:
        """The ids of the sharded parameters whose gradient is a sum not reduced yet (kept
        on the whole weight by an accumulating call: their shard's ``.grad`` is None)."""
        held = set()
        for module in self.modules.values():
            for fsdp_param in _fsdp_params(module):
                whole = (fsdp_param.unsharded_param.grad
                         if hasattr(fsdp_param, "_unsharded_param") else None)
                if whole is not None or fsdp_param.unsharded_accumulated_grad is not None:
                    held.add(id(fsdp_param.sharded_param))
        return held

    def shard_ids(self) -> set[int]:
        """The ids of the sharded stages' FSDP shards (the DTensors their modules hold
        between a reduce and the next step's gather)."""
        return {id(fsdp_param.sharded_param)
                for module in self.modules.values() for fsdp_param in _fsdp_params(module)}

    def drop(self, only: set[int] | None = None) -> None:
        """Forget the whole weights' gradients summed since the last reduce (a dropped step);
        ``only``: those of the sharded parameters with these ids."""
        for module in self.modules.values():
            for fsdp_param in _fsdp_params(module):
                if only is not None and id(fsdp_param.sharded_param) not in only:
                    continue
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param.unsharded_param.grad = None
                fsdp_param.unsharded_accumulated_grad = None

    def reshard(self) -> None:
        """Put every sharded stage's weights back to their shards (the state's own objects)."""
        for module in self.modules.values():
            module.reshard()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """The sharded stages' weights whole inside (evaluation); back as they were after."""
        from torch.distributed.fsdp import fully_shard

        was = [m for m in self.modules.values()
               if all(g.is_sharded for g in
                      _param_groups(fully_shard.state(m)))]  # type: ignore[attr-defined]
        for module in self.modules.values():
            module.unshard()
        try:
            yield
        finally:
            for module in was:
                module.reshard()


def _quiet_view_outputs(cls: str) -> None:
    """Silence FSDP2's "returned a view tensor" warning for orgel's own stages (class ``cls``).

    A stage's outputs are the values its cut crosses, and a cut inside a layer often
    crosses a view (attention's output reshaped from its heads, before ``o_proj``), so
    torch warned on every FSDP run. The warning is about an in-place op on such an output
    dropping FSDP2's pre-backward hook, whose all-gather the backward then misses. Neither
    can happen here: orgel never writes a stage's outputs in place (a send reads them;
    a stage on the same rank takes ``.detach()`` of them as a fresh leaf; the backward
    passes gradients into them), and a sharded stage's weights stay gathered from its
    first forward of a step until :meth:`Sharding.reduce` (``reshard_after_forward=False``,
    ``set_reshard_after_backward(False)``), so that all-gather has nothing to do. The
    filter names the class FSDP2 gives the stage module (``FSDPGraphModule``): a module
    the user shards elsewhere in the process keeps its warning.
    """
    warnings.filterwarnings(
        "ignore", category=UserWarning,
        message=rf"FSDP2-wrapped module \({re.escape(cls)}\) returned a view tensor")


def _inputs_as_they_are(module: Any) -> None:
    """Let ``module``'s forward take its inputs as they are: FSDP2 passes them through one
    autograd Function, to run its post-backward when their gradients come, whose backward
    makes zeros for an input no gradient reached (a value only a model output the loss does
    not read depends on). orgel runs the post-backward itself (:meth:`Sharding.reduce`), and
    an input no gradient reaches must keep none, as in one process (the reach flags of
    ``orgel.backend``'s gradient messages: its parameters then keep no gradient and the
    optimizer skips them). Set on this module's own parameter groups only."""
    from torch.distributed.fsdp import fully_shard

    def as_they_are(args: tuple[Any, ...], kwargs: dict[str, Any],
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    for group in _param_groups(fully_shard.state(module)):  # type: ignore[attr-defined]
        group._register_post_backward_hook = as_they_are


def _fsdp_params(module: Any) -> list[Any]:
    """The FSDP2 parameters of a ``fully_shard`` module (torch's ``FSDPParam`` objects)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    return [p for group in _param_groups(state) for p in group.fsdp_params]


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list since torch 2.12, one group or None before
    (2.11, the GPU machines' image)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]

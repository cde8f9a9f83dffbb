"""Tensor parallelism inside a stage: its column/row regions run on DTensors over ``tp`` processes.

A plan with ``plan.tp > 1`` runs each pipeline rank ``r`` as ``tp`` processes,
``r * tp + t`` being member ``t`` (:meth:`~orgel.schedule.ir.Plan.processes_of`,
:meth:`~orgel.schedule.ir.Plan.pipeline_rank_of`, :meth:`~orgel.schedule.ir.Plan.tp_member_of`).
Member ``t`` of every pipeline rank forms *plane* ``t``: a full copy of the pipeline
running the same action lists, whose messages go from member ``t`` to member ``t``
(:meth:`~orgel.schedule.ir.Plan.process_of`), whose data-parallel and tied-weight sums
are over the plane (:func:`plane_group`).
Every member holds the same, replicated, values between stages. A stage's
data-parallel replicas are pipeline ranks; their gradient sums run per plane, each
member sending its own part of a split weight's gradient (:mod:`orgel.runtime.optim`),
and an FSDP-sharded stage (``plan.shard``) shards each plane's copy over the replicas
with torch's FSDP2 on a 2-D ``("dp", "tp")`` mesh (:func:`meshes`): its TP DTensors are
split again on dimension 0. The eval-mode stages (``evaluate``) hold the training
stages' DTensor parameters and split the same regions (:func:`shard_eval_stages`).

Inside a stage the members split the regions :func:`orgel.graph.tensor_parallel.tp_regions`
finds (attention, MLP). :func:`parallelize` rewrites the stage's fx graph, which has
no ``nn.Linear`` submodules for ``torch.distributed.tensor.parallel``'s
``ColwiseParallel``/``RowwiseParallel`` module hooks to attach to, so it does at graph
level what they do:

* the column linears' weights (and biases) become ``Shard(0)`` DTensor parameters,
  the row linear's weight ``Shard(1)``, its bias ``Replicate()`` (an ``addmm`` weight,
  stored ``[in, out]``, along the other dimension:
  :meth:`~orgel.graph.tensor_parallel.Region.weight_dim`), over a
  :class:`~torch.distributed.device_mesh.DeviceMesh` of the pipeline rank's ``tp``
  processes (:func:`meshes`);
* the region's input enters as a ``Replicate()`` DTensor (``DTensor.from_local``: its
  backward all-reduces the input's gradient), and the row output leaves as a plain
  tensor after ``redistribute`` to ``Replicate()`` (the forward all-reduce);
* between them every op runs on DTensors, which keeps the single-process result: an
  op without a sharded rule for its inputs' layout redistributes them, and one DTensor
  cannot run at all runs on the gathered, whole tensors (:class:`_Guarded`; the stage
  module's ``tp_fallbacks`` names them: GPT's fused qkv viewed as ``(3, heads, dim)``
  with ``tp=2``, and the attention after it). Attention whose q, k and v are split by
  heads (``Shard(1)``, separate projections as in Llama) runs on each member's own
  heads, with no communication (:func:`_local_heads`). Plain tensors an op of a region
  reads (rotary tables, masks, a norm's weight) enter it as replicated DTensors made
  with ``from_local``, so their gradients come back plain; ``implicit_replication``
  (switched on around orgel's passes by :func:`implicit_replication`) covers what autograd
  mixes in backward.

Parameter names and whole values are unchanged for ``state_dict`` and ``copy_to``:
:func:`orgel.runtime.sharding.full_tensor` gathers a DTensor parameter and
:func:`orgel.runtime.sharding.shard_like` keeps the member's shard of a whole tensor
(the same rules as FSDP2's).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from orgel.graph.tensor_parallel import Region, tp_regions
from orgel.schedule.ir import Plan


def plane_group(plan: Plan, processes: Sequence[int]) -> Any:
    """A process group of ``processes`` (processes of this process's plane), made the same
    way on every process: one group per plane, the others' the same ranks shifted to their
    member (``dist.new_group`` is collective over the whole job, in one order)."""
    if plan.tp == 1:
        return dist.new_group(list(processes))
    own = plan.tp_member_of(dist.get_rank())
    mine = None
    for t in range(plan.tp):
        group = dist.new_group([p - own + t for p in processes])
        if t == own:
            mine = group
    return mine


#: the mesh dimension names: the members of a pipeline rank, and the replicas of a
#: sharded stage (FSDP2 over the plane: member t of each replica)
TP, DP = "tp", "dp"


def forget_meshes() -> None:
    """Drop the sharding rules DTensor cached for earlier meshes, in this thread.

    DTensor caches each op's sharding by its inputs' specs, per thread, and a
    :class:`~torch.distributed.device_mesh.DeviceMesh` equals another of the same processes
    whatever its process group. A pipeline built after another in the same processes
    (under torchrun: ``orgel.load`` after ``close``) would then run the ops its thread ran
    before on the earlier pipeline's groups, where a member whose thread is new (process 0
    of a forward with graph breaks runs its rank in a thread of its own) runs them on the
    new ones: the members wait in two different groups, for ever.
    """
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:  # the dispatcher's native cache (torch 2.10 and later)
        clear()


def meshes(plan: Plan, device_type: str) -> tuple[DeviceMesh, dict[tuple[int, ...], DeviceMesh]]:
    """This process's meshes: the 1-D mesh (``"tp"``) of its pipeline rank's members, and
    for each FSDP-sharded replica set it is in, the 2-D mesh (``"dp"``, ``"tp"``) of the
    set's processes, rows the replicas, columns the members. Collective over every
    process (each makes every group, in one order)."""
    process = dist.get_rank()
    own, member = plan.pipeline_rank_of(process), plan.tp_member_of(process)
    forget_meshes()
    groups = [dist.new_group(plan.processes_of(r)) for r in range(plan.num_ranks)]
    mesh = DeviceMesh.from_group(groups[own], device_type, mesh_dim_names=(TP,))
    sets = sorted({plan.placement[s] for s in range(plan.num_stages) if plan.sharded(s)})
    planes: dict[tuple[int, ...], DeviceMesh] = {}
    for rset in sets:
        dp = plane_group(plan, [plan.process_of(r, member) for r in rset])
        if own in rset:
            planes[rset] = DeviceMesh.from_group(
                [dp, groups[own]], device_type,
                mesh=[plan.processes_of(r) for r in rset], mesh_dim_names=(DP, TP))
    return mesh, planes


def shard_stages(plan: Plan, split: Any, stages: dict[int, Any], device: torch.device,
                 ) -> tuple[dict[int, DeviceMesh], dict[tuple[int, ...], DeviceMesh]]:
    """Split the regions of this process's stages (``StageInfo`` by index) over its
    pipeline rank's members; each stage's ``params`` then lists the DTensor parameters.

    Returns each stage's TP mesh (a sharded stage's: the ``"tp"`` dimension of its
    replica set's 2-D mesh, so that FSDP2 shards its DTensors over the ``"dp"`` one),
    and the ``"dp"`` mesh of each sharded replica set this process is in (for
    :class:`~orgel.runtime.sharding.Sharding`). Collective over every process."""
    mesh, planes = meshes(plan, device.type)
    used: dict[int, DeviceMesh] = {}
    ties = set(getattr(split, "tied", ()) or ())  # one tensor several stages hold: kept whole
    for s, info in stages.items():
        used[s] = planes[plan.placement[s]][TP] if plan.sharded(s) else mesh
        module = info.stage.module
        if not isinstance(module, torch.fx.GraphModule):
            continue
        tied = {local for local, name in info.stage.param_names.items() if name in ties}
        info.tp_regions = parallelize(module, used[s], split.requires_grad,
                                      whole=frozenset(tied))
        info.params = list(module.parameters())
    return used, {rset: planes[rset][DP] for rset in planes}


def shard_eval_stages(split: Any, stages: dict[int, Any], used: dict[int, DeviceMesh]) -> None:
    """Rewrite the eval-mode stages (``StageInfo`` by index, :mod:`orgel.split.evaluation`),
    which hold the training stages' DTensor parameters already (``share_weights``), to
    run their regions over the training stages' meshes (``used``, by stage) as they do;
    a region whose weights the training stages did not split stays whole
    (``parallelize(shared=True)``)."""
    for s, info in stages.items():
        module = info.stage.module
        if isinstance(module, torch.fx.GraphModule):
            info.tp_regions = parallelize(module, used[s], split.requires_grad, shared=True)


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside, plain tensors that meet DTensors count as replicated; as it was after.

    The switch is thread-local and autograd carries it to the threads that run a
    backward started inside, so orgel's passes over the stages run within this and
    the caller's process (torchrun's ranks are the caller's) keeps its own setting.
    ``torch.distributed.tensor.experimental.implicit_replication`` would switch it off
    after, even where the caller had it on.
    """
    before = torch._C._get_dtensor_allow_implicit_replication()
    torch._C._set_dtensor_allow_implicit_replication(True)
    try:
        yield
    finally:
        torch._C._set_dtensor_allow_implicit_replication(before)


# -- the graph rewrite ---------------------------------------------------------------------


def parallelize(module: torch.fx.GraphModule, mesh: DeviceMesh,
                requires_grad: dict[str, bool] | None = None, *,
                shared: bool = False, whole: frozenset[str] = frozenset()) -> list[Region]:
    """Rewrite ``module`` (a stage's GraphModule) to run its regions over ``mesh``.

    Returns the regions it split; ``module.tp_fallbacks`` lists the ops that had
    to run on full tensors (filled as they run). A region whose weights are not
    parameters of ``module`` stays whole. ``requires_grad``: which of its inputs carry
    a gradient (``SplitModel.requires_grad``; see :func:`~orgel.graph.tensor_parallel.tp_regions`).
    ``shared``: split only the regions whose weights are DTensors already (an eval-mode
    stage holding the training stage's parameters). ``whole``: parameters (by their name in
    ``module``) no region may split: a tied parameter another stage holds too, whose
    copies' gradients are summed part by part (:class:`orgel.runtime.optim.GradSync`), so
    each copy must be laid out alike, and another stage may read it outside any region.
    """
    graph = module.graph
    nodes = {n.name: n for n in graph.nodes}
    done: list[Region] = []
    fallbacks: list[str] = []
    for region in tp_regions(module, requires_grad):
        leaves = [nodes[p] for p in region.column_params + region.row_params]
        if not all(n.op == "get_attr" and _is_param(module, str(n.target))
                   and str(n.target) not in whole for n in leaves):
            continue
        if shared and not all(isinstance(module.get_parameter(str(n.target)), DTensor)
                              for n in leaves):
            continue
        for name in region.column_params:
            _distribute(module, str(nodes[name].target), mesh,
                        Shard(region.weight_dim(name, column=True)))
        _distribute(module, str(nodes[region.row_weight].target), mesh,
                    Shard(region.weight_dim(region.row_weight, column=False)))
        if region.row_bias:
            _distribute(module, str(nodes[region.row_bias].target), mesh, Replicate())
        source = nodes[region.input]
        first = nodes[region.columns[0]]
        with graph.inserting_before(first):
            entered = graph.call_function(_Enter(mesh), (source,))
        for c in region.columns:
            nodes[c].replace_input_with(source, entered)
        row = nodes[region.row]
        with graph.inserting_after(row):
            left = graph.call_function(_Leave(mesh), (row,))
        row.replace_all_uses_with(left, delete_user_cb=lambda user, left=left: user is not left)
        for name in region.inner:
            _guard(nodes[name], fallbacks)
        done.append(region)
    graph.lint()
    module.recompile()
    module.tp_fallbacks = fallbacks  # type: ignore[assignment]
    return done


class _Enter:
    """The region's input as a replicated DTensor (backward: its gradient all-reduced); a
    value cut along the sequence (:mod:`orgel.runtime.sequence_parallel`) is gathered
    (backward: its gradient reduce-scattered)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.__name__ = "tp_enter"

    def __call__(self, x: torch.Tensor) -> DTensor:
        if isinstance(x, DTensor):
            return x.redistribute(self.mesh, [Replicate()])
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)


class _Leave:
    """The row output, summed over the members (one all-reduce), as a plain tensor."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.__name__ = "tp_leave"

    def __call__(self, y: Any) -> Any:
        if not isinstance(y, DTensor):
            return y
        return y.redistribute(self.mesh, [Replicate()]).to_local()


class _Guarded:
    """Runs one op of a region on DTensors, or where DTensor has no rule for it, on the
    full tensors (gathered), its tensor outputs replicated DTensors again."""

    def __init__(self, fn: Callable[..., Any], what: str, fallbacks: list[str]) -> None:
        self.fn = fn
        self.what = what
        self.fallbacks = fallbacks
        self.full = False  # once it failed, straight to full tensors
        self.__name__ = getattr(fn, "__name__", what)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.__name__ == "scaled_dot_product_attention":
            heads = _local_heads(self.fn, args, kwargs)
            if heads is not None:
                return heads
            self.full = True  # DTensor's rule for it is slow to search, where it has one
        if not self.full:
            try:
                return self.fn(*_replicated(args), **_replicated(kwargs))
            except (NotImplementedError, RuntimeError) as exc:
                if not no_rule(exc):
                    raise
                self.full = True
                self.fallbacks.append(self.what)
        mesh = next(a.device_mesh for a in _flat(args, kwargs) if isinstance(a, DTensor))
        out = self.fn(*gathered(args), **gathered(kwargs))
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False),
            out)


def no_rule(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by an op on DTensors) says DTensor has no sharding rule for
    the op: the op then runs on the gathered, whole tensors instead."""
    return "sharding" in str(exc).lower() or "DTensor" in str(exc)


def gathered(tree: Any) -> Any:
    """``tree`` with every DTensor in it gathered to a plain, whole tensor."""
    return torch.utils._pytree.tree_map_only(DTensor, lambda t: t.full_tensor(), tree)


def _replicated(tree: Any) -> Any:
    """Plain tensors next to a DTensor in one op's arguments, as replicated DTensors made
    with ``from_local``, so that their gradients come back as plain tensors (implicit
    replication alone would give a weight read inside a region a DTensor gradient)."""
    leaves = torch.utils._pytree.tree_leaves(tree)
    mesh = next((a.device_mesh for a in leaves if isinstance(a, DTensor)), None)
    if mesh is None:
        return tree
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t if isinstance(t, DTensor) or t.dim() == 0 else
        DTensor.from_local(t, mesh, [Replicate()], run_check=False), tree)


def _local_heads(fn: Callable[..., Any], args: Any, kwargs: Any) -> DTensor | None:
    """Attention with q, k and v split by heads (``Shard(1)``), each member its own heads:
    no communication; None where they are not, or a mask differs between heads."""
    qkv = args[:3]
    if len(qkv) < 3 or not all(isinstance(t, DTensor) and tuple(t.placements) == (Shard(1),)
                                and t.dim() == 4 for t in qkv):
        return None
    rest = list(args[3:]) + list(kwargs.values())
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    if any(isinstance(a, DTensor) for a in rest) or (
            isinstance(mask, torch.Tensor) and mask.dim() >= 3 and mask.shape[-3] != 1):
        return None
    q, k, v = qkv
    out = fn(q.to_local(), k.to_local(), v.to_local(), *args[3:], **kwargs)
    return DTensor.from_local(out, q.device_mesh, [Shard(1)], run_check=False)


def _flat(args: Any, kwargs: Any) -> list[Any]:
    return list(torch.utils._pytree.tree_leaves((args, kwargs)))


def _method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _guard(node: torch.fx.Node, fallbacks: list[str]) -> None:
    if node.op == "call_method":
        node.op = "call_function"
        node.target = _Guarded(_method(str(node.target)), f"{node.name} (.{node.target})",
                               fallbacks)
    elif node.op == "call_function" and node.target is not operator.getitem:
        name = getattr(node.target, "__name__", str(node.target))
        node.target = _Guarded(node.target, f"{node.name} ({name})",  # type: ignore[arg-type]
                               fallbacks)


def _is_param(module: torch.nn.Module, target: str) -> bool:
    prefix, _, leaf = target.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    return leaf in owner._parameters


def _distribute(module: torch.nn.Module, target: str, mesh: DeviceMesh, placement: Any) -> None:
    prefix, _, leaf = target.rpartition(".")
    owner = module.get_submodule(prefix) if prefix else module
    p = owner._parameters[leaf]
    assert p is not None
    if isinstance(p, DTensor):
        return
    dt = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None)
    owner._parameters[leaf] = torch.nn.Parameter(dt, requires_grad=p.requires_grad)


# -- parameter state -----------------------------------------------------------------------


def sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor split over the members (each holds a different part)."""
    return isinstance(t, DTensor) and any(isinstance(p, (Shard, Partial)) for p in t.placements)


def settle_grads(params: list[torch.nn.Parameter]) -> None:
    """Give each DTensor parameter's gradient the parameter's own placements (autograd may
    leave a sharded weight's gradient replicated, or a partial sum): then each member's
    local gradient is its part, for the norm and the optimizer. Every member calls it
    for the same parameters, in one order (it may reduce)."""
    for p in params:
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def norm_params(params: list[torch.nn.Parameter], member: int) -> list[torch.nn.Parameter]:
    """The parameters whose gradient member ``member`` counts in the global norm: each
    once over the job (split over the members: every member its part; the rest,
    FSDP-sharded over the replicas or not: member 0)."""
    return [p for p in params if member == 0 or split_over_members(p)]


def split_over_members(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor whose ``"tp"`` mesh dimension splits it (each member of
    the pipeline rank holds a different part)."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return TP in names and isinstance(t.placements[names.index(TP)], (Shard, Partial))

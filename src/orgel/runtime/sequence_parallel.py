"""Sequence parallelism: what the tensor-parallel regions leave whole runs on a slice of the rows.

With plain tensor parallelism (:mod:`orgel.runtime.tensor_parallel`) every member of a
pipeline rank holds the whole residual stream between the regions and runs the norms,
residual adds and the rest there on all of it, each member the same work. With
``Plan.sequence_parallel`` (Megatron's sequence parallelism, torchtitan's
``SequenceParallel``) each member holds ``1/tp`` of those values instead, cut along the
sequence:

* a region's row output leaves as a ``Shard(d)`` DTensor, ``d`` the dimension before the
  features (the sequence of a ``[batch, sequence, features]`` value): a reduce-scatter
  where plain tensor parallelism all-reduces;
* every torch op downstream of it on the way to the next region runs on DTensors (each
  member on its own rows: a norm, a residual add, a cast), with DTensor's rules, which
  keep the single-process meaning of every op: a reduction over the sharded dimension
  sums across the members, a view takes the global sizes;
* a region's input, a ``Shard(d)`` DTensor then, is gathered to ``Replicate()`` as it
  enters (an all-gather; its backward reduce-scatters the input's gradient);
* an op DTensor has no rule for, and any op that draws random numbers (dropout: one
  process draws over the whole tensor, a member over its slice would draw other numbers),
  runs on the gathered, whole tensors (the module's ``tp_sequence_fallbacks`` names those
  that had no rule); so do ``call_module`` nodes and functions that are not torch's (the
  exchanges with the controller of a forward with graph breaks);
* what leads to no region but only to the stage's outputs (a stage's last residual add,
  the final norm, the head and the loss) runs on whole tensors, as every value the stage
  outputs leaves whole. DTensor's rules are not all of one process's meaning there: its
  ``cross_entropy`` over rows split between the members, with ``ignore_index`` and a mean,
  averages the members' means (a Hugging Face loss on padded batches came out 1e-3 off).

The communication per region is the same bytes as the all-reduce (a reduce-scatter plus
an all-gather), and the values between regions, and what their ops keep for backward, are
``1/tp`` per member (:func:`orgel.costs.mesh.tp_costs` with ``sequence_parallel=True``
prices it so). The result is the single process's, to float32 rounding: the reduce-scatter
sums the partial row outputs in another order than an all-reduce, and a norm's weight
gradient is summed over the members' rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_leaves

from orgel.graph.tensor_parallel import Region
from orgel.runtime.compiled import is_exchange
from orgel.runtime.tensor_parallel import _Enter, _Leave, _method, _replicated, gathered, no_rule

#: ops whose result depends on a random draw: they run on whole tensors, as one process's
RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "randint",
          "randperm", "exponential", "geometric", "cauchy", "log_normal")


def sequence_dim(region: Region) -> int | None:
    """The dimension region ``region``'s row output is cut along between regions: the one
    before the features (the sequence of ``[batch, sequence, features]``, the tokens of
    ``[tokens, features]``); None where its shape is not known (the region stays plain)."""
    if region.row_shape is None or len(region.row_shape) < 2:
        return None
    return len(region.row_shape) - 2


def split_stages(stages: dict[int, Any], meshes: dict[int, DeviceMesh]) -> None:
    """Cut what the regions of this process's stages (``StageInfo`` by index, split by
    :func:`~orgel.runtime.tensor_parallel.shard_stages`; ``meshes``: each stage's TP mesh)
    leave whole along the sequence."""
    for s, info in stages.items():
        module = info.stage.module
        if isinstance(module, torch.fx.GraphModule) and info.tp_regions:
            split_sequence(module, meshes[s], info.tp_regions)


def split_sequence(module: torch.fx.GraphModule, mesh: DeviceMesh,
                   regions: list[Region]) -> None:
    """Rewrite ``module`` (whose ``regions`` :func:`~orgel.runtime.tensor_parallel.parallelize`
    split) to keep the values between regions cut along the sequence.
    ``module.tp_sequence_ran`` collects the nodes that ran on a member's slice and
    ``module.tp_sequence_fallbacks`` those that ran on whole tensors for want of a rule (both
    filled as they run)."""
    graph = module.graph
    leaves = {n.args[0].name: n for n in graph.nodes  # type: ignore[union-attr]
              if n.op == "call_function" and isinstance(n.target, _Leave)}
    fallbacks: list[str] = []
    ran: set[str] = set()
    module.tp_sequence_fallbacks = fallbacks  # type: ignore[assignment]
    module.tp_sequence_ran = ran  # type: ignore[assignment]
    inside = {name for r in regions for name in (*r.columns, *r.inner, r.row)}
    starts = {leaves[r.row]: dim for r in regions
              if r.row in leaves and (dim := sequence_dim(r)) is not None}
    # every node reached from a row output, up to the regions (their enter nodes gather)
    reached: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set(starts)
    todo = list(starts)
    while todo:
        for user in list(todo.pop().users):
            if user in seen or user.name in inside or _enters(user):
                continue
            seen.add(user)
            reached.append(user)
            if user.op in ("call_function", "call_method"):
                todo.append(user)
    # of those, the torch ops on the way to a region run on slices; what only leads to the
    # stage's outputs (the last layer's tail, the head, the loss) takes whole tensors
    feeding = _feeding_regions(graph)
    on_slices = {n for n in reached if n in feeding and (n.op == "call_method"
                 or (n.op == "call_function" and _torch_op(n.target)))}
    for leave, dim in starts.items():
        if any(user in on_slices for user in leave.users):
            leave.target = _LeaveSliced(mesh, dim)
    for node in reached:
        if node in on_slices:
            fn = _method(str(node.target)) if node.op == "call_method" else node.target
            node.op, node.target = "call_function", _OnSlices(fn, node.name,  # type: ignore[arg-type]
                                                              fallbacks, ran)
            continue
        for source in [n for n in node.all_input_nodes if n in on_slices or n in starts]:
            with graph.inserting_before(node):
                whole = graph.call_function(gathered, (source,))
            node.replace_input_with(source, whole)
    graph.lint()
    module.recompile()


def _feeding_regions(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes a region's input is computed from (the regions' enter nodes' ancestors).

    Not through an exchange with the controller of a forward with graph breaks: what it
    returns the controller computed, from whole tensors; what only goes to it (a value the
    Python between graphs reads, ``h.abs().amax().item()``) runs on whole tensors too.
    On slices, the backward of DTensor's ``amax`` turned the zero gradient of such a value
    (no loss reaches it) into NaN on the member whose slice did not hold the maximum."""
    found: set[torch.fx.Node] = set()
    todo = [n for n in graph.nodes if _enters(n)]
    while todo:
        node = todo.pop()
        if is_exchange(node):
            continue
        for source in node.all_input_nodes:
            if source not in found:
                found.add(source)
                todo.append(source)
    return found


def _torch_op(target: Any) -> bool:
    """Whether ``target`` is one of torch's (or Python's ``operator``) functions, which
    DTensor runs with the whole tensor's meaning; any other function (one of the model's
    own, the exchange with a controller of :mod:`orgel.graph.glue`) takes whole tensors."""
    module = getattr(target, "__module__", None) or ""
    return module in ("torch", "_operator", "operator", "math") or module.startswith("torch.")


def _enters(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, _Enter)


class _LeaveSliced:
    """The row output, summed over the members and cut along ``dim`` (a reduce-scatter)."""

    def __init__(self, mesh: DeviceMesh, dim: int) -> None:
        self.mesh = mesh
        self.dim = dim
        self.__name__ = "tp_leave_sliced"

    def __call__(self, y: Any) -> Any:
        if not isinstance(y, DTensor):
            return y
        return y.redistribute(self.mesh, [Shard(self.dim)])


class _OnSlices:
    """One op downstream of a sliced row output: on the members' slices (DTensor), or on
    whole tensors where it draws random numbers or DTensor has no rule for it."""

    def __init__(self, fn: Callable[..., Any], what: str, fallbacks: list[str],
                 ran: set[str]) -> None:
        self.fn = fn
        self.what = what
        self.fallbacks = fallbacks
        self.ran = ran
        name = getattr(fn, "__name__", what)
        self.__name__ = name
        self.whole = any(word in name for word in RANDOM)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            return self.fn(*args, **kwargs)
        if not self.whole:
            try:
                out = self.fn(*_replicated(args), **_replicated(kwargs))
                if any(isinstance(a, DTensor) and any(isinstance(p, Shard) for p in a.placements)
                       for a in tree_leaves((args, kwargs))):
                    self.ran.add(self.what)  # on this member's slice
                return out
            except (NotImplementedError, RuntimeError) as exc:
                if not no_rule(exc):
                    raise
                self.whole = True
                self.fallbacks.append(self.what)
        return self.fn(*gathered(args), **gathered(kwargs))




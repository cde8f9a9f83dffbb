"""The op graph: a captured fx graph of the forward plus measured facts per node.

Every value in the graph has a name: a model input is named by its keyword in
the model's signature, every other value by the fx node that computes it.
Parameters and buffers are not values: nodes read them by qualified name in the
original model (a tied parameter has one name and several readers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree


class CaptureError(RuntimeError):
    """The model could not be captured as one graph; the message says why and what to try."""


class GraphBreakError(CaptureError):
    """TorchDynamo hit a graph break: the message names the reason and the source line."""


@dataclass
class OpNode:
    """One operation of the forward and what it costs.

    ``inputs`` names the values it reads (other nodes or model inputs),
    ``params`` the parameters/buffers it reads; ``nbytes``/``shape``/``dtype``
    describe its output (``shape`` is None when the output is not one tensor);
    ``saved_bytes`` is what autograd kept for backward when it ran (measured,
    not guessed; parameters and storages already counted by an earlier node are
    left out); ``flops`` counts matmul/conv/attention FLOPs, or one per output
    element for other ops; ``grad_enabled`` is the grad mode it ran under and
    ``autocast`` the arguments of the autocast regions around it (outermost first,
    as passed to ``torch.amp.autocast_mode._enter_autocast``).
    An in-place node (``mutates`` set) is, for every later reader, the new
    version of the value it overwrote: capture rewires those readers to it.
    """

    name: str
    op: str
    module: str
    inputs: tuple[str, ...]
    params: tuple[str, ...] = ()
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    nbytes: int = 0
    param_bytes: int = 0
    flops: int = 0
    saved_bytes: int = 0
    requires_grad: bool = False
    is_tensor: bool = True
    grad_enabled: bool = True
    autocast: tuple[tuple[Any, ...], ...] = ()
    source: str = ""
    constant: Any = None  # the output itself when it holds no tensors (sizes, ints)
    mutates: str | None = None  # the value this node overwrites in place (``x.add_(y)``)


@dataclass
class OutputSpec:
    """How the model's output structure is rebuilt from named values.

    ``leaves[i]`` is ``("value", name)`` for a tensor the graph produces (or a
    model input passed through) and ``("const", obj)`` for anything else.
    """

    treespec: Any
    leaves: list[tuple[str, Any]]

    @property
    def value_names(self) -> list[str]:
        """Distinct value names the output needs, in leaf order."""
        names: list[str] = []
        for kind, payload in self.leaves:
            if kind == "value" and payload not in names:
                names.append(payload)
        return names


class Unflatten:
    """Rebuild the model's output object from the tensors named in ``names`` (that order)."""

    def __init__(self, spec: OutputSpec, names: list[str]) -> None:
        self.spec = spec
        self.names = list(names)

    def __call__(self, tensors: list[torch.Tensor]) -> Any:
        if len(tensors) != len(self.names):
            raise ValueError(f"expected {len(self.names)} output tensors, got {len(tensors)}")
        by_name = dict(zip(self.names, tensors, strict=True))
        leaves = [by_name[p] if k == "value" else p for k, p in self.spec.leaves]
        return pytree.tree_unflatten(leaves, self.spec.treespec)


def held_bytes(name: str, *tables: dict[str, Any]) -> int:
    """Bytes of what the first of ``tables`` that has ``name`` holds under it: a parameter,
    buffer or constant; 0 for one that is no tensor (the forward and backward graphs of an
    autograd Function the model calls are constants of the captured graph) or is nowhere."""
    for table in tables:
        if name in table:
            t = table[name]
            return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0
    return 0


@dataclass
class OpGraph:
    """A captured forward: the fx graph, its nodes' facts and how to rebuild the output.

    ``graph_module`` has one placeholder per model input (named like the input),
    per parameter/buffer (see ``attr_of``) and per lifted constant.
    ``nodes`` holds the compute nodes in a topological order (the graph's own
    order); structural nodes (grad-mode switches, autocast entries and exits) are
    left out of ``nodes`` and recorded as each node's ``grad_enabled`` and
    ``autocast`` instead, so that a stage re-enters the regions it starts in.
    """

    graph_module: torch.fx.GraphModule
    nodes: dict[str, OpNode]
    model_inputs: list[str]
    params: dict[str, torch.nn.Parameter]
    buffers: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]
    attr_of: dict[str, str]
    output_spec: OutputSpec
    method: str
    aliases: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # buffers the forward updates in place
    #: a forward Dynamo captured as several graphs, joined (:class:`orgel.graph.glue.Glue`)
    glue: Any = None
    #: size placeholders (symbolic capture): name -> (model input, dim) it is the size of
    sizes: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: graph nodes computing sizes from ``sizes`` (no OpNodes): each stage recomputes them
    size_nodes: list[str] = field(default_factory=list)
    #: the input sizes the graph takes (:class:`orgel.graph.sizes.Shapes`)
    shapes: Any = None
    #: each tensor value's shape in the size symbols (ints and sympy expressions)
    symbolic_shapes: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: the outputs the loss takes a gradient from (None: every output, as where the loss
    #: is the caller's); set by :func:`orgel.flow.capture.capture_microbatch`
    loss_reads: frozenset[str] | None = None

    def carries_grad(self) -> set[str]:
        """The values a gradient reaches in the backward: those that require grad and lead,
        through values that require grad too, to an output the loss reads
        (:attr:`loss_reads`). Any other value gets no gradient in one process, so a stage
        boundary that it crosses sends none back, and the parameters that only it reads
        keep no gradient, as one process leaves them."""
        names = [*self.model_inputs, *self.nodes]
        if any(n.mutates and n.requires_grad for n in self.nodes.values()):
            # an in-place op passes gradients to what its users read by another name (a
            # view's base): every value counts, as a boundary then sends one for each
            return set(names)
        users = self.users()
        reached = set(self.outputs if self.loss_reads is None else self.loss_reads)
        for name in reversed(names):
            node = self.nodes.get(name)
            grad = node.requires_grad if node is not None else True  # inputs: as given
            if grad and any(u in reached for u in users.get(name, ())):
                reached.add(name)
        return reached

    @property
    def outputs(self) -> list[str]:
        """The value names the model's output is built from."""
        return self.output_spec.value_names

    def users(self) -> dict[str, list[str]]:
        """For each value (node or model input), the compute nodes that read it."""
        result: dict[str, list[str]] = {name: [] for name in self.model_inputs}
        for name in self.nodes:
            result[name] = []
        for node in self.nodes.values():
            for src in node.inputs:
                result[src].append(node.name)
        return result

    def param_users(self) -> dict[str, list[str]]:
        """For each parameter/buffer/constant, the nodes that read it (tied: several)."""
        result: dict[str, list[str]] = {}
        for node in self.nodes.values():
            for p in node.params:
                result.setdefault(p, []).append(node.name)
        return result

    def tensor_bytes(self, name: str) -> int:
        """Bytes of one parameter, buffer or constant (:func:`held_bytes`)."""
        return held_bytes(name, self.params, self.buffers, self.constants)

    def unflatten(self, names: list[str]) -> Callable[[list[torch.Tensor]], Any]:
        """A callable rebuilding the model's output from tensors named ``names``."""
        return Unflatten(self.output_spec, names)

    def summary(self) -> dict[str, int]:
        """Totals: nodes, parameter bytes, saved-activation bytes, FLOPs."""
        return {
            "nodes": len(self.nodes),
            "params": len(self.params),
            "param_bytes": sum(self.tensor_bytes(p) for p in self.params),
            "buffer_bytes": sum(self.tensor_bytes(b) for b in self.buffers),
            "saved_bytes": sum(n.saved_bytes for n in self.nodes.values()),
            "flops": sum(n.flops for n in self.nodes.values()),
        }


def tuple_of(opgraph: OpGraph, node: OpNode) -> str | None:
    """The name of the tuple-valued node that ``node`` takes an item of (a getitem), or
    None. A tuple is not sent between stages: its items run where it is computed."""
    if node.op != "getitem" or len(node.inputs) != 1:
        return None
    src = opgraph.nodes.get(node.inputs[0])
    if src is None or src.is_tensor or src.constant is not None:
        return None
    return str(src.name)


def tuple_spans(graph: OpGraph, position: dict[str, int]) -> list[tuple[int, int]]:
    """``(producer, last getitem)`` positions of each tuple-valued node: no stage boundary
    may fall inside one, as a tuple is not sent and its getitems run where it runs
    (:func:`orgel.split.split.split_model`): a stage or block of such getitems alone
    would be empty."""
    last: dict[str, int] = {}
    for node in graph.nodes.values():
        src = tuple_of(graph, node)
        if src is not None and src in position and node.name in position:
            last[src] = max(last.get(src, 0), position[node.name])
    return [(position[src], hi) for src, hi in last.items() if hi > position[src]]

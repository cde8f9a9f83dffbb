"""Where a captured graph can be split for tensor parallelism: its column/row regions.

A *region* is the Megatron pattern read off the fx graph itself (linear ops and
what consumes them, never module names):

* one or more *column* linears (``F.linear`` / ``torch._C._nn.linear`` whose
  weight is a parameter: a placeholder or ``get_attr`` leaf; or ``torch.addmm(bias, x,
  weight)`` with a ``[in, out]`` weight, as Hugging Face GPT-2's ``Conv1D`` computes) that
  all read one common input, e.g. the q, k, v projections, a fused qkv, or an MLP's gate
  and up;
* the *inner* nodes computed from their outputs (views, rotary embedding,
  attention, the activation, ``gate * up``);
* one *row* linear (o_proj, down) that consumes all of it,

such that nothing the columns or the inner nodes produce is read anywhere but
inside the region or by the row linear, the region's weights are read by its
linears only, and the inner nodes read from outside only values without a gradient
(rotary tables, masks, sizes) and parameters: not a residual stream, which would
make a region of one layer's last linear and the next one's first. Sharding the
columns' weights by output features (``Shard(0)``, ``Shard(1)`` for an ``addmm``
weight; bias ``Shard(0)``) and the row's by input features (``Shard(1)``, ``Shard(0)``
for ``addmm``; bias replicated) then leaves the row output a
partial sum over the ``tp`` members: one all-reduce of the row output forward, and
one of the region input's gradient backward (:mod:`orgel.runtime.tensor_parallel`
runs it with DTensor).

For a planner: each region costs ``2 * region.allreduce_bytes()`` of all-reduce
per micro-batch (forward and backward, each over the ``tp`` processes), and its
``column_params`` and ``row_params`` (leaf node names: placeholders in a captured
graph, ``get_attr`` nodes in a stage module) are held ``1/tp`` per process, the
row bias excepted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the call targets that count as a linear layer
LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
#: ``addmm(bias, x, weight)``: a linear layer whose weight is stored ``[in, out]``
ADDMM_TARGETS = (torch.addmm, torch.ops.aten.addmm.default)


@dataclass(frozen=True)
class Region:
    """One column/row region of an fx graph (node names; see the module docstring).

    ``input``: the node all ``columns`` read; ``inner``: the nodes between the
    columns and ``row``, in graph order; ``column_params``: the columns' weight and
    bias leaves (sharded along dim 0); ``row_weight`` (sharded along dim 1) and
    ``row_bias`` (replicated, or None); ``row_shape``/``row_dtype``: the row
    output's shape (the sizes it was captured with) and dtype, from node meta
    (None where the meta holds none).
    """

    input: str
    columns: tuple[str, ...]
    inner: tuple[str, ...]
    row: str
    column_params: tuple[str, ...]
    row_weight: str
    row_bias: str | None
    row_shape: tuple[int, ...] | None = None
    row_dtype: str | None = None
    #: the weights (leaf names) stored ``[in, out]`` (``addmm``): their dims swap
    transposed: tuple[str, ...] = ()

    def weight_dim(self, leaf: str, column: bool) -> int:
        """The dimension ``leaf`` is split along: output features for a column's weight and
        bias, input features for the row's weight."""
        if leaf not in self.transposed:
            return 0 if column else 1
        return 1 if column else 0

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node of the region: columns, inner nodes and the row linear."""
        return self.columns + self.inner + (self.row,)

    @property
    def row_params(self) -> tuple[str, ...]:
        """The row linear's weight and bias leaves (the bias stays whole on every member)."""
        return (self.row_weight,) + ((self.row_bias,) if self.row_bias else ())

    def allreduce_elements(self) -> int:
        """Elements of the row output: what one all-reduce (forward, or backward) moves."""
        if self.row_shape is None:
            raise ValueError(f"region {self.row}: the graph's node meta has no output shape")
        return math.prod(self.row_shape)

    def allreduce_bytes(self) -> int:
        """Bytes of the row output (:meth:`allreduce_elements` times its element size)."""
        dtype = getattr(torch, self.row_dtype or "float32")
        return self.allreduce_elements() * torch.empty((), dtype=dtype).element_size()


def is_linear(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a linear op whose weight (and bias) are graph leaves (parameters)."""
    if node.op != "call_function":
        return False
    if node.target in ADDMM_TARGETS:  # addmm(bias, x, weight), beta = alpha = 1
        return (len(node.args) == 3 and not node.kwargs and _leaf(node.args[0])
                and _leaf(node.args[2]))
    if node.target not in LINEAR_TARGETS:
        return False
    weight = _arg(node, 1, "weight")
    bias = _arg(node, 2, "bias")
    return _leaf(weight) and (bias is None or _leaf(bias)) and not node.kwargs.keys() - {
        "input", "weight", "bias"}


def linear_parts(node: torch.fx.Node) -> tuple[object, object, object]:
    """A linear node's ``(input, weight, bias)`` arguments (bias None where it has none)."""
    if node.target in ADDMM_TARGETS:
        return node.args[1], node.args[2], node.args[0]
    return _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 2, "bias")


def tp_regions(gm: torch.fx.GraphModule,
               requires_grad: Mapping[str, bool] | None = None) -> list[Region]:
    """The column/row regions of ``gm`` (captured or a stage module), in graph order.

    ``requires_grad``: for a stage module, whose placeholders have no node meta, which
    of its inputs carry a gradient (``SplitModel.requires_grad``; inputs it leaves out
    carry none: model inputs, sizes).

    Regions never overlap: a linear is the column of at most one region and the
    row of at most one. Linears that fit no region (an LM head, an embedding
    projection, a column whose output escapes) stay whole.
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    groups: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        source = linear_parts(n)[0] if is_linear(n) else None
        if isinstance(source, torch.fx.Node):
            groups.setdefault(source, []).append(n)
    regions: list[Region] = []
    used: set[torch.fx.Node] = set()
    for source, columns in sorted(groups.items(), key=lambda kv: order[kv[0]]):
        if any(c in used for c in columns):
            continue
        region = _region(source, columns, order, requires_grad or {})
        if region is None or any(n in used for n in region):
            continue
        used.update(region)
        regions.append(_describe(source, columns, region, order))
    return sorted(regions, key=lambda r: order[_by_name(nodes, r.row)])


def _region(source: torch.fx.Node, columns: list[torch.fx.Node],
            order: dict[torch.fx.Node, int],
            requires_grad: Mapping[str, bool]) -> list[torch.fx.Node] | None:
    """The columns' region (columns, inner nodes, row last), or None where there is none."""
    reached: set[torch.fx.Node] = set()
    stack = [u for c in columns for u in c.users]
    while stack:
        n = stack.pop()
        if n in reached or n.op == "output":
            continue
        reached.add(n)
        if not is_linear(n):
            stack.extend(n.users)
    rows = sorted((n for n in reached if is_linear(n)), key=order.__getitem__)
    for row in rows:
        inner = _between(columns, row, reached)
        inside = set(columns) | inner
        row_input = linear_parts(row)[0]
        if not isinstance(row_input, torch.fx.Node) or row_input not in inside:
            continue
        if not all(_reaches(c, inside | {row}) for c in columns):
            continue
        if any(u not in inside and u is not row for n in inside for u in n.users):
            continue
        if _weights_escape(columns + [row], inside | {row}):
            continue
        if any(is_linear(n) for n in inner) or _reads_gradients(inner, inside, requires_grad):
            continue
        return sorted(columns, key=order.__getitem__) + sorted(inner, key=order.__getitem__) + [row]
    return None


def _between(columns: list[torch.fx.Node], row: torch.fx.Node,
             reached: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes that descend from a column and that ``row`` depends on."""
    inner: set[torch.fx.Node] = set()
    stack = [a for a in row.all_input_nodes]
    columns_set = set(columns)
    while stack:
        n = stack.pop()
        if n in inner or n in columns_set or n not in reached:
            continue
        inner.add(n)
        stack.extend(n.all_input_nodes)
    return inner


def _reaches(column: torch.fx.Node, inside: set[torch.fx.Node]) -> bool:
    """Whether every user of ``column`` is in ``inside`` (each column feeds the row)."""
    return bool(column.users) and all(u in inside for u in column.users)


def _reads_gradients(inner: set[torch.fx.Node], inside: set[torch.fx.Node],
                     requires_grad: Mapping[str, bool]) -> bool:
    """Whether an inner node reads, from outside the region, a computed value that carries
    a gradient (a residual stream: the region would then span two layers); rotary tables,
    masks, sizes and parameters are fine."""
    for n in inner:
        for a in n.all_input_nodes:
            if a in inside or a.op == "get_attr":
                continue
            value = a.meta.get("example_value", a.meta.get("val"))
            grad = (value.requires_grad if isinstance(value, torch.Tensor)
                    else requires_grad.get(a.name, False))
            if grad and not _leaf_param(a):
                return True
    return False


def _leaf_param(node: torch.fx.Node) -> bool:
    """A placeholder that is a parameter of a captured graph (Dynamo names them so)."""
    return node.op == "placeholder" and "_parameters_" in node.name


def _weights_escape(linears: list[torch.fx.Node], inside: set[torch.fx.Node]) -> bool:
    """Whether a region weight or bias is read outside the region (a tied parameter)."""
    for lin in linears:
        for leaf in linear_parts(lin)[1:]:
            if isinstance(leaf, torch.fx.Node) and any(u not in inside for u in leaf.users):
                return True
    return False


def _describe(source: torch.fx.Node, columns: list[torch.fx.Node], region: list[torch.fx.Node],
              order: dict[torch.fx.Node, int]) -> Region:
    row = region[-1]
    cols = region[:len(columns)]
    params: list[str] = []
    transposed: list[str] = []
    for lin in cols + [row]:
        weight = linear_parts(lin)[1]
        if lin.target in ADDMM_TARGETS and isinstance(weight, torch.fx.Node):
            transposed.append(weight.name)
    for c in cols:
        params.extend(leaf.name for leaf in linear_parts(c)[1:]
                      if isinstance(leaf, torch.fx.Node))
    _, row_weight, bias = linear_parts(row)
    assert isinstance(row_weight, torch.fx.Node)
    shape, dtype = _meta(row)
    return Region(input=source.name, columns=tuple(c.name for c in cols),
                  inner=tuple(n.name for n in region[len(columns):-1]), row=row.name,
                  column_params=tuple(params), row_weight=row_weight.name,
                  row_bias=bias.name if isinstance(bias, torch.fx.Node) else None,
                  row_shape=shape, row_dtype=dtype, transposed=tuple(transposed))


def _meta(node: torch.fx.Node) -> tuple[tuple[int, ...] | None, str | None]:
    """A node's output shape (captured sizes, symbolic ones by their hint) and dtype name."""
    value = node.meta.get("example_value", node.meta.get("val", node.meta.get("tensor_meta")))
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None:
        return None, None
    dims: list[int] = []
    for d in shape:
        if isinstance(d, torch.SymInt):
            hint = d.node.hint if d.node.has_hint() else None
            if hint is None:
                return None, str(dtype).removeprefix("torch.") if dtype else None
            dims.append(int(hint))
        else:
            dims.append(int(d))
    return tuple(dims), str(dtype).removeprefix("torch.") if dtype else None


def _arg(node: torch.fx.Node, index: int, name: str) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def _leaf(value: object) -> bool:
    return isinstance(value, torch.fx.Node) and value.op in ("placeholder", "get_attr")


def _by_name(nodes: list[torch.fx.Node], name: str) -> torch.fx.Node:
    return next(n for n in nodes if n.name == name)

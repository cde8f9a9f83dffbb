"""Symbolic sizes for a forward of several graphs: which model input dimension each size is.

A forward with graph breaks (:mod:`orgel.graph.glue`) is captured with the example
batch's sizes symbolic wherever Dynamo meets them (:func:`glue_settings`), so its graphs,
and the stages split from them, take batches of other sizes, as a one-graph capture does
(:mod:`orgel.graph.sizes`).

Dynamo compiles each graph in its own frame (the model's ``forward``, then each resume
function after a break), each with its own size symbols, which nothing ties to the model's
inputs: a later graph's ``s47`` is the hidden state's first dimension, and only its value
says that it is the batch's rows. So each size a later graph takes is bound to a model
input dimension of the same size in the captured batch (one of an input the graph itself
takes, else one at the same position first), and the controller checks at every graph
call, on the real micro-batch, that the size it passes is still that dimension's
(:attr:`orgel.graph.glue.Call.roles`); where it is not, that micro-batch leaves the
captured path and runs in the controller, as any other deviation does. The tensors the
Python between graphs hands over are bound the same way, dimension by dimension
(:attr:`orgel.graph.glue.Call.shapes`). An int no input dimension matches (a product,
``rows * tokens``, or a number the code passes on) is checked as a number: a micro-batch
where it differs runs in the controller. A graph that returns a size, or size arithmetic
that reads a tensor, makes the capture static instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from orgel.graph.opgraph import CaptureError
from orgel.graph.sizes import (
    Shapes,
    _expr,
    _sizes_from_symbols,
    input_shapes,
    is_symbolic,
    size_settings,
)


def size_values(named: dict[str, Any]) -> tuple[int, ...]:
    """The example batch's sizes (each dimension of each model input but 0): what
    :func:`glue_settings` marks dynamic wherever Dynamo meets it. A size of 1 (a micro-batch
    of one row) too: Dynamo's sizes are size-oblivious there, so it is not fixed."""
    return tuple(sorted({int(n) for t in named.values() if isinstance(t, torch.Tensor)
                         for n in t.shape if n > 0}))


@contextlib.contextmanager
def glue_settings(values: tuple[int, ...]) -> Iterator[None]:
    """Dynamo's settings while a forward of several graphs is captured, and while the
    controller compiles it again (``torch.compile(dynamic=None)`` both): every tensor
    dimension and every int a frame takes whose value is one of the example batch's sizes
    ``values`` (:func:`size_values`) is symbolic from the first compile, one symbol each (no
    duck sizing), in every frame, the resumed ones after a break included
    (``torch.compiler.config.dynamic_values``, made for graph breaks), size-oblivious as a
    one-graph capture's (:func:`orgel.graph.sizes.size_settings`: a graph found on one row
    takes more, and one found on more rows takes one); parameters stay
    static, and a float (a value read off a tensor with ``.item()``) turns symbolic at its
    first change, as under ``dynamic=None`` alone. A no-op without ``values`` (a static
    capture). Dynamo's settings are the calling thread's."""
    if not values:
        yield
        return
    with (size_settings(True),
          torch.compiler.config.patch(  # type: ignore[attr-defined]
              dynamic_values=",".join(str(v) for v in values))):
        yield


@contextlib.contextmanager
def capture_settings(values: tuple[int, ...]) -> Iterator[None]:
    """:func:`glue_settings` while a forward of several graphs is captured; without
    ``values`` (a static capture) static whatever Dynamo learned of the model's frames
    before in this process: with its automatic dynamic shapes on, a frame the caller had
    run on other shapes (a compiled evaluation first, another model of the same class)
    took symbolic sizes, which a static capture cannot join, and the capture was refused.
    Only the capture: the controller's later compiles keep Dynamo's defaults."""
    if values:
        with glue_settings(values):
            yield
        return
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


#: placeholder meta: an int Dynamo left symbolic that is a number of the model's, not a size
FIXED_INT = "orgel_fixed_int"


def mark_fixed_ints(gm: torch.fx.GraphModule) -> None:
    """Mark each int placeholder of a graph Dynamo just compiled that it read off an object
    (an attribute: a module's ``n_heads``, a config's, a global), not off a tensor's shape,
    a frame's local or an item of one; call it in the ``torch.compile`` backend, while
    Dynamo's sources are on the graph. :func:`glue_settings` makes every int of a batch
    size's value symbolic, so a head count equal to the rows became a graph argument, was
    bound to the rows (:func:`size_roles`) and changed with them; marked, it is checked as
    the number it is."""
    from torch._dynamo.source import AttrSource, GlobalSource, TensorPropertySource

    for node in gm.graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("example_value"),
                                                      torch.SymInt):
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        fixed = False
        while source is not None:
            if isinstance(source, TensorPropertySource):
                fixed = False
                break
            fixed = fixed or isinstance(source, AttrSource | GlobalSource)
            source = getattr(source, "base", None)
        if fixed:
            node.meta[FIXED_INT] = True


def size_roles(calls: list[tuple[torch.fx.GraphModule, list[Any], list[Any],
                                 list[tuple[str, Any] | None]]],
               named: dict[str, Any],
               probe: Callable[[int], list[list[Any]] | None] | None = None
               ) -> dict[tuple[int, int], tuple[Any, ...]]:
    """Give each size argument of each graph call its role, in place; return the dimensions
    of each tensor argument the Python between graphs hands over.

    ``calls``: ``(graph, arguments, outputs, roles)`` as :func:`orgel.graph.glue.join_calls`
    takes them. A size argument's role becomes ``("size", (input, dim))``, ``("number", n)``
    where a guard fixed it or no input dimension has its size (an int the Python between
    graphs passes on: the controller checks it stays ``n``), or ``("unused", n)`` where no
    op reads it. Each graph's ``x.size()`` calls are rewritten to its size placeholders
    first. The result maps ``(call, argument)`` to that argument's
    dimensions: a size (fixed), ``(input, dim)`` (that model input dimension), or None (any).

    A size no tensor of the graph's own model inputs has is bound by its value alone, which
    a number of the model's can share (a head count passed on in a local variable, equal to
    the rows). ``probe(value)``, where given, is the calls' arguments on the example with
    every input dimension of that size one longer (None where that forward cannot be had):
    an int or a dimension it leaves at ``value`` is a number, not that size.
    """
    inputs = [(name, t) for name, t in named.items() if isinstance(t, torch.Tensor)]
    read = {id(t): name for name, t in inputs}
    dims: dict[tuple[int, int], tuple[Any, ...]] = {}
    for c, (gm, args, _, roles) in enumerate(calls):
        _sizes_from_symbols(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, (node, value) in enumerate(zip(placeholders, args, strict=True)):
            example = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and roles[i] is None:
                dims[(c, i)] = tuple(
                    _bind(int(n), d, inputs)
                    if _free(size) and not _stays(probe, int(n), c, i, d) else int(n)
                    for d, (n, size) in enumerate(zip(value.shape, example.shape,
                                                      strict=True)))
            if isinstance(value, torch.Tensor) or roles[i] is not None:
                continue
            if not isinstance(value, int):
                raise CaptureError(f"graph {c} of the forward takes a {type(value).__name__}")
            if not node.users:  # a size no op reads: any
                roles[i] = ("unused", value)
            elif not _free(example) or node.meta.get(FIXED_INT):  # a guard fixed it,
                roles[i] = ("number", value)  # or the model's code holds it (mark_fixed_ints)
            else:  # a size, or an int the Python between graphs passes (checked as a number)
                found, own = _input_dim(node, value, placeholders, args, read, inputs)
                if found is None or (not own and _stays(probe, value, c, i)):
                    roles[i] = ("number", value)
                else:
                    roles[i] = ("size", found)
    return dims


def _stays(probe: Callable[[int], list[list[Any]] | None] | None, value: int, c: int,
           i: int, d: int | None = None) -> bool:
    """Whether argument ``i`` of call ``c`` (its dimension ``d``, for a tensor) keeps
    ``value`` on the probe where the input dimensions of that size grew."""
    got = None if probe is None else probe(value)
    if got is None:
        return False
    arg = got[c][i]
    if d is None:
        return isinstance(arg, int) and arg == value
    return isinstance(arg, torch.Tensor) and d < arg.dim() and int(arg.shape[d]) == value


def _free(size: Any) -> bool:
    """Whether a fake size is a symbol no guard fixed."""
    if not isinstance(size, torch.SymInt):
        return False
    expr = _expr(size)
    return not isinstance(expr, int) and not getattr(expr, "is_number", False)


def _bind(value: int, d: int, inputs: list[tuple[str, torch.Tensor]]) -> tuple[str, int] | None:
    """The model input dimension of size ``value``: one at the same position ``d`` first."""
    for name, t in inputs:
        if d < t.dim() and int(t.shape[d]) == value:
            return name, d
    for name, t in inputs:
        for k, size in enumerate(t.shape):
            if int(size) == value:
                return name, k
    return None


def _input_dim(node: torch.fx.Node, value: int, placeholders: list[torch.fx.Node],
               args: list[Any], read: dict[int, str],
               inputs: list[tuple[str, torch.Tensor]]
               ) -> tuple[tuple[str, int] | None, bool]:
    """The model input dimension that size placeholder ``node`` (``value`` now) stands for:
    that of a model input the graph takes, else one of the same size, at the position the
    size has in the tensor it is read off first; None where no input dimension has it.
    With whether it is one of a model input the graph takes (else bound by value alone)."""
    symbol = _expr(node.meta["example_value"])
    position: int | None = None
    for other, t in zip(placeholders, args, strict=True):
        fake = other.meta.get("example_value")
        if not isinstance(fake, torch.Tensor):
            continue
        at = [d for d, size in enumerate(fake.shape)
              if isinstance(size, torch.SymInt) and _expr(size) == symbol]
        if at and id(t) in read:
            return (read[id(t)], at[0]), True
        if at and position is None:
            position = at[0]
    return _bind(value, position or 0, inputs), False


def check_size_nodes(graph: torch.fx.Graph, sizes: set[torch.fx.Node]) -> None:
    """Raise :class:`CaptureError` where size arithmetic reads a tensor (a split recomputes
    size nodes in every stage from the size placeholders ``sizes`` only)."""
    known = set(sizes)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method") and \
                is_symbolic(node.meta.get("example_value")):
            if any(n not in known for n in node.all_input_nodes):
                raise CaptureError(f"size node {node.name} reads a tensor")
            known.add(node)


def glue_shapes(named: dict[str, Any], gm: torch.fx.GraphModule,
                roles: list[tuple[str, Any] | None]) -> Shapes:
    """The sizes the joined graph takes (:class:`~orgel.graph.sizes.Shapes`): any size along
    every dimension of every model input, except where graph 0 (``gm``, its placeholders'
    ``roles``) reads that input with the dimension fixed.

    The sizes' relations (labels as long as the inputs) are not checked here: a later
    graph that depends on one has its size argument checked at its call, and Dynamo's
    guards in the controller hold the rest (a micro-batch that breaks one runs there).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = input_shapes({role[1]: node for node, role in zip(placeholders, roles, strict=True)
                          if role is not None and role[0] == "input"}).inputs
    return Shapes({name: tuple(size if isinstance(size, int) else f"{name}.{d}"
                               for d, size in enumerate(fixed.get(name, (None,) * t.dim())))
                   for name, t in named.items() if isinstance(t, torch.Tensor)})


def expected_shape(dims: tuple[Any, ...], sizes: dict[str, tuple[int, ...]]
                   ) -> tuple[int | None, ...]:
    """A glue argument's shape for a micro-batch whose model inputs have shapes ``sizes``:
    its dimensions (:attr:`orgel.graph.glue.Call.shapes`) evaluated; None where any size."""
    return tuple(sizes[d[0]][d[1]] if isinstance(d, tuple) else d for d in dims)


def stretched(value: torch.Tensor, dims: tuple[Any, ...],
              sizes: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """``value`` (recorded at capture) cut or repeated along each dimension bound to a model
    input dimension to that dimension's size in ``sizes``: a stand-in the ranks can run on
    in place of a micro-batch's own argument (:mod:`orgel.explicit.fallback`)."""
    for d, size in enumerate(expected_shape(dims, sizes)):
        if size is not None and size != value.shape[d]:
            value = value.index_select(d, torch.arange(size, device=value.device) % value.shape[d])
    return value

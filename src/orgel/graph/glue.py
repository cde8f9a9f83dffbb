"""A forward Dynamo captures as several graphs, made one graph with exchange points.

When a forward has graph breaks (a Python branch on a tensor's value,
``.item()``, a NumPy call), Dynamo compiles it as several graphs with Python
("glue") running between them. A graph that reads no parameter or buffer is a
pure function of its arguments and counts as glue (so it may differ from one
micro-batch to the next). :func:`~orgel.graph.glue_capture.capture_graphs` runs the forward once,
records which of the other graphs ``0 .. K-1`` runs in which order and what
each reads, and joins them into one fx graph:

```
inputs ─▶ graph 0 ─▶ exchange(1) ─▶ graph 1 ─▶ exchange(2) ─▶ ... ─▶ graph K-1 ─▶ outputs, anchor
```

``exchange(c)`` is the point where the glue runs: it takes graph ``c-1``'s
outputs and returns what graph ``c`` reads that is not a parameter or a buffer
(values the glue computed, or passed along from earlier graphs). Split and
planned like any other node, it lives in one stage. In training it sends its
inputs to the controller, which runs the glue for that micro-batch and sends
back graph ``c``'s arguments; its backward sends the gradients of those
arguments and returns the controller's gradients of graph ``c-1``'s outputs
(:class:`RankExchange` on the ranks, :mod:`orgel.explicit.glued` in the controller).
While orgel measures and profiles the graph, it returns the values recorded
when the forward ran once.

Every exchange also passes on a scalar *anchor* (zero, requiring grad) from the
previous one, and the last anchor is a model output: the backward then reaches
every exchange, in the reverse order of the forward, on every rank, so that no
exchange waits for a gradient the controller can only send after a later one.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from orgel.graph.glue_sizes import check_size_nodes, glue_settings
from orgel.graph.opgraph import CaptureError
from orgel.graph.sizes import is_symbolic
from orgel.nesting import placeholder as input_placeholder

#: Values recorded when the forward ran once, by capture key: what exchanges return
#: while orgel measures and profiles the graph (the newest few captures are kept).
_EXAMPLES: OrderedDict[str, dict[int, list[torch.Tensor]]] = OrderedDict()
_KEEP = 32
_keys = itertools.count()
#: On a rank: the :class:`RankExchange` that talks to the controller (None elsewhere).
_RUNTIME: Any = None


class Layout(NamedTuple):
    """How a graph's output lay in memory at capture: a view's (or a non-contiguous
    tensor's) shape, strides and offset, and its base's shape and strides (None: no view)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    base: tuple[tuple[int, ...], tuple[int, ...]] | None

    @staticmethod
    def of(t: Any) -> Layout | None:
        """``t``'s layout where it is a view or not contiguous and its sizes are ints."""
        if not isinstance(t, torch.Tensor) or (t._base is None and t.is_contiguous()):
            return None
        try:
            base = None if t._base is None else (_ints(t._base.shape), _ints(t._base.stride()))
            return Layout(_ints(t.shape), _ints(t.stride()), int(t.storage_offset()), base)
        except TypeError:  # symbolic sizes
            return None

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` laid out so, where ``t`` has its shape (else a plain copy)."""
        if tuple(t.shape) != self.shape:
            return t.clone()
        # an expanded dimension (stride 0) holds one row of values
        repeated = [d for d, (n, s) in enumerate(zip(self.shape, self.strides, strict=True))
                    if s == 0 and n > 1]
        one = t
        for d in repeated:
            one = one.narrow(d, 0, 1)
        if self.base is None:
            holder = torch.empty_strided(one.shape, self.strides, dtype=t.dtype, device=t.device)
        else:
            holder = torch.empty_strided(*self.base, dtype=t.dtype, device=t.device)
        try:
            holder.as_strided(one.shape, self.strides, self.offset).copy_(one)
        except RuntimeError:  # elements that overlap otherwise
            return t.clone()
        if self.base is None:
            return holder.expand(self.shape) if repeated else holder
        return holder.as_strided(self.shape, self.strides, self.offset)


def _ints(sizes: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in sizes)


@dataclass
class Call:
    """One graph call of the forward: the graph's code and what each of its inputs is.

    ``roles[i]`` is ``("param", name)``, ``("buffer", name)``, ``("input", name)``
    (a model input, graph 0 only), ``("glue", j)``: the ``j``-th value its
    exchange hands over, or (symbolic capture) ``("size", (input, dim))``: a size
    argument, that model input dimension of the micro-batch, ``("number", n)`` (a size
    a guard fixed) or ``("unused", n)`` (a size no op reads).
    """

    code: str
    roles: list[tuple[str, Any]]
    outputs: int
    where: str = ""
    #: the glue arguments' shapes; with symbolic sizes a dimension may be ``(input, dim)``
    #: (that model input dimension of the micro-batch) or None (any size)
    shapes: list[tuple[Any, ...]] = field(default_factory=list)
    #: whether each glue argument carries a gradient on the ranks (it required one at
    #: capture): the ranks send back the gradients of these only (:func:`exchange`'s mask)
    carries: tuple[bool, ...] = ()
    #: whether each output required a gradient at capture (it depends on a parameter that
    #: trains): the controller's copy of an output that did not requires none either, so
    #: that the frames after the call meet the tensors Dynamo compiled them for
    differentiable: tuple[bool, ...] = ()
    #: the :class:`Layout` of each output that is a view or not contiguous at capture
    #: (``mask[:, 0, 0, :]``, ``x.t()``), else None: the controller lays its copy of such
    #: an output out alike (Dynamo's guards check strides and a view's base)
    layouts: tuple[Layout | None, ...] = ()

    @property
    def glue(self) -> list[int]:
        """Positions of the inputs the controller sends (in exchange order)."""
        return [i for i, (kind, _) in enumerate(self.roles) if kind == "glue"]


@dataclass
class Glue:
    """How a forward with graph breaks was joined: its graph calls, in order."""

    key: str
    calls: list[Call]
    reason: str  # Dynamo's graph break, as the single-graph capture reported it
    exchanges: dict[int, str] = field(default_factory=dict)  # call -> its exchange node
    #: parameters that code outside every graph trains (the Python between graphs, a module
    #: Dynamo ran eagerly, a custom Function's backward), by name; see
    #: :func:`orgel.split.exchanges.eager_homes`
    eager: list[str] = field(default_factory=list)
    #: ``(device type, dtype)`` of the autocast the forward ran under (mixed precision):
    #: the joined graph holds that region, and the Python between graphs runs in it
    region: tuple[str, torch.dtype] | None = None
    #: captured with symbolic sizes (:mod:`orgel.graph.glue_sizes`): the example batch's
    #: sizes, which the controller compiles symbolic too (:meth:`settings`); () if static
    values: tuple[int, ...] = ()

    @property
    def dynamic(self) -> bool:
        """Whether the forward was captured with symbolic sizes."""
        return bool(self.values)

    def settings(self) -> Any:
        """Dynamo's settings to compile the forward with, as it was captured."""
        return glue_settings(self.values)

    def autocast(self) -> Any:
        """The autocast the forward's Python between graphs runs under (a no-op without
        mixed precision), for every place that runs the forward in the controller."""
        return region_autocast(self.region)

    def has_exchange(self, c: int) -> bool:
        """Call ``c`` is preceded by an exchange (every call but a first one without glue)."""
        return c in self.exchanges


def region_autocast(region: tuple[str, torch.dtype] | None) -> Any:
    """``torch.autocast`` of a ``(device type, dtype)`` region; a no-op for None."""
    if region is None:
        return contextlib.nullcontext()
    return torch.autocast(region[0], dtype=region[1])


def exchange(key: str, c: int, mask: tuple[bool, ...], anchor: torch.Tensor | None,
             *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The glue point before graph ``c``: returns ``(anchor, *graph c's glue arguments)``.

    ``mask[j]`` says whether argument ``j`` carries a gradient. On a rank it
    asks the controller (:class:`RankExchange`); elsewhere it returns the
    values recorded by :func:`~orgel.graph.glue_capture.capture_graphs`.
    """
    if anchor is None:
        anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
    if _RUNTIME is not None:
        return _RUNTIME(c, mask, anchor, outs)
    recorded = _EXAMPLES.get(key)
    if recorded is None:
        raise CaptureError(f"the values recorded for exchange {c} of capture {key} are gone; "
                           "capture the model again")
    return _Recorded.apply(recorded[c], mask, anchor, *outs)


class _Recorded(torch.autograd.Function):
    """Exchange while measuring: the recorded arguments; zero gradients for the outputs."""

    @staticmethod
    def forward(ctx: Any, values: list[torch.Tensor], mask: tuple[bool, ...],
                anchor: torch.Tensor, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.like = [(o.shape, o.dtype, o.device, o.is_floating_point()) for o in outs]
        result = tuple(v.clone() for v in values)
        ctx.mark_non_differentiable(*[t for t, m in zip(result, mask, strict=True)
                                      if not (m and t.is_floating_point())])
        return (anchor.detach().clone(), *result)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        zeros = [torch.zeros(s, dtype=d, device=dev) if f else None for s, d, dev, f in ctx.like]
        return (None, None, None, *zeros)


def side_leaf(leaf: torch.Tensor) -> None:
    """Make ``leaf`` one of the present micro-batch's leaves on this rank (see
    :meth:`RankExchange.leaves`): a split backward's ``I`` walks towards it too."""
    if _RUNTIME is not None:
        _RUNTIME.add_leaf(leaf)


def pinned(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the exchanges' micro-batch fixed to the present one: a checkpoint runs
    a forward again in a backward, after other micro-batches' forwards (GPipe)."""
    runtime = _RUNTIME
    if runtime is None:
        return fn
    m = runtime.microbatch

    def run(*args: Any) -> Any:
        present, runtime.microbatch = runtime.microbatch, m
        try:
            return fn(*args)
        finally:
            runtime.microbatch = present
    return run


def set_runtime(runtime: Any) -> None:
    """Make ``exchange`` ask ``runtime`` (a rank's :class:`RankExchange`)."""
    global _RUNTIME
    _RUNTIME = runtime


class RankExchange:
    """A rank's side of the exchanges: talks to the controller through the rank's inbox.

    Messages are keyed ``(step, c, micro-batch)``: ``"x_out"`` (graph ``c-1``'s
    outputs, to the controller), ``"x_in"`` (graph ``c``'s glue arguments, from
    it), ``"x_ingrad"`` (their gradients, to it), ``"x_outgrad"`` (the gradients
    of graph ``c-1``'s outputs, from it). A recomputed forward reuses the
    arguments it got the first time.
    """

    def __init__(self, inbox: Any, device: torch.device) -> None:
        self.inbox = inbox
        self.device = device
        self.step = 0
        self.microbatch = -1  # set by the executor around each stage forward
        self._values: dict[tuple[int, int, int], list[Any]] = {}
        #: per micro-batch, the anchors that are leaves here (see :meth:`leaves`): a chain's
        #: start, or an anchor another stage sent (a stage input)
        self._anchors: dict[int, list[torch.Tensor]] = {}

    def begin(self, step: int) -> None:
        self.step = step
        self._values.clear()
        self._anchors.clear()

    def leaves(self, m: int) -> dict[str, torch.Tensor]:
        """The executor's ``side_leaves``: micro-batch ``m``'s anchors that are leaves here
        (a stage whose graph does not hold one gets no gradient for it: unused).

        Every exchange lies on the anchors' chain, so a backward that walks towards this
        leaf runs each exchange's backward, which the controller waits for, even where
        no input or parameter of the stage lies below the exchange (graph 0 makes the
        rotary tables from position ids, say). A split backward's ``I`` walks only
        towards its leaves: without this one it skipped such an exchange, and the
        controller and the ranks waited for each other until the timeout.
        """
        return {f"<exchange anchor {k}>": a for k, a in enumerate(self._anchors.get(m, ()))}

    def add_leaf(self, leaf: torch.Tensor) -> None:
        """A leaf of the present micro-batch's forward that :meth:`leaves` returns too."""
        self._anchors.setdefault(self.microbatch, []).append(leaf)

    def __call__(self, c: int, mask: tuple[bool, ...], anchor: torch.Tensor,
                 outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        key = (self.step, c, self.microbatch)
        if key not in self._values:
            if c > 0:
                self.inbox.send(("x_out", key, [o.detach().cpu() for o in outs]))
            self._values[key] = self.inbox.get("x_in", key)
        values = [v.to(self.device) for v in self._values[key]]
        if anchor.grad_fn is None and anchor.requires_grad:  # a leaf: the chain's start, or
            self.add_leaf(anchor)  # a stage input
        return _Exchanged.apply(self, key, mask, anchor, values, *outs)


class _Exchanged(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ex: RankExchange, key: tuple[int, int, int], mask: tuple[bool, ...],
                anchor: torch.Tensor, values: list[torch.Tensor],
                *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # weakly: a failed step's graph kept the rank's engine alive (a cycle through autograd)
        ctx.ex, ctx.key = weakref.ref(ex), key
        ctx.like = [(o.shape, o.dtype, o.is_floating_point()) for o in outs]
        result = tuple(v.clone() for v in values)
        ctx.carries = [m and t.is_floating_point() for t, m in zip(result, mask, strict=True)]
        ctx.mark_non_differentiable(*[t for t, c in zip(result, ctx.carries, strict=True)
                                      if not c])
        return (anchor.detach().clone(), *result)

    @staticmethod
    def backward(ctx: Any, anchor_grad: Any, *grads: Any) -> tuple[Any, ...]:
        # a split backward's ``W`` may start from this node again, with the gradients it
        # had in ``I``: the answer is the same, and the controller is asked only once
        if getattr(ctx, "answer", None) is not None:
            return ctx.answer  # type: ignore[no-any-return]
        ex, key = ctx.ex(), ctx.key
        if ex is None:
            raise RuntimeError("the pipeline that ran this forward is closed")
        ex.inbox.send(("x_ingrad", key, [g.detach().cpu() if c and g is not None else None
                                         for g, c in zip(grads, ctx.carries, strict=True)]))
        out_grads: list[Any] = [None] * len(ctx.like)
        if key[1] > 0:
            got = ex.inbox.get("x_outgrad", key)
            for i, ((shape, dtype, floating), g) in enumerate(zip(ctx.like, got, strict=True)):
                if floating:
                    out_grads[i] = (torch.zeros(shape, dtype=dtype, device=ex.device)
                                    if g is None else g.to(ex.device, dtype))
        ctx.answer = (None, None, None, None, None, *out_grads)
        return ctx.answer  # type: ignore[no-any-return]


# -- capture ---------------------------------------------------------------------------------


RETURNS_SIZE = "graph {} of the forward returns a size (the exchanges carry tensors)"


def returns_size(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph Dynamo traced with symbolic sizes returns one of them."""
    return any(is_symbolic(x.meta.get("example_value")) for node in gm.graph.nodes
               if node.op == "output" for x in pytree.tree_leaves(node.args[0])
               if isinstance(x, torch.fx.Node))


def join_calls(seen: list[tuple[torch.fx.GraphModule, list[Any], list[Any],
                                list[tuple[str, Any] | None]]],
               reason: str, eager: list[str],
               region: tuple[str, torch.dtype] | None = None,
               dims: dict[tuple[int, int], tuple[Any, ...]] | None = None,
               values: tuple[int, ...] = ()) -> tuple[Any, Glue]:
    """The joined graph and its :class:`Glue` from the graph calls a forward ran, in order.

    Each call is ``(graph, arguments, outputs, roles)``; ``roles[i]`` is
    ``("param"|"buffer"|"input", name)`` or None for a value the Python between
    graphs hands over (recorded now, exchanged in training), or a size's
    (:func:`orgel.graph.glue_sizes.size_roles`). ``region``: the autocast the calls ran
    under (see :func:`~orgel.graph.glue_capture.capture_graphs`); ``dims`` (symbolic
    sizes): each glue argument's dimensions, by ``(call, argument)`` (the same function),
    and ``values`` the sizes captured symbolic (:attr:`Glue.values`).
    """
    calls: list[Call] = []
    recorded: dict[int, list[torch.Tensor]] = {}
    for c, (gm, args, outs, given) in enumerate(seen):
        roles: list[tuple[str, Any]] = []
        glue: list[torch.Tensor] = []
        shapes: list[tuple[Any, ...]] = []
        for i, (a, role) in enumerate(zip(args, given, strict=True)):
            if not isinstance(a, torch.Tensor) and role is None:
                raise CaptureError(
                    f"graph {c} of the forward takes a {type(a).__name__}, not a tensor: "
                    "Dynamo compiled it with symbolic sizes (it had run this code on other "
                    "shapes in this process, or dynamic=True), and a forward of several graphs "
                    "is captured with static shapes; pass torch.compile(..., dynamic=False)")
            if role is not None:
                roles.append(role)
            else:
                roles.append(("glue", len(glue)))
                glue.append(a.detach().clone().requires_grad_(a.requires_grad))
                shapes.append(tuple(a.shape) if dims is None else dims[(c, i)])
        calls.append(Call(gm.code, roles, len(outs), _where(gm), shapes,
                          differentiable=tuple(isinstance(o, torch.Tensor) and o.requires_grad
                                               for o in outs),
                          layouts=tuple(Layout.of(o) for o in outs)))
        recorded[c] = glue
    key = f"g{next(_keys)}"
    _EXAMPLES[key] = recorded
    while len(_EXAMPLES) > _KEEP:
        _EXAMPLES.popitem(last=False)
    glue_info = Glue(key, calls, reason, eager=eager, region=region, values=values)
    return _join([gm for gm, _, _, _ in seen], glue_info, recorded), glue_info


def _where(gm: torch.fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
            return lines[-2] if len(lines) > 1 else lines[-1]
    return ""


def _join(gms: list[torch.fx.GraphModule], glue: Glue,
          recorded: dict[int, list[torch.Tensor]]) -> Any:
    """One fx graph: the calls in order, an exchange before each call that needs one."""
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    roles: dict[str, tuple[str, Any]] = {}
    shared: dict[tuple[str, str], torch.fx.Node] = {}

    def placeholder(kind: str, name: Any) -> torch.fx.Node:
        if (kind, name) not in shared:
            base = (name if kind == "input" else f"{name[0]}_size{name[1]}" if kind == "size"
                    else f"{kind[0]}_{name.replace('.', '_')}")
            node = input_placeholder(graph, base)
            roles[node.name] = (kind, name)
            shared[(kind, name)] = node
        return shared[(kind, name)]

    for call in glue.calls:  # placeholders first, model inputs before the rest
        for kind, name in sorted((r for r in call.roles if r[0] in ("input", "param", "buffer",
                                                                  "size")),
                                 key=lambda r: r[0] != "input"):
            placeholder(kind, name)
    previous: list[torch.fx.Node] = []
    anchor: torch.fx.Node | None = None
    entered = None if glue.region is None else graph.call_function(
        torch.amp.autocast_mode._enter_autocast, (*glue.region, True, None))
    for c, (gm, call) in enumerate(zip(gms, glue.calls, strict=True)):
        root.add_module(f"graph{c}", gm)
        values: list[torch.fx.Node] = []
        if c > 0 or call.glue:
            mask = call.carries = tuple(bool(t.requires_grad) for t in recorded[c])
            node = graph.call_function(exchange, (glue.key, c, mask, anchor, *previous))
            glue.exchanges[c] = node.name
            anchor = graph.call_function(operator.getitem, (node, 0))
            values = [graph.call_function(operator.getitem, (node, j + 1))
                      for j in range(len(call.glue))]
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, (kind, name) in zip(placeholders, call.roles, strict=True):
            env[node] = (values[name] if kind == "glue" else name if kind in ("number", "unused")
                         else placeholder(kind, name))
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outs = [x for x in pytree.tree_leaves(node.args[0])]
                if not all(isinstance(x, torch.fx.Node) for x in outs) or len(outs) != call.outputs:
                    raise CaptureError(f"graph {c} of the forward returns values that are not "
                                       "tensors; orgel captures with static shapes")
                if glue.dynamic and returns_size(gm):
                    raise CaptureError(RETURNS_SIZE.format(c))
                previous = [env[x] for x in outs]
                continue
            copy = graph.node_copy(node, env.__getitem__)
            if node.op == "get_attr":  # a flat name: measure reads constants off the root
                flat = f"graph{c}_{str(node.target).replace('.', '_')}"
                setattr(root, flat, operator.attrgetter(str(node.target))(gm))
                copy.target = flat
            elif node.op == "call_module":
                copy.target = f"graph{c}.{node.target}"
            env[node] = copy
    if anchor is None:  # one graph, the Python after it (an `if` at the end): no exchange
        anchor = graph.call_function(torch.zeros, ((),))
    if entered is not None:  # the region around every graph call
        graph.call_function(torch.amp.autocast_mode._exit_autocast, (entered,))
    graph.output((*previous, anchor))
    if glue.dynamic:  # a split recomputes size arithmetic from the size placeholders only
        check_size_nodes(graph, {n for (kind, _), n in shared.items() if kind == "size"})
    joined = torch.fx.GraphModule(root, graph)
    leaves = [("out", i) for i in range(len(previous) + 1)]
    _, spec = pytree.tree_flatten(tuple(range(len(leaves))))
    return joined, roles, leaves, spec

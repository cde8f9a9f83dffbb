"""A forward Dynamo captures as several graphs, made one graph with exchange points.

When a forward has graph breaks (a Python branch on a tensor's value,
``.item()``, a NumPy call), Dynamo compiles it as several graphs with Python
("glue") running between them. A graph that reads no parameter or buffer is a
pure function of its arguments and counts as glue (so it may differ from one
micro-batch to the next). :func:`capture_graphs` runs the forward once,
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
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.graph.dynamo import dynamo_settings, forget_compiled
from orgel.graph.opgraph import CaptureError

#: Values recorded when the forward ran once, by capture key: what exchanges return
#: while orgel measures and profiles the graph (the newest few captures are kept).
_EXAMPLES: OrderedDict[str, dict[int, list[torch.Tensor]]] = OrderedDict()
_KEEP = 32
_keys = itertools.count()
#: On a rank: the :class:`RankExchange` that talks to the controller (None elsewhere).
_RUNTIME: Any = None


@dataclass
class Call:
    """One graph call of the forward: the graph's code and what each of its inputs is.

    ``roles[i]`` is ``("param", name)``, ``("buffer", name)``, ``("input", name)``
    (a model input, graph 0 only) or ``("glue", j)``: the ``j``-th value its
    exchange hands over.
    """

    code: str
    roles: list[tuple[str, Any]]
    outputs: int
    where: str = ""
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # of the glue arguments

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
    values recorded by :func:`capture_graphs`.
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


def capture_graphs(model: torch.nn.Module, named: dict[str, Any], reason: str,
                   region: tuple[str, torch.dtype] | None = None) -> tuple[Any, Glue]:
    """Run the forward once through Dynamo with graph breaks allowed; one joined graph.

    ``region``: ``(device type, dtype)`` of the autocast the forward runs under (mixed
    precision). Dynamo's graphs hold no casts for an autocast entered around them, so
    the joined graph opens that region around everything (every stage re-enters it) and
    the controller runs the Python between graphs in it (:meth:`Glue.autocast`).

    Returns the capture route's raw form (graph module, placeholder roles,
    output leaves, output spec; see :mod:`orgel.graph.capture`) and the
    :class:`Glue` that the controller follows in training. Parameters that
    code outside every graph trains are listed in :attr:`Glue.eager`: the
    controller computes their gradients, a rank keeps and steps them
    (:func:`orgel.split.exchanges.eager_homes`).
    """

    params = {id(p): n for n, p in model.named_parameters()}
    buffers = {id(b): n for n, b in model.named_buffers()}
    inputs = {id(t): n for n, t in named.items() if isinstance(t, torch.Tensor)}
    seen: list[tuple[torch.fx.GraphModule, list[Any], list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        def run(*args: Any) -> Any:
            # the graph trains detached copies of the parameters: a real parameter in the
            # autograd graph afterwards was used by the glue, outside every graph
            shadow = [a.detach().requires_grad_(a.requires_grad)
                      if isinstance(a, torch.Tensor) and id(a) in params else a for a in args]
            check_grad_mode(gm, [isinstance(a, torch.Tensor)
                                 and (id(a) in params or a.requires_grad) for a in args], reason)
            out = gm(*shadow)
            seen.append((gm, list(args), list(out) if isinstance(out, (tuple, list)) else [out]))
            return out

        return run

    try:
        compiled = torch.compile(model, backend=backend, dynamic=False)
        with dynamo_settings(), torch.enable_grad(), region_autocast(region):
            result = compiled(**named)
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(f"{reason} orgel then tried to pipeline the forward as several "
                           f"graphs, and Dynamo failed: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    finally:
        forget_compiled(backend)  # the caller's compiled code stays (no torch._dynamo.reset())
    if not seen:
        raise CaptureError("torch.compile produced no graph; does the model compute anything "
                           "with tensors?")
    eager = _eager_parameters(result, model)
    # a graph that reads no parameter or buffer is a pure function of its arguments: it
    # runs in the controller with the Python around it (so it may differ per micro-batch)
    seen = [s for s in seen if any(id(a) in params or id(a) in buffers for a in s[1])]
    if not seen:
        raise CaptureError(f"{reason} No graph of the forward reads a parameter: nothing to "
                           "pipeline")
    prepared = []
    for c, (gm, args, outs) in enumerate(seen):
        roles: list[tuple[str, Any] | None] = []
        for a in args:
            if id(a) in params:
                roles.append(("param", params[id(a)]))
            elif id(a) in buffers:
                roles.append(("buffer", buffers[id(a)]))
            elif c == 0 and id(a) in inputs:
                roles.append(("input", inputs[id(a)]))
            else:
                roles.append(None)
        prepared.append((gm, args, outs, roles))
    return join_calls(prepared, reason, eager, region)


def check_grad_mode(gm: torch.fx.GraphModule, trainable: list[bool], reason: str) -> None:
    """Refuse a graph run with gradients off whose inputs could carry one (``trainable``):
    on a rank, whose stages run with gradients on, it would train what the forward left alone."""
    if not torch.is_grad_enabled() and any(trainable):
        raise CaptureError(
            f"{reason} orgel then tried to pipeline the forward as several graphs, but "
            f"the graph at {_where(gm)!r} runs with gradients off (under torch.no_grad, "
            "or in the forward of a custom autograd Function, as reversible layers "
            "are): a stage would train it. Keep that code free of graph breaks, or "
            "outside torch.no_grad")


def join_calls(seen: list[tuple[torch.fx.GraphModule, list[Any], list[Any],
                                list[tuple[str, Any] | None]]],
               reason: str, eager: list[str],
               region: tuple[str, torch.dtype] | None = None) -> tuple[Any, Glue]:
    """The joined graph and its :class:`Glue` from the graph calls a forward ran, in order.

    Each call is ``(graph, arguments, outputs, roles)``; ``roles[i]`` is
    ``("param"|"buffer"|"input", name)`` or None for a value the Python between
    graphs hands over (recorded now, exchanged in training). ``region``: the autocast
    the calls ran under (see :func:`capture_graphs`).
    """
    calls: list[Call] = []
    recorded: dict[int, list[torch.Tensor]] = {}
    for c, (gm, args, outs, given) in enumerate(seen):
        roles: list[tuple[str, Any]] = []
        glue: list[torch.Tensor] = []
        for a, role in zip(args, given, strict=True):
            if not isinstance(a, torch.Tensor):
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
        calls.append(Call(gm.code, roles, len(outs), _where(gm),
                          [tuple(t.shape) for t in glue]))
        recorded[c] = glue
    key = f"g{next(_keys)}"
    _EXAMPLES[key] = recorded
    while len(_EXAMPLES) > _KEEP:
        _EXAMPLES.popitem(last=False)
    glue_info = Glue(key, calls, reason, eager=eager, region=region)
    return _join([gm for gm, _, _, _ in seen], glue_info, recorded), glue_info


def _where(gm: torch.fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace")
        if trace:
            lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
            return lines[-2] if len(lines) > 1 else lines[-1]
    return ""


def _eager_parameters(result: Any, model: torch.nn.Module) -> list[str]:
    """Names of real parameters that a backward from the output trains: the graphs ran on
    detached copies, so only code outside every graph (the glue, or a custom autograd Function
    whose backward runs layers again, as Reformer's reversible layers) gives one a gradient.
    The caller restores the gradients (:func:`orgel.guard.untouched`)."""
    leaves = [t for t in pytree.tree_leaves(_plain(result))
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not leaves:
        return []
    for p in model.parameters():
        p.grad = None
    torch.autograd.backward([t.sum() for t in leaves])
    return sorted(n for n, p in model.named_parameters() if p.grad is not None)


def _plain(obj: Any) -> Any:
    """``obj`` with mappings (a transformers ModelOutput) as dicts, for pytree."""
    if isinstance(obj, dict) or hasattr(obj, "keys") and hasattr(obj, "__getitem__"):
        try:
            return {k: _plain(obj[k]) for k in obj.keys()}  # noqa: SIM118 - not always a dict
        except Exception:  # noqa: BLE001 - not a mapping after all
            return obj
    if isinstance(obj, (tuple, list)):
        return [_plain(x) for x in obj]
    return obj


def _join(gms: list[torch.fx.GraphModule], glue: Glue,
          recorded: dict[int, list[torch.Tensor]]) -> Any:
    """One fx graph: the calls in order, an exchange before each call that needs one."""
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    roles: dict[str, tuple[str, Any]] = {}
    shared: dict[tuple[str, str], torch.fx.Node] = {}

    def placeholder(kind: str, name: str) -> torch.fx.Node:
        if (kind, name) not in shared:
            base = name if kind == "input" else f"{kind[0]}_{name.replace('.', '_')}"
            node = graph.placeholder(base)
            roles[node.name] = (kind, name)
            shared[(kind, name)] = node
        return shared[(kind, name)]

    for call in glue.calls:  # placeholders first, model inputs before the rest
        for kind, name in sorted((r for r in call.roles if r[0] != "glue"),
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
            mask = tuple(bool(t.requires_grad) for t in recorded[c])
            node = graph.call_function(exchange, (glue.key, c, mask, anchor, *previous))
            glue.exchanges[c] = node.name
            anchor = graph.call_function(operator.getitem, (node, 0))
            values = [graph.call_function(operator.getitem, (node, j + 1))
                      for j in range(len(call.glue))]
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, (kind, name) in zip(placeholders, call.roles, strict=True):
            env[node] = values[name] if kind == "glue" else placeholder(kind, name)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outs = [x for x in pytree.tree_leaves(node.args[0])]
                if not all(isinstance(x, torch.fx.Node) for x in outs) or len(outs) != call.outputs:
                    raise CaptureError(f"graph {c} of the forward returns values that are not "
                                       "tensors; orgel captures with static shapes")
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
    joined = torch.fx.GraphModule(root, graph)
    leaves = [("out", i) for i in range(len(previous) + 1)]
    _, spec = pytree.tree_flatten(tuple(range(len(leaves))))
    return joined, roles, leaves, spec

"""Capturing a forward of several graphs: Dynamo runs it once, our backend records each graph.

:func:`capture_graphs` runs the forward through ``torch.compile`` with graph breaks
allowed, keeps the graphs that read a parameter or buffer, and joins them
(:func:`orgel.graph.glue.join_calls`); with symbolic sizes, each size a graph takes is
bound to a model input dimension first (:mod:`orgel.graph.glue_sizes`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.batching import plain
from orgel.graph.dynamo import (
    dynamo_settings,
    forget_compiled,
    new_code_state,
    own_code_state,
)
from orgel.graph.glue import RETURNS_SIZE, Glue, _where, join_calls, region_autocast, returns_size
from orgel.graph.glue_sizes import (
    capture_settings,
    glue_shapes,
    mark_fixed_ints,
    size_roles,
    size_values,
    stretched,
)
from orgel.graph.opgraph import CaptureError
from orgel.guard import no_autocast_cache, untouched
from orgel.nesting import call


class GlueCompiler:
    """The ``torch.compile`` backend a forward of several graphs is captured with, and that
    its controller compiles its copy of the model with (:mod:`orgel.explicit.glued`).

    One backend object for both: Dynamo's guards pass for the controller's copy (the same
    class and attributes; parameters are lifted inputs), so the code Dynamo compiled at the
    capture serves the controller, and the forward is traced once, not twice. Each graph
    call goes to the calling thread's route (:meth:`routed`); without one the graph runs
    as it is."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        mark_fixed_ints(gm)

        def run(*args: Any) -> Any:
            route = getattr(self._local, "route", None)
            return gm(*args) if route is None else route(gm, args)

        return run

    @contextlib.contextmanager
    def routed(self, route: Callable[[torch.fx.GraphModule, tuple[Any, ...]], Any]
               ) -> Iterator[None]:
        """Send this thread's graph calls to ``route(graph, args)`` inside the block."""
        before = getattr(self._local, "route", None)
        self._local.route = route
        try:
            yield
        finally:
            self._local.route = before


#: the compilers whose code a capture kept for its controller, by :attr:`Glue.key`
_KEPT: dict[str, GlueCompiler] = {}


def kept_compiler(glue: Glue) -> GlueCompiler:
    """The compiler ``glue``'s capture kept (its code compiled), handed over once; a new one
    where none was kept."""
    return _KEPT.pop(glue.key, None) or GlueCompiler()


def release(glue: Any) -> None:
    """Drop the code ``glue``'s capture kept for a controller that will not run it (a no-op
    for None, or where none was kept)."""
    compiler = None if glue is None else _KEPT.pop(glue.key, None)
    if compiler is not None:
        forget_compiled(compiler)


def capture_graphs(model: torch.nn.Module, named: dict[str, Any], reason: str,
                   region: tuple[str, torch.dtype] | None = None,
                   dynamic: bool = False, keep: bool = False) -> tuple[Any, Glue]:
    """Run the forward once through Dynamo with graph breaks allowed; one joined graph.

    ``dynamic``: with symbolic sizes (:mod:`orgel.graph.glue_sizes`); raises
    :class:`CaptureError` where they cannot be bound to the model inputs. ``keep``: keep
    the code Dynamo compiled for the controller (:func:`kept_compiler`; whoever drops the
    capture instead calls :func:`release`), else drop it now.

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
    state = _state_ids(model)
    seen: list[tuple[torch.fx.GraphModule, list[Any], list[Any]]] = []
    values = size_values(named) if dynamic else ()
    # Dynamo's record of compiled sizes: this capture's own, for its first run and probes
    sizes_record = new_code_state()

    def shadow(args: tuple[Any, ...]) -> list[Any]:
        # the graph trains detached copies of the parameters: a real parameter in the
        # autograd graph afterwards was used by the glue, outside every graph
        return [a.detach().requires_grad_(a.requires_grad)
                if isinstance(a, torch.Tensor) and id(a) in params else a for a in args]

    @contextlib.contextmanager
    def traced(route: Callable[[torch.fx.GraphModule, tuple[Any, ...]], Any]
               ) -> Iterator[None]:
        # the controller's global state (its threads run without the autocast cache), which
        # Dynamo's code guards on, so that this code serves it; graph calls go to ``route``
        with (dynamo_settings(nested=True), own_code_state(sizes_record), capture_settings(values),
              torch.enable_grad(), no_autocast_cache(), region_autocast(region),
              compiler.routed(route)):
            yield

    def record(gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> Any:
        check_grad_mode(gm, [isinstance(a, torch.Tensor)
                             and (id(a) in params or a.requires_grad) for a in args], reason)
        if values and returns_size(gm) and _reads(args, state):
            # the join refuses it (the capture is then static): say so before Dynamo traces
            # the rest of the forward with symbolic sizes (seconds, for nothing)
            raise CaptureError(RETURNS_SIZE.format(sum(_reads(s[1], state) for s in seen)))
        out = gm(*shadow(args))
        seen.append((gm, list(args), list(out) if isinstance(out, (tuple, list)) else [out]))
        return out

    compiler = GlueCompiler()
    try:
        compiled = torch.compile(model, backend=compiler, dynamic=None if values else False)
        with traced(record):
            result = call(compiled, named)
    except BaseException as exc:
        forget_compiled(compiler)  # the caller's compiled code stays (no torch._dynamo.reset())
        if isinstance(exc, CaptureError) or not isinstance(exc, Exception):
            raise
        raise CaptureError(f"{reason} orgel then tried to pipeline the forward as several "
                           f"graphs, and Dynamo failed: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc

    def probe(value: int) -> list[list[Any]] | None:
        """The state-reading graph calls' arguments on the example with every input
        dimension of size ``value`` one longer (:func:`orgel.graph.glue_sizes.size_roles`
        tells a size from a number of the same value by it); None where that forward
        needs another graph or fails. Nothing of the model or the random streams changes
        (:func:`orgel.guard.untouched`)."""
        calls: list[tuple[torch.fx.GraphModule, list[Any]]] = []

        def rec(gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> Any:
            calls.append((gm, list(args)))
            return gm(*shadow(args))

        longer = {k: _view_like(stretched(v, tuple((k, d) if n == value else n
                                                   for d, n in enumerate(v.shape)),
                                          {k: tuple(n + 1 if n == value else n
                                                    for n in v.shape)}), v)
                  if isinstance(v, torch.Tensor) else v for k, v in named.items()}
        try:
            with (untouched(model), traced(rec),
                  torch.compiler.set_stance("fail_on_recompile")):
                call(compiled, longer)
        except Exception:
            return None
        ran = [(gm, args) for gm, args in calls if _reads(args, state)]
        if [gm for gm, _ in ran] != [gm for gm, args, _ in seen if _reads(args, state)]:
            return None
        return [args for _, args in ran]

    try:
        raw, glue = _joined(seen, model, named, result, reason, region, values,
                            functools.cache(probe))
    except BaseException:
        forget_compiled(compiler)
        raise
    if keep:
        _KEPT[glue.key] = compiler
    else:
        forget_compiled(compiler)
    return raw, glue


def _joined(seen: list[tuple[torch.fx.GraphModule, list[Any], list[Any]]],
            model: torch.nn.Module, named: dict[str, Any], result: Any, reason: str,
            region: tuple[str, torch.dtype] | None, values: tuple[int, ...],
            probe: Callable[[int], list[list[Any]] | None] | None = None
            ) -> tuple[Any, Glue]:
    """The graph calls ``seen`` (graph, arguments, outputs) joined (:func:`capture_graphs`)."""
    params = {id(p): n for n, p in model.named_parameters()}
    buffers = {id(b): n for n, b in model.named_buffers()}
    inputs = {id(t): n for n, t in named.items() if isinstance(t, torch.Tensor)}
    if not seen:
        raise CaptureError("torch.compile produced no graph; does the model compute anything "
                           "with tensors?")
    eager = _eager_parameters(result, model)
    # a graph that reads no parameter or buffer is a pure function of its arguments: it
    # runs in the controller with the Python around it (so it may differ per micro-batch)
    state = {*params, *buffers}
    seen = [s for s in seen if _reads(s[1], state)]
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
    dims = size_roles(prepared, named, probe) if values else None
    raw, glue = join_calls(prepared, reason, eager, region, dims, values)
    if values:
        raw[0].meta["orgel_shapes"] = glue_shapes(named, prepared[0][0], prepared[0][3])
    return raw, glue


def _view_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``, as the first rows of a larger tensor where ``like`` is a view (a micro-batch cut
    from its batch), so that Dynamo's guards on the input's base pass as for ``like``."""
    if like._base is None or t.dim() == 0:
        return t
    base = t.new_empty((t.shape[0] + 1, *t.shape[1:]))
    base[: t.shape[0]] = t
    return base[: t.shape[0]]


def _state_ids(model: torch.nn.Module) -> set[int]:
    """The ids of ``model``'s parameters and buffers."""
    return {id(t) for t in [*model.parameters(), *model.buffers()]}


def _reads(args: list[Any] | tuple[Any, ...], state: set[int]) -> bool:
    """Whether a graph called with ``args`` reads a parameter or buffer (else it is glue,
    run by the controller with the Python around it)."""
    return any(id(a) in state for a in args)


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


def _eager_parameters(result: Any, model: torch.nn.Module) -> list[str]:
    """Names of real parameters that a backward from the output trains: the graphs ran on
    detached copies, so only code outside every graph (the glue, or a custom autograd Function
    whose backward runs layers again, as Reformer's reversible layers) gives one a gradient.
    The caller restores the gradients (:func:`orgel.guard.untouched`)."""
    leaves = [t for t in pytree.tree_leaves(plain(result))
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not leaves:
        return []
    for p in model.parameters():
        p.grad = None
    torch.autograd.backward([t.sum() for t in leaves])
    return sorted(n for n, p in model.named_parameters() if p.grad is not None)

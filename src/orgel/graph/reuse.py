"""Capture a model class once per process: Dynamo's guards decide when its graph still holds.

Capturing a forward with TorchDynamo costs seconds (a 2-layer Qwen2 with symbolic sizes:
about 3 s on one CPU core), and a process often captures the same model again at the same
sizes: a second ``orgel.pipeline`` after ``close`` (``orgel.load`` to resume), a second
model built from the same config, each cell of a test matrix. Dynamo already
knows when a graph it traced still describes a call: the guards it checks before running
compiled code (the module's type and attributes, the tensors' dtypes, devices, ranks and
static sizes, the global grad and autocast state). So each :class:`Capturer` is one
``torch.compile``'d function of its own (its own code object: no cache entry of the
caller's is touched), called with the model as an argument. A call that passes the guards
runs the graph traced before (parameters and buffers are lifted inputs, so it reads this
model's tensors) and reports that graph; one that does not makes Dynamo trace again.

Two things Dynamo does not guard decide the key instead (:func:`capturer_for`): module
hooks (``skip_nnmodule_hook_guards``: a hook added later would be ignored), so a model
with any hook is captured afresh every time, and which parameters or buffers are one
tensor (tied embeddings are one graph input, not two). So is the micro-batch's shape: a
symbolic graph's example values keep the sizes it was traced at, which later code reads.
"""

from __future__ import annotations

import itertools
import threading
import types
from collections import OrderedDict
from typing import Any

import torch

from orgel.nesting import nest

#: capturers kept (least recently used first out), and the traces each may hold
KEPT, TRACES = 8, 6

_KEPT: OrderedDict[Any, Capturer] = OrderedDict()
_LOCK = threading.Lock()
_NAMES = itertools.count()


class Capturer:
    """A ``torch.compile``'d call of a model; :meth:`run` returns the graph and its inputs."""

    def __init__(self, autocast: tuple[str, torch.dtype] | None, dynamic: bool) -> None:
        self.traces = 0
        self._found: list[tuple[torch.fx.GraphModule, list[Any], Any]] = []
        self._sizes: dict[int, tuple[Any, int, dict[Any, Any]]] = {}  # id(gm) -> its trace's
        self._lock = threading.Lock()
        if autocast is not None:  # the region is part of the graph: every stage re-enters it
            kind, dtype = autocast

            def call(model: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
                with torch.autocast(kind, dtype=dtype):
                    return model(**kwargs)
        else:
            def call(model: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
                return model(**kwargs)
        # a code object of its own: Dynamo's cache entries for it are this capturer's
        self.code = call.__code__.replace(co_name=f"orgel_capture_{next(_NAMES)}")
        own = types.FunctionType(self.code, call.__globals__, call.__name__, None,
                                 call.__closure__)
        self._compiled = torch.compile(own, backend=self._backend, fullgraph=True,
                                       dynamic=None if dynamic else False)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.traces += 1

        env = _shape_env(gm)

        def run(*args: Any) -> Any:
            if env is not None and id(gm) not in self._sizes:  # as the trace left them
                self._sizes[id(gm)] = (env, len(env.guards), dict(env.replacements))
            with torch.no_grad():
                out = gm(*args)
            self._found.append((gm, list(args), out))
            return out

        return run

    def _changed(self, gm: torch.fx.GraphModule) -> bool:
        """Whether code that read ``gm``'s symbolic sizes since added guards to them."""
        env, guards, replacements = self._sizes.get(id(gm), (None, 0, {}))
        return env is not None and (len(env.guards) != guards
                                    or dict(env.replacements) != replacements)

    def run(self, model: torch.nn.Module, kwargs: dict[str, Any]
            ) -> tuple[torch.fx.GraphModule, list[Any], Any, Any]:
        """``(graph, its inputs, its outputs, the model's result)`` of ``model(**kwargs)``.

        The graph is a copy of this capturer's (the caller may change it); its inputs are
        the tensors and sizes of this call. Raises what Dynamo raises (a graph break under
        ``fullgraph``), or :class:`LookupError` where no graph ran.
        """
        with self._lock:
            result, found = self._call(model, kwargs)
            if len(found) == 1 and self._changed(found[0][0]):
                # an earlier capture's use guarded its sizes (``int()`` of a symbolic
                # size): those guards are not the model's, so trace afresh
                self.forget()
                result, found = self._call(model, kwargs)
        if len(found) != 1:
            raise LookupError(f"torch.compile ran {len(found)} graphs")
        gm, args, out = found[0]
        return copy_graph(gm), args, out, result

    def _call(self, model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[Any, list[Any]]:
        self._found = []
        try:
            return self._compiled(model, nest(kwargs)), self._found
        finally:
            self._found = []

    def forget(self) -> None:
        """Drop every trace this capturer holds."""
        torch._dynamo.eval_frame.reset_code(self.code)
        self._sizes.clear()
        self.traces = 0


def _shape_env(gm: torch.fx.GraphModule) -> Any:
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        env = getattr(getattr(value, "fake_mode", None), "shape_env", None)
        if env is not None:
            return env
    return None


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose graph and node metadata can be changed without touching ``gm``'s
    (the example values themselves are shared)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta = dict(gm.meta)
    return copied


def tied(named: Any) -> frozenset[tuple[str, ...]]:
    """The groups of names (``(name, tensor)`` pairs) that name one tensor."""
    groups: dict[int, list[str]] = {}
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
    return frozenset(tuple(g) for g in groups.values() if len(g) > 1)


def _hooked(model: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, name, None) for name in (
            "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
            "_global_backward_pre_hooks")):
        return True
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(m, h, None) for m in model.modules() for h in hooks)


def capturer_for(model: torch.nn.Module, inputs: dict[str, Any],
                 autocast: tuple[str, torch.dtype] | None,
                 dynamic: bool) -> tuple[Capturer, bool]:
    """The capturer for ``model`` called on ``inputs``, and whether it is kept for later
    captures.

    A model with hooks gets a capturer of its own, not kept (the caller forgets it). The
    inputs' sizes are part of the key: a symbolic graph's example values carry the sizes
    it was traced at (read as hints: the measured bytes of an input, a region's shape),
    so a graph is reused only at the sizes it describes.
    """
    if _hooked(model):
        return Capturer(autocast, dynamic), False
    sizes = tuple((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, None, None)
                  for k, v in inputs.items())
    key = (type(model), sizes, autocast, dynamic,
           tied(model.named_parameters(remove_duplicate=False)),
           tied(model.named_buffers(remove_duplicate=False)))
    with _LOCK:
        capturer = _KEPT.pop(key, None)
        if capturer is not None and capturer.traces >= TRACES:  # below Dynamo's limit
            capturer.forget()
            capturer = None
        if capturer is None:
            capturer = Capturer(autocast, dynamic)
        _KEPT[key] = capturer
        while len(_KEPT) > KEPT:
            _KEPT.popitem(last=False)[1].forget()
    return capturer, True


def forget_all() -> None:
    """Drop every kept capturer and its traces."""
    with _LOCK:
        while _KEPT:
            _KEPT.popitem()[1].forget()

"""Dynamo's options while orgel traces a forward, and forgetting what orgel compiled."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

#: Log calls in a forward that capture skips rather than break the graph at (the
#: ``*_once`` ones are what transformers adds to ``logging.Logger``).
_LOG_METHODS = ("debug", "info", "warning", "warning_once", "info_once")


def dynamo_settings(nested: bool = False) -> Any:
    """Dynamo's options while orgel traces a forward (capture, and ``orgel.backend``'s steps).

    They avoid graph breaks that need not happen: ``allow_rnn`` traces
    ``nn.LSTM``/``GRU``/``RNN`` as ops, and log calls in the forward (Longformer's
    "Initializing global attention on CLS token") are skipped instead of breaking.

    The fake tensors' cache of op results is off: a trace with symbolic sizes meets
    few ops twice at the same sizes, and keying and checking each entry cost more than the
    hits save (a 2-layer Hugging Face Qwen2 with a graph break: 14 s to 10 s, without one
    3.7 s to 3.0 s; 12 layers: 25.7 to 21.6 s and 3.4 to 2.7 s, on this 2-core CPU).

    Hooks are guarded (``skip_nnmodule_hook_guards`` off): by default Dynamo guards a
    module's hooks only where the trace ran one, so code compiled for a layer without
    hooks also runs for a layer with one and skips its hook. Under transformers 4.57,
    whose decoder layers each enter Dynamo as a frame of their own, a hook on layer 0
    (a graph break) was skipped from the second call on: the controller ran other graphs
    than the capture's, and every micro-batch left them for the calling process.

    ``nested`` (``orgel.pipeline``'s capture of a forward of several graphs, and its
    controller, which runs the code that capture compiled): Dynamo's
    ``nested_graph_breaks``, so that a break deep in the forward (a hook on a layer of a
    Hugging Face model) ends the graphs of the frames around it where it is, instead of
    each enclosing frame being traced again up to the call that holds the break: that
    capture of a 2-layer Qwen2 with a break in a layer's hook took 5.0-5.5 s instead of
    6.7-7.5 s (the seven such cells of the composition matrix, 67 s instead of 85). Not
    for ``orgel.backend``, whose user compiled the model under Dynamo's defaults: a
    micro-batch that leaves its captured graphs is continued in the caller from Dynamo's
    frames as they run by default.
    """
    calls = {getattr(logging.Logger, name) for name in _LOG_METHODS
             if hasattr(logging.Logger, name)}
    options: dict[str, Any] = {"allow_rnn": True, "ignore_logging_functions": calls,
                               "fake_tensor_cache_enabled": False,
                               "skip_nnmodule_hook_guards": False}
    if nested and hasattr(torch._dynamo.config, "nested_graph_breaks"):
        options["nested_graph_breaks"] = True
    if hasattr(torch._dynamo.config, "log_compilation_metrics"):
        # torch 2.11 logs each compile's config and fails to sort that set of functions
        options["log_compilation_metrics"] = False
    return torch._dynamo.config.patch(**options)


def new_code_state() -> Any:
    """An empty record of compiled sizes, for :func:`own_code_state`."""
    from collections import defaultdict

    from torch._dynamo import pgo

    return defaultdict(pgo.CodeState)


@contextlib.contextmanager
def own_code_state(state: Any = None) -> Iterator[None]:
    """Dynamo's record of the sizes each code object was compiled with: ``state`` (from
    :func:`new_code_state`; a fresh one by default) inside the block; after it, the
    caller's again, with the block's entries added (replacing the caller's for the same
    code).

    Dynamo keeps one such record per process (``torch._dynamo.pgo``, for automatic
    dynamic shapes) and reads it when it first compiles a code object: code that every
    model shares (transformers' attention helpers) compiled earlier at other sizes made a
    capture trace a size-1 dimension of the attention mask as a symbol, and fail
    (transformers 4.57's OPT, after other models in the process). A capture reads no such
    history. What it records stays, as any compile's would: the pipeline's own compiled
    copy of the forward compiles the captured frames again later and must make the same
    choices.
    """
    from torch._dynamo import pgo

    mine = new_code_state() if state is None else state
    before = (pgo._CODE_STATE, pgo._INIT_CODE_STATE)
    pgo._CODE_STATE, pgo._INIT_CODE_STATE = mine, None
    try:
        yield
    finally:
        pgo._CODE_STATE, pgo._INIT_CODE_STATE = before
        pgo.get_code_state().update(mine)


def forget_compiled(backend: Any) -> None:
    """Drop the code Dynamo compiled with ``backend``, and nothing else.

    ``torch._dynamo.reset()`` would drop the caller's own compiled code as well (their
    models compile again on the next call). A capture that converts the model's own
    frames (graph breaks: the model's ``forward`` and Dynamo's resume functions) adds
    entries to those frames' caches, which would keep the capture's graphs alive and
    count against the caller's recompile limit; each entry names its backend. A frame
    whose entries are all ours is emptied; where the caller compiled it too, ours are
    invalidated as Dynamo does when a model they guard on is freed (a dead entry
    stays in that frame's list). ``backend`` compares by ``==`` (a bound method is made
    anew at each lookup).
    """
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import cached_backends
    from torch._dynamo.guards import DeletedGuardManagerWrapper

    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    compiled: set[str] = set()  # the globals our entries' code calls: our graphs
    for ref in list(input_codes.seen):  # every code object Dynamo converted
        code = ref()
        if code is None:
            continue
        found = entries(code)
        ours = [e for e in found if getattr(e.backend, "compiler_fn", None) == backend]
        compiled.update(n for e in ours for n in e.code.co_names
                        if n.startswith("__compiled_fn"))
        if ours and all(e in ours or e.backend is None for e in found):
            torch._dynamo.eval_frame.reset_code(code)
            continue
        for entry in ours:
            manager = entry.guard_manager
            extra, own = manager.extra_state, manager.cache_entry
            if extra is not None and own is not None:
                extra.invalidate(own, DeletedGuardManagerWrapper("orgel's capture ended"))
    _forget_graphs(backend, compiled, cached_backends)


def _forget_graphs(backend: Any, names: set[str], cached: dict[int, Any]) -> None:
    """Let go of what else holds ``backend`` and its graphs: Dynamo's table of backends,
    and the graphs it installs as globals (``__compiled_fn_<n>_<uuid>``, names no other
    code uses) in the compiled code's module. They kept a closed pipeline, and its copy of
    the model, alive in the caller's process. A global is set to None, not deleted: Dynamo
    deletes it itself once the code that calls it is gone."""
    for key in [k for k, v in cached.items() if getattr(v, "compiler_fn", None) == backend]:
        del cached[key]
    if not names:
        return
    for module in list(sys.modules.values()):
        scope = getattr(module, "__dict__", {})
        for name in [n for n in names if n in scope]:  # a lookup, not a walk of the module
            scope[name] = None

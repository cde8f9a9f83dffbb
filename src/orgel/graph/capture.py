"""Capture a model's forward as one fx graph (TorchDynamo, or torch.export as fallback).

Dynamo route: ``torch.compile(model, backend=..., fullgraph=True)`` hands our
backend the fx graph with parameters and buffers lifted as inputs, and the real
tensors behind them, so placeholders are matched to parameters, buffers and
model inputs by identity (never by position); a later capture of the same model class at
the same sizes reuses the trace where Dynamo's guards pass (:mod:`orgel.graph.reuse`). A
graph break makes capture join the forward's several graphs instead
(:mod:`orgel.graph.glue`); where that cannot work the error names dynamo's reason and the
user's source line. Export route:
``torch.export.export(strict=False)``, whose graph signature names the same roles.

Either way the graph is then run once on the real inputs to measure, per node,
output sizes, FLOPs (``FlopCounterMode``) and the bytes autograd saves for
backward (``saved_tensors_hooks``). A model built on the meta device
(``with torch.device("meta"):``) is captured and measured on meta copies of the
inputs: the same facts, no parameter or activation memory. The model and torch's global state are
restored afterwards (:func:`orgel.guard.untouched`), so capturing changes nothing.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.graph.dynamo import dynamo_settings, own_code_state
from orgel.graph.glue import Glue
from orgel.graph.glue_capture import capture_graphs, release
from orgel.graph.measure import GRAD_SWITCH, Raw, measure
from orgel.graph.opgraph import CaptureError, GraphBreakError, OpGraph
from orgel.graph.repeat import number_in_order
from orgel.graph.reuse import capturer_for
from orgel.graph.sizes import bind_sizes, mark_sizes, size_settings, static_shapes
from orgel.guard import autograd_first, untouched
from orgel.nesting import call, nest
from orgel.precision import autocast_dtype, device_type
from orgel.workload import meta_autocast_advice, named_inputs, on_meta

METHODS = ("auto", "dynamo", "export")
__all__ = ["METHODS", "CaptureError", "GraphBreakError", "capture", "dynamo_settings"]


def capture(model: torch.nn.Module, inputs: Any, *, method: str = "auto",
            several: bool = True, precision: str = "32", dynamic: bool = True,
            shallow: bool | str = False, keep: bool = False) -> OpGraph:
    """Capture ``model``'s forward on ``inputs`` (tuple or dict) as an :class:`OpGraph`.

    ``method``: ``"dynamo"`` (torch.compile backend), ``"export"`` (torch.export,
    non-strict) or ``"auto"`` (dynamo, falling back to export when dynamo fails
    for a reason other than a graph break). Facts are measured on these inputs:
    pass one micro-batch to get per-micro-batch sizes.

    A forward with graph breaks is captured as its several Dynamo graphs joined
    by exchange points (:mod:`orgel.graph.glue`; ``graph.glue`` describes them);
    ``several=False`` raises :class:`GraphBreakError` instead.

    ``precision="bf16-mixed"`` captures the forward inside ``torch.autocast``
    (bfloat16): the graph holds the region (:mod:`orgel.precision`).

    ``dynamic`` (Dynamo route): capture with symbolic sizes (:mod:`orgel.graph.sizes`),
    so the graph runs on batches of other sizes; where the model's code fixes a size
    it stays static, and where the symbolic capture fails the capture is static
    (``graph.notes`` says why). Facts are measured at the example's sizes.

    ``shallow``: a long stack of alike layers is traced two layers deep and the rest copied
    from the second (:mod:`orgel.graph.repeat`), where that holds and the copy computes
    bit for bit what the model does on ``inputs`` (else the whole forward is traced;
    ``graph.notes`` says why). A meta model's copy cannot be checked so: it is taken only
    with ``shallow="costs"``, for a caller that reads the graph's costs and trains nothing.

    ``keep`` (several graphs): keep the code Dynamo compiled for the controller
    (:func:`orgel.graph.glue_capture.kept_compiler`; :func:`~orgel.graph.glue_capture.release`
    drops it where no controller will run).
    """
    autograd_first()  # before Dynamo: ranks forked from here run backward (orgel.guard)
    dtype = autocast_dtype(precision)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    named = named_inputs(model, inputs)
    notes: list[str] = []
    traced = named
    if on_meta(model):  # shapes only: the inputs are traced on the meta device with the model
        traced = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in named.items()}
        notes.append("the model is on the meta device: captured and measured without memory")
    # the region the stages enter runs where the caller's batch is (a meta model's too:
    # its trace is on the meta device, its ranks are not)
    region = None if dtype is None else (device_type(list(named.values())), dtype)
    with untouched(model):
        glue = None
        if method == "export" and dtype is not None:
            raise CaptureError(f"precision={precision!r} captures with TorchDynamo; use "
                               "method='dynamo' or 'auto'")
        if method == "export":
            raw = _export_graph(model, traced)
        else:
            try:
                raw = (_shallow(model, traced, region, dynamic, shallow == "costs", notes)
                       if shallow else None) or _dynamic_or_static(model, traced, region,
                                                                   dynamic, notes)
            except GraphBreakError as exc:
                if traced is not named:
                    raise GraphBreakError(f"{exc} A model on the meta device needs one "
                                          "graph of the forward") from None
                if not several:
                    raise
                # run as several graphs, the Python between them in the controller
                raw, glue = _graphs(model, named, str(exc), region, dynamic,
                                    notes, keep)
                notes.append(f"Dynamo captured the forward as {len(glue.calls)} graphs "
                             f"(first break: {str(exc).split('. For one graph')[0]}); the Python "
                             "between them runs in the controller for each micro-batch")
            except CaptureError:
                raise
            except Exception as exc:  # dynamo internal failure: try export
                if method == "dynamo" or dtype is not None:
                    raise CaptureError(f"torch.compile could not capture the model"
                                       f"{meta_autocast_advice(exc, model)}: {exc}") from exc
                notes.append(f"dynamo failed ({type(exc).__name__}: {str(exc)[:200]}); used export")
                raw = _export_graph(model, traced)
        if glue is None:  # one graph: its nodes named in order, however it was traced
            number_in_order(raw[0])
        exported = any(n.startswith("dynamo failed") for n in notes)
        used = "export" if method == "export" or (exported and glue is None) else "dynamo"
        try:
            graph = measure(model, named, raw, notes, used)
        except Exception as exc:  # noqa: BLE001
            if "orgel_shapes" not in raw[0].meta:
                raise
            # the symbolic graph did not run where the static one may: capture that one
            if glue is None:
                raw = _dynamo_graph(model, traced, region)
                number_in_order(raw[0])
            else:
                release(glue)
                raw, glue = _graphs(model, named, glue.reason, region, False, notes, keep)
            notes.append(f"captured with static sizes: the symbolic graph failed to run "
                         f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})")
            graph = measure(model, named, raw, notes, used)
        if glue is None:
            return graph
        return with_glue(graph, glue, named)


def with_glue(graph: OpGraph, glue: Glue, named: dict[str, Any]) -> OpGraph:
    """``graph``, the joined capture of a forward of several graphs, with its ``glue``
    (every front end's one rule). The sizes are graph 0's, and each later graph's are
    checked at its call; message shapes are exchanged (the graphs' size symbols are their
    own); a static capture takes the inputs ``named`` as they are."""
    graph.glue = glue
    graph.symbolic_shapes = {}
    if not glue.dynamic:
        graph.shapes = static_shapes(named)
    return graph


def _graphs(model: torch.nn.Module, named: dict[str, Any], reason: str,
            region: tuple[str, torch.dtype] | None, dynamic: bool, notes: list[str],
            keep: bool = False) -> Any:
    """The forward's several graphs joined (:func:`orgel.graph.glue_capture.capture_graphs`), with
    symbolic sizes where ``dynamic`` and they bind to the model's inputs, else static."""
    if dynamic:
        try:
            return capture_graphs(model, named, reason, region, dynamic=True, keep=keep)
        except CaptureError as exc:
            notes.append(f"captured with static sizes: {str(exc).splitlines()[0][:200]}")
    return capture_graphs(model, named, reason, region, keep=keep)


# -- the two routes: both return (gm, roles, leaves, treespec) -------------------------
# roles: placeholder name -> ("input", name) | ("param", qualname) | ("buffer", qualname)
#        | ("const", tensor); leaves: ("out", index) | ("input", name) | ("const", obj)

def _identity_roles(model: torch.nn.Module, named: dict[str, Any]) -> dict[int, tuple[str, Any]]:
    roles: dict[int, tuple[str, Any]] = {}
    for name, t in named.items():
        if isinstance(t, torch.Tensor):
            roles.setdefault(id(t), ("input", name))
    for name, p in model.named_parameters():
        roles[id(p)] = ("param", name)
    for name, b in model.named_buffers():
        roles[id(b)] = ("buffer", name)
    return roles


def _shallow(model: torch.nn.Module, named: dict[str, Any],
             autocast: tuple[str, torch.dtype] | None, dynamic: bool, costs_only: bool,
             notes: list[str]) -> Raw | None:
    """Dynamo's graph traced two layers deep and copied to the model's depth (None: the
    model has no stack to copy, its layers are not one pattern, or the copy does not
    compute what the model does on ``named``; ``costs_only``: a meta model's copy is
    taken unchecked, as the caller reads its costs only)."""
    from orgel.graph.repeat import repeated_layers, replicate, two_layers

    found = repeated_layers(model)
    if found is None:
        return None
    prefix, layers = found
    whole = f"traced all {len(layers)} layers of {prefix}"
    own: list[str] = []
    try:
        with two_layers(layers):
            raw = _dynamic_or_static(model, named, autocast, dynamic, own)
    except Exception as exc:  # noqa: BLE001 - whatever two layers cannot do, the whole trace says
        # a graph break too: code that reads the stack's length (zip(layers, inputs,
        # strict=True)) raises two layers deep, which Dynamo reports as a break; where the
        # whole forward breaks as well, its trace finds that (up to the break) and says so
        notes.append(f"{whole}: two of them failed to trace "
                     f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})")
        return None
    out = replicate(raw, prefix, len(layers))
    if out is None:
        notes.append(f"{whole}: two of them are not one pattern with the rest")
        return None
    if on_meta(model) and not costs_only:
        notes.append(f"{whole}: a copy of two cannot be checked on the meta device")
        return None
    try:
        same = on_meta(model) or _computes_as_model(model, _check_rows(named, out), out,
                                                    autocast)
    except Exception:  # noqa: BLE001 - a check that cannot run accepts nothing
        same = False
    if not same:
        notes.append(f"{whole}: two of them copied do not compute what the model does")
        return None
    notes.extend(own)
    notes.append(f"traced two of the {len(layers)} layers of {prefix}; the others copied "
                 "from the second")
    return out


def _check_rows(named: dict[str, Any], raw: Raw, rows: int = 2) -> dict[str, Any]:
    """The inputs the copy is checked on: ``named`` cut to its first ``rows`` rows where the
    graph takes any number of rows (every batch-sized input's first size is symbolic), else
    ``named`` itself.

    The check runs the forward twice, in a rank forked with one thread; on the whole
    micro-batch of a 185 M-parameter GPT (8 x 512 tokens) that was most of the rank's
    start-up. Layers copied wrongly differ on two rows as on all of them; two, not one,
    so that a batch norm still has rows to average."""
    gm, roles = raw[0], raw[1]
    tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    nested = [k for k, v in named.items() if k not in tensors and any(
        isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v))]
    sizes = {v.shape[0] for v in tensors.values()}
    if nested or len(sizes) != 1 or next(iter(sizes)) <= rows:
        return named
    for node in gm.graph.nodes:
        role = roles.get(node.name)
        if node.op == "placeholder" and role is not None and role[0] == "input" \
                and role[1] in tensors:
            value = node.meta.get("example_value", node.meta.get("val"))
            if not isinstance(value, torch.Tensor) or not isinstance(value.shape[0],
                                                                      torch.SymInt):
                return named
    return {k: v[:rows] if k in tensors else v for k, v in named.items()}


def _computes_as_model(model: torch.nn.Module, named: dict[str, Any], raw: Raw,
                       autocast: tuple[str, torch.dtype] | None) -> bool:
    """Whether ``raw``'s graph returns and writes to the buffers bit for bit what
    ``model(**named)`` does (the same random numbers drawn, the buffers as they were before
    each run)."""
    from orgel.graph.measure import role_value

    gm, roles, leaves, _ = raw
    buffers = [b for b in model.buffers() if b is not None]
    before = [b.detach().clone() for b in buffers]
    args = [role_value(model, named, roles[n.name]) for n in gm.graph.nodes
            if n.op == "placeholder"]
    region = (torch.autocast(autocast[0], dtype=autocast[1]) if autocast is not None
              else contextlib.nullcontext())
    kind = device_type(list(named.values()))
    indices = sorted({t.device.index or 0 for t in named.values()
                      if isinstance(t, torch.Tensor) and t.device.type == kind})
    with torch.random.fork_rng(devices=[] if kind == "cpu" else indices, device_type=kind):
        # grad mode on, as traced
        torch.manual_seed(0)
        with region:
            expected = [t.detach() if isinstance(t, torch.Tensor) else t  # free its graph
                        for t in pytree.tree_leaves(call(model, named))]
        with torch.no_grad():
            written = [b.detach().clone() for b in buffers]
            for b, value in zip(buffers, before, strict=True):
                b.copy_(value)
        torch.manual_seed(0)
        got = gm(*args)
    # the buffers the forward writes in place: each layer its own, as the model does
    if len(expected) != len(leaves) or not all(
            torch.equal(b, w) for b, w in zip(buffers, written, strict=True)):
        return False
    for want, (leaf, payload) in zip(expected, leaves, strict=True):
        value = got[payload] if leaf == "out" else want
        if isinstance(want, torch.Tensor) != isinstance(value, torch.Tensor):
            return False
        if isinstance(want, torch.Tensor) and not (
                want.shape == value.shape and want.dtype == value.dtype
                and torch.equal(want, value)):
            return False
    return True


def _dynamic_or_static(model: torch.nn.Module, named: dict[str, Any],
                       autocast: tuple[str, torch.dtype] | None, dynamic: bool,
                       notes: list[str]) -> Raw:
    """Dynamo's graph with symbolic sizes, or with static ones where that fails."""
    if not dynamic:
        return _dynamo_graph(model, named, autocast)
    try:
        return _dynamo_graph(model, named, autocast, dynamic=True)
    except GraphBreakError:  # a break is no matter of sizes: tracing again statically
        raise  # would stop at the same place, seconds later (zoo, 2026-12-06: it always did)
    except Exception as exc:  # noqa: BLE001 - any failure: the static capture decides
        raw = _dynamo_graph(model, named, autocast)  # its error, if any, is today's error
        reason = (str(exc).splitlines() or [""])[0][:200]
        notes.append(f"captured with static sizes: the symbolic capture failed "
                     f"({type(exc).__name__}: {reason})")
        return raw


def _dynamo_graph(model: torch.nn.Module, named: dict[str, Any],
                  autocast: tuple[str, torch.dtype] | None = None, dynamic: bool = False) -> Raw:
    """Dynamo's graph of ``model`` on ``named``; ``autocast``: the ``(device type, dtype)``
    region the forward runs in (part of the graph)."""
    traced = mark_sizes(named) if dynamic else named  # views carry the marks, not the caller's
    capturer, kept = capturer_for(model, traced, autocast, dynamic)
    try:
        # Traced with grad enabled, as in training: dynamo specialises on grad mode.
        with dynamo_settings(), own_code_state(), size_settings(dynamic):
            gm, examples, out, result = capturer.run(model, traced)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
        # Unsupported: a graph break; UserError: a guard on a data-dependent value
        # (``if t.item() > 0``), which is a graph break under fullgraph too.
        raise GraphBreakError(_describe_break(exc)) from None
    except LookupError as exc:
        raise CaptureError(
            f"{exc}; orgel needs exactly one graph of the forward (does the model compute "
            "anything with tensors?)") from None
    finally:
        if not kept:
            capturer.forget()
    by_id = _identity_roles(model, traced)
    roles: dict[str, tuple[str, Any]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, examples, strict=True):
        if isinstance(example, torch.Tensor):
            roles[node.name] = by_id.get(id(example), ("const", example))
        elif not dynamic:
            raise CaptureError(
                f"graph input {node.name} is a {type(example).__name__}, not a tensor; "
                "orgel captured with static shapes"
            )
    if dynamic:
        bind_sizes(gm, roles)
    out_index = {id(t): i for i, t in enumerate(out) if isinstance(t, torch.Tensor)}
    leaves, spec = pytree.tree_flatten(result)
    return gm, roles, [_leaf(x, out_index, by_id) for x in leaves], spec


def _leaf(x: Any, out_index: dict[int, int], by_id: dict[int, tuple[str, Any]]) -> tuple[str, Any]:
    if isinstance(x, torch.Tensor):
        if id(x) in out_index:
            return ("out", out_index[id(x)])
        role = by_id.get(id(x))
        if role is not None and role[0] == "input":
            return role
        raise CaptureError(
            "the model returns a tensor that the captured graph does not compute "
            f"(shape {tuple(x.shape)}); return only tensors computed from the inputs"
        )
    return ("const", x)


def _export_graph(model: torch.nn.Module, named: dict[str, Any]) -> Raw:
    from torch.export.graph_signature import InputKind, OutputKind

    try:
        ep = torch.export.export(model, (), kwargs=nest(named), strict=False)
    except Exception as exc:
        hint = ""
        if "Cache" in str(exc):  # a Hugging Face model inside the user's own module
            hint = (" (a Hugging Face model returns its generation cache: call it with "
                    "use_cache=False; orgel does so for the model it is given)")
        raise CaptureError(f"torch.export could not capture the model"
                           f"{meta_autocast_advice(exc, model)}: {exc}{hint}") from exc
    gm = ep.graph_module
    _inline_grad_regions(gm)
    by_obj = _identity_roles(model, named)
    user_names = list(named)
    roles: dict[str, tuple[str, Any]] = {}
    user_i = 0
    for spec in ep.graph_signature.input_specs:
        pname = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            roles[pname] = by_obj[id(model.get_parameter(spec.target))]
        elif spec.kind == InputKind.BUFFER:
            roles[pname] = by_obj[id(model.get_buffer(spec.target))]
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            roles[pname] = ("const", ep.constants[spec.target])
        elif spec.kind == InputKind.USER_INPUT:
            roles[pname] = ("input", user_names[user_i])
            user_i += 1
        else:
            raise CaptureError(f"torch.export input {pname} of kind {spec.kind} is not supported")
    # Functional buffer updates come back as extra outputs: write them in place
    # again so that a stage updates the buffers it owns, as the eager model does.
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output_node.args[0])
    by_name = {n.name: n for n in gm.graph.nodes}
    buffer_node = {spec.target: spec.arg.name for spec in ep.graph_signature.input_specs
                   if spec.kind == InputKind.BUFFER}
    user_outs = []
    for spec, value in zip(ep.graph_signature.output_specs, outs, strict=True):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            with gm.graph.inserting_before(output_node):
                gm.graph.call_function(
                    torch.ops.aten.copy_.default, (by_name[buffer_node[spec.target]], value)
                )
        elif spec.kind == OutputKind.USER_OUTPUT:
            user_outs.append(value)
        else:
            raise CaptureError(f"torch.export output of kind {spec.kind} is not supported")
    nodes_out = [v for v in user_outs if isinstance(v, torch.fx.Node)]
    output_node.args = (tuple(nodes_out),)
    gm.recompile()
    leaves: list[tuple[str, Any]] = []
    for v in user_outs:
        leaves.append(("out", nodes_out.index(v)) if isinstance(v, torch.fx.Node) else ("const", v))
    return gm, roles, leaves, ep.call_spec.out_spec


def _inline_grad_regions(gm: torch.fx.GraphModule) -> None:
    """Replace export's ``wrap_with_set_grad_enabled`` regions by grad switches + their ops."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph = gm.graph
    for node in list(graph.nodes):
        if hop is None or node.op != "call_function" or node.target is not hop:
            continue
        flag, sub_node, *args = node.args
        sub = getattr(gm, str(sub_node.target))
        env: dict[torch.fx.Node, Any] = {}
        outs: list[Any] = []
        with graph.inserting_before(node):
            graph.call_function(GRAD_SWITCH, (bool(flag),))
            inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
            env.update(zip(inner, args, strict=True))
            for sn in sub.graph.nodes:
                if sn.op == "output":
                    outs = [env[a] if isinstance(a, torch.fx.Node) else a for a in sn.args[0]]
                elif sn.op != "placeholder":
                    env[sn] = graph.node_copy(sn, env.__getitem__)
            graph.call_function(GRAD_SWITCH, (True,))
        for user in list(node.users):
            user.replace_all_uses_with(outs[int(user.args[1])])
            graph.erase_node(user)
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
    gm.recompile()


def _describe_break(exc: BaseException) -> str:
    """One message: what broke the graph, where, dynamo's reason and how to fix it."""
    text = str(exc)
    kind = getattr(exc, "gb_type", None) or (
        "data-dependent control flow" if "data-dependent" in text else text.splitlines()[0][:120]
    )
    where = ""
    frame = getattr(exc, "innermost_user_frame_summary", None)
    if frame is not None:
        where = f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    else:
        match = re.search(r'File "([^"]+)", line (\d+).*\n\s*(.+)', text)
        if match:
            where = f" at {match.group(1)}:{match.group(2)} `{match.group(3).strip()}`"
    reason = ""
    match = re.search(r"Explanation: (.+)", text)
    if match:
        reason = f": {match.group(1).strip()}"
    hints = re.findall(r"Hint: (.+)", text)
    hint = f" Dynamo's hint: {hints[0].strip()}" if hints else ""
    return (
        f"graph break ({kind}){where}{reason}. For one graph of the whole forward, "
        "rewrite that line without the break (no .item()/Python branches on "
        "tensor values, no print; use torch.where or torch.cond), or move it out of "
        f"the model into the loss or data code.{hint}"
    )

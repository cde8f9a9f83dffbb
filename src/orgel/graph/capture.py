"""Capture a model's forward as one fx graph (TorchDynamo, or torch.export as fallback).

Dynamo route: ``torch.compile(model, backend=..., fullgraph=True)`` hands our
backend the fx graph with parameters and buffers lifted as inputs, and the real
tensors behind them, so placeholders are matched to parameters, buffers and
model inputs by identity (never by position). A graph break is an error that
names dynamo's reason and the user's source line. Export route:
``torch.export.export(strict=False)``, whose graph signature names the same roles.

Either way the graph is then run once on the real inputs to measure, per node,
output sizes, FLOPs (``FlopCounterMode``) and the bytes autograd saves for
backward (``saved_tensors_hooks``). The model's buffers and the RNG state are
restored afterwards, so capturing does not change the model.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from orgel.graph.opgraph import OpGraph, OpNode, OutputSpec
from orgel.workload import named_inputs

METHODS = ("auto", "dynamo", "export")

# Nodes that switch state rather than compute: recorded as each node's grad mode.
_GRAD_SWITCH = torch._C._set_grad_enabled
_DROP = {"_log_api_usage_once"}


class CaptureError(RuntimeError):
    """The model could not be captured as one graph; the message says why and what to try."""


class GraphBreakError(CaptureError):
    """TorchDynamo hit a graph break: the message names the reason and the source line."""


def capture(model: torch.nn.Module, inputs: Any, *, method: str = "auto") -> OpGraph:
    """Capture ``model``'s forward on ``inputs`` (tuple or dict) as an :class:`OpGraph`.

    ``method``: ``"dynamo"`` (torch.compile backend), ``"export"`` (torch.export,
    non-strict) or ``"auto"`` (dynamo, falling back to export when dynamo fails
    for a reason other than a graph break). Facts are measured on these inputs:
    pass one micro-batch to get per-micro-batch sizes.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    named = named_inputs(model, inputs)
    saved_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    notes: list[str] = []
    try:
        if method == "export":
            raw = _export_graph(model, named)
        else:
            try:
                raw = _dynamo_graph(model, named)
            except CaptureError:
                raise
            except Exception as exc:  # dynamo internal failure: try export
                if method == "dynamo":
                    raise CaptureError(f"torch.compile could not capture the model: {exc}") from exc
                notes.append(f"dynamo failed ({type(exc).__name__}: {str(exc)[:200]}); used export")
                raw = _export_graph(model, named)
        _restore(model, saved_buffers, rng)
        used = "export" if method == "export" or notes else "dynamo"
        graph = _measure(model, named, raw, notes, used)
    finally:
        _restore(model, saved_buffers, rng)
    return graph


def _restore(model: torch.nn.Module, buffers: dict[str, torch.Tensor], rng: torch.Tensor) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    torch.set_rng_state(rng)


# -- the two routes: both return (gm, roles, leaves, treespec) -------------------------
# roles: placeholder name -> ("input", name) | ("param", qualname) | ("buffer", qualname)
#        | ("const", tensor); leaves: ("out", index) | ("input", name) | ("const", obj)

Raw = tuple[torch.fx.GraphModule, dict[str, tuple[str, Any]], list[tuple[str, Any]], Any]


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


def _dynamo_graph(model: torch.nn.Module, named: dict[str, Any]) -> Raw:
    captured: list[tuple[torch.fx.GraphModule, list[Any]]] = []
    returned: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured.append((gm, list(example_inputs)))

        def run(*args: Any) -> Any:
            with torch.no_grad():
                out = gm(*args)
            returned.append(out)
            return out

        return run

    # A fresh cache: dynamo keys compiled code on the forward's code object, so a
    # previous capture of another instance (or >8 of them) would skip our backend.
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        # Traced with grad enabled, as in training: dynamo specialises on grad mode.
        result = compiled(**named)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
        # Unsupported: a graph break; UserError: a guard on a data-dependent value
        # (``if t.item() > 0``), which is a graph break under fullgraph too.
        raise GraphBreakError(_describe_break(exc)) from None
    finally:
        torch._dynamo.reset()
    if len(captured) != 1 or not returned:
        raise CaptureError(
            f"torch.compile produced {len(captured)} graphs; orgel needs exactly one graph "
            "of the forward (does the model compute anything with tensors?)"
        )
    gm, examples = captured[0]
    by_id = _identity_roles(model, named)
    roles: dict[str, tuple[str, Any]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, examples, strict=True):
        if not isinstance(example, torch.Tensor):
            raise CaptureError(
                f"graph input {node.name} is a {type(example).__name__}, not a tensor; "
                "orgel captures with static shapes (no symbolic sizes)"
            )
        roles[node.name] = by_id.get(id(example), ("const", example))
    out_index = {id(t): i for i, t in enumerate(returned[0]) if isinstance(t, torch.Tensor)}
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
        ep = torch.export.export(model, (), kwargs=named, strict=False)
    except Exception as exc:
        raise CaptureError(f"torch.export could not capture the model: {exc}") from exc
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
            graph.call_function(_GRAD_SWITCH, (bool(flag),))
            inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
            env.update(zip(inner, args, strict=True))
            for sn in sub.graph.nodes:
                if sn.op == "output":
                    outs = [env[a] if isinstance(a, torch.fx.Node) else a for a in sn.args[0]]
                elif sn.op != "placeholder":
                    env[sn] = graph.node_copy(sn, env.__getitem__)
            graph.call_function(_GRAD_SWITCH, (True,))
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
        f"graph break ({kind}){where}{reason}. orgel pipelines one graph of the whole "
        "forward: rewrite that line without the break (no .item()/Python branches on "
        "tensor values, no print; use torch.where or torch.cond), or move it out of "
        f"the model into the loss or data code.{hint}"
    )


# -- measurement ---------------------------------------------------------------------


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    text = str(list(stack.values())[-1][0])
    for _ in range(8):  # getattr(getattr(L['self'].h, '0'), 'attn') → L['self'].h.0.attn
        new = re.sub(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)", r"\1.\2", text)
        if new == text:
            break
        text = new
    text = re.sub(r"^L\['[^']*'\]", "", text)
    text = re.sub(r"\._modules\['([^']*)'\]", r".\1", text)
    text = re.sub(r"\[(\d+)\]", r".\1", text)
    text = re.sub(r"\['([^']*)'\]", r".\1", text)
    return text.strip(".")


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket.__name__)
    return str(getattr(target, "__name__", target))


def _source(node: torch.fx.Node) -> str:
    matches = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    return f"{matches[-1][0]}:{matches[-1][1]}" if matches else ""


def _describe(value: Any) -> tuple[tuple[int, ...] | None, str | None, int, bool, bool]:
    """(shape, dtype, bytes, is_tensor, requires_grad) of a node's output."""
    if isinstance(value, torch.Tensor):
        return (
            tuple(value.shape), str(value.dtype).replace("torch.", ""),
            value.numel() * value.element_size(), True, value.requires_grad,
        )
    tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return None, None, nbytes, False, any(t.requires_grad for t in tensors)


def _measure(
    model: torch.nn.Module, named: dict[str, Any], raw: Raw, notes: list[str], method: str
) -> OpGraph:
    gm, roles, raw_leaves, treespec = raw
    graph = gm.graph
    input_names = [r[1] for r in roles.values() if r[0] == "input"]
    # Name values by what they are: a model input's placeholder takes the input's name.
    for node in graph.nodes:
        if node.op != "placeholder" and node.name in input_names:
            node._rename(node.name + "_v")
    attr_of: dict[str, str] = {}
    params: dict[str, torch.nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    args: list[Any] = []
    for node in list(graph.nodes):
        if node.op == "placeholder":
            kind, payload = roles[node.name]
            if kind == "input":
                node._rename(payload)
                if node.name != payload:  # the namespace still remembers a renamed node
                    node.name = payload
                args.append(named[payload])
                continue
            if kind == "param":
                params[payload] = model.get_parameter(payload)
                args.append(params[payload])
            elif kind == "buffer":
                buffers[payload] = model.get_buffer(payload)
                args.append(buffers[payload])
            else:
                payload = f"_orgel_const_{len(constants)}"
                constants[payload] = roles[node.name][1]
                args.append(constants[payload])
            attr_of[node.name] = payload
        elif node.op == "get_attr":
            name = f"_orgel_const_{len(constants)}"
            constants[name] = getattr(gm, str(node.target))
            attr_of[node.name] = name
        elif node.op == "call_module":
            raise CaptureError(f"captured graph calls submodule {node.target}; not supported")
        elif node.op == "call_function" and _op_name(node) in _DROP:
            graph.erase_node(node)
    mutated = _rewire_inplace(graph, attr_of)
    gm.recompile()

    facts = _run_measured(gm, args, attr_of, params, buffers)
    nodes: dict[str, OpNode] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or node.target is _GRAD_SWITCH:
            continue
        reads = [n for n in node.all_input_nodes if n.op != "call_function"
                 or n.target is not _GRAD_SWITCH]
        value, saved, flops, grad_mode = facts[node.name]
        shape, dtype, nbytes, is_tensor, requires_grad = _describe(value)
        pnames = tuple(dict.fromkeys(attr_of[n.name] for n in reads if n.name in attr_of))
        nodes[node.name] = OpNode(
            name=node.name, op=_op_name(node), module=_module_path(node),
            inputs=tuple(dict.fromkeys(n.name for n in reads if n.name not in attr_of)),
            params=pnames, shape=shape, dtype=dtype, nbytes=nbytes,
            param_bytes=sum(_nbytes(params, buffers, constants, p) for p in pnames),
            flops=flops if flops else (value.numel() if isinstance(value, torch.Tensor) else 0),
            saved_bytes=saved, requires_grad=requires_grad, is_tensor=is_tensor,
            grad_enabled=grad_mode, source=_source(node),
            constant=None if is_tensor or _holds_tensors(value, 3) else value,
            mutates=mutated.get(node.name),
        )
    output_node = next(n for n in graph.nodes if n.op == "output")
    out_values = list(output_node.args[0])
    leaves: list[tuple[str, Any]] = []
    for kind, payload in raw_leaves:
        if kind == "out":
            src = out_values[payload]
            if src.name in attr_of:
                raise CaptureError(f"the model returns parameter/buffer {attr_of[src.name]}")
            leaves.append(("value", src.name))
        elif kind == "input":
            leaves.append(("value", payload))
        else:
            leaves.append(("const", _constant_leaf(payload, notes)))
    aliases: dict[str, list[str]] = {}
    canonical = {id(p): n for n, p in params.items()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in canonical:
            aliases.setdefault(canonical[id(p)], []).append(name)
    return OpGraph(
        graph_module=gm, nodes=nodes, model_inputs=[n for n in named if n in input_names],
        params=params, buffers=buffers, constants=constants, attr_of=attr_of,
        output_spec=OutputSpec(treespec, leaves), method=method,
        aliases={k: v for k, v in aliases.items() if len(v) > 1}, notes=notes,
    )


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift}


def _mutated_arg(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor argument ``node`` overwrites in place, if any."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    first = node.args[0]
    if not isinstance(first, torch.fx.Node):
        return None
    target = node.target
    if node.op == "call_method":
        name = str(target)
        inplace = name.endswith("_") and not name.startswith("_")
    elif isinstance(target, torch._ops.OpOverload):
        args = target._schema.arguments
        inplace = bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    else:
        name = getattr(target, "__name__", "")
        inplace = (target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True
                   or (name.endswith("_") and not name.startswith("_")))
    return first if inplace else None


def _rewire_inplace(graph: torch.fx.Graph, attr_of: dict[str, str]) -> dict[str, str]:
    """Make in-place updates explicit: later readers of ``x`` read ``x.add_(y)`` instead.

    The graph computes the same thing (the in-place op returns ``x`` itself),
    but now the data dependency is an edge, so a split sends the updated value
    and never a stale copy. Returns {in-place node: value it overwrites}.
    Parameters and buffers (BatchNorm's counter) are left alone: they live in
    the stage that updates them.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    mutated: dict[str, str] = {}
    for node in list(graph.nodes):
        target = _mutated_arg(node)
        if target is None or target.name in attr_of:
            continue
        mutated[node.name] = target.name
        for user in list(target.users):
            if user is not node and order[user] > order[node]:
                user.replace_input_with(target, node)
    return mutated


def _nbytes(*tables_and_name: Any) -> int:
    *tables, name = tables_and_name
    for table in tables:
        if name in table:
            t = table[name]
            return int(t.numel() * t.element_size())
    return 0


def _constant_leaf(obj: Any, notes: list[str]) -> Any:
    """Keep a non-tensor output as a constant, unless it hides tensors (e.g. a KV cache)."""
    if _holds_tensors(obj, 3):
        notes.append(
            f"the model also returns a {type(obj).__name__} holding tensors (not a pytree); "
            "the split model returns None there (for HF models pass use_cache=False)"
        )
        return None
    return obj


def _holds_tensors(obj: Any, depth: int) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return False
    if isinstance(obj, dict):
        return any(_holds_tensors(v, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return any(_holds_tensors(v, depth - 1) for v in obj)
    return hasattr(obj, "__dict__") and _holds_tensors(vars(obj), depth - 1)


def _run_measured(
    gm: torch.fx.GraphModule, args: list[Any], attr_of: dict[str, str],
    params: dict[str, torch.nn.Parameter], buffers: dict[str, torch.Tensor],
) -> dict[str, tuple[Any, int, int, bool]]:
    """Run the graph on real tensors: per node (output, saved bytes, FLOPs, grad mode)."""
    excluded = {t.untyped_storage().data_ptr() for t in [*params.values(), *buffers.values()]}
    counted: set[int] = set()
    keep: list[Any] = []  # hold saved storages so a freed address is never reused
    facts: dict[str, tuple[Any, int, int, bool]] = {}

    class Measured(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op not in ("call_function", "call_method"):
                return super().run_node(n)
            saved: list[torch.Tensor] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved.append(t)
                return t

            grad_mode = torch.is_grad_enabled()
            counter = FlopCounterMode(display=False)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
                out = super().run_node(n)
            nbytes = 0
            for t in saved:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in excluded or key in counted or storage.nbytes() == 0:
                    continue
                counted.add(key)
                keep.append(storage)
                nbytes += storage.nbytes()
            facts[n.name] = (out, nbytes, int(counter.get_total_flops()), grad_mode)
            return out

    grad_before = torch.is_grad_enabled()
    try:
        with torch.enable_grad():
            Measured(gm).run(*args)
    finally:
        torch._C._set_grad_enabled(grad_before)
    return facts

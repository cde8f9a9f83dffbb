"""Measure a captured graph on a real forward: per-node sizes, FLOPs, saved-for-backward bytes.

The graph runs once under an fx Interpreter on the real inputs, parameters and
buffers. Around every node a ``saved_tensors_hooks`` pair records the tensors
autograd keeps for backward (storages counted once, parameters and buffers
left out) and a ``FlopCounterMode`` counts its FLOPs. The graph is also
normalised here: values are named (model inputs by keyword), in-place updates
become explicit edges, and the result is an :class:`OpGraph`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import re
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from orgel.graph.opgraph import CaptureError, OpGraph, OpNode, OutputSpec, held_bytes
from orgel.graph.regions import collapse_transforms
from orgel.graph.repeat import COPIES, module_path
from orgel.graph.sizes import is_symbolic, static_shapes, symbolic_shapes

# Nodes that switch state rather than compute: recorded as each node's grad mode.
GRAD_SWITCH = torch._C._set_grad_enabled
AUTOCAST_ENTER = torch.amp.autocast_mode._enter_autocast
AUTOCAST_EXIT = torch.amp.autocast_mode._exit_autocast
#: Graph nodes that change a mode rather than compute: recorded on the nodes they govern.
STRUCTURAL = (GRAD_SWITCH, AUTOCAST_ENTER, AUTOCAST_EXIT)
_DROP = {"_log_api_usage_once"}

#: (graph, placeholder roles, output leaves, output treespec) from a capture route.
Raw = tuple[torch.fx.GraphModule, dict[str, tuple[str, Any]], list[tuple[str, Any]], Any]

def role_value(model: torch.nn.Module, named: dict[str, Any], role: tuple[str, Any]) -> Any:
    """What a graph's placeholder of ``role`` takes as ``model`` runs on ``named``."""
    kind, payload = role
    if kind == "input":
        return named[payload]
    if kind == "size":
        return int(named[payload[0]].shape[payload[1]])
    if kind == "param":
        return model.get_parameter(payload)
    if kind == "buffer":
        return model.get_buffer(payload)
    return payload


def op_name(node: torch.fx.Node) -> str:
    """The name of the op a graph node calls (a method, an aten overload packet, a function)."""
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


def measure(
    model: torch.nn.Module, named: dict[str, Any], raw: Raw, notes: list[str], method: str
) -> OpGraph:
    gm, roles, raw_leaves, treespec = raw
    if collapse_transforms(gm):
        notes.append("torch.vmap regions run whole, each as one node")
    graph = gm.graph
    input_names = [r[1] for r in roles.values() if r[0] == "input"]
    # Name values by what they are: a model input's placeholder takes the input's name.
    for node in graph.nodes:
        if node.op != "placeholder" and node.name in input_names:
            node._rename(node.name + "_v")
    attr_of: dict[str, str] = {}
    sizes: dict[str, tuple[str, int]] = {}  # size placeholder -> (model input, dim)
    params: dict[str, torch.nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    args: list[Any] = []
    for node in list(graph.nodes):
        if node.op == "placeholder":
            kind, payload = roles[node.name]
            args.append(role_value(model, named, roles[node.name]))
            if kind == "input":
                node._rename(payload)
                if node.name != payload:  # the namespace still remembers a renamed node
                    node.name = payload
                continue
            if kind == "size":  # measured at the example's size
                name = f"{payload[0]}_size{payload[1]}"
                node._rename(name)
                sizes[node.name] = payload
                continue
            if kind == "param":
                params[payload] = args[-1]
            elif kind == "buffer":
                buffers[payload] = args[-1]
            else:
                payload = f"_orgel_const_{len(constants)}"
                constants[payload] = args[-1]
            attr_of[node.name] = payload
        elif node.op == "get_attr":
            name = f"_orgel_const_{len(constants)}"
            constants[name] = getattr(gm, str(node.target))
            attr_of[node.name] = name
        elif node.op == "call_module":
            raise CaptureError(f"captured graph calls submodule {node.target}; not supported")
        elif node.op == "call_function" and op_name(node) in _DROP:
            graph.erase_node(node)
    mutated = _rewire_inplace(graph, attr_of)
    fake = any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
    if fake:  # a meta model, traced on meta inputs: its graph runs where the inputs are
        to_device(gm, next((a.device for a in args if isinstance(a, torch.Tensor)
                            and not a.is_meta), torch.device("cpu")))
    gm.recompile()

    facts = _run_measured(gm, args, attr_of, params, buffers, fake=fake,
                          copies=gm.meta.pop(COPIES, None))
    nodes: dict[str, OpNode] = {}
    # size arithmetic on the size placeholders: recomputed by every stage that reads it
    size_nodes = set(sizes)
    for node in graph.nodes:
        if (node.op in ("call_function", "call_method") and sizes
                and is_symbolic(node.meta.get("example_value"))):
            size_nodes.add(node.name)
    for node in graph.nodes:
        if (node.op not in ("call_function", "call_method") or node.target in STRUCTURAL
                or node.name in size_nodes):
            continue
        reads = [n for n in node.all_input_nodes if (n.op != "call_function"
                 or n.target not in STRUCTURAL) and n.name not in size_nodes]
        value, saved, flops, grad_mode, autocast = facts[node.name]
        shape, dtype, nbytes, is_tensor, requires_grad = _describe(value)
        pnames = tuple(dict.fromkeys(attr_of[n.name] for n in reads if n.name in attr_of))
        nodes[node.name] = OpNode(
            name=node.name, op=op_name(node), module=module_path(node),
            inputs=tuple(dict.fromkeys(n.name for n in reads if n.name not in attr_of)),
            params=pnames, shape=shape, dtype=dtype, nbytes=nbytes,
            param_bytes=sum(held_bytes(p, params, buffers, constants) for p in pnames),
            flops=flops if flops else (value.numel() if isinstance(value, torch.Tensor) else 0),
            saved_bytes=saved, requires_grad=requires_grad, is_tensor=is_tensor,
            grad_enabled=grad_mode, autocast=autocast, source=_source(node),
            constant=None if is_tensor or holds_tensors(value, 3) else value,
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
        written=_written_buffers(graph, attr_of, buffers), sizes=sizes,
        size_nodes=sorted(size_nodes - set(sizes)),
        shapes=gm.meta.get("orgel_shapes") or static_shapes(named),
        symbolic_shapes=symbolic_shapes(graph, nodes) if sizes else {},
    )


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift}


@functools.cache
def _inplace_signature(target: Any) -> inspect.Signature | None:
    """``target``'s signature where it has an ``inplace`` parameter (else None), read once
    per function: a 126-layer graph asked it 17,000 times (13 s)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    return signature if "inplace" in signature.parameters else None


def _inplace_flag(node: torch.fx.Node) -> bool:
    """Whether ``node`` passes ``inplace=True``, by keyword or by position (``F.hardtanh``)."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        signature = _inplace_signature(node.target)
    except TypeError:  # an unhashable target: asked each time
        signature = _inplace_signature.__wrapped__(node.target)
    if signature is None:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:  # other arguments than the signature takes
        return False
    return bound.arguments.get("inplace") is True


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
        inplace = (target in _INPLACE_OPERATORS or _inplace_flag(node)
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


# Ops that update the running statistics they read (BatchNorm in training mode).
_STAT_UPDATES = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                 "_native_batch_norm_legit_functional", "instance_norm"}


def _written_buffers(
    graph: torch.fx.Graph, attr_of: dict[str, str], buffers: dict[str, torch.Tensor]
) -> list[str]:
    """Buffers the forward updates in place (``add_`` on a counter, BatchNorm statistics)."""
    written: dict[str, None] = {}
    for node in graph.nodes:
        target = _mutated_arg(node)
        if target is not None and attr_of.get(target.name) in buffers:
            written[attr_of[target.name]] = None
        if node.op in ("call_function", "call_method") and op_name(node) in _STAT_UPDATES:
            for arg in node.all_input_nodes:
                if attr_of.get(arg.name) in buffers:
                    written[attr_of[arg.name]] = None
    return list(written)


def _constant_leaf(obj: Any, notes: list[str]) -> Any:
    """Keep a non-tensor output as a constant, unless it hides tensors (e.g. a KV cache)."""
    if holds_tensors(obj, 3):
        notes.append(
            f"the model also returns a {type(obj).__name__} holding tensors (not a pytree); "
            "the split model returns None there (for HF models pass use_cache=False)"
        )
        return None
    return obj


def holds_tensors(obj: Any, depth: int) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return False
    if isinstance(obj, dict):
        return any(holds_tensors(v, depth - 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return any(holds_tensors(v, depth - 1) for v in obj)
    return hasattr(obj, "__dict__") and holds_tensors(vars(obj), depth - 1)


def to_device(gm: torch.fx.GraphModule, device: torch.device,
              source: torch.device | str = "meta") -> bool:
    """Make ``gm``'s ops that name the ``source`` device (``torch.arange(n, device=x.device)``
    traced on inputs there, an autocast region entered for its device type) name
    ``device``; whether any did. Recompile afterwards."""
    source = torch.device(source)
    changed = False

    def swap(a: Any) -> Any:
        nonlocal changed
        if isinstance(a, torch.device) and a.type == source.type and (
                source.index is None or a.index in (None, source.index)):
            changed = True
            return device
        return a

    for node in gm.graph.nodes:
        node.args = pytree.tree_map(swap, node.args)
        node.kwargs = pytree.tree_map(swap, node.kwargs)
        if (node.target is torch.amp.autocast_mode._enter_autocast and node.args
                and node.args[0] == source.type):  # the autocast region names a device type
            node.args = (device.type, *node.args[1:])
            changed = True
    return changed


def _storage_key(storage: torch.UntypedStorage) -> int:
    """One number per storage: its address, or for a storage without data (meta, fake) the
    storage object's own (negative: never an address)."""
    ptr = int(storage.data_ptr()) if storage.device.type != "meta" else 0
    return ptr if ptr else -int(storage._cdata)


def _fake_args(args: list[Any], mode: Any) -> list[Any]:
    """``args`` as fake tensors on their real devices (meta parameters on the CPU).

    Ops on fake tensors dispatch as on that device (scaled-dot-product attention
    picks the CPU kernel, and saves what it saves) without allocating anything.
    """
    out: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_meta:
            with mode:
                t = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu")
            out.append(t.requires_grad_(a.requires_grad))
        elif isinstance(a, torch.Tensor):
            out.append(mode.from_tensor(a))
        else:
            out.append(a)
    return out


def _run_measured(
    gm: torch.fx.GraphModule, args: list[Any], attr_of: dict[str, str],
    params: dict[str, torch.nn.Parameter], buffers: dict[str, torch.Tensor], *,
    fake: bool = False, copies: dict[torch.fx.Node, torch.fx.Node] | None = None,
) -> dict[str, tuple[Any, int, int, bool, tuple[tuple[Any, ...], ...]]]:
    """Run the graph on real tensors: per node (output, saved bytes, FLOPs, grad mode, autocast).

    ``fake``: on fake tensors instead (a meta model): the same facts, no memory.
    ``copies``: nodes that are copies of an earlier node on the same shapes
    (:func:`orgel.graph.repeat.replicate`): they take its output, saved bytes and FLOPs.
    """
    copied = copies or {}
    weights: list[torch.Tensor] = [*params.values(), *buffers.values()]
    mode: Any = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        held = set(map(id, weights))
        fakes = _fake_args(args, mode)
        weights = [f for a, f in zip(args, fakes, strict=True) if id(a) in held]
        args = fakes
    excluded = {_storage_key(t.untyped_storage()) for t in weights}
    counted: set[int] = set()
    keep: list[Any] = []  # hold saved storages so a freed address is never reused
    facts: dict[str, tuple[Any, int, int, bool, tuple[tuple[Any, ...], ...]]] = {}
    autocast: list[tuple[Any, ...]] = []  # the open autocast regions' arguments

    class Measured(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.op not in ("call_function", "call_method"):
                return super().run_node(n)
            source = copied.get(n)
            if source is not None and n.target not in (AUTOCAST_ENTER, AUTOCAST_EXIT):
                out, nbytes, flops, _, _ = facts[source.name]
                facts[n.name] = (out, nbytes, flops, torch.is_grad_enabled(), tuple(autocast))
                return out
            saved: list[torch.Tensor] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                saved.append(t)
                return t

            grad_mode = torch.is_grad_enabled()
            regions = tuple(autocast)
            counter = FlopCounterMode(display=False)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
                out = super().run_node(n)
            if n.target is AUTOCAST_ENTER:
                autocast.append(tuple(n.args))
            elif n.target is AUTOCAST_EXIT:
                autocast.pop()
            nbytes = 0
            for t in saved:
                storage = t.untyped_storage()
                key = _storage_key(storage)
                if key in excluded or key in counted or storage.nbytes() == 0:
                    continue
                counted.add(key)
                keep.append(storage)
                nbytes += storage.nbytes()
            flops = int(counter.get_total_flops())
            if not flops and n.target is torch.nn.functional.scaled_dot_product_attention:
                flops = attention_flops(*self.fetch_args_kwargs_from_env(n))
            facts[n.name] = (out, nbytes, flops, grad_mode, regions)
            return out

    grad_before = torch.is_grad_enabled()
    try:
        with torch.enable_grad(), mode:
            Measured(gm).run(*args)
    finally:
        torch._C._set_grad_enabled(grad_before)
    return facts


def attention_flops(args: Any, kwargs: dict[str, Any]) -> int:
    """FLOPs of an SDPA call, for the CPU kernels ``FlopCounterMode`` does not count (the
    captured graph runs them, on real or fake CPU tensors): ``Q K^T`` and ``P V``, two
    FLOPs a multiply-add, as its formulas for the GPU kernels count them; a causal flag
    (``is_causal=True``) halves them, as flash attention skips the masked half (an explicit
    mask is priced whole: what it masks is not known from its shape)."""
    q, k, v = (list(args) + [kwargs.get(x) for x in ("query", "key", "value")])[:3]
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return 0
    *batch, length, e = q.shape
    keys, ev = k.shape[-2], v.shape[-1]
    count = 2 * length * keys * (e + ev)
    for b in batch:
        count *= b
    causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    return int(count // 2 if causal is True else count)


def place(module: torch.nn.Module, device: torch.device) -> None:
    """Move a stage module to ``device``: its parameters and buffers, and the device
    constants of its graphs (``torch.arange(n, device=x.device)`` captured on the CPU or
    the meta device names that device; on ``device`` it must name ``device``)."""
    module.to(device)
    for gm in module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            changed = False
            for source in ("cpu", "meta"):
                if source != device.type:
                    changed |= to_device(gm, device, source)
            if changed:
                gm.recompile()

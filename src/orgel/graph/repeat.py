"""A deep stack of identical layers captured from a shallow one: trace two, copy the second.

Dynamo traces a forward op by op, about 10 ms an op on this CPU, so a 126-layer model on
the meta device took over three minutes to capture for ``orgel plan``, nearly all of it
the same layer traced again. :func:`repeated_layers` finds the longest module list whose
elements are alike (one class, parameters and buffers of the same names, shapes, dtypes
and devices, frozen or not alike, the same settings but for ``layer_idx``, no list in the
model's config that sets them apart, and no tensor shared with another module);
:func:`two_layers` hides all but its first two while Dynamo traces; :func:`replicate`
makes the graph of every layer from the second one's nodes: layer ``i`` reads its own
parameters, takes from layer ``i - 1`` what layer 1 took from layer 0, and shares what
layer 1 read from before the layers (the mask, the position table). The graph is then
measured like any capture, on the whole model, except that a copied node takes its layer-1
node's facts (its output, saved bytes and FLOPs: the same op on the same shapes) rather
than running again (``gm.meta[COPIES]``, read by :func:`orgel.graph.measure.measure`).

It declines (returns None; the caller traces the whole model) where the layers are not one
pattern: the two traced layers differ op by op, code between the layers runs per layer, or
something after the layers reads the first layer's values (every layer's hidden states
returned). :func:`orgel.graph.capture.capture` then checks the copy against the model's
own forward before it uses it for training.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch

from orgel.graph.reuse import tied

#: fewer layers than this are traced whole (nothing to gain)
MIN_LAYERS = 4
#: the graph-module meta key of :func:`replicate`'s ``{copied node: its layer-1 node}``
COPIES = "orgel_copies"


def module_entry(node: torch.fx.Node) -> tuple[str, Any]:
    """``(module path, module class)`` a captured node ran in (``("", None)``: none).

    The innermost module of Dynamo's ``nn_module_stack`` that the model owns: a module
    reached through a global (transformers 5.25 wraps ``apply_rotary_pos_emb`` as a module
    object in the modeling file's namespace, ``G['__import_...'].apply_rotary_pos_emb``)
    runs in the layer that called it.
    """
    stack = [v for v in (node.meta.get("nn_module_stack") or {}).values()
             if not str(v[0]).startswith("G[")]
    if not stack:
        return "", None
    text = str(stack[-1][0])
    for _ in range(8):  # getattr(getattr(L['self'].h, '0'), 'attn') → L['self'].h.0.attn
        new = re.sub(r"getattr\(([^()]*), ['\"]([^'\"]+)['\"]\)", r"\1.\2", text)
        if new == text:
            break
        text = new
    text = re.sub(r"^L\['[^']*'\]", "", text)
    text = re.sub(r"\._modules\['([^']*)'\]", r".\1", text)
    text = re.sub(r"\[(\d+)\]", r".\1", text)
    text = re.sub(r"\['([^']*)'\]", r".\1", text)
    return text.strip("."), stack[-1][1]


def module_path(node: torch.fx.Node) -> str:
    """The module a captured node ran in, as a dotted path (``model.layers.3.mlp``)."""
    return module_entry(node)[0]


def repeated_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """``(qualified name, list)`` of the longest module list of alike layers, or None."""
    best: tuple[str, torch.nn.ModuleList] | None = None
    per_layer = _per_layer_settings(model)
    shared = {n for group in tied([*model.named_parameters(remove_duplicate=False),
                                   *model.named_buffers(remove_duplicate=False)])
              for n in group}
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) >= MIN_LAYERS
                and (best is None or len(module) > len(best[1]))
                and len(module) not in per_layer and _alike(module)
                and not _shares_tensors(name, shared)):
            best = (name, module)
    return best


def _shares_tensors(prefix: str, shared: set[str]) -> bool:
    """Whether a tensor under ``prefix`` has other names too (``shared``: every name of a
    tensor with several; a layer reusing layer 0's Linear): a copy would give each layer a
    tensor of its own, the value check cannot tell (the values are the same), and training
    would untie them."""
    return any(not prefix or n.startswith(prefix + ".") for n in shared)


def _per_layer_settings(model: torch.nn.Module) -> set[int]:
    """Lengths of the settings lists in the model's ``config`` whose entries differ (a
    Hugging Face ``layer_types`` of sliding and full attention): the forward may treat the
    layers of a list that long differently by their index."""
    config = getattr(model, "config", None)
    found = set()
    for value in (vars(config).values() if config is not None and hasattr(config, "__dict__")
                  else ()):
        if isinstance(value, list | tuple) and len({repr(v) for v in value}) > 1:
            found.add(len(value))
    return found


def _alike(layers: torch.nn.ModuleList) -> bool:
    first = _signature(layers[0])
    return first is not None and all(_signature(m) == first for m in layers[1:])


def _signature(layer: torch.nn.Module) -> Any:
    """What must agree between two layers for one to stand for the other (None: never)."""
    out: list[Any] = []
    for name, m in layer.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        settings = sorted((k, repr(v)) for k, v in vars(m).items()
                          if not k.startswith("_") and k != "layer_idx")
        out.append((name, type(m), settings))
    # a frozen layer is not a trained one's copy: the graph's facts say which values
    # carry gradients (freezing the first layers of a stack is common in fine-tuning)
    out.extend((n, tuple(t.shape), t.dtype, t.device, t.requires_grad) for n, t in
               [*layer.named_parameters(), *layer.named_buffers()])
    return out


@contextlib.contextmanager
def two_layers(layers: torch.nn.ModuleList) -> Iterator[None]:
    """While inside: ``layers`` holds only its first two elements."""
    kept = layers._modules
    layers._modules = type(kept)((k, kept[k]) for k in list(kept)[:2])
    try:
        yield
    finally:
        layers._modules = kept


def replicate(raw: Any, prefix: str, count: int) -> Any:
    """The captured ``raw`` graph of two layers of ``prefix`` made ``count`` layers, or None."""
    gm, roles, leaves, spec = raw
    graph = gm.graph
    nodes = list(graph.nodes)

    def layer(node: torch.fx.Node) -> int | None:
        path = module_path(node)
        for i in (0, 1):
            head = f"{prefix}.{i}"
            if path == head or path.startswith(head + "."):
                return i
        return None

    body = [n for n in nodes if n.op in ("call_function", "call_method")]
    first, second = ([n for n in body if layer(n) == i] for i in (0, 1))
    if not first or len(first) != len(second) or any(
            a.op != b.op or a.target != b.target for a, b in zip(first, second, strict=True)):
        return None
    own = set(first) | set(second)
    start, end = nodes.index(first[0]), nodes.index(second[-1])
    if any(n not in own and n.op != "placeholder" for n in nodes[start:end + 1]):
        return None  # code between the layers, run once per layer
    if any(u not in own for n in first for u in n.users):
        return None  # something after the layers reads the first layer's values
    index0 = {n: k for k, n in enumerate(first)}
    index1 = {n: k for k, n in enumerate(second)}
    # each layer-1 node's module below the layer (".mlp.up"), and its class, for its copies
    below = {n: (module_path(n)[len(f"{prefix}.1"):], module_entry(n)[1]) for n in second}
    last = [[n for n in nodes if n.op == "placeholder"][-1]]  # new placeholders go after it
    by_role = {roles[p.name]: p for p in nodes if p.op == "placeholder"}
    head = f"{prefix}.1."
    previous: list[torch.fx.Node] = second
    made: set[torch.fx.Node] = set()
    after = second[-1]
    copy_of: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in range(2, count):
        env: dict[torch.fx.Node, torch.fx.Node] = {}

        def arg(n: torch.fx.Node, i: int = i, env: dict[torch.fx.Node, torch.fx.Node] = env,
                previous: list[torch.fx.Node] = previous) -> torch.fx.Node:
            if n in env:
                return env[n]
            if n in index0:  # what layer 1 took from layer 0: from the layer before
                return previous[index0[n]]
            role = roles.get(n.name) if n.op == "placeholder" else None
            if role is not None and role[0] in ("param", "buffer") and role[1].startswith(head):
                own_role = (role[0], f"{prefix}.{i}." + role[1][len(head):])
                if own_role not in by_role:
                    with graph.inserting_after(last[0]):
                        last[0] = graph.placeholder(own_role[1].replace(".", "_"))
                    roles[last[0].name] = own_role
                    by_role[own_role] = last[0]
                return by_role[own_role]
            return n

        copies = []
        for n in second:
            with graph.inserting_after(after):
                c = graph.node_copy(n, arg)
            c.meta = dict(n.meta)  # its module: layer i's, where n's is layer 1's
            c.meta["nn_module_stack"] = {f"orgel_layer_{i}": (f"{prefix}.{i}{below[n][0]}",
                                                              below[n][1])}
            env[n] = after = c
            copies.append(c)
            copy_of[c] = n
        made.update(copies)
        previous = copies
    for n in second:  # what read the last traced layer reads the last copy
        for user in list(n.users):
            if user not in own and user not in made:
                user.replace_input_with(n, previous[index1[n]])
    graph.lint()
    gm.recompile()
    # measure takes a copy's facts from its layer-1 node (COPIES) rather than run it
    gm.meta[COPIES] = copy_of
    return gm, roles, leaves, spec


def number_in_order(gm: torch.fx.GraphModule) -> None:
    """Name ``gm``'s computing nodes as fx names them, counted in graph order (``linear``,
    ``linear_1``, ...), so that a graph copied from two layers and the one traced whole
    name each node alike (a plan names the nodes it places). Placeholders keep their names.
    """
    fresh = torch.fx.graph._Namespace()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            fresh.create_name(node.name, None)
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            # set, not _rename: the graph's namespace still holds the old names
            node.name = fresh.create_name(re.sub(r"_\d+$", "", node.name) or node.name, None)
    used = fresh._used_names
    gm.graph._graph_namespace._used_names.update(used)
    gm.recompile()

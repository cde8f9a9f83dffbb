"""Functorch transforms traced inline (``torch.vmap`` in a forward) become one graph node each.

Dynamo traces ``torch.vmap(f)(x)`` inline: ``_vmap_increment_nesting``, then
``_add_batch_dim``, ``f``'s ops on batched tensors, ``_remove_batch_dim`` and
``_vmap_decrement_nesting`` (transformers 4.x builds its attention masks this
way). The tensors in between exist only while the vmap level is open: they
cannot be measured, saved, sent to another rank, or left behind at a stage or
block boundary. :func:`collapse_transforms` therefore replaces every outermost
region by a single call of a small GraphModule that runs it whole, with one
output per value the rest of the graph reads (picked out with ``getitem``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch


def _nesting(node: torch.fx.Node) -> int:
    """+1 for a node that opens a functorch level, -1 for one that closes it, else 0."""
    if node.op != "call_function":
        return 0
    name = str(getattr(node.target, "__name__", ""))
    if name.endswith("_increment_nesting"):
        return 1
    if name.endswith("_decrement_nesting"):
        return -1
    return 0


def _runner(module: torch.fx.GraphModule) -> Callable[..., Any]:
    def transform_region(*args: Any) -> Any:
        return module(*args)

    return transform_region


def collapse_transforms(gm: torch.fx.GraphModule) -> int:
    """Replace each outermost functorch region of ``gm`` by one node; how many were replaced."""
    graph = gm.graph
    nodes = list(graph.nodes)
    count = 0
    i = 0
    while i < len(nodes):
        if _nesting(nodes[i]) != 1:
            i += 1
            continue
        depth, j = 0, i
        while True:
            depth += _nesting(nodes[j])
            if depth == 0:
                break
            j += 1
            if j == len(nodes):
                raise ValueError(f"functorch level opened at {nodes[i].name} is never closed")
        _collapse(gm, nodes[i:j + 1])
        count += 1
        i = j + 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _collapse(gm: torch.fx.GraphModule, region: list[torch.fx.Node]) -> None:
    graph = gm.graph
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    for n in region:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    module = torch.fx.GraphModule(gm, sub)
    with graph.inserting_before(region[0]):
        call = graph.call_function(_runner(module), tuple(inputs))
        call.meta["stack_trace"] = next((n.meta["stack_trace"] for n in region
                                         if n.meta.get("stack_trace")), None)
        for k, out in enumerate(outputs):
            picked = graph.call_function(operator.getitem, (call, k))
            picked.meta.update(out.meta)
            out.replace_all_uses_with(picked, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        graph.erase_node(n)

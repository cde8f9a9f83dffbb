"""A compiled stage's backward graph cut in two (:mod:`orgel.runtime.compiled`): the input
half ``I``, which the stage inputs' gradients need, and the weight half ``W``, which only
the parameters' gradients need and which runs later from the values ``I`` hands it."""

from __future__ import annotations

import operator

import torch
import torch.fx


def _ancestors(roots: list[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _part(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def partition_backward(bw: torch.fx.GraphModule, weights: int
                       ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """Split a backward graph whose first ``weights`` outputs are the parameters' gradients
    (the rest the inputs') into ``I`` and ``W``; also the number of ``I``'s gradient outputs.

    ``I`` takes the backward's inputs and returns ``(*input grads, *frontier)``; ``W``
    takes the frontier and returns the parameters' gradients (``None`` where the backward
    gives none). Nothing is computed twice: ``W`` holds only nodes ``I`` does not."""
    outputs = list(bw.graph.output_node().args[0])  # type: ignore[arg-type]
    w_outs, i_outs = outputs[:weights], outputs[weights:]
    need_i = _ancestors([n for n in i_outs if isinstance(n, torch.fx.Node)])
    need_w = _ancestors([n for n in w_outs if isinstance(n, torch.fx.Node)])
    w_only = {n for n in need_w - need_i if n.op != "placeholder"}
    # an operation of several results that both halves read (a convolution's backward: the
    # input's gradient and the weight's) hands W the parts it reads, not its tuple, which
    # Inductor cannot return from a graph
    parts = {u for n in need_i for u in n.users if u in w_only and _part(u)}
    w_only -= parts
    need_i |= parts
    order = list(bw.graph.nodes)
    frontier = [n for n in order if n in need_w and n not in w_only
                and (n in w_outs or any(u in w_only for u in n.users))]

    i_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in order:
        if n.op == "placeholder" or (n in need_i and n.op != "output"):
            env[n] = i_graph.node_copy(n, lambda x: env[x])
    i_graph.output([env[n] if isinstance(n, torch.fx.Node) else n for n in i_outs]
                   + [env[n] for n in frontier])
    w_graph = torch.fx.Graph()
    wenv: dict[torch.fx.Node, torch.fx.Node] = {}
    for k, n in enumerate(frontier):
        wenv[n] = w_graph.placeholder(f"frontier_{k}")
        wenv[n].meta = dict(n.meta)
    for n in order:
        if n in w_only and n.op not in ("output", "placeholder"):
            wenv[n] = w_graph.node_copy(n, lambda x: wenv[x])
    w_graph.output([wenv[n] if isinstance(n, torch.fx.Node) else n for n in w_outs])
    i_module = torch.fx.GraphModule(bw, i_graph)
    w_module = torch.fx.GraphModule(bw, w_graph)
    i_module.graph.eliminate_dead_code()
    i_module.recompile()
    return i_module, w_module, len(i_outs)

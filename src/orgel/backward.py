"""The backward split in two halves: ``I`` (input gradients) now, ``W`` (weights) later.

``I`` runs autograd only towards the stage's input leaves, so every node on a
path to an input computes just its input-side gradient. Before it runs, a
pre-hook goes on each such node that also leads to a parameter (an
*intermediate*): it keeps the gradient arriving there. ``W`` then starts from
those kept gradients and runs only the parameter-side work::

    loss -> n1 ----------> n2 ----------> x (input leaf)      I: n1, n2 on the x path
             \\              \\
              -> W1 grad     -> W2 grad                     W: from n1 to W1, from n2 to W2

Parameters are grouped by the intermediates they hang from (one autograd call
per group, its inputs only that group's parameters, so ``W`` never walks the
input path again). When a group starts from two intermediates and one lies
below the other, a pre-hook in ``W`` replaces what flows into the lower one by
its kept gradient, so nothing is counted twice. Roots that reach no input (the
first stage) start ``W`` directly. The gradients equal a full backward's.

``W`` asks a start node for its parameters' gradients alone, which a full backward
never does for a node on the input path. PyTorch's CPU GroupNorm backward ignores
that request on a channels-last input (``GroupNormBackwardKernelImplChannelsLast``
writes the input gradient through a null pointer: a segmentation fault, in plain
PyTorch too: ``torch.autograd.grad(gn(x_cl), gn.weight, g)``), so for such nodes
``W`` also asks for the input gradient (:func:`_input_too`) and drops it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node | None:
    """``t``'s grad_fn, or for a leaf its AccumulateGrad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    fn = t.view_as(t).grad_fn
    return None if fn is None else fn.next_functions[0][0]


@dataclass
class WeightWork:
    """What ``I`` kept for ``W``: per parameter group, the start edges and gradients."""

    groups: list[tuple[list[torch.nn.Parameter], list[GradientEdge], list[torch.Tensor],
                       dict[Node, tuple[Any, ...]], list[GradientEdge]]] = \
        field(default_factory=list)


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the autograd graph below ``roots``."""
    parents: dict[Node, list[Node]] = {}
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _above(starts: list[Node], parents: dict[Node, list[Node]],
           stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable upwards from ``starts``; ``stop`` nodes met are returned apart."""
    seen: set[Node] = set()
    hit: set[Node] = set()
    queue = deque(starts)
    while queue:
        node = queue.popleft()
        for parent in parents.get(node, ()):
            if parent in stop:
                hit.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, hit


def input_backward(
    roots: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: list[torch.Tensor],
    params: list[torch.nn.Parameter],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """Gradients of ``leaves`` now; what ``W`` needs for ``params`` later."""
    filled = [torch.ones_like(r) if g is None else g for r, g in zip(roots, grads, strict=True)]
    root_nodes = [n for n in map(_node, roots) if n is not None]
    parents = _parents(root_nodes)
    leaf_nodes = [n for n in map(_node, leaves) if n is not None]
    closure, _ = _above(leaf_nodes, parents, set())  # nodes on some path to an input
    closure.update(n for n in leaf_nodes if n in parents)
    # each parameter hangs from the closure nodes just above it, or from roots outside it
    groups: list[tuple[list[torch.nn.Parameter], set[Node]]] = []
    owner: dict[Node, int] = {}
    for p in params:
        acc = _node(p)
        if acc is None or acc not in parents:
            continue  # not used by this stage's forward
        above, hit = _above([acc], parents, closure)
        starts = hit | {n for n in root_nodes if n in above or n is acc}
        merged = sorted({owner[n] for n in starts if n in owner})
        if merged:
            target = merged[0]
            for g in merged[1:]:  # join groups that share a start
                groups[target][0].extend(groups[g][0])
                groups[target][1].update(groups[g][1])
                groups[g] = ([], set())
            groups[target][0].append(p)
            groups[target][1].update(starts)
        else:
            target = len(groups)
            groups.append(([p], set(starts)))
        for n in groups[target][1]:
            owner[n] = target
    kept: dict[Node, tuple[Any, ...]] = {}
    hooks = []
    for n in {n for _, starts in groups for n in starts if n in closure}:
        def keep(grad_outputs: tuple[Any, ...], n: Node = n) -> None:
            kept[n] = tuple(grad_outputs)
        hooks.append(n.register_prehook(keep))
    try:
        wanted = [t for t in leaves if t.requires_grad]
        got: tuple[torch.Tensor | None, ...] = ()
        if wanted and roots:
            got = torch.autograd.grad(roots, wanted, filled, retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    it = iter(got)
    leaf_grads = [next(it, None) if t.requires_grad else None for t in leaves]
    root_grad = {_node(r): (r, g) for r, g in zip(roots, filled, strict=True)}
    work = WeightWork()
    for group_params, starts in groups:
        if not group_params:
            continue
        edges: list[GradientEdge] = []
        values: list[torch.Tensor] = []
        clamp: dict[Node, tuple[Any, ...]] = {}
        extra: list[GradientEdge] = []
        for n in starts:
            if n in kept:
                clamp[n] = kept[n]
                extra += _input_too(n)
                for k, kept_grad in enumerate(kept[n]):
                    if kept_grad is not None:
                        edges.append(GradientEdge(n, k))
                        values.append(kept_grad)
            elif n in root_grad:
                root, root_g = root_grad[n]
                edges.append(GradientEdge(n, root.output_nr))
                values.append(root_g)
        work.groups.append((group_params, edges, values, clamp if len(clamp) > 1 else {},
                            extra))
    return leaf_grads, work


def _input_too(node: Node) -> list[GradientEdge]:
    """Input edges whose gradient ``W`` must ask ``node`` for, besides its parameters'.

    PyTorch's CPU GroupNorm backward on a channels-last input writes the input
    gradient whether or not it was asked for (through a null pointer when not):
    for such a node ``W`` asks for it too, and drops it. Its cost is the input
    half of one GroupNorm backward.
    """
    if node.name() != "NativeGroupNormBackward0":
        return []
    saved = getattr(node, "_saved_input", None)
    if not isinstance(saved, torch.Tensor) or saved.device.type != "cpu" \
            or saved.dim() not in (4, 5):
        return []
    fmt = torch.channels_last if saved.dim() == 4 else torch.channels_last_3d
    if not saved.is_contiguous(memory_format=fmt):
        return []
    child, k = node.next_functions[0]
    return [] if child is None else [GradientEdge(child, k)]


def weight_backward(work: WeightWork) -> None:
    """Accumulate the parameters' gradients from what :func:`input_backward` kept.

    Groups can pass through the same nodes (a module applied twice, across an
    exchange): all but the last keep the saved tensors, which go with ``work``.
    """
    last = max((i for i, g in enumerate(work.groups) if g[1]), default=-1)
    for i, (params, edges, values, clamp, extra) in enumerate(work.groups):
        if not edges:
            continue
        hooks = [n.register_prehook(lambda _grads, saved=saved: saved)
                 for n, saved in clamp.items()]
        try:
            # ``extra``: input edges asked for only so that a kernel gets its mask right
            # (:func:`_input_too`); backward computes their gradients and drops them
            torch.autograd.backward(edges, values, inputs=[*params, *extra],  # type: ignore[arg-type]
                                    retain_graph=i < last)
        finally:
            for h in hooks:
                h.remove()

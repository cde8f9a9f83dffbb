"""The recompute policies of a compiled stage (:mod:`orgel.runtime.compiled`): each node of
the stage's graph tagged as torch's activation checkpointing tags it under
``torch.compile``, so that AOTAutograd's min-cut partitioner saves and recomputes as the
policy says."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx


def recompute_tags(module: torch.nn.Module, policy: bool | str,
                   layers: Sequence[tuple[str | None, list[str]]]
                   ) -> dict[str, tuple[Any, int]] | None:
    """For each node of stage ``module``'s graph, the partitioner's recompute tag and region
    for ``policy`` (None for False and True, whose recompute is the executor's):

    * ``"layer"``: every node of layer ``k`` (:func:`orgel.graph.blocks.layer_runs`) must
      be recomputed, region ``k``; AOTAutograd's partitioner then saves only what enters
      each region (a layer's input, where one region follows another);
    * ``"selective"``: one region; the matmul and attention nodes' outputs are saved
      (:data:`orgel.graph.kept.SAVED_OPS`), the rest preferably recomputed.

    The joint graph's aten nodes inherit their stage node's tags (torch.fx copies
    ``recompute`` and ``ac_graph_id`` from the node it runs), as torch's own activation
    checkpointing tags them under ``torch.compile``.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    from orgel.graph.kept import SAVED_OPS
    from orgel.graph.measure import op_name

    if policy not in ("layer", "selective") or not isinstance(module, torch.fx.GraphModule):
        return None
    computed = [n for n in module.graph.nodes if n.op in ("call_function", "call_method",
                                                          "call_module")]
    if policy == "selective":
        return {n.name: (CheckpointPolicy.MUST_SAVE if op_name(n) in SAVED_OPS
                         else CheckpointPolicy.PREFER_RECOMPUTE, 1) for n in computed}
    region = {name: k + 1 for k, (layer, names) in enumerate(layers) if layer is not None
              for name in names}
    return {n.name: (CheckpointPolicy.MUST_RECOMPUTE, region[n.name]) for n in computed
            if n.name in region}


def tagged_call(module: torch.fx.GraphModule, state: dict[str, torch.Tensor],
                 args: list[Any], tags: dict[str, tuple[Any, int]]) -> Any:
    """``module(*args)`` on ``state``, node by node with each node's tag as the current
    meta, so that the ops traced under it carry the tag (see :func:`recompute_tags`)."""
    from torch.fx import traceback as fx_traceback
    from torch.nn.utils.stateless import _reparametrize_module

    saved = {}
    for node in module.graph.nodes:
        if node.name in tags:
            saved[node] = {k: node.meta[k] for k in ("recompute", "ac_graph_id")
                           if k in node.meta}
            node.meta["recompute"], node.meta["ac_graph_id"] = tags[node.name]
    try:
        with _reparametrize_module(module, state), fx_traceback.preserve_node_meta():
            return torch.fx.Interpreter(module).run(*args)
    finally:
        for node, meta in saved.items():
            node.meta.pop("recompute", None)
            node.meta.pop("ac_graph_id", None)
            node.meta.update(meta)

"""Recompute inside a stage: per layer, or per operator, as practitioners checkpoint.

A plan says for each stage how its backward gets its activations (``Plan.recompute[s]``):

* ``False``: the forward keeps them all;
* ``True`` (``"stage"``): the forward keeps only the stage's inputs and runs the whole stage
  again before its backward (:mod:`orgel.runtime.backward_actions`), so the backward holds
  every layer's activations at once;
* ``"layer"``: each layer of the stage (a run of nodes under one element of a module list,
  such as ``model.layers.3``, :func:`orgel.graph.blocks.layer_runs`) runs under
  :func:`torch.utils.checkpoint.checkpoint`: the forward keeps each layer's inputs, and the
  backward recomputes one layer at a time (torchtitan's, Megatron's and DeepSpeed's
  activation checkpointing);
* ``"selective"``: the whole stage runs under a checkpoint whose policy keeps the outputs of
  the operators that are costly to recompute (matrix products and attention,
  :data:`SAVED_OPS`) and recomputes the rest (torchtitan's operator-level selective
  checkpointing, through torch's ``create_selective_checkpoint_contexts``).

Both run in the one forward with gradients on; torch's checkpoint restores the random
state for the recompute, so dropout draws the same masks and the result is the forward's.
A stage whose forward updates buffers in place (BatchNorm statistics) takes only ``False``
or ``True``: a checkpoint's recompute would update them again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from orgel.graph import glue
from orgel.schedule.ir import RECOMPUTE

_aten = torch.ops.aten
#: what ``"selective"`` keeps: the outputs of matrix products and attention
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.linear.default, _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
})

def check_policy(value: Any, where: str = "recompute") -> Any:
    """``value`` if it is one of :data:`orgel.schedule.ir.RECOMPUTE` (``"stage"`` reads as
    True), else ValueError."""
    if value == "stage":
        return True
    if isinstance(value, bool) or value in RECOMPUTE:
        return value
    raise ValueError(f"{where}={value!r}: give False (keep the activations), True or 'stage' "
                     "(recompute each stage whole), 'layer' (checkpoint each layer) or "
                     "'selective' (keep matmul and attention outputs, recompute the rest)")


class _Checkpointed(torch.nn.Module):
    """``inner`` run under a non-reentrant checkpoint (``context_fn``: a selective policy)."""

    def __init__(self, inner: torch.nn.Module, context_fn: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self._context_fn = context_fn

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to keep: no recompute either
            return self.inner(*args)
        # the recompute runs to the end: stopped early, it would leave an autocast region
        # of the graph entered (its exit is the graph's last node), and autocast's cache of
        # cast weights would then outlive the optimizer step
        inner = glue.pinned(self.inner)  # recomputed, its exchanges answer for this forward
        with set_checkpoint_early_stop(False):
            if self._context_fn is None:
                return checkpoint(inner, *args, use_reentrant=False)
            return checkpoint(inner, *args, use_reentrant=False, context_fn=self._context_fn)


def _keep_costly(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in SAVED_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def checkpointed(module: torch.nn.Module, policy: Any,
                 layers: Sequence[tuple[str | None, list[str]]]) -> torch.nn.Module:
    """What runs stage ``module``'s forward under ``policy``
    (:data:`~orgel.schedule.ir.RECOMPUTE`): the module itself for False and True, else a
    module sharing its parameters and buffers.

    ``layers``: the stage's nodes as :func:`orgel.graph.blocks.layer_runs` cuts them (for
    ``"layer"``).
    """
    if policy is False or policy is True:
        return module
    if policy == "selective":
        return _Checkpointed(module, functools.partial(create_selective_checkpoint_contexts,
                                                       _keep_costly))
    from torch.fx.passes.split_module import split_module

    if not isinstance(module, torch.fx.GraphModule):
        raise TypeError(f"recompute='layer' cuts a stage's fx graph; got a "
                        f"{type(module).__name__}")
    named = {name: i for i, (_, names) in enumerate(layers) for name in names}
    part_of: dict[str, int] = {}
    last = 0
    for node in module.graph.nodes:  # a node the layers do not name (size arithmetic, an
        last = named.get(node.name, last)  # autocast region's ends) joins the run before it
        part_of[node.name] = last

    def part(node: torch.fx.Node) -> int:
        return part_of[node.name]

    # the capture's symbolic sizes in the nodes' meta would make split_module pass each
    # size symbol between the parts; the parts read sizes off their tensors instead
    metas = {node: node.meta for node in module.graph.nodes}
    try:
        for node in metas:
            node.meta = {}
        parts = split_module(module, module, part, keep_original_order=True)
    finally:
        for node, meta in metas.items():
            node.meta = meta
    in_layer = {i for i, (layer, _) in enumerate(layers) if layer is not None}
    for index in in_layer:
        name = f"submod_{index}"
        child = getattr(parts, name, None)
        if child is not None:  # a run of only sizes or attributes makes no part
            setattr(parts, name, _Checkpointed(child))
    return parts

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
A stage whose forward updates buffers in place (BatchNorm statistics) recomputes on copies
of them as its forward found them (:class:`_Checkpointed`), so they are updated once per
micro-batch, as in one process.
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
    """``inner`` run under a non-reentrant checkpoint (``context_fn``: a selective policy).

    ``written``: the names in ``stage`` (the stage module ``inner`` is or is part of) of the
    buffers its forward updates in place, looked up at each call. The forward copies them
    as it finds them, and the recompute runs on the copies, so the live buffers are updated
    once, by the forward, and the recompute reads what the forward read."""

    def __init__(self, inner: torch.nn.Module, context_fn: Any = None,
                 stage: torch.nn.Module | None = None, written: Sequence[str] = ()) -> None:
        super().__init__()
        self.inner = inner
        self._context_fn = context_fn
        self.__dict__["_stage"] = stage  # not a child (it may be inner, or hold it)
        self._written = tuple(written)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to keep: no recompute either
            return self.inner(*args)
        # the recompute runs to the end: stopped early, it would leave an autocast region
        # of the graph entered (its exit is the graph's last node), and autocast's cache of
        # cast weights would then outlive the optimizer step
        inner = glue.pinned(self.inner)  # recomputed, its exchanges answer for this forward
        stage: torch.nn.Module | None = self.__dict__["_stage"]
        if stage is None or not self._written:
            return self._checkpoint(inner, args)
        # the written buffers as the forward finds them, for the recompute to write: those
        # ``inner`` holds are swapped in for its call; those it is given (``split_module``
        # passes a layer the stage's buffers) are the checkpoint's arguments, and the
        # forward gets the live ones. (Copied here: an op inside the recompute that the
        # forward did not run fails torch's checks.)
        ids = frozenset(id(stage.get_buffer(name)) for name in self._written)
        found = _holders(self.inner, ids)
        kept = [tensor.clone() for *_, tensor in found]
        given = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and id(a) in ids]
        copies = [a.clone() if i in given else a for i, a in enumerate(args)]
        calls = 0

        def run(*inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:  # the forward: on the live buffers
                return inner(*[args[i] if i in given else a for i, a in enumerate(inputs)])
            for (holder, slot, leaf, _), copy in zip(found, kept, strict=True):
                getattr(holder, slot)[leaf] = copy
            try:
                return inner(*inputs)
            finally:
                for holder, slot, leaf, tensor in found:
                    getattr(holder, slot)[leaf] = tensor

        return self._checkpoint(run, copies)

    def _checkpoint(self, run: Any, args: Sequence[Any]) -> Any:
        with set_checkpoint_early_stop(False):
            if self._context_fn is None:
                return checkpoint(run, *args, use_reentrant=False)
            return checkpoint(run, *args, use_reentrant=False, context_fn=self._context_fn)


def _holders(module: torch.nn.Module, ids: frozenset[int]
             ) -> list[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """``(module, "_buffers" or "__dict__", name, tensor)`` for each tensor of ``module`` or
    its children whose id is in ``ids`` (a part that ``split_module`` made holds a stage's
    buffer as a plain attribute)."""
    found = []
    for holder in module.modules():
        for slot in ("_buffers", "__dict__"):
            for name, value in list(getattr(holder, slot).items()):
                if isinstance(value, torch.Tensor) and id(value) in ids:
                    found.append((holder, slot, name, value))
    return found


def _keep_costly(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in SAVED_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def checkpointed(module: torch.nn.Module, policy: Any,
                 layers: Sequence[tuple[str | None, list[str]]],
                 written: Sequence[str] = ()) -> torch.nn.Module:
    """What runs stage ``module``'s forward under ``policy``
    (:data:`~orgel.schedule.ir.RECOMPUTE`): the module itself for False and True, else a
    module sharing its parameters and buffers.

    ``layers``: the stage's nodes as :func:`orgel.graph.blocks.layer_runs` cuts them (for
    ``"layer"``). ``written``: the buffers (names in ``module``) its forward updates in
    place, which a recompute must not update again.
    """
    if policy is False or policy is True:
        return module
    if policy == "selective":
        return _Checkpointed(module, functools.partial(create_selective_checkpoint_contexts,
                                                       _keep_costly), module, written)
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
            setattr(parts, name, _Checkpointed(child, stage=module, written=written))
    return parts

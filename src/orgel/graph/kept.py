"""What a stage's forward keeps for its backward under each recompute policy, from the graph.

The policies are :data:`orgel.schedule.ir.RECOMPUTE`'s, run by
:mod:`orgel.runtime.checkpointing`; the bytes come from the capture's measured facts
(:class:`~orgel.graph.opgraph.OpNode`: ``saved_bytes`` autograd kept for a node, ``nbytes``
of its output):

* ``False``: every node's saved bytes;
* ``True`` (the stage whole): its inputs; its backward first rebuilds all of it;
* ``"layer"``: each layer's inputs (a checkpoint keeps its arguments; a value several
  layers read counts once) and the saved bytes of the nodes outside every layer; the
  backward rebuilds one layer at a time;
* ``"selective"``: the stage's inputs and the outputs of the operators that are costly to
  recompute (:data:`SAVED_OPS`); the backward rebuilds the rest.

:func:`kept_bytes` gives ``(kept, rebuilt)``: the bytes kept from the forward to the
backward, and the most bytes the backward rebuilds at once on top of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orgel.graph.blocks import layer_runs
from orgel.graph.opgraph import OpGraph

#: the graph ops whose outputs ``"selective"`` keeps (what their aten kernels are in
#: :data:`orgel.runtime.checkpointing.SAVED_OPS`)
SAVED_OPS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d",
                       "conv2d", "conv3d", "scaled_dot_product_attention"})


def _outside(opg: OpGraph, names: Sequence[str]) -> set[str]:
    """The distinct values ``names`` read that none of them computes (model inputs and other
    nodes' outputs; parameters are not values)."""
    inside = set(names)
    return {src for n in names for src in opg.nodes[n].inputs if src not in inside}


def _outside_bytes(opg: OpGraph, names: Sequence[str]) -> int:
    """Bytes of :func:`_outside`'s values."""
    return sum(value_bytes(opg, src) for src in _outside(opg, names))


def value_bytes(opg: OpGraph, value: str) -> int:
    """Bytes of a value: a node's output, or a model input."""
    return opg.nodes[value].nbytes if value in opg.nodes else input_bytes(opg, value)


def input_bytes(opg: OpGraph, name: str) -> int:
    """Bytes of model input ``name`` as the capture saw it (0 where it is not a tensor)."""
    for node in opg.graph_module.graph.nodes:
        if node.op == "placeholder" and node.name == name:
            value = node.meta.get("example_value", node.meta.get("val"))
            if isinstance(value, torch.Tensor):
                try:
                    return int(value.numel()) * value.element_size()
                except (TypeError, RuntimeError):  # symbolic sizes: no count
                    return 0
    return 0


def kept_bytes(opg: OpGraph, names: Sequence[str], policy: bool | str) -> tuple[int, int]:
    """``(kept, rebuilt)`` bytes of the stage made of nodes ``names`` (in graph order)."""
    saved = {n: opg.nodes[n].saved_bytes for n in names}
    everything = sum(saved.values())
    if policy is False:
        return everything, 0
    inputs = _outside_bytes(opg, names)
    if policy is True:
        return inputs, everything
    if policy == "layer":
        runs = layer_runs(names, [opg.nodes[n].module for n in names])
        # each checkpoint keeps its arguments; a value several layers read is one tensor
        read = {src for layer, run in runs if layer is not None
                for src in _outside(opg, run)}
        kept = sum(value_bytes(opg, v) for v in read) + sum(
            saved[n] for layer, run in runs if layer is None for n in run)
        rebuilt = max((sum(saved[n] for n in run) for layer, run in runs
                       if layer is not None), default=0)
        return kept, rebuilt
    if policy == "selective":
        outputs = sum(opg.nodes[n].nbytes for n in names if opg.nodes[n].op in SAVED_OPS)
        kept = min(everything, inputs + outputs)
        return kept, max(0, everything - outputs)
    raise ValueError(f"recompute policy {policy!r} is not one of False, True, 'layer', "
                     "'selective'")

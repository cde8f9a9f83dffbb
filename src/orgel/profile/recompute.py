"""Each block's facts for ``"layer"`` and ``"selective"`` recompute, from its captured nodes.

See :mod:`orgel.costs.recompute`: the bytes follow :mod:`orgel.graph.kept`'s rules of
what each policy keeps, per block; the forward a policy runs again is the block's forward
time apportioned by the roofline shares of its nodes (as
:func:`orgel.profile.roofline.measured_tp_splits` apportions a measured block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orgel.costs.recompute import BlockRecompute
from orgel.graph.blocks import layer_of
from orgel.graph.kept import SAVED_OPS, value_bytes


def block_facts(opgraph: Any, blocks: Sequence[Sequence[str]], fwd: Sequence[float],
                roof: Any) -> list[BlockRecompute]:
    """Each block's :class:`BlockRecompute` from its captured ``blocks[b]`` nodes and its
    forward ms ``fwd[b]``; ``roof`` (:class:`~orgel.profile.roofline.Roofline`) gives the
    shares that apportion a block's forward among its nodes.

    ``"layer"`` checkpoints whole layers (a stage holding all of a layer, which blocks may
    cut in parts): a layer's inputs count at the block where it starts, each value once,
    and only those no other layer reads (the residual stream; a mask or a position table
    every layer reads is one value, counted with the stage's inputs); what it rebuilds is
    the whole layer's saved bytes, in every block it reaches.
    """
    nodes = opgraph.nodes
    layer: dict[str, str] = {}  # node -> its layer (nodes outside every layer: absent)
    members: dict[str, list[str]] = {}  # layer -> its nodes, in order
    for n in (n for b in blocks for n in b if n in nodes):
        key = layer_of(nodes[n].module)
        if key is not None:
            layer[n] = key
            members.setdefault(key, []).append(n)
    readers: dict[str, set[str]] = {}  # value -> the layers that read it from outside
    for key, run in members.items():
        inside = set(run)
        for src in (src for n in run for src in nodes[n].inputs if src not in inside):
            readers.setdefault(src, set()).add(key)
    sole: dict[str, list[str]] = {}  # layer -> the values only it reads
    for src, keys in readers.items():
        if len(keys) == 1:
            sole.setdefault(next(iter(keys)), []).append(src)
    saved = {key: sum(nodes[n].saved_bytes for n in run) for key, run in members.items()}
    out = []
    for block, ms in zip(blocks, fwd, strict=True):
        mine = [nodes[n] for n in block if n in nodes]
        times = {x.name: roof.times(x)[0] for x in mine}
        inner = [x.name for x in mine if x.name in layer]
        starts = {layer[n] for n in inner if members[layer[n]][0] == n}
        kept = sum(value_bytes(opgraph, v) for key in starts for v in sole.get(key, []))
        kept += sum(x.saved_bytes for x in mine if x.name not in layer)
        total = sum(x.saved_bytes for x in mine)
        outputs = min(total, sum(x.nbytes for x in mine if x.op in SAVED_OPS))
        out.append(BlockRecompute(
            layer_kept=kept, layer_rebuilt=max((saved[layer[n]] for n in inner), default=0),
            layer_fwd=_share(ms, times, inner),
            selective_kept=outputs, selective_rebuilt=max(0, total - outputs),
            selective_fwd=_share(ms, times, [x.name for x in mine if x.op not in SAVED_OPS])))
    return out


def _share(ms: float, times: dict[str, float], chosen: Sequence[str]) -> float:
    """The part of a block's ``ms`` that its ``chosen`` nodes take by roofline ``times``."""
    total = sum(times.values())
    return ms * sum(times[n] for n in chosen) / total if total > 0 else 0.0

"""A parameter's value leaving its processes without a collective: each sends its own piece.

The controller of a forward with graph breaks runs a micro-batch that left the captured
graphs on its own copy of the model (:mod:`orgel.explicit.fallback`), with the ranks'
values of the step. It asks for them mid-step, where a rank answers from whichever wait
reads the question: a tensor-parallel member or an FSDP replica cannot gather its
parameter there (its partners are elsewhere in the step, and a collective they do not
join hangs). So every process sends its own part as it holds it, a :class:`Piece` (its
local tensor and where that lies in the whole), and the controller lays the pieces of
each name into the whole tensor (:func:`assembled`).

Where a process's part is one block of the whole (``Shard``: tensor parallelism's column
and row splits, FSDP2's dimension-0 shards; ``Replicate``) the piece says where the block
starts. An FSDP shard of a tensor-parallel weight cut on the same dimension
(``_StridedShard``) is rows from here and there: its piece carries the flat index of each
of its values in the whole, found by laying an ``arange`` of the whole out as the
parameter is laid out (``distribute_tensor`` without communication).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Piece:
    """One process's part of a tensor of ``shape``: ``local`` at ``offset`` in the whole
    (a block), or where ``index`` says (each value's flat index in the whole)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...] | None = None
    index: torch.Tensor | None = None


def piece_of(t: torch.Tensor) -> torch.Tensor | Piece:
    """``t`` as this process sends it, copied to the CPU: a plain tensor itself, a DTensor
    its :class:`Piece` (no communication)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t.detach().cpu().clone()
    local = t.to_local().detach().cpu().clone()
    shape = tuple(int(s) for s in t.shape)
    if all(type(p) in (Shard, Replicate) for p in t.placements):  # one block
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return Piece(local, shape, offset=tuple(int(o) for o in offset))
    flat = torch.arange(t.numel(), device=t.to_local().device).view(shape)
    index = distribute_tensor(flat, t.device_mesh, t.placements, src_data_rank=None)
    return Piece(local, shape, index=index.to_local().reshape(-1).cpu())


def assembled(name: str, pieces: list[Piece]) -> torch.Tensor:
    """The whole tensor ``name`` from its processes' :class:`Piece` s (copies may repeat,
    as replicas send alike); ValueError where they leave part of it uncovered."""
    first = pieces[0]
    whole = torch.empty(first.shape, dtype=first.local.dtype)
    covered = torch.zeros(first.shape, dtype=torch.bool)
    for piece in pieces:
        if piece.index is not None:
            whole.view(-1)[piece.index] = piece.local.reshape(-1)
            covered.view(-1)[piece.index] = True
            continue
        assert piece.offset is not None
        block = tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.local.shape,
                                                       strict=True))
        whole[block] = piece.local
        covered[block] = True
    if not bool(covered.all()):
        raise ValueError(f"the processes' parts of {name!r} do not cover it "
                         f"({int(covered.sum())} of {covered.numel()} values)")
    return whole


def whole_values(replies: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Each name's whole value from every process's reply (name -> tensor or
    :class:`Piece`): the first plain tensor of a name, else its pieces assembled."""
    plain: dict[str, torch.Tensor] = {}
    parts: dict[str, list[Piece]] = {}
    for reply in replies:
        for name, value in reply.items():
            if isinstance(value, Piece):
                parts.setdefault(name, []).append(value)
            else:
                plain.setdefault(name, value)
    for name, pieces in parts.items():
        if name not in plain:  # (a replica still holding it gathered sent it whole)
            plain[name] = assembled(name, pieces)
    return plain


__all__ = ["Piece", "assembled", "piece_of", "whole_values"]

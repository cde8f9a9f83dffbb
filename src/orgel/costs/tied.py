"""Tied weights: which blocks read one parameter, where it is held, which stages reduce it.

A parameter read by nodes in several blocks (a token embedding tied to the LM
head, a layer applied twice) ends up in every stage that holds one of those
blocks. :func:`tied_groups` finds such parameters in a captured graph for the
cost table (``BlockCosts.tied``, a list of :class:`TiedGroup`);
:func:`plan_tied_weights` turns them, for a split and placement, into the
plan's ``tied`` field: the groups whose stages sit on more than one
rank, whose gradient the runtime all-reduces each step
(:mod:`orgel.runtime.optim`) and the simulator prices. A stage holds such a
parameter once, and so does a rank (:func:`tied_within`, :func:`tied_shared`
are what stage costs leave out).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orgel.schedule.ir import TiedWeight

if TYPE_CHECKING:
    from orgel.costs.table import BlockCosts
    from orgel.graph.blocks import BlockGraph
    from orgel.graph.opgraph import OpGraph


@dataclass(frozen=True)
class TiedGroup:
    """One parameter read by several blocks: their indices (sorted), its bytes, its name."""

    blocks: tuple[int, ...]
    nbytes: int
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": list(self.blocks), "nbytes": self.nbytes, "name": self.name}


def check_group(g: Any, where: str, params: list[int]) -> TiedGroup:
    """A TiedGroup from ``g`` (one, or its costs-file dict), checked against the blocks' params.

    Raises ValueError naming ``where`` and what to fix.
    """
    if isinstance(g, dict):
        bad = sorted(set(g) - {"blocks", "nbytes", "name"})
        if bad or "blocks" not in g or "nbytes" not in g:
            raise ValueError(f"{where} must be {{\"blocks\": [a, b, ...], \"nbytes\": N, "
                             f"\"name\": \"...\"}}, got {g!r}")
        blocks, nbytes, name = g["blocks"], g["nbytes"], g.get("name", "")
    elif isinstance(g, TiedGroup):
        blocks, nbytes, name = g.blocks, g.nbytes, g.name
    else:
        raise ValueError(f"{where} must be an object with 'blocks' and 'nbytes', got {g!r}")
    n = len(params)
    if (not isinstance(blocks, (list, tuple))
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)):
        raise ValueError(f"{where}.blocks must be a list of block indices, got {blocks!r}")
    out = [b for b in blocks if not 0 <= b < n]
    if out:
        raise ValueError(f"{where}.blocks names block(s) {out} outside 0..{n - 1}")
    if len(set(blocks)) < 2:
        raise ValueError(f"{where}.blocks must name at least 2 different blocks (the "
                         f"blocks that share the parameter), got {list(blocks)}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{where}.nbytes must be a non-negative integer (the parameter's "
                         f"bytes), got {nbytes!r}")
    small = [b for b in blocks if params[b] < nbytes]
    if small:
        raise ValueError(f"{where}.nbytes ({nbytes}) exceeds the params of block(s) "
                         f"{small}: each block's params include the shared parameter")
    if not isinstance(name, str):
        raise ValueError(f"{where}.name must be a string, got {name!r}")
    return TiedGroup(tuple(sorted(set(blocks))), nbytes, name)


def tied_groups(opgraph: OpGraph, blockgraph: BlockGraph) -> list[TiedGroup]:
    """The parameters of ``opgraph`` that nodes in two or more blocks read, sorted by name.

    Each group lists the blocks (sorted), the parameter's bytes and its
    qualified name. Buffers and constants are left out: the runtime reduces
    only parameter gradients.
    """
    node_block = blockgraph.node_block
    out = []
    for name, readers in sorted(opgraph.param_users().items()):
        if name not in opgraph.params:
            continue
        blocks = sorted({node_block[n] for n in readers if n in node_block})
        if len(blocks) > 1:
            out.append(TiedGroup(tuple(blocks), opgraph.tensor_bytes(name), name))
    return out


def tied_stages(bc: BlockCosts, stage_blocks: list[list[int]] | list[range]
                ) -> list[tuple[int, ...]]:
    """For each of ``bc.tied``, the stages (sorted) that hold one of its blocks."""
    if not bc.tied:
        return []
    starts = _range_starts(stage_blocks)
    if starts is not None:
        return [tuple(sorted({bisect.bisect_right(starts, b) - 1 for b in g.blocks}))
                for g in bc.tied]
    owner = {b: s for s, blocks in enumerate(stage_blocks) for b in blocks}
    return [tuple(sorted({owner[b] for b in g.blocks if b in owner})) for g in bc.tied]


def tied_within(bc: BlockCosts, blocks: list[int] | range) -> int:
    """Bytes of tied parameters that ``blocks`` (one stage) would count more than once."""
    if not bc.tied:
        return 0
    inside = blocks if isinstance(blocks, range) else set(blocks)  # range: O(1) membership
    return sum(g.nbytes * (k - 1) for g in bc.tied
               if (k := sum(b in inside for b in g.blocks)) > 1)


def tied_shared(bc: BlockCosts, stage_blocks: list[list[int]] | list[range],
                placement: list[tuple[int, ...]],
                holders: list[tuple[int, ...]] | None = None) -> list[int]:
    """Per stage, tied parameter bytes an earlier stage on its rank already holds.

    Stages on one rank share one copy of a tied parameter (the split modules
    hold the model's own Parameter). Only a stage on a single rank gives its
    copy up: a replicated stage keeps it counted (an over-estimate), since the
    simulator's data-parallel all-reduce already leaves tied bytes out of it.
    ``holders``: :func:`tied_stages` of the split, if known.
    """
    out = [0] * len(stage_blocks)
    if not bc.tied:
        return out
    if holders is None:
        holders = tied_stages(bc, stage_blocks)
    for g, stages in zip(bc.tied, holders, strict=True):
        for i, t in enumerate(stages):
            if len(placement[t]) == 1 and any(placement[t][0] in placement[s]
                                               for s in stages[:i]):
                out[t] += g.nbytes
    return out


def _range_starts(stage_blocks: list[list[int]] | list[range]) -> list[int] | None:
    """First blocks of a linear split given as consecutive ranges (else None)."""
    if not all(isinstance(b, range) and b.step == 1 for b in stage_blocks):
        return None
    starts = [b.start for b in stage_blocks]  # type: ignore[union-attr]
    stops = [b.stop for b in stage_blocks]  # type: ignore[union-attr]
    if starts and starts[0] == 0 and all(a == b for a, b in zip(stops, starts[1:], strict=False)):
        return starts
    return None


def plan_tied_weights(bc: BlockCosts, stage_blocks: list[list[int]] | list[range],
                      placement: list[tuple[int, ...]],
                      holders: list[tuple[int, ...]] | None = None) -> list[TiedWeight]:
    """The plan's ``tied`` groups of a split: those whose stages span several ranks.

    The same entries :func:`orgel.plan.workload.tied_weights` records from a
    real split, in the same order (by name). A group whose stages share one rank is summed
    locally and left out. ``holders``: :func:`tied_stages` of the split, if known.
    """
    out = []
    if holders is None:
        holders = tied_stages(bc, stage_blocks)
    for g, stages in zip(bc.tied, holders, strict=True):
        ranks = {r for s in stages for r in placement[s]}
        if len(ranks) > 1:
            out.append(TiedWeight(g.name, tuple(stages), g.nbytes))
    out.sort(key=lambda e: (e.name, e.stages))
    return out

"""Tied weights: which blocks read one parameter, and which stages all-reduce its gradient.

A parameter read by nodes in several blocks (a token embedding tied to the LM
head, a layer applied twice) ends up in every stage that holds one of those
blocks. :func:`tied_groups` finds such parameters in a captured graph for the
cost table (``BlockCosts.tied``); :func:`plan_tied_weights` turns them, for a
split and placement, into the plan's ``meta["tied_weights"]``: the groups whose
stages sit on more than one rank, whose gradient the runtime all-reduces each
step (:mod:`orgel.runtime.optim`) and the simulator prices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orgel.graph.blocks import BlockGraph
    from orgel.graph.opgraph import OpGraph
    from orgel.profile.costs import BlockCosts, TiedGroup


def tied_groups(opgraph: OpGraph, blockgraph: BlockGraph) -> list[TiedGroup]:
    """The parameters of ``opgraph`` that nodes in two or more blocks read, sorted by name.

    Each group lists the blocks (sorted), the parameter's bytes and its
    qualified name. Buffers and constants are left out: the runtime reduces
    only parameter gradients.
    """
    from orgel.profile.costs import TiedGroup

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
        import bisect

        return [tuple(sorted({bisect.bisect_right(starts, b) - 1 for b in g.blocks}))
                for g in bc.tied]
    owner = {b: s for s, blocks in enumerate(stage_blocks) for b in blocks}
    return [tuple(sorted({owner[b] for b in g.blocks if b in owner})) for g in bc.tied]


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
                      holders: list[tuple[int, ...]] | None = None) -> list[dict[str, Any]]:
    """``meta["tied_weights"]`` of a split: the groups whose stages span several ranks.

    Each entry is ``{"name", "stages", "nbytes"}``, the form
    :func:`orgel.plan.workload.tied_weights` records from a real split, in
    the same order (by name). A group whose stages share one rank is summed
    locally and left out. ``holders``: :func:`tied_stages` of the split, if known.
    """
    out = []
    if holders is None:
        holders = tied_stages(bc, stage_blocks)
    for g, stages in zip(bc.tied, holders, strict=True):
        ranks = {r for s in stages for r in placement[s]}
        if len(ranks) > 1:
            out.append({"name": g.name, "stages": list(stages), "nbytes": g.nbytes})
    out.sort(key=lambda e: (e["name"], e["stages"]))
    return out

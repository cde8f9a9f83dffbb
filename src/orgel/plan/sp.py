"""Series-parallel decomposition of a block DAG into a small tree (leaf, series, parallel).

The graph planner runs a dynamic program over this tree (after GraphPipe §5 and
FlexFlow's SP decomposition). Blocks are numbered in a topological order, so
every edge goes from a lower to a higher index. For a set of blocks:

* one block is a :class:`Leaf`;
* if the blocks fall into several weakly connected pieces they are a
  :class:`Parallel` of those pieces (independent branches);
* otherwise they are cut into a :class:`Series` at every position of the
  topological order where *everything before reaches everything after*. That
  holds exactly when every sink of the prefix has an edge to every source of
  the suffix (each earlier block reaches a prefix sink, each later block is
  reached from a suffix source, and a path from a prefix sink to a suffix
  source can only be a direct edge).

A connected piece with no such cut is not series-parallel (an "N" shape). It is
made series-parallel by running it in topological order, one block after the
other: that adds ordering constraints, never changes what is computed (the
same trick GraphPipe uses to make a DAG arithmetically identical but SP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from orgel.costs.blocks import BlockCosts


@dataclass(frozen=True)
class Leaf:
    """One block."""

    block: int

    @property
    def blocks(self) -> tuple[int, ...]:
        return (self.block,)


@dataclass(frozen=True)
class Series:
    """Children that run one after another: every block of a child precedes the next child's."""

    children: tuple[SPTree, ...]
    linearised: bool = False  # True when made series by topological order (not SP)

    @cached_property
    def blocks(self) -> tuple[int, ...]:  # cached: planners ask for it in inner loops
        return tuple(b for c in self.children for b in c.blocks)


@dataclass(frozen=True)
class Parallel:
    """Children with no edges between them: independent branches."""

    children: tuple[SPTree, ...]

    @cached_property
    def blocks(self) -> tuple[int, ...]:
        return tuple(sorted(b for c in self.children for b in c.blocks))


SPTree = Leaf | Series | Parallel


def decompose(num_blocks: int, edges: list[tuple[int, int]]) -> SPTree:
    """The series-parallel tree of blocks ``0..num_blocks-1`` joined by ``edges``."""
    if num_blocks <= 0:
        raise ValueError("decompose needs at least one block")
    succ: list[list[int]] = [[] for _ in range(num_blocks)]
    pred: list[list[int]] = [[] for _ in range(num_blocks)]
    for a, b in set(edges):
        if not a < b:
            raise ValueError(f"edge ({a}, {b}) is not in topological order (need a < b)")
        succ[a].append(b)
        pred[b].append(a)
    return _build(list(range(num_blocks)), succ, pred)


def _build(nodes: list[int], succ: list[list[int]], pred: list[list[int]]) -> SPTree:
    if len(nodes) == 1:
        return Leaf(nodes[0])
    pieces = _components(nodes, succ, pred)
    if len(pieces) > 1:
        return Parallel(tuple(_build(p, succ, pred) for p in pieces))
    cuts = _series_cuts(nodes, succ, pred)
    if not cuts:
        # Not series-parallel: serialise in topological order.
        return Series(tuple(Leaf(b) for b in nodes), linearised=True)
    parts = []
    start = 0
    for cut in [*cuts, len(nodes)]:
        parts.append(nodes[start:cut])
        start = cut
    children: list[SPTree] = []
    for part in parts:
        child = _build(part, succ, pred)
        # Flatten nested series so a chain is one Series of leaves.
        if isinstance(child, Series) and not child.linearised:
            children.extend(child.children)
        else:
            children.append(child)
    return Series(tuple(children))


def _components(nodes: list[int], succ: list[list[int]], pred: list[list[int]]) -> list[list[int]]:
    """Weakly connected pieces of ``nodes`` (each sorted), ordered by first block."""
    inside = set(nodes)
    seen: set[int] = set()
    pieces: list[list[int]] = []
    for start in nodes:
        if start in seen:
            continue
        stack, piece = [start], []
        seen.add(start)
        while stack:
            v = stack.pop()
            piece.append(v)
            for w in succ[v] + pred[v]:
                if w in inside and w not in seen:
                    seen.add(w)
                    stack.append(w)
        pieces.append(sorted(piece))
    return pieces


def _series_cuts(nodes: list[int], succ: list[list[int]], pred: list[list[int]]) -> list[int]:
    """Positions ``k`` (1..n-1) where ``nodes[:k]`` completely precedes ``nodes[k:]``."""
    inside = set(nodes)
    pos = {v: i for i, v in enumerate(nodes)}
    n = len(nodes)
    succ_sets = {v: set(succ[v]) for v in nodes}
    sinks: set[int] = set()  # prefix blocks with no successor inside the prefix
    # A suffix source has no predecessor inside the suffix; count predecessors inside.
    pred_in_suffix = {v: sum(1 for u in pred[v] if u in inside) for v in nodes}
    sources = {v for v in nodes if pred_in_suffix[v] == 0}
    cuts = []
    for k in range(1, n):
        v = nodes[k - 1]  # v moves from the suffix into the prefix
        sources.discard(v)
        for w in succ[v]:
            if w in inside:
                pred_in_suffix[w] -= 1
                if pred_in_suffix[w] == 0 and pos[w] >= k:
                    sources.add(w)
        for u in pred[v]:
            sinks.discard(u)
        sinks.add(v)
        # Complete bipartite sinks x sources (both are small at real cuts, one each in a chain).
        if all(sources <= succ_sets[s] for s in sinks):
            cuts.append(k)
    return cuts


def branch_groups(par: Parallel, groups: int, weight: Callable[[SPTree], float]
                  ) -> list[SPTree]:
    """``par``'s branches dealt into ``groups`` groups, each run as one flat series.

    Branches go heaviest first to the lightest group (LPT), so groups carry
    similar work. A group of several branches becomes a :class:`Series` (marked
    ``linearised``) of their blocks, branch after branch: the branch holding the
    smallest block first, the one holding the largest last, so the order stays
    topological even when a fork block was folded into one branch and a join
    block into another (a stage cut from it then never forms a cycle).
    """
    if not 1 <= groups <= len(par.children):
        raise ValueError(f"groups must be in 1..{len(par.children)}, got {groups}")
    loads = [0.0] * groups
    members: list[list[SPTree]] = [[] for _ in range(groups)]
    for c in sorted(par.children, key=lambda c: -weight(c)):
        i = loads.index(min(loads))
        loads[i] += weight(c)
        members[i].append(c)
    top = max(par.blocks)
    out: list[SPTree] = []
    for group in members:
        if len(group) == 1:
            out.append(group[0])
            continue
        group.sort(key=lambda c: (top in c.blocks, min(c.blocks)))
        parts: list[SPTree] = []
        for c in group:
            parts.extend(c.children if isinstance(c, Series) else (c,))
        out.append(Series(tuple(parts), linearised=True))
    return out


def concat(a: SPTree, b: SPTree) -> Series:
    """``a`` then ``b`` as one flat series (so a folded block can share a stage with a
    branch's first or last block alone)."""
    def parts(t: SPTree) -> tuple[SPTree, ...]:
        return t.children if isinstance(t, Series) and not t.linearised else (t,)
    return Series(parts(a) + parts(b))


class TreeCosts:
    """Per-subtree sums of block costs (fwd + bwd, params, activations, max temporary),
    and the derived trees a planner builds (folds, branch groups), cached by identity
    so memo keys stay stable; ``caches`` holds a planner's own shared tables."""

    def __init__(self, bc: BlockCosts) -> None:
        self.bc = bc
        self._memo: dict[int, tuple[float, int, int, int]] = {}
        self._folded: dict[tuple[int, int, int], Parallel] = {}
        self._groups: dict[tuple[int, int], list[SPTree]] = {}
        self._prefix: dict[int, tuple[list[float], list[int], list[int], list[int]]] = {}
        self.no_pack: set[int] = set()  # folded at both ends: never share a stage
        self.caches: dict[tuple[object, ...], dict[Any, Any]] = {}

    def of(self, node: SPTree) -> tuple[float, int, int, int]:
        """(work, params, activations, max temporary) of ``node``'s blocks."""
        got = self._memo.get(id(node))
        if got is None:
            bc = self.bc
            blocks = node.blocks
            got = (sum(bc.fwd[b] + bc.bwd[b] for b in blocks), sum(bc.params[b] for b in blocks),
                   sum(bc.activations[b] + bc.input_saved[b] for b in blocks),
                   max((bc.temporary[b] for b in blocks), default=0))
            self._memo[id(node)] = got
        return got

    def prefix(self, node: Series) -> tuple[list[float], list[int], list[int], list[int]]:
        """Prefix sums of a series' children (work, params, activations) and their
        temporaries, so any run of children costs O(1) (O(run) for the temporary)."""
        got = self._prefix.get(id(node))
        if got is None:
            cw, cp, ca, temps = [0.0], [0], [0], []
            for c in node.children:
                w, p, a, t = self.of(c)
                cw.append(cw[-1] + w)
                cp.append(cp[-1] + p)
                ca.append(ca[-1] + a)
                temps.append(t)
            got = (cw, cp, ca, temps)
            self._prefix[id(node)] = got
        return got

    def groups(self, par: Parallel, count: int) -> list[SPTree]:
        """:func:`branch_groups` of ``par`` (cached: stable memo keys)."""
        key = (id(par), count)
        got = self._groups.get(key)
        if got is None:
            got = branch_groups(par, count, lambda c: self.of(c)[0])
            self._groups[key] = got
        return got

    def fold(self, before: SPTree | None, par: SPTree, after: SPTree | None) -> Parallel:
        """``par`` with ``before`` prepended to its lightest branch and ``after``
        appended to the lightest other one (cached, so DP memo keys stay stable)."""
        key = (id(before), id(par), id(after))
        got = self._folded.get(key)
        if got is None:
            assert isinstance(par, Parallel)
            branches = list(par.children)
            order = sorted(range(len(branches)), key=lambda i: self.of(branches[i])[0])
            if before is not None:
                i = order[0]
                branches[i] = concat(before, branches[i])
            if after is not None:
                i = order[1] if before is not None else order[0]
                branches[i] = concat(branches[i], after)
            got = Parallel(tuple(branches))
            if before is not None and after is not None:
                self.no_pack.add(id(got))
            self._folded[key] = got
        return got


def tree_text(tree: SPTree, indent: int = 0) -> str:
    """An indented picture of the tree, for debugging and docs."""
    pad = "  " * indent
    if isinstance(tree, Leaf):
        return f"{pad}{tree.block}"
    kind = "series" if isinstance(tree, Series) else "parallel"
    if isinstance(tree, Series) and all(isinstance(c, Leaf) for c in tree.children):
        blocks = tree.blocks
        return f"{pad}{kind} {blocks[0]}..{blocks[-1]}" + (" (linearised)"
                                                           if tree.linearised else "")
    return "\n".join([f"{pad}{kind}"] + [tree_text(c, indent + 1) for c in tree.children])

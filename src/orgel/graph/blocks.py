"""Coarsening: group an op graph's nodes into blocks that follow module boundaries and cost.

Every block is a contiguous interval of the graph's topological node order, so
every block is convex (a path that leaves an interval only reaches later nodes
and can never come back) and the blocks are numbered in a topological order of
the block DAG. Within that constraint the node order is first cut along the
module tree (a transformer stack into layers, a layer into attention and MLP,
a flat run of ops by FLOPs), then a dynamic program groups those segments into
the target number of blocks: balanced first, then cut at the shallowest module
boundaries, never gluing independent branches together when it can avoid it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from orgel.graph.opgraph import OpGraph, tuple_spans

DEFAULT_BLOCKS = 32
_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")


def blocks_for(ranks: int, blocks: int | None = None) -> int:
    """How many blocks to coarsen a model into for a plan on ``ranks`` ranks: ``blocks``
    where given, else :data:`DEFAULT_BLOCKS` or twice the ranks where that is more (a
    pipeline stage per rank, and two for a looped schedule, without the caller knowing
    what a block is)."""
    return blocks if blocks is not None else max(DEFAULT_BLOCKS, 2 * ranks)


def layer_of(module_path: str) -> str | None:
    """The layer a node computed under ``module_path`` belongs to: the path up to the first
    index into a module list (``model.layers.3.mlp.up`` -> ``model.layers.3``); None for a
    node outside every module list (the embeddings, the final norm, the head)."""
    found = _LAYER.match(module_path)
    return found.group(1) if found else None


def layer_runs(names: Sequence[str], paths: Sequence[str]) -> list[tuple[str | None, list[str]]]:
    """The nodes ``names`` (in order; ``paths``: their module paths) cut into maximal runs of
    one layer each (:func:`layer_of`); a run outside every layer has the layer None."""
    runs: list[tuple[str | None, list[str]]] = []
    for name, path in zip(names, paths, strict=True):
        layer = layer_of(path)
        if runs and runs[-1][0] == layer:
            runs[-1][1].append(name)
        else:
            runs.append((layer, [name]))
    return runs


@dataclass
class Block:
    """A convex group of nodes with their summed facts (bytes, FLOPs)."""

    index: int
    name: str
    nodes: list[str]
    params: list[str] = field(default_factory=list)
    param_bytes: int = 0
    saved_bytes: int = 0
    output_bytes: int = 0
    flops: int = 0
    model_inputs: list[str] = field(default_factory=list)
    produces_output: bool = False


@dataclass(frozen=True)
class BlockEdge:
    """Values computed in block ``src`` and read in block ``dst`` (bytes per micro-batch)."""

    src: int
    dst: int
    values: tuple[str, ...]
    nbytes: int


@dataclass
class BlockGraph:
    """The fused graph: blocks, the DAG between them, and the op graph underneath."""

    opgraph: OpGraph
    blocks: list[Block]
    edges: list[BlockEdge]

    @property
    def node_block(self) -> dict[str, int]:
        """The block of every node."""
        return {n: b.index for b in self.blocks for n in b.nodes}

    def order(self) -> list[int]:
        """A topological linearisation of the blocks (for sequential planners)."""
        return [b.index for b in self.blocks]

    def successors(self, block: int) -> list[int]:
        return sorted({e.dst for e in self.edges if e.src == block})

    def predecessors(self, block: int) -> list[int]:
        return sorted({e.src for e in self.edges if e.dst == block})

    def fan_outs(self) -> list[tuple[int, list[int]]]:
        """Blocks whose values go to several blocks: where the DAG branches."""
        return [(b.index, s) for b in self.blocks if len(s := self.successors(b.index)) > 1]

    def joins(self) -> list[tuple[int, list[int]]]:
        """Blocks that read values from several blocks: where branches meet."""
        return [(b.index, p) for b in self.blocks if len(p := self.predecessors(b.index)) > 1]

    def skips(self) -> list[BlockEdge]:
        """Edges that jump over at least one block of the linear order (long skips)."""
        return [e for e in self.edges if e.dst > e.src + 1]

    def edge_bytes(self, output: list[int]) -> tuple[dict[tuple[int, int], int],
                                                    dict[tuple[int, int], int]]:
        """What each edge ``(a, b)`` carries where it is less than block ``a``'s whole
        ``output`` (bytes per block): the bytes of ``a``'s values that ``b`` reads (a stage
        is sent the values it reads: a layer reads the embedding block's mask, not the
        hidden state it also makes), and of those the bytes that carry a gradient back (a
        mask or a position table carries none). Both keyed by edge, as
        ``BlockCosts.edge_bytes`` and ``BlockCosts.edge_grads`` take them."""
        nodes = self.opgraph.nodes
        read: dict[tuple[int, int], int] = {}
        back: dict[tuple[int, int], int] = {}
        for e in self.edges:
            if e.src == e.dst:
                continue
            key = (e.src, e.dst)
            values = [nodes[v] for v in e.values if v in nodes]
            sent = sum(v.nbytes for v in values)
            grad = sum(v.nbytes for v in values if v.requires_grad)
            if sent < output[e.src]:
                read[key] = max(read.get(key, 0), sent)
            if grad < output[e.src]:
                back[key] = max(back.get(key, 0), grad)
        return read, back


def coarsen(
    opgraph: OpGraph, target_blocks: int | None = None, *, slack: float = 0.5
) -> BlockGraph:
    """Group ``opgraph``'s nodes into at most ``target_blocks`` convex blocks (default 32).

    First the node order is cut along the module tree into up to three times
    as many fine segments (a leaf module is cut by cost only when it costs
    more than an average block). Then a dynamic program groups the
    segments into ``target_blocks`` blocks: it finds the smallest possible
    costliest block, and among the groupings whose blocks cost at most
    ``1 + slack`` times that, picks the one that cuts at the shallowest module
    boundaries (between layers rather than inside one), keeps independent
    branches apart and avoids tiny blocks. Fewer blocks come back only when
    there are fewer segments.
    """
    target = DEFAULT_BLOCKS if target_blocks is None else target_blocks
    if not isinstance(target, int) or target < 1:
        raise ValueError(f"target_blocks must be a positive integer, got {target_blocks!r}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack!r}")
    names = list(opgraph.nodes)
    if not names:
        raise ValueError("the op graph has no nodes to group into blocks")
    paths = [tuple(p for p in opgraph.nodes[n].module.split(".") if p) for n in names]
    cost = [max(opgraph.nodes[n].flops, 1) for n in names]
    cut_ok = [True] + [_can_cut(opgraph, names[i - 1]) for i in range(1, len(names))]
    position = {n: i for i, n in enumerate(names)}
    preds = [[position[s] for s in opgraph.nodes[n].inputs if s in position] for n in names]
    target = min(target, len(names))
    share = sum(cost) / target
    limit = share
    segs = _runs(paths, 0, len(names), 1)
    # Fine enough that the grouping has choices: three segments per block, and
    # no segment costlier than an average block unless it cannot be cut.
    while (len(segs) < 3 * target or max(_cost(g, cost) for g in segs) > share) and len(
        segs
    ) < 20 * target and _split_largest(segs, paths, cost, cut_ok, limit):
        pass
    segs = _keep_spans_together(opgraph, segs, position)
    live = _live_bytes(opgraph, names, position)
    groups = _partition(segs, min(target, len(segs)), paths, cost, preds, live, slack)
    blocks = [names[segs[i][0]:segs[j - 1][1]] for i, j in groups]
    return _assemble(opgraph, blocks, paths, [segs[i][0] for i, _ in groups])


def unsplit_spans(opgraph: OpGraph, position: dict[str, int]) -> list[tuple[int, int]]:
    """``(first, last)`` positions of each run of nodes that no stage or block boundary may
    fall inside: the nodes reading a buffer the forward updates in place (the buffer lives
    in one stage), and a tuple-valued node with its items
    (:func:`~orgel.graph.opgraph.tuple_spans`).
    """
    users = opgraph.param_users()
    writers = [(min(ix), max(ix)) for buf in opgraph.written
               if len(ix := [position[n] for n in users.get(buf, ()) if n in position]) > 1]
    return sorted(writers + tuple_spans(opgraph, position))


def cuts_a_span(spans: list[tuple[int, int]], at: int) -> bool:
    """Whether a stage boundary before position ``at`` falls inside one of ``spans``."""
    return any(lo < at <= hi for lo, hi in spans)


def _keep_spans_together(opgraph: OpGraph, segs: list[tuple[int, int, int]],
                         position: dict[str, int]) -> list[tuple[int, int, int]]:
    """Merge the segments that :func:`unsplit_spans` says no boundary may fall between.

    A buffer the forward writes lives in one stage (its updates are ordered);
    a module used twice in one forward (a BatchNorm in a siamese encoder)
    writes it in two places, so everything between them is one block. So is a tuple-valued
    node with its items.
    """
    spans = unsplit_spans(opgraph, position)
    out: list[tuple[int, int, int]] = []
    for seg in segs:
        if out and cuts_a_span(spans, seg[0]):
            start, _, depth = out[-1]
            out[-1] = (start, seg[1], min(depth, seg[2]))
        else:
            out.append(seg)
    return out


def _live_bytes(opgraph: OpGraph, names: list[str], position: dict[str, int]) -> list[int]:
    """``live[p]``: bytes of the values computed before node ``p`` and read at or after it."""
    n = len(names)
    last = list(range(n))
    for i, name in enumerate(names):
        for src in opgraph.nodes[name].inputs:
            if src in position:
                last[position[src]] = max(last[position[src]], i)
    for out in opgraph.outputs:
        if out in position:
            last[position[out]] = n
    delta = [0] * (n + 2)
    for i, name in enumerate(names):
        if last[i] > i:  # crosses every cut p with i < p <= last[i]
            delta[i + 1] += opgraph.nodes[name].nbytes
            delta[last[i] + 1] -= opgraph.nodes[name].nbytes
    live, acc = [], 0
    for p in range(n + 1):
        acc += delta[p]
        live.append(acc)
    return live


def _partition(
    segs: list[tuple[int, int, int]], k: int, paths: list[tuple[str, ...]], cost: list[int],
    preds: list[list[int]], live: list[int], slack: float,
) -> list[tuple[int, int]]:
    """Group consecutive segments into ``k`` runs ``[i, j)``: balanced, then module-aligned."""
    n = len(segs)
    c = np.concatenate([[0.0], np.cumsum([_cost(s, cost) for s in segs], dtype=float)])
    # Boundary b sits before segment b. Cutting there costs its module depth
    # (0 between top-level modules) plus the bytes that cross it, counted in
    # units of the cheapest cut (between two transformer layers: one tensor);
    # not cutting where the two sides share no data edge (independent
    # branches) costs a lot.
    depth = np.zeros(n + 1)
    glue = np.zeros(n + 1)
    crossing = [live[segs[b][0]] for b in range(1, n)]
    unit = max(min((x for x in crossing if x > 0), default=1), 1)
    for b in range(1, n):
        left, right = segs[b - 1], segs[b]
        depth[b] = _common(paths[left[1] - 1], paths[right[0]]) + 2 * (live[right[0]] / unit - 1)
        linked = any(left[0] <= p < left[1] for j in range(right[0], right[1]) for p in preds[j])
        glue[b] = 0.0 if linked else 1000.0
    glue_sum = np.cumsum(glue)  # glue_sum[j-1] - glue_sum[i]: boundaries strictly inside [i, j)
    back = _cuts(c, k, depth, glue_sum, slack)
    groups: list[tuple[int, int]] = []
    end = n
    for g in range(k, 0, -1):
        start = int(back[g, end])
        groups.append((start, end))
        end = start
    return groups[::-1]


#: cells of (block end, block start) that :func:`_cuts` scores at once
_BAND = 1 << 20


def _cuts(c: np.ndarray, k: int, depth: np.ndarray, glue_sum: np.ndarray,
          slack: float) -> np.ndarray:
    """``back[g, j]``: where the last of ``g`` blocks covering segments ``[0, j)`` starts, in
    the cheapest grouping whose costliest block is within ``slack`` of the least possible.

    Two dynamic programs over (blocks, segments). The first finds the least possible
    costliest block: the best of ``g`` blocks over ``[0, i)`` grows with ``i`` while the
    last block ``[i, j)`` shrinks, so the best ``i`` for each ``j`` is where the two cross
    (a binary search, for every ``j`` at once). The second minimises the cuts' cost over the
    ``i`` whose last block stays within the bound, a window found by binary search, for the
    ``j`` from which the other blocks can still cover the rest.
    """
    n = len(c) - 1
    inf = float("inf")
    best = np.full(n + 1, inf)
    best[0] = 0.0
    for g in range(1, k + 1):
        lo, js = g - 1, np.arange(g, n - (k - g) + 1)
        pos = np.searchsorted(best[lo:] + c[lo:], c[js], side="left") + lo
        cur = np.full(n + 1, inf)
        got = np.full(len(js), inf)
        for shift in (-2, -1, 0, 1):  # the crossing, and its neighbours against rounding
            i = np.clip(pos + shift, lo, js - 1)
            got = np.minimum(got, np.maximum(best[i], c[js] - c[i]))
        cur[js] = got
        best = cur
    bound = best[n] * (1 + slack) + 1e-9
    average = c[n] / k
    score = np.full(n + 1, inf)
    score[0] = 0.0
    back = np.zeros((k + 1, n + 1), dtype=int)
    for g in range(1, k + 1):
        cur = np.full(n + 1, inf)
        # the j from which the other k - g blocks can still cover the rest (a margin
        # against rounding: a cell outside it is never on the chosen grouping's path)
        first = max(g, int(np.searchsorted(c, c[n] - (k - g) * bound, side="left")) - 2)
        last = min(n - (k - g), int(np.searchsorted(c, g * bound, side="right")) + 2)
        # every j of the window at once, a band of i below each (in chunks of bounded size)
        window = np.arange(first, last + 1)
        starts = np.maximum(g - 1, np.searchsorted(c, c[window] - bound, side="left") - 2)
        width = int((window - starts).max(initial=1))
        step = max(1, _BAND // width)
        for at in range(0, len(window), step):
            js, lo = window[at:at + step], starts[at:at + step]
            i = lo[:, None] + np.arange(width)[None, :]
            inside = i < js[:, None]
            i = np.where(inside, i, 0)
            inner = glue_sum[js - 1][:, None] - glue_sum[i]
            # Squared size (in average blocks) keeps tiny blocks from being free.
            span = c[js][:, None] - c[i]
            total = score[i] + np.where(i > 0, depth[i], 0.0) + inner + (span / average) ** 2
            total = np.where(inside & (span <= bound), total, inf)
            m = np.argmin(total, axis=1)
            rows = np.arange(len(js))
            chosen = total[rows, m]
            cur[js] = chosen
            back[g, js] = np.where(np.isfinite(chosen), i[rows, m], g - 1)
        score = cur
    return back


def from_groups(opgraph: OpGraph, groups: list[list[str]]) -> BlockGraph:
    """A BlockGraph from explicit node groups (each must be an interval of the node order)."""
    names = list(opgraph.nodes)
    position = {n: i for i, n in enumerate(names)}
    paths = [tuple(p for p in opgraph.nodes[n].module.split(".") if p) for n in names]
    flat = [n for g in groups for n in g]
    if sorted(flat, key=position.__getitem__) != flat or len(flat) != len(names):
        raise ValueError("groups must cover every node once, in the graph's node order")
    return _assemble(opgraph, groups, paths, [position[g[0]] for g in groups])


def layer_blocks(opgraph: OpGraph) -> BlockGraph:
    """One block per layer (:func:`layer_runs`), with what comes before the first layer (the
    embedding) and after the last (the final norm, the head) as blocks of their own: a
    table whose cuts all lie between layers, where a transformer's residual stream is the
    one value crossing. Nodes outside every layer between two layers join the layer
    before."""
    names = list(opgraph.nodes)
    runs = layer_runs(names, [opgraph.nodes[n].module for n in names])
    groups: list[list[str]] = []
    for i, (layer, nodes) in enumerate(runs):
        if groups and layer is None and i < len(runs) - 1:
            groups[-1].extend(nodes)
        else:
            groups.append(list(nodes))
    return from_groups(opgraph, groups)


def _cost(seg: tuple[int, int, int], cost: list[int]) -> int:
    return sum(cost[seg[0]:seg[1]])


def _split_largest(
    segs: list[tuple[int, int, int]], paths: list[tuple[str, ...]], cost: list[int],
    cut_ok: list[bool], limit: float,
) -> bool:
    """Refine the costliest splittable segment in place; False if none can be split.

    A segment splits at its next module level; one inside a single module is
    cut by cost only when it costs more than ``limit`` (a leaf module's ops,
    e.g. a BatchNorm and its counter update, otherwise stay together).
    """
    costs = [_cost(s, cost) for s in segs]
    # the costliest first (the first of equal ones): the first that splits is the one
    for i in sorted(range(len(segs)), key=lambda x: -costs[x]):
        seg = segs[i]
        pieces = _refine(seg, paths, cost, cut_ok, costs[i] > limit) if seg[1] - seg[0] > 1 else []
        if pieces:
            segs[i:i + 1] = pieces
            return True
    return False


def _can_cut(opgraph: OpGraph, before: str) -> bool:
    node = opgraph.nodes[before]
    return node.is_tensor or node.constant is not None


def _key(path: tuple[str, ...], depth: int) -> tuple[str, ...]:
    return path[:depth]


def _runs(paths: list[tuple[str, ...]], a: int, b: int, depth: int) -> list[tuple[int, int, int]]:
    """Maximal runs of [a, b) whose module paths agree on their first ``depth`` names."""
    out: list[tuple[int, int, int]] = []
    start = a
    for i in range(a + 1, b + 1):
        if i == b or _key(paths[i], depth) != _key(paths[start], depth):
            out.append((start, i, depth))
            start = i
    return out


def _refine(
    seg: tuple[int, int, int], paths: list[tuple[str, ...]], cost: list[int], cut_ok: list[bool],
    by_cost: bool,
) -> list[tuple[int, int, int]]:
    """Split a segment at the next module level that divides it, else (if allowed) by cost."""
    a, b, depth = seg
    deepest = max(len(p) for p in paths[a:b])
    for d in range(depth + 1, deepest + 1):
        runs = _runs(paths, a, b, d)
        if len(runs) > 1:
            return runs
    if not by_cost:
        return []
    total = sum(cost[a:b])
    best, best_gap, acc = None, None, 0
    for k in range(a + 1, b):
        acc += cost[k - 1]
        if not cut_ok[k]:
            continue
        gap = abs(2 * acc - total)
        if best_gap is None or gap < best_gap:
            best, best_gap = k, gap
    if best is None:
        best = (a + b) // 2
    deep = deepest + 1  # below the module tree: later splits are by cost only
    return [(a, best, deep), (best, b, deep)]


def _common(p: tuple[str, ...], q: tuple[str, ...]) -> int:
    n = 0
    while n < min(len(p), len(q)) and p[n] == q[n]:
        n += 1
    return n


def _label(paths: list[tuple[str, ...]]) -> str:
    """A readable name: the common module prefix and the first..last child under it."""
    first = paths[0]
    depth = min(_common(first, p) for p in paths)
    prefix = list(first[:depth])
    tails = list(dict.fromkeys(p[depth] for p in paths if len(p) > depth))
    if len(tails) > 1:
        prefix.append(f"{tails[0]}..{tails[-1]}")
    elif tails:
        prefix.append(tails[0])
    return ".".join(prefix) or "<root>"


def _assemble(
    opgraph: OpGraph, groups: list[list[str]], paths: list[tuple[str, ...]], starts: list[int]
) -> BlockGraph:
    node_block = {n: i for i, g in enumerate(groups) for n in g}
    outputs = set(opgraph.outputs)
    blocks: list[Block] = []
    edge_values: dict[tuple[int, int], dict[str, None]] = {}
    leaving: dict[int, dict[str, None]] = {i: {} for i in range(len(groups))}
    for node in opgraph.nodes.values():
        dst = node_block[node.name]
        for src in node.inputs:
            if src in node_block and node_block[src] != dst:
                edge_values.setdefault((node_block[src], dst), {})[src] = None
                leaving[node_block[src]][src] = None
    for i, group in enumerate(groups):
        infos = [opgraph.nodes[n] for n in group]
        params = list(dict.fromkeys(p for info in infos for p in info.params))
        outs = dict(leaving[i])
        outs.update({n: None for n in group if n in outputs})
        blocks.append(Block(
            index=i,
            name=_label([paths[starts[i] + k] for k in range(len(group))]),
            nodes=list(group), params=params,
            param_bytes=sum(opgraph.tensor_bytes(p) for p in params),
            saved_bytes=sum(info.saved_bytes for info in infos),
            output_bytes=sum(opgraph.nodes[n].nbytes for n in outs),
            flops=sum(info.flops for info in infos),
            model_inputs=[m for m in opgraph.model_inputs
                          if any(m in info.inputs for info in infos)],
            produces_output=any(n in outputs for n in group),
        ))
    edges = [
        BlockEdge(a, b, tuple(vals), sum(opgraph.nodes[v].nbytes for v in vals))
        for (a, b), vals in sorted(edge_values.items())
    ]
    return BlockGraph(opgraph, blocks, edges)

"""Graph planner after GraphPipe §5–6: stages form a DAG, independent branches run at once.

1. Decompose the block DAG into a series-parallel tree (:mod:`orgel.plan.sp`).
2. Binary-search the bound ``T`` on a stage's time per micro-batch (time per
   sample, since every stage sees the same micro-batch). For one ``T`` a
   dynamic program over the tree, memoised per subtree, finds the stage DAG
   that needs the fewest ranks (ties: the shallowest pipeline) with every stage
   under ``T`` and under the memory cap:

   * a series node is cut into consecutive segments, each either one stage
     (merging its children, with as many data-parallel replicas as it needs)
     or a child solved on its own;
   * a parallel node either gives each branch its own ranks (branches run
     concurrently), or runs branches one after another on the same ranks
     (all in one stage, or small branches packed into shared stages, first fit
     decreasing), or deals its branches into ``g`` groups that run at once,
     each group cut like a sequential pipeline so a stage may span branches
     (:func:`~orgel.plan.sp.branch_groups`; finer balance than whole branches).

   A stage on ``r`` ranks takes ``(fwd + bwd) / r`` plus the fixed action
   cost plus its gradient all-reduce spread over the micro-batches. A found
   solution's slowest stage becomes the new upper bound (not just ``T``), and
   subtree solutions carry over between bounds (feasible sets only shrink as
   ``T`` falls), so a search costs a few dozen cheap programs.
3. At the tightest bound and two looser ones (fewer, shallower stages) the
   program runs again with the ranks the tree left idle to spend: a parallel
   node then takes its shallowest option within that budget. Each layout is
   kept as found and with spare ranks spread as replicas of the slowest
   stages; the most promising by a quick estimate get a ``dag-1f1b``
   schedule's zero-bubble rewrite (``I`` now, ``W`` later), or plain
   ``dag-1f1b`` when that does not fit, scored by the simulator; the fastest
   feasible one wins (:func:`~orgel.plan.replicas.score_layouts`).

Replica counts are restricted by ``replica_counts`` (the counts a stage may
have: at most ``max_replicas``, and only divisors of a micro-batch's rows, since
a stage's replicas each take an equal share of every micro-batch) and, with
``pure_dp=False``, at least one stage keeps a single rank: a layout that
replicates every stage is data parallelism over the whole pipeline, which the
caller asks for with ``dp`` instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from orgel.costs.blocks import BlockCosts
from orgel.plan.replicas import StageSpec, replica_counts, score_layouts
from orgel.plan.scorer import Score, Scorer
from orgel.plan.sp import Leaf, Parallel, Series, SPTree, TreeCosts, decompose
from orgel.plan.templates import Template
from orgel.schedule.ir import Plan


@dataclass(frozen=True)
class Solution:
    """A stage set for a subtree: ranks used, pipeline depth (stages on the longest path)."""

    devices: int
    depth: int
    stages: tuple[StageSpec, ...]
    slowest: float = 0.0  # the largest stage time (ms per micro-batch) in ``stages``

    @property
    def key(self) -> tuple[int, int]:
        return (self.devices, self.depth)


@dataclass
class GraphResult:
    """The chosen graph plan and what the search did."""

    plan: Plan
    score: Score
    template: Template
    stages: list[StageSpec]
    bound: float
    candidates: int


class _DP:
    """The dynamic program for one bound ``T`` (see the module docstring)."""

    def __init__(self, bc: BlockCosts, totals: TreeCosts, ranks: int, microbatches: int,
                 memory: int | None, bound: float, *, exposed: bool = False,
                 counts: Collection[int] | None = None, grouped: bool = False,
                 spare: int = 0) -> None:
        self.bc, self.totals, self.ranks = bc, totals, ranks
        self.counts = sorted(set(counts)) if counts is not None else list(range(1, ranks + 1))
        # The all-reduce of a replicated stage spread over the micro-batches (its
        # throughput cost), or whole (it runs at the end of the step, exposed).
        self.reduce_share = 1.0 if exposed else 1.0 / microbatches
        self.m, self.memory, self.bound = microbatches, memory, bound
        # In-flight micro-batches of a stage are at most min(m, ranks) under 1F1B on a DAG.
        self.inflight = min(microbatches, ranks)
        self.memo: dict[int, Solution | None] = {}
        self.grouped, self.spare = grouped, spare
        config = (exposed, tuple(self.counts), microbatches, memory, grouped, spare)
        # (work, params, acts, temp) -> (replicas, time) options, the same at every bound.
        self.tables: dict[tuple[float, int, int, int], tuple[tuple[int, float], ...]] = \
            totals.caches.setdefault(("tables", *config), {})
        # Subtree id -> (highest bound found infeasible, a solution, its bound); see solve.
        self.across: dict[int, tuple[float, Solution | None, float]] = \
            totals.caches.setdefault(("across", *config), {})

    def replicas(self, work: float, params: int, acts: int, temp: int
                 ) -> tuple[int, float] | None:
        """Fewest replicas (and the stage's time) under the bound and the memory cap."""
        key = (work, params, acts, temp)
        table = self.tables.get(key)
        if table is None:
            table = self._table(work, params, acts, temp)
            self.tables[key] = table
        bound = self.bound
        for r, t in table:
            if t <= bound:
                return r, t
        return None

    def _table(self, work: float, params: int, acts: int, temp: int
               ) -> tuple[tuple[int, float], ...]:
        """(replicas, stage time) for every allowed count that fits memory; the same for
        every bound, so it is shared by the binary search's dynamic programs."""
        bc = self.bc
        out = []
        for r in self.counts:
            if r > self.ranks:
                break
            if self.memory is not None:
                mem = params * bc.optimizer_factor + (acts * self.inflight + temp) / r
                if mem > self.memory:
                    continue
            reduce = 0.0
            if r > 1:
                reduce = 2 * (r - 1) * bc.link.time(params // r) * self.reduce_share
            out.append((r, work / r + 2 * bc.action_overhead + reduce))
        return tuple(out)

    def merged(self, nodes: list[SPTree], *, only_count: bool = False) -> Solution | None:
        """``nodes`` as one stage (None if it misses the bound or memory on any count);
        ``only_count``: leave the stage's blocks out (a feasibility probe)."""
        work, params, acts, temp = 0.0, 0, 0, 0
        for nd in nodes:
            w, p, a, t = self.totals.of(nd)
            work, params, acts, temp = work + w, params + p, acts + a, max(temp, t)
        got = self.replicas(work, params, acts, temp)
        if got is None:
            return None
        if only_count:
            return Solution(got[0], 1, (), got[1])
        blocks = (nodes[0].blocks if len(nodes) == 1 and not isinstance(nodes[0], Series)
                  else tuple(sorted(b for nd in nodes for b in nd.blocks)))
        return Solution(got[0], 1, (StageSpec(blocks, got[0]),), got[1])

    def solve(self, node: SPTree) -> Solution | None:
        key = id(node)
        if key in self.memo:
            return self.memo[key]
        # Across bounds: a subtree infeasible at T is infeasible below it, and the best
        # solution at T stays the best at any T' in [its slowest stage, T] (the
        # feasible set only shrinks), so the binary search re-solves few subtrees.
        seen = self.across.get(key)
        bound = self.bound
        if seen is not None:
            none_at, sol, at = seen
            if bound <= none_at:
                self.memo[key] = None
                return None
            if sol is not None and sol.slowest <= bound <= at:
                self.memo[key] = sol
                return sol
        if isinstance(node, Leaf):
            sol = self.merged([node])
        elif isinstance(node, Series):
            sol = self._series(node)
        else:
            sol = self._parallel(node)
        self.memo[key] = sol
        none_at = -1.0 if seen is None else seen[0]
        if sol is None:
            self.across[key] = (max(none_at, bound), None if seen is None else seen[1],
                                0.0 if seen is None else seen[2])
        else:
            self.across[key] = (none_at, sol, bound)
        return sol

    def _series(self, node: Series) -> Solution | None:
        children = node.children
        k = len(children)
        # cost[j]: (ranks, depth) of the best cover of children j..k-1; slow[j]: its
        # slowest stage; choice[j]: how (end, replicas of a merged stage, or a solution).
        cost: list[tuple[int, int] | None] = [None] * (k + 1)
        slow = [0.0] * (k + 1)
        choice: list[tuple[int, int, Solution | None]] = [(0, 0, None)] * (k + 1)
        cost[k] = (0, 0)
        cw, cp, ca, temps = self.totals.prefix(node)
        ranks, bound, fixed = self.ranks, self.bound, 2 * self.bc.action_overhead
        single = self.counts == [1]
        # Beyond this much work a stage misses the bound even on the most replicas.
        reach = (bound - fixed) * min(self.counts[-1], ranks)
        # Single-rank stages: a segment j..e-1 fits iff e <= last (shrinks as j falls),
        # and its cost is 1 + cost[e]: a sliding-window minimum over e (``window``
        # holds ends in increasing order with strictly decreasing costs).
        window: deque[int] = deque()
        last = k
        for j in range(k - 1, -1, -1):
            best: tuple[int, int] | None = None
            child = children[j]
            options: list[tuple[int, SPTree]] = [] if isinstance(child, Leaf) else [(j + 1, child)]
            for e, sub in options + self._absorbing(children, j):
                own, rest = self.solve(sub), cost[e]
                if own is not None and rest is not None:
                    key = (own.devices + rest[0], own.depth + rest[1])
                    if best is None or key < best:
                        best = key
                        choice[j] = (e, 0, own)
                        slow[j] = max(own.slowest, slow[e])
            if single:
                c = cost[j + 1]
                if c is not None and c[0] < ranks:
                    while window and cost[window[0]] >= c:  # type: ignore[operator]
                        window.popleft()
                    window.appendleft(j + 1)
                while last > j and not self._fits(j, last, cw, cp, ca, temps):
                    last -= 1
                while window and window[-1] > last:
                    window.pop()
                if window:
                    e = window[-1]
                    rest = cost[e]
                    assert rest is not None
                    key = (1 + rest[0], 1 + rest[1])
                    if best is None or key < best:
                        best = key
                        choice[j] = (e, 1, None)
                        slow[j] = max(cw[e] - cw[j] + fixed, slow[e])
                cost[j] = best
                continue
            # Merged segments j..e-1; stop once even all ranks cannot hold one under T.
            for e in range(j + 1, k + 1):
                work = cw[e] - cw[j]
                if work > reach:
                    break
                rest = cost[e]
                if rest is None or rest[0] >= ranks:
                    continue
                got = self.replicas(work, cp[e] - cp[j], ca[e] - ca[j], max(temps[j:e]))
                if got is None:
                    continue
                key = (got[0] + rest[0], 1 + rest[1])
                if best is None or key < best:
                    best = key
                    choice[j] = (e, got[0], None)
                    slow[j] = max(got[1], slow[e])
            cost[j] = best
        if cost[0] is None:
            return None
        stages: list[StageSpec] = []
        j = 0
        while j < k:
            e, r, own = choice[j]
            if own is not None:
                stages.extend(own.stages)
            else:
                blocks = tuple(sorted(b for c in children[j:e] for b in c.blocks))
                stages.append(StageSpec(blocks, r))
            j = e
        return Solution(cost[0][0], cost[0][1], tuple(stages), slow[0])

    def _fits(self, j: int, e: int, cw: list[float], cp: list[int], ca: list[int],
              temps: list[int]) -> bool:
        """Whether children ``j..e-1`` fit one single-rank stage under the bound and memory."""
        if cw[e] - cw[j] + 2 * self.bc.action_overhead > self.bound:
            return False
        if self.memory is None:
            return True
        mem = ((cp[e] - cp[j]) * self.bc.optimizer_factor + (ca[e] - ca[j]) * self.inflight
               + max(temps[j:e]))
        return mem <= self.memory

    def _absorbing(self, children: Sequence[SPTree], j: int) -> list[tuple[int, SPTree]]:
        """Parallel nodes with their neighbours folded into their lightest branches.

        A small block before a fork (or after a join) as a stage of its own
        would take a rank; folded into a branch's first (last) stage it rides
        along. Both at once go to different branches, and such a node is never
        packed: a stage holding the fork and the join would form a cycle with
        any branch in another stage. Returns ``(end, node)``: the node covers
        children ``j..end-1``.
        """
        out: list[tuple[int, SPTree]] = []
        k = len(children)
        if j + 1 < k and isinstance(children[j + 1], Parallel):
            out.append((j + 2, self.totals.fold(children[j], children[j + 1], None)))
            if j + 2 < k and len(children[j + 1].children) > 1:  # type: ignore[union-attr]
                out.append((j + 3, self.totals.fold(children[j], children[j + 1],
                                                    children[j + 2])))
        if isinstance(children[j], Parallel) and j + 1 < k:
            out.append((j + 2, self.totals.fold(None, children[j], children[j + 1])))
        return out

    def _parallel(self, node: Parallel) -> Solution | None:
        options: list[Solution] = []
        whole = self.merged([node])
        if whole is not None:
            options.append(whole)
        subs = [self.solve(c) for c in node.children]
        if all(s is not None for s in subs):
            options.append(_join_parallel([s for s in subs if s is not None]))
        packed = None if id(node) in self.totals.no_pack else self._packed(node)
        if packed is not None:
            options.append(packed)
        # Branches dealt into fewer groups, each cut like a sequential pipeline: stages
        # may span branches (balance finer than whole branches), groups still run at
        # once. A node folded at both ends keeps one group: fork and join in one
        # group's single stage, with another group beside it, would form a cycle.
        n = len(node.children)
        top = 1 if id(node) in self.totals.no_pack else min(n - 1, self.ranks - 1)
        for count in range(1, top + 1 if self.grouped else 1):
            parts = [self.solve(g) for g in self.totals.groups(node, count)]
            if all(p is not None for p in parts):
                options.append(_join_parallel([p for p in parts if p is not None]))
        if not options:
            return None
        best = min(options, key=lambda s: s.key)
        if self.spare:
            # Ranks the whole tree leaves idle buy a shallower layout here.
            roomy = [o for o in options if o.devices <= best.devices + self.spare]
            best = min(roomy, key=lambda s: (s.depth, s.devices))
        return best

    def _packed(self, node: Parallel) -> Solution | None:
        """Small branches packed into shared single-rank stages (first fit decreasing)."""
        small: list[tuple[float, SPTree]] = []
        parts: list[Solution] = []
        for c in node.children:
            work = self.totals.of(c)[0]
            if work + 2 * self.bc.action_overhead <= self.bound:
                small.append((work, c))
            else:
                sol = self.solve(c)
                if sol is None:
                    return None
                parts.append(sol)
        if len(small) < 2:
            return None
        bins: list[list[SPTree]] = []
        loads: list[float] = []
        for work, c in sorted(small, key=lambda x: -x[0]):
            for i, load in enumerate(loads):
                if load + work + 2 * self.bc.action_overhead <= self.bound:
                    trial = self.merged(bins[i] + [c], only_count=True)
                    if trial is not None and trial.devices == 1:
                        bins[i].append(c)
                        loads[i] += work
                        break
            else:
                bins.append([c])
                loads.append(work)
        for group in bins:
            sol = self.merged(group)
            if sol is None:
                return None
            parts.append(sol)
        return _join_parallel(parts)


def _join_parallel(parts: list[Solution]) -> Solution:
    return Solution(sum(p.devices for p in parts), max(p.depth for p in parts),
                    tuple(s for p in parts for s in p.stages), max(p.slowest for p in parts))


def graph_plan(scorer: Scorer, ranks: int, microbatches: int, *,
               iterations: int = 40, grid: int = 2, tolerance: float = 0.005,
               zero_bubble: bool = True, score_top: int = 3,
               max_replicas: int | None = None, rows: int | None = None,
               pure_dp: bool = True, grouped: bool = True) -> GraphResult | None:
    """The fastest graph plan found (see the module docstring); None if nothing fits.

    ``max_replicas`` caps the ranks of one stage (1: every stage on one rank),
    ``rows`` (a micro-batch's rows) allows only replica counts that divide it,
    ``pure_dp=False`` keeps at least one stage on a single rank.

    The binary search stops when the bound is known within ``tolerance``
    (relative). Besides the solutions it meets, ``grid`` looser bounds (up to
    twice the tightest) are solved; ``grouped=False`` leaves out branch groups.
    Layouts get DAG 1F1B's split-backward rewrite (:mod:`orgel.plan.transforms`)
    with ``zero_bubble``, else (or when it does not fit) plain DAG 1F1B; only
    the ``score_top`` most promising by
    :func:`~orgel.plan.replicas.estimate_step` reach the simulator.
    """
    bc = scorer.bc
    counts = replica_counts(ranks, max_replicas=max_replicas, rows=rows)
    tree = decompose(bc.num_blocks, bc.edges)
    totals = TreeCosts(bc)
    work = [bc.fwd[b] + bc.bwd[b] for b in range(bc.num_blocks)]
    found: dict[tuple[tuple[tuple[int, ...], int], ...], float] = {}
    # Without pure data parallelism the DP (which breaks ties towards shallow
    # pipelines) may only find "one stage on every rank"; also solve with
    # single-rank stages, whose spare ranks may still become replicas below.
    # Passes: (all-reduce exposed, replica counts, branch groups). With groups the
    # single-rank pass covers the plain one's options.
    passes = [(False, counts, False)]
    if not pure_dp and counts != [1] and not grouped:
        passes.append((False, [1], False))
    if grouped:
        passes.append((False, [1], True))
    if counts != [1]:
        passes.append((True, counts, False))
    total = sum(work)
    for exposed, cs, grp in passes:
        if exposed and not any(r > 1 for key in found for _, r in key):
            continue  # an exposed all-reduce only matters to replicated stages
        # No layout beats perfect balance: sum_s r_s (t_s - 2 overhead) >= total work.
        lo = (total / ranks + 2 * bc.action_overhead) * (1 - 1e-9)
        hi = total + 2 * bc.action_overhead * bc.num_blocks + 1.0
        hi += 2 * ranks * bc.link.time(sum(bc.params))
        tightest = None
        mid = hi
        for _ in range(iterations):
            sol = _DP(bc, totals, ranks, microbatches, scorer.memory, mid,
                      exposed=exposed, counts=cs, grouped=grp).solve(tree)
            if sol is not None and sol.devices <= ranks:
                # The solution's own slowest stage is a tighter feasible bound than ``mid``.
                hi = tightest = min(mid, sol.slowest)
                found.setdefault(tuple((s.blocks, s.replicas) for s in sol.stages), hi)
            else:
                lo = mid
            if hi - lo <= tolerance * hi:
                break
            mid = (lo + hi) / 2
        if tightest is None:
            continue
        # The tightest bound is not always the fastest step: a looser one gives fewer,
        # shallower stages and spare ranks for replicas. Score a few looser bounds too,
        # and at each, spend the ranks left idle on shallower branch layouts.
        for k in range(grid + 1):
            bound = tightest * (1 + k / grid)
            sol = _DP(bc, totals, ranks, microbatches, scorer.memory, bound,
                      exposed=exposed, counts=cs, grouped=grp).solve(tree)
            if sol is None or sol.devices > ranks:
                continue
            found.setdefault(tuple((s.blocks, s.replicas) for s in sol.stages), bound)
            if sol.devices < ranks:
                wide = _DP(bc, totals, ranks, microbatches, scorer.memory, bound,
                           exposed=exposed, counts=cs, grouped=grp,
                           spare=ranks - sol.devices).solve(tree)
                if wide is not None and wide.devices <= ranks:
                    found.setdefault(tuple((s.blocks, s.replicas) for s in wide.stages), bound)
    chosen = score_layouts(scorer, found, ranks, microbatches, counts=counts,
                           pure_dp=pure_dp, zero_bubble=zero_bubble, top=score_top)
    if chosen is None:
        return None
    score, template, blocks, stages, bound = chosen
    plan = scorer.to_plan(template, blocks, meta={"planner": "graph"})
    return GraphResult(plan, score, template, stages, bound, len(found))

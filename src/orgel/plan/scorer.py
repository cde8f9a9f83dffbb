"""Score splits of a block cost table under a fixed schedule, fast, with the one simulator.

A :class:`Template` is one schedule family instance (family, options, stage
count, placement, per-rank action lists). A split assigns blocks to its stages.
:class:`Scorer` turns (template, split) into stage costs from prefix sums of the
block costs and scores it with :class:`orgel.sim.compiled.CompiledPlan`, which
is compiled once per (template, stage-edge set, recompute flags) and re-evaluated
with new durations and bytes for every candidate: the dependency graph is never
rebuilt per candidate. :meth:`Scorer.lower_bound` is a cheap bound (the busiest
rank's compute) that lets searches skip candidates that cannot win.

Links. Every message is priced on the link between its two ranks (``Costs.link_between``).
With per-pair links (``BlockCosts.links``) each template is renamed (:meth:`Scorer.placed`,
per template and stage-edge set): the rank permutation that puts its busiest channels on
the fastest links (all permutations up to 6 ranks, pair swaps beyond), used by every score
and plan of that template; with one link for all pairs the template is used as it is.

Tied weights. With ``BlockCosts.tied`` (a parameter several blocks read), each
candidate's stages holding a group's blocks are looked up; where they span more
than one rank the compiled plan carries the group in its ``tied`` field
and prices its gradient all-reduce exactly as :func:`orgel.sim.simulate` does
(compiled plans are cached per template, edges, recompute flags and these stage sets).
A tied parameter counts once per stage and once per rank in the static bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orgel.costs.blocks import (
    BlockCosts,
    RangeMax,
    edge_grad_bytes,
    replica_stages,
    reported_peak,
    stage_cost,
    stage_costs,
    stage_graph,
    static_parts,
    unsaved_outputs,
)
from orgel.costs.recompute import ChainPolicies, rerun
from orgel.costs.tied import plan_tied_weights, tied_shared, tied_stages, tied_within
from orgel.plan.floor import memory_floor, stage_peak_alive
from orgel.plan.ranks import best_ranks, channel_traffic
from orgel.plan.templates import Template, rename
from orgel.schedule.costs import Costs, StageCost
from orgel.schedule.ir import Plan, StageGraph, TiedWeight
from orgel.sim.compiled import CompiledPlan

#: Ops of compiled plans a scorer keeps (about 1 KiB of Python objects each): a
#: pipeline of 64 ranks over 512 micro-batches compiles to ~0.5M ops, and a search
#: that kept every split's stage graph would not stay within a few GiB.
COMPILED_OPS = 1_500_000


@dataclass
class Score:
    """A scored candidate: step time (ms) and peak bytes per rank."""

    step_time: float
    peak_memory: np.ndarray
    feasible: bool
    extra: dict[str, Any] = field(default_factory=dict)


class Scorer:
    """Scores ``(template, split)`` pairs for one block cost table (see module docstring).

    ``memory`` is the per-rank cap (default: the table's ``memory_per_rank``;
    ``None`` means unlimited). ``rename_ranks=False`` keeps every template's
    ranks even with per-pair links (see :meth:`placed`). ``evaluations`` counts
    simulator calls.
    """

    def __init__(self, costs: BlockCosts, *, memory: int | None = None,
                 sequential: bool = False, rename_ranks: bool = True) -> None:
        self.bc = costs
        self.memory = costs.memory_per_rank if memory is None else memory
        # ``sequential``: score linear splits the way classic pipelines run them
        # (stage i feeds only stage i+1 and forwards every live value through it).
        self.sequential = sequential
        self.chain = costs.is_chain() or sequential
        # cuts of a chain table before these blocks send no gradient back (costs.edge_grads):
        # a split there takes the stage graph that says so (no gradient message)
        self._gradless = ({b for (a, b), n in costs.edge_grads.items() if n == 0}
                          if costs.is_chain() else set())
        cross = np.zeros(costs.num_blocks + 1, dtype=np.int64)
        last = list(range(costs.num_blocks))
        for a, b in costs.edges:
            last[a] = max(last[a], b)
        # bytes of block a's outputs that blocks at or after c read: a stage [a', c) no other
        # stage feeds hands these to W (see costs.blocks.stage_cost's weight_kept)
        self._last_reader = np.array(last, dtype=np.int64)
        for a in range(costs.num_blocks):
            if last[a] > a:
                cross[a + 1] += costs.output[a]
                cross[last[a] + 1 if last[a] + 1 <= costs.num_blocks else -1] -= costs.output[a]
        self._cross = np.cumsum(cross)  # bytes alive across the cut before block c
        self._cf = np.concatenate([[0.0], np.cumsum(costs.fwd)])
        self._cb = np.concatenate([[0.0], np.cumsum(costs.bwd)])
        self._cw = np.concatenate([[0.0], np.cumsum(costs.wgrad)])
        self._cp = np.concatenate([[0], np.cumsum(costs.params)]).astype(np.int64)
        self._ca = np.concatenate([[0], np.cumsum(costs.activations)]).astype(np.int64)
        self._ck = np.concatenate([[0], np.cumsum(costs.weight_kept)]).astype(np.int64)
        # backward peak of blocks [a, b) (see costs.blocks.grad_overlap):
        # cp[b] - ca[a] + max over a <= j < b of (ca[j + 1] - cp[j])
        self._peak_at = RangeMax(self._ca[1:] - self._cp[:-1])
        # a block's saved inputs count when a producer lies before the stage's first block
        self._inp = np.asarray(costs.input_saved, dtype=np.int64)
        self._output = np.asarray(costs.output, dtype=np.int64)
        self._first_producer = np.arange(costs.num_blocks)
        for a, b in costs.edges:
            self._first_producer[b] = min(self._first_producer[b], a)
        # outputs no one saves, freed where the stage holds all their consumers
        spare, consumers = unsaved_outputs(costs)
        self._spare = np.asarray(spare, dtype=np.int64)
        self._last_consumer = np.array([max(c) if c else costs.num_blocks for c in consumers],
                                       dtype=np.int64)
        # a split backward's halves as measured apart (see costs.blocks.stage_cost)
        self._csi = np.concatenate([[0.0], np.cumsum(costs.split_input)]) \
            if costs.split_input else None
        self._csw = np.concatenate([[0.0], np.cumsum(costs.split_weight)]) \
            if costs.split_weight else None
        self._policies = ChainPolicies(costs.recompute)  # "layer", "selective" by range
        # (template, stage edges, tied groups) -> recompute flags -> compiled plan,
        # least recently used first (see _evict)
        self._compiled: OrderedDict[tuple[Any, ...],
                                    dict[tuple[bool | str, ...], CompiledPlan]] = OrderedDict()
        # schedule templates built for this table (orgel.plan.templates.cached_template)
        self.templates: dict[tuple[Any, ...], Template | None] = {}
        # (kind, id(template)) -> (template, array), kept so the id stays the template's own
        self._arrays: dict[tuple[str, int], tuple[Template, np.ndarray]] = {}
        # id(template) -> (template, renamed); the template is kept so its id stays unique
        self._placed: dict[tuple[int, tuple[tuple[int, int], ...]],
                           tuple[Template, Template]] = {}
        self.rename_ranks = rename_ranks
        self.evaluations = 0
        self.pruned = 0  # candidates memory_floor ruled out before the simulator
        # The static bytes a tied parameter's extra copies add at most: the quick
        # memory checks allow for them so they never reject a split that fits once
        # each rank counts the parameter once (the scores count exactly).
        self._tied_slack = int(costs.optimizer_factor
                               * sum(g.nbytes * (len(g.blocks) - 1) for g in costs.tied))

    # -- splits ------------------------------------------------------------------

    def chain_stage_costs(self, points: list[int] | tuple[int, ...], *,
                          split: bool = False) -> list[StageCost]:
        """Stage costs of a linear split at ``points`` (first block of stages 1..n-1).

        ``split``: a split-backward schedule, whose ``I`` keeps gradients for ``W``.
        """
        bc = self.bc
        bounds = [0, *points, bc.num_blocks]
        out = []
        factor = bc.optimizer_factor
        temp = bc.temporary
        for i in range(len(bounds) - 1):
            a, b = bounds[i], bounds[i + 1]
            params = int(self._cp[b] - self._cp[a])
            if bc.tied:
                params -= tied_within(bc, range(a, b))
            params, grads, optimizer = static_parts(params, factor)
            bwd = float(self._cb[b] - self._cb[a])
            # A stage no other stage feeds (the first, or a second tower's first) computes
            # no input gradient: W is its whole backward (orgel.costs.blocks.stage_cost).
            fed = bool((self._first_producer[a:b] < a).any())
            weight = float(self._cw[b] - self._cw[a]) if fed else bwd
            if split and fed and self._csi is not None and self._csw is not None:
                weight = float(self._csw[b] - self._csw[a])
                bwd = float(self._csi[b] - self._csi[a]) + weight
            # differences of running sums round: the weight half never exceeds the backward
            weight = min(weight, bwd)
            acts = int(self._ca[b] - self._ca[a])
            peak = int(self._cp[b] - self._ca[a]) + self._peak_at(a, b) if b > a else 0
            overlap = max(0, acts + grads - peak)
            if self._inp.any():
                entered = self._first_producer[a:b] < a
                acts += int(self._inp[a:b][entered].sum())
            if self._spare.any():
                freed = int(self._spare[a:b][self._last_consumer[a:b] < b].sum())
                acts, overlap = acts - freed, max(0, overlap - freed)
            out.append(StageCost(
                fwd=float(self._cf[b] - self._cf[a]), bwd=bwd, bwd_weight=weight,
                params=params, grads=grads, optimizer=optimizer, activations=acts,
                grad_overlap=overlap,
                # an unfed stage's I keeps only its outputs' gradients for W
                weight_kept=(0 if not split else int(self._ck[b] - self._ck[a]) if fed
                             else int(self._output[a:b][self._last_reader[a:b] >= b].sum())),
                temporary=max(temp[a:b]) if b > a else 0,
                recompute=self._policies(a, b),
            ))
        return out

    def lower_bound(self, template: Template, stages: list[StageCost],
                    recompute: tuple[bool | str, ...] | None = None) -> float:
        """The busiest rank's compute time: no schedule can finish before it."""
        m = template.base.microbatches
        oh = self.bc.action_overhead
        best = 0.0
        for hosted in template.rank_stages():
            t = 0.0
            for s in hosted:
                st = stages[s]
                share = 1.0 / len(template.placement[s])
                extra = rerun(st.fwd, st.recompute, recompute[s]) if recompute else 0.0
                t += m * ((st.fwd + st.bwd + extra) * share + 2 * oh)
            best = max(best, t)
        return best

    def chain_bounds(self, template: Template,
                     points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised over candidate rows of ``points``: (compute lower bound, static fits).

        ``points`` has one row per candidate linear split (``num_stages - 1``
        columns). The bound is :meth:`lower_bound` without recompute. With tied
        groups "fits" is optimistic (it allows for every extra copy).
        """
        n = self.bc.num_blocks
        rows = points.shape[0]
        bounds = np.hstack([np.zeros((rows, 1), dtype=np.int64), points,
                            np.full((rows, 1), n, dtype=np.int64)])
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        work = (self._cf[hi] - self._cf[lo]) + (self._cb[hi] - self._cb[lo])
        share = self._share_matrix(template)
        m = template.base.microbatches
        per_rank = (work @ share) * m + self._overheads(template)
        lb = per_rank.max(axis=1)
        if self.memory is None:
            return lb, np.ones(rows, dtype=bool)
        static = (self._cp[hi] - self._cp[lo]) * self.bc.optimizer_factor
        fits = ((static @ (share > 0)) <= self.memory + self._tied_slack).all(axis=1)
        return lb, fits

    def _of_template(self, kind: str, template: Template,
                     make: Callable[[Template], np.ndarray]) -> np.ndarray:
        """``make(template)``, once per template."""
        found = self._arrays.get((kind, id(template)))
        if found is None or found[0] is not template:
            found = self._arrays[(kind, id(template))] = (template, make(template))
        return found[1]

    def _share_matrix(self, template: Template) -> np.ndarray:
        def make(t: Template) -> np.ndarray:  # [stage, rank]: the rank's share of the stage
            share = np.zeros((t.num_stages, t.base.num_ranks))
            for s, ranks in enumerate(t.placement):
                share[s, list(ranks)] = 1.0 / len(ranks)
            return share

        return self._of_template("share", template, make)

    def _overheads(self, template: Template) -> np.ndarray:
        actions = np.array([len(a) for a in template.base.schedule], dtype=np.float64)
        return actions * self.bc.action_overhead

    def partial_policies(self, template: Template) -> list[str]:
        """The recompute policies short of a stage whole that this table prices and
        ``template`` runs, cheapest in time first: ``"selective"`` (not with a split
        backward: torch's selective checkpoint allows one backward per region), then
        ``"layer"``; none where the table has no per-layer facts."""
        if not self.bc.recompute:
            return []
        return ["layer"] if template.splits_backward else ["selective", "layer"]

    def static_fits(self, template: Template, stages: list[StageCost]) -> bool:
        """Whether weights + grads + optimizer state alone fit on every rank.

        Optimistic with tied groups, like :meth:`chain_bounds`.
        """
        if self.memory is None:
            return True
        for hosted in template.rank_stages():
            if sum(stages[s].static_bytes for s in hosted) > self.memory + self._tied_slack:
                return False
        return True

    # -- scoring -----------------------------------------------------------------

    def _graph_for(self, stage_blocks: list[range] | list[list[int]],
                   template: Template) -> StageGraph:
        if self.chain and all(isinstance(b, range) for b in stage_blocks) and not any(
                b and b[0] in self._gradless for b in stage_blocks[1:]):
            return template.base.stage_graph  # chain of stages, bytes passed separately
        return stage_graph(self.bc, stage_blocks)

    def compiled(self, template: Template, graph: StageGraph,
                 recompute: tuple[bool | str, ...],
                 tied: list[TiedWeight] | None = None) -> CompiledPlan:
        """The compiled plan of ``template`` over ``graph`` (cached by edge set).

        ``tied``: the candidate's tied groups (see
        :func:`orgel.costs.tied.plan_tied_weights`); part of the cache key, as is
        which edges send gradients back (``Edge.carries_grad``: their messages).
        """
        tied_key = tuple((g.stages, g.nbytes) for g in tied) if tied else ()
        key = (id(template), tuple((e.src, e.dst, e.carries_grad) for e in graph.edges),
               tied_key)
        variants = self._compiled.get(key)
        if variants is None:
            variants = self._compiled[key] = {}
            self._evict(keep=key)
        else:
            self._compiled.move_to_end(key)
        cp = variants.get(recompute)
        if cp is None:
            if variants:
                # recompute flags change no dependency: every set of flags shares one
                # compiled topology (CompiledPlan.with_recompute)
                cp = next(iter(variants.values())).with_recompute(recompute)
            else:
                meta = dict(template.base.meta)
                plan = Plan(stage_graph=graph, placement=template.base.placement,
                            num_ranks=template.base.num_ranks,
                            microbatches=template.base.microbatches,
                            schedule=template.base.schedule, recompute=list(recompute),
                            meta=meta, tied=list(tied or ()))
                cp = CompiledPlan(plan)
            variants[recompute] = cp
        return cp

    def _evict(self, keep: tuple[Any, ...]) -> None:
        """Drop the least recently used compiled plans beyond :data:`COMPILED_OPS` ops."""
        total = sum(next(iter(v.values())).num_ops for v in self._compiled.values() if v)
        for key in list(self._compiled):
            if total <= COMPILED_OPS or key == keep:
                break
            variants = self._compiled.pop(key)
            total -= next(iter(variants.values())).num_ops if variants else 0

    def score_chain(self, template: Template, points: tuple[int, ...],
                    recompute: tuple[bool | str, ...] | None = None) -> Score:
        """Score a linear split (see :meth:`chain_stage_costs`)."""
        stages = self.chain_stage_costs(points, split=template.splits_backward)
        blocks = [range(a, b) for a, b in zip((0, *points), (*points, self.bc.num_blocks),
                                                strict=True)]
        return self._score(template, blocks, stages, recompute)

    def score_split(self, template: Template, stage_blocks: list[list[int]] | list[range],
                    recompute: tuple[bool | str, ...] | None = None) -> Score:
        """Score any assignment of blocks to the template's stages."""
        split = template.splits_backward
        stages = [stage_cost(self.bc, blocks, split=split) for blocks in stage_blocks]
        return self._score(template, stage_blocks, stages, recompute)

    def _score(self, template: Template, stage_blocks: list[range] | list[list[int]],
               stages: list[StageCost], recompute: tuple[bool | str, ...] | None) -> Score:
        graph = self._graph_for(stage_blocks, template)
        template = self.placed(template, graph)
        stages = replica_stages(self.bc, stages, stage_blocks, template.base.placement)
        rec = tuple(recompute) if recompute else (False,) * template.num_stages
        grads = None
        if graph is template.base.stage_graph:
            edge_bytes = np.array([self._cross[stage_blocks[e.dst][0]] for e in graph.edges],
                                  dtype=np.int64)
            if self.bc.edge_grads and self.bc.is_chain():
                grads = edge_grad_bytes(self.bc, stage_blocks)
        else:
            edge_bytes = np.array([e.nbytes for e in graph.edges], dtype=np.int64)
            grads = edge_grad_bytes(self.bc, stage_blocks)
        tied = None
        if self.bc.tied:
            holders = tied_stages(self.bc, stage_blocks)
            stages = self._share_tied(template, stage_blocks, stages, holders)
            tied = plan_tied_weights(self.bc, stage_blocks, template.base.placement, holders)
        if self.memory is not None:
            alive = self._of_template("alive", template, lambda t: stage_peak_alive(
                t.base.schedule, t.num_stages))
            least = memory_floor(alive, template.base.placement, template.base.num_ranks,
                                 stages, [(e.src, e.dst) for e in graph.edges], edge_bytes, rec)
            if least.max() > self.memory:  # cannot fit: neither compile nor simulate it
                self.pruned += 1
                return Score(math.inf, least, False)
        cp = self.compiled(template, graph, rec, tied)
        costs = Costs(stages=stages, link=self.bc.link, links=self.bc.links,
                      action_overhead=self.bc.action_overhead,
                      memory_per_rank=self.memory, node_ranks=self.bc.node_ranks,
                      node_link=self.bc.node_link, edge_grad_bytes=grads,
                      cores=self.bc.cores)
        self.evaluations += 1
        # gloo's receive buffers are kept across steps (BlockCosts.receives_posted_ahead)
        step, peak = cp.evaluate(costs, edge_bytes=edge_bytes,
                                 receives_kept=self.bc.receives_posted_ahead)
        peak = reported_peak(self.bc, costs, template.base.placement, peak,
                             cp.held_send_bytes(edge_bytes, grads))  # see planner.held_sends
        feasible = self.memory is None or bool(peak.max() <= self.memory)
        return Score(step, peak, feasible)

    def _share_tied(self, template: Template, stage_blocks: list[range] | list[list[int]],
                    stages: list[StageCost], holders: list[tuple[int, ...]]
                    ) -> list[StageCost]:
        """``stages`` less the tied bytes another stage on the same rank holds."""
        shared = tied_shared(self.bc, stage_blocks, template.base.placement, holders)
        if not any(shared):
            return stages
        factor = self.bc.optimizer_factor
        out = list(stages)
        for s, nbytes in enumerate(shared):
            if nbytes:
                params, grads, optimizer = static_parts(out[s].params - nbytes, factor)
                out[s] = dataclasses.replace(out[s], params=params, grads=grads,
                                             optimizer=optimizer)
        return out

    def to_plan(self, template: Template, stage_blocks: list[range] | list[list[int]],
                recompute: tuple[bool | str, ...] | None = None,
                meta: dict[str, Any] | None = None) -> Plan:
        """The full Plan of a candidate: real stage graph (blocks, edge bytes) and costs."""
        template = self.placed(template, self._graph_for(stage_blocks, template))
        graph = stage_graph(self.bc, [list(b) for b in stage_blocks])
        costs = stage_costs(self.bc, [list(b) for b in stage_blocks],
                            split=template.splits_backward, placement=template.base.placement)
        costs.memory_per_rank = self.memory
        plan_meta = dict(template.base.meta)
        # the all-reduces the score priced; attach_split re-derives them from the split
        tied = plan_tied_weights(self.bc, stage_blocks, template.base.placement)
        plan_meta.update(meta or {})
        return Plan(stage_graph=graph, placement=template.base.placement,
                    num_ranks=template.base.num_ranks,
                    microbatches=template.base.microbatches,
                    schedule=[list(a) for a in template.base.schedule],
                    recompute=list(recompute) if recompute else [],
                    costs=costs, meta=plan_meta, tied=tied)

    # -- per-pair links ----------------------------------------------------------

    def placed(self, template: Template, graph: StageGraph | None = None) -> Template:
        """``template`` with ranks renamed so its busiest channels get the fastest links.

        Only with per-pair links (``costs.links``); renaming ranks changes no
        rank's work, only which links its messages take. ``graph``: the stage
        graph the template runs (default: its chain). Cached per template and
        edge set.
        """
        if not self.bc.links or not self.rename_ranks:
            return template
        graph = template.base.stage_graph if graph is None else graph
        key = (id(template), tuple((e.src, e.dst) for e in graph.edges))
        hit = self._placed.get(key)
        if hit is None:
            base = template.base
            runs = (base if graph is base.stage_graph
                    else dataclasses.replace(base, stage_graph=graph))
            perm = best_ranks(channel_traffic(runs), self._link_times(template))
            renamed = template if perm == tuple(range(len(perm))) else rename(template, perm)
            hit = (template, renamed)
            self._placed[key] = hit
        return hit[1]

    def _link_times(self, template: Template) -> np.ndarray:
        """[src, dst] ms of a typical message (the median cut's bytes) on each pair's link."""
        ranks = template.base.num_ranks
        cuts = self._cross[1:-1]
        nbytes = int(np.median(cuts[cuts > 0])) if (cuts > 0).any() else 1 << 20
        costs = Costs(stages=[], link=self.bc.link, links=self.bc.links,
                      node_ranks=self.bc.node_ranks, node_link=self.bc.node_link)
        return np.array([[costs.link_between(a, b).time(nbytes) if a != b else 0.0
                          for b in range(ranks)] for a in range(ranks)])

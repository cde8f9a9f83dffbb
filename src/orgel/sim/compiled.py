"""A Plan compiled into a fixed operation dependency graph, evaluated fast under many costs.

The graph (:mod:`orgel.sim.topology`) has one op per compute action, per
message and per gradient all-reduce. The earliest start of an op is the latest
end of its predecessors; the step time is the latest end of all.

Planners score thousands of candidates that share a schedule and differ only in
costs, so everything that depends on the topology alone (ops, predecessors,
topological order, index arrays, in-flight counts) is computed once here and
:meth:`CompiledPlan.evaluate` only turns costs into durations, runs the longest
path and sweeps memory.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orgel.costs.recompute import policy_effects
from orgel.schedule.comm import CommPlan
from orgel.schedule.costs import Costs, PolicyCost
from orgel.schedule.ir import Plan, PlanError
from orgel.sim.allreduce import (
    AllReduce,
    allreduce_time,
    gather_time,
    plan_allreduces,
)
from orgel.sim.longest import longest_path, straight_line_for
from orgel.sim.memory import MemoryLayout, peak_memory
from orgel.sim.sharing import mean_overlap, shared_step
from orgel.sim.topology import PlanTopology

__all__ = ["AllReduce", "CompiledPlan", "StageArrays", "allreduce_time", "plan_allreduces"]

_MIB = float(1 << 20)

#: ``evaluate`` compiles the longest path into straight-line Python after this
#: many calls: compiling costs ~25 µs per op once and saves ~0.1 µs per op per
#: call, so it pays back after a few hundred calls (a search loop), never in a
#: one-off simulation. Compiled topologies are shared between CompiledPlans.
STRAIGHT_LINE_AFTER = 100
#: Below this many ops the generic loop is as fast as straight-line code.
STRAIGHT_LINE_MIN_OPS = 32


#: Fixed-point rounds of :meth:`CompiledPlan.shared_timeline` (ranks sharing cores).
SHARE_ROUNDS = 6


@dataclass(frozen=True)
class StageArrays:
    """Per-stage costs as arrays (what :meth:`CompiledPlan.evaluate` reads from Costs)."""

    fwd: np.ndarray
    bwd: np.ndarray
    wgrad: np.ndarray
    activations: np.ndarray
    temporary: np.ndarray
    static: np.ndarray
    grads: np.ndarray
    weight_kept: np.ndarray | None = None  # per stage; None when every stage has 0
    grad_overlap: np.ndarray | None = None  # per stage; None when every stage has 0
    #: per stage, what "layer" and "selective" recompute cost it (StageCost.recompute)
    known: tuple[tuple[PolicyCost, ...], ...] = ()

    @classmethod
    def from_costs(cls, costs: Costs, num_stages: int) -> StageArrays:
        """Read one entry per stage; raises :class:`PlanError` on a count mismatch."""
        if len(costs.stages) != num_stages:
            raise PlanError(
                f"costs describe {len(costs.stages)} stages but the plan has {num_stages}: "
                "give one StageCost per stage"
            )
        table = np.array(
            [(s.fwd, s.bwd, s.weight_grad, s.activations, s.temporary, s.static_bytes,
              s.grad_bytes) for s in costs.stages],
            dtype=np.float64,
        ).reshape(num_stages, 7)
        kept = np.array([s.weight_kept for s in costs.stages], dtype=np.float64)
        overlap = np.array([s.grad_overlap for s in costs.stages], dtype=np.float64)
        fwd, bwd, wgrad, activations, temporary, static, grads = table.T
        return cls(fwd, bwd, wgrad, activations, temporary, static, grads,
                   kept if kept.any() else None, overlap if overlap.any() else None,
                   tuple(s.recompute for s in costs.stages))

    def check(self, costs: Costs, split: np.ndarray) -> None:
        """Raise :class:`PlanError` on a negative time, or on ``bwd_weight > bwd``
        for a stage that runs split backward (``split[s]``: its I/W halves)."""
        bad = (np.minimum(np.minimum(self.fwd, self.bwd), self.wgrad) < 0) | (
            split & (self.wgrad > self.bwd)
        )
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            s = costs.stages[i]
            raise PlanError(
                f"stage {i} has fwd={s.fwd:g}, bwd={s.bwd:g}, bwd_weight={s.weight_grad:g}: "
                "times must be >= 0 and, with a split backward, bwd_weight <= bwd"
            )


class CompiledPlan(PlanTopology):
    """The operation dependency graph of ``plan`` with its topology precomputed.

    ``evaluate(costs)`` returns ``(step_time, peak_memory_per_rank)``; use it in
    search loops. :func:`orgel.sim.simulate` gives the full result (timeline,
    critical path, busy fractions) through the same graph. The index arrays
    (``op_rank``, ``msg_send``, ``preds``, ``order``, ...) are
    :class:`~orgel.sim.topology.PlanTopology`'s.
    """

    def __init__(self, plan: Plan, *, comm: CommPlan | None = None,
                 gathers: list[tuple[int, tuple[int, ...], list[tuple[int, int]]]]
                 | None = None) -> None:
        super().__init__(plan, comm=comm, gathers=gathers)
        graph = plan.stage_graph
        flags = [bool(f) for f in self.policies]
        self.memory = MemoryLayout.build(
            self.op_rank, self.op_stage, self.op_kind, self.rank_start, plan.placement, flags,
        )
        self.edge_dst = np.array([e.dst for e in graph.edges], dtype=np.int64)
        self.default_edge_bytes = np.array([e.nbytes for e in graph.edges], dtype=np.int64)
        # a gradient message carries the values that carry a gradient (Value.grad)
        self.default_grad_bytes = np.array([e.grad_nbytes for e in graph.edges], dtype=np.int64)
        self.default_msg_bytes = np.where(
            self.msg_grad, self.default_grad_bytes[self.msg_edge],
            self.default_edge_bytes[self.msg_edge]) * self.msg_part_num // self.msg_part_den
        self.recompute = np.array(flags, dtype=bool)
        self._straight: Any = None
        self._fresh: np.ndarray | None = None  # fresh_shares, once asked for
        self._calls = 0
        self._topology: CompiledPlan | None = None  # the plan whose longest path this one runs
        self._arrays_cache: tuple[tuple[Any, ...], StageArrays] | None = None
        self._link_cache: tuple[Any, ...] | None = None
        # the last recompute_effects: its arrays and edge bytes, and what it gave
        self._effects: tuple[StageArrays, Any, tuple[np.ndarray, np.ndarray, np.ndarray]] \
            | None = None

    def with_recompute(self, recompute: Sequence[bool | str]) -> CompiledPlan:
        """This compiled plan with other recompute flags, sharing its topology.

        Recompute changes durations and what a forward keeps, never which op
        waits for which: the copy shares the dependency graph (and its
        straight-line code) and rebuilds only the memory layout.
        """
        policies = [f if isinstance(f, str) else bool(f) for f in recompute]
        flags = [bool(f) for f in policies]
        if len(flags) != self.num_stages:
            raise PlanError(f"recompute has {len(flags)} entries but there are "
                            f"{self.num_stages} stages: give one per stage")
        out = copy.copy(self)
        out.plan = dataclasses.replace(self.plan, recompute=policies)
        out.recompute = np.array(flags, dtype=bool)
        out.policies = policies
        out.memory = MemoryLayout.build(self.op_rank, self.op_stage, self.op_kind,
                                        self.rank_start, self.plan.placement, flags)
        out._topology = self._topology or self
        out._arrays_cache = None
        out._link_cache = None
        out._effects = None
        return out

    # -- evaluation ----------------------------------------------------------------

    def stage_arrays(self, costs: Costs | None) -> tuple[Costs, StageArrays]:
        """The costs to use (``costs`` or the plan's) and their per-stage arrays.

        The arrays of the last costs seen are reused while ``costs.stages``
        holds the same StageCost objects (they are frozen).
        """
        if costs is None:
            costs = self.plan.costs
        if costs is None:
            raise PlanError("the plan carries no costs: pass costs=Costs(...) to simulate it")
        stages = costs.stages
        hit = self._arrays_cache
        if hit is not None and len(hit[0]) == len(stages) and all(
            a is b for a, b in zip(hit[0], stages, strict=True)
        ):
            return costs, hit[1]
        arrays = StageArrays.from_costs(costs, self.num_stages)
        arrays.check(costs, self.split_stage)
        self._arrays_cache = (tuple(stages), arrays)
        return costs, arrays

    def durations(
        self, costs: Costs, arrays: StageArrays, edge_bytes: np.ndarray | None = None,
        gathers: Costs | None = None,
    ) -> np.ndarray:
        """Duration of every op (compute, messages, all-reduces, parameter all-gathers), in
        op order. ``gathers``: the costs that price the all-gathers (default ``costs``)."""
        # F: fwd; B: bwd; I: bwd - wgrad; W: wgrad; B/I of a recomputed stage add the
        # forward its policy runs again
        again = self.recompute_effects(arrays, edge_bytes)[0]
        table = np.stack([arrays.fwd, arrays.bwd + again, arrays.bwd - arrays.wgrad + again,
                          arrays.wgrad], axis=1)
        table *= self.stage_share[:, None]
        compute = table.ravel()[self.op_table_index] + costs.action_overhead
        parts = [compute, self._comm_durations(costs, edge_bytes)]
        if self.allreduces:
            reduce = [self._allreduce_time(g, costs, arrays) for g in self.allreduces]
            parts.append(np.asarray(reduce, dtype=np.float64))
        if self.gathers:
            parts.append(self.gather_durations(costs if gathers is None else gathers))
        return np.concatenate(parts)

    def gather_durations(self, costs: Costs) -> np.ndarray:
        """ms of each parameter all-gather (:attr:`gathers`) over its stage's replicas."""
        return np.asarray([gather_time(ranks, costs.stages[s].params, costs)
                           for s, ranks, _ in self.gathers], dtype=np.float64)

    def message_bytes(self, edge_bytes: np.ndarray | None = None,
                      grad_bytes: list[int] | np.ndarray | None = None) -> np.ndarray:
        """Bytes of every message (its share of its edge's bytes).

        ``grad_bytes`` (per edge, optional): what a gradient message of the edge
        carries instead (``Costs.edge_grad_bytes``: values without a gradient send
        none back). With neither argument a gradient message carries the bytes of
        its edge's values that carry a gradient (``Value.grad``).
        """
        if edge_bytes is None and grad_bytes is None:
            return self.default_msg_bytes
        eb = self.default_edge_bytes if edge_bytes is None \
            else np.asarray(edge_bytes, dtype=np.int64)
        per = eb[self.msg_edge]
        if grad_bytes is not None:
            per = np.where(self.msg_grad, np.asarray(grad_bytes, dtype=np.int64)[self.msg_edge],
                           per)
        return per * self.msg_part_num // self.msg_part_den

    def held_send_bytes(self, edge_bytes: np.ndarray | None = None,
                        grad_bytes: list[int] | np.ndarray | None = None) -> np.ndarray:
        """Per rank, the most bytes it sends right after one action.

        ``orgel.runtime.comm`` waits for a send once the sender's next action
        has run (gloo; NCCL drops sends as they complete), so at most one
        action's sends are pending at a time: this is what a rank's sent
        tensors add to its memory on top of what the simulator counts. A value
        sent to several stages after one action is one tensor, held once
        (:meth:`fresh_shares`).
        """
        out = np.zeros(self.num_ranks, dtype=np.int64)
        if self.num_messages == 0:
            return out
        if self._fresh is None:
            self._fresh = self.fresh_shares()
        per_action = np.bincount(self.msg_send,
                                 weights=self.message_bytes(edge_bytes, grad_bytes) * self._fresh,
                                 minlength=self.num_compute)
        for r in range(self.num_ranks):
            lo, hi = int(self.rank_start[r]), int(self.rank_start[r + 1])
            if hi > lo:
                out[r] = int(per_action[lo:hi].max())
        return out

    def fresh_shares(self) -> np.ndarray:
        """Per message, the share of its bytes no earlier message after the same action
        holds already: the runtime sends one tensor (a mask every later stage reads) to
        each stage that reads it, so the sends hold it once. A value's messages to
        several stages carry nested parts of it (:func:`orgel.costs.blocks.stage_graph`:
        the most any reader reads), so the largest is what is held."""
        graph = self.plan.stage_graph
        out = np.ones(self.num_messages)
        seen: dict[tuple[int, str, tuple[int, int, int]], int] = {}
        for k, m in enumerate(self.comm.messages):
            values = graph.edges[m.edge].values
            total = sum(v.nbytes for v in values)
            if m.grad or total == 0:
                continue  # gradients: one per edge, no two the same tensor
            fresh = 0
            for v in values:
                key = (int(self.msg_send[k]), v.name, m.part)
                before = seen.get(key, 0)
                fresh += max(0, v.nbytes - before)
                seen[key] = max(before, v.nbytes)
            out[k] = fresh / total
        return out

    def posted_receive_bytes(self, edge_bytes: np.ndarray | None = None,
                             grad_bytes: list[int] | np.ndarray | None = None) -> np.ndarray:
        """Per rank, the bytes of every message it receives in a step.

        On gloo ``orgel.runtime.comm`` posts every receive at the step's start
        into a buffer per message kept across steps: memory the rank holds all
        the time, on top of what the simulator counts (it charges a message
        from its transfer to its receiving action, as NCCL's receives hold it).
        """
        out = np.zeros(self.num_ranks, dtype=np.int64)
        if self.num_messages == 0:
            return out
        ranks = self.op_rank[self.msg_recv]
        np.add.at(out, ranks, self.message_bytes(edge_bytes, grad_bytes).astype(np.int64))
        return out

    def _comm_durations(self, costs: Costs, edge_bytes: np.ndarray | None) -> np.ndarray:
        """Transfer time of every message.

        Per-message link parameters are cached per ``costs.links`` dict object
        (and ``costs.link``): give a new dict rather than editing one in place
        between calls. With default edge bytes the times themselves are cached.
        """
        links = costs.links
        hit = self._link_cache
        key = (costs.link, costs.node_ranks, costs.node_link)
        if hit is None or hit[0] is not links or hit[1] != len(links) or hit[2] != key:
            if not costs.uniform_links:
                per_channel = [costs.link_between(s, d) for s, d in self.channels]
                latency = np.array([lk.latency for lk in per_channel])[self.msg_channel]
                per_mib = np.array([lk.per_mib for lk in per_channel])[self.msg_channel]
            else:
                latency = np.full(self.num_messages, costs.link.latency)
                per_mib = np.full(self.num_messages, costs.link.per_mib)
            hit = (links, len(links), key, latency, per_mib / _MIB, None)
        grads = costs.edge_grad_bytes
        if edge_bytes is None and grads is None and hit[5] is not None:
            return hit[5]
        nbytes = self.message_bytes(edge_bytes, grads)
        comm = np.where(nbytes > 0, hit[3] + hit[4] * nbytes, 0.0)
        if edge_bytes is None and grads is None:
            hit = (*hit[:5], comm)
        self._link_cache = hit
        return comm

    def _allreduce_time(self, g: AllReduce, costs: Costs, arrays: StageArrays) -> float:
        return allreduce_time(g, costs, arrays.grads)

    def longest(self, durations: np.ndarray) -> np.ndarray:
        """End time of every op (earliest start = latest predecessor end).

        The first :data:`STRAIGHT_LINE_AFTER` calls run the generic loop; after
        that the topology is compiled to straight-line code (see
        :mod:`orgel.sim.longest`), which pays off only over many calls.
        """
        if self._topology is not None:
            return self._topology.longest(durations)
        if self._straight is None:
            self._calls += 1
            if self._calls <= STRAIGHT_LINE_AFTER or self.num_ops < STRAIGHT_LINE_MIN_OPS:
                return np.asarray(longest_path(self.preds, self.order, durations.tolist()))
            self._straight = straight_line_for(self.preds, self.order)
        return np.asarray(self._straight(durations.tolist()))

    def shared_timeline(self, costs: Costs, durations: np.ndarray, *, copies: int = 1
                        ) -> tuple[np.ndarray, np.ndarray, float]:
        """``(durations, end times, least step)`` when the ranks share ``costs.cores``.

        ``durations`` are each action's with a core to itself. With more ranks
        than cores, an action runs slower by the number of ranks computing
        during it over the cores (processor sharing): found by fixed-point
        rounds, each timing the schedule with the last round's slowdowns
        (:data:`SHARE_ROUNDS`, averaged with the one before so they settle).
        ``copies``: that many replicas run this timeline at once on the same
        cores (data parallelism priced from one pipeline). Without shared
        cores, the schedule's own times. The least step is every rank's compute
        over the cores (:func:`shared_step`; 0 without shared cores): a step
        takes the later of it and the last end.
        """
        cores, nc = costs.cores, self.num_compute
        least = shared_step(copies * float(durations[:nc].sum()), self.num_ranks * copies, cores)
        if cores is None or cores >= self.num_ranks * copies or nc == 0:
            return durations, self.longest(durations), least
        factor = np.ones(nc)
        out = durations
        for _ in range(SHARE_ROUNDS):
            out = durations.copy()
            out[:nc] *= factor
            end = self.longest(out)
            busy = copies * mean_overlap(end[:nc] - out[:nc], end[:nc])
            factor = 0.5 * (factor + np.maximum(1.0, busy / max(cores, 1e-9)))
        out = durations.copy()
        out[:nc] *= factor
        return out, self.longest(out), least

    def recompute_effects(self, arrays: StageArrays, edge_bytes: np.ndarray | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stage: ``(again, kept, rebuilt)`` under the plan's recompute policies: the
        forward ms its backward runs again, the bytes one forward keeps until its backward,
        the bytes that backward rebuilds at once (:func:`orgel.costs.recompute.policy_effects`).
        An evaluation asks twice (its durations, its memory): the second is the first's.
        """
        if not self.recompute.any():
            zero = np.zeros(self.num_stages)
            return zero, arrays.activations, zero
        hit = self._effects
        if hit is not None and hit[0] is arrays and hit[1] is edge_bytes:
            return hit[2]
        eb = self.default_edge_bytes if edge_bytes is None else np.asarray(edge_bytes)
        inputs = np.bincount(self.edge_dst, weights=eb, minlength=self.num_stages)
        known = arrays.known or ((),) * self.num_stages
        got = policy_effects(self.policies, arrays.fwd, arrays.activations, inputs, known)
        self._effects = (arrays, edge_bytes, got)
        return got

    def evaluate(
        self,
        costs: Costs | None = None,
        *,
        fwd: np.ndarray | None = None,
        bwd: np.ndarray | None = None,
        wgrad: np.ndarray | None = None,
        edge_bytes: np.ndarray | None = None,
        receives_kept: bool = False,
    ) -> tuple[float, np.ndarray]:
        """``(step_time, peak_memory[rank])`` under ``costs`` (default: the plan's).

        ``receives_kept``: every receive is posted at the step's start into a
        buffer kept across steps (gloo, see :meth:`posted_receive_bytes`).

        ``fwd``/``bwd``/``wgrad`` (one entry per stage, whole micro-batch) and
        ``edge_bytes`` (one per stage-graph edge) override the costs' values,
        so a planner can rescore new split points without building Costs.
        """
        costs, arrays = self.stage_arrays(costs)
        if fwd is not None or bwd is not None or wgrad is not None:
            arrays = StageArrays(
                arrays.fwd if fwd is None else np.asarray(fwd, dtype=np.float64),
                arrays.bwd if bwd is None else np.asarray(bwd, dtype=np.float64),
                arrays.wgrad if wgrad is None else np.asarray(wgrad, dtype=np.float64),
                arrays.activations, arrays.temporary, arrays.static, arrays.grads,
                arrays.weight_kept, arrays.grad_overlap, arrays.known,
            )
        alone = self.durations(costs, arrays, edge_bytes)
        dur, end, least = self.shared_timeline(costs, alone)
        step = max(float(end.max()) if len(end) else 0.0, least)
        return step, self.peak_memory(arrays, dur, end, edge_bytes, receives_kept,
                                      costs.edge_grad_bytes)

    def peak_memory(
        self,
        arrays: StageArrays,
        dur: np.ndarray,
        end: np.ndarray,
        edge_bytes: np.ndarray | None = None,
        receives_kept: bool = False,
        grad_bytes: list[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Peak bytes per rank given op durations and end times (see :mod:`memory`).

        ``grad_bytes``: per edge, what its gradient messages carry (see
        :meth:`message_bytes`).

        ``receives_kept``: the receive buffers are held all the time
        (:meth:`posted_receive_bytes`) instead of from a message's transfer
        until its receiving action starts.
        """
        nc, nm = self.num_compute, self.num_messages
        msg_bytes = self.message_bytes(edge_bytes, grad_bytes)
        held = np.zeros(self.num_ranks, dtype=np.int64)
        if receives_kept:
            held = self.posted_receive_bytes(edge_bytes, grad_bytes)
            msg_bytes = np.zeros_like(msg_bytes)
        _, keep, rebuilt = self.recompute_effects(arrays, edge_bytes)
        return held + peak_memory(
            self.memory,
            keep=keep,
            rebuilt=rebuilt,
            temporary=arrays.temporary,
            static=arrays.static,
            share=self.stage_share,
            compute_end=end[:nc],
            compute_start=end[:nc] - dur[:nc],
            msg_start=end[nc:nc + nm] - dur[nc:nc + nm],
            msg_recv=self.msg_recv,
            msg_bytes=msg_bytes,
            weight_kept=arrays.weight_kept,
            grads=arrays.grads,
            grad_overlap=arrays.grad_overlap,
        )


"""The op dependency graph of a Plan: its ops, their predecessors, a topological order.

The graph follows Pfeife §3.2–3.3: one op per compute action (ranks run their
list in order), one op per message of :func:`orgel.schedule.comm.derive_comm`
(a channel per (sender, receiver) pair carries one message at a time, in the
channel's order), and one gradient all-reduce per data-parallel stage and per
tied weight group. Built once per plan; it depends on the topology alone, not
on costs. A schedule whose graph has a cycle deadlocks: :class:`PlanError` names
where each stuck rank waits.

Op numbering: compute ops first (rank by rank, in list order), then messages
(their index in the CommPlan), then all-reduces.

:class:`PlanTopology` is the base of :class:`orgel.sim.compiled.CompiledPlan`,
which turns costs into durations over it.
"""

from __future__ import annotations

import numpy as np

from orgel.schedule.comm import CommPlan, derive_comm
from orgel.schedule.ir import Plan, PlanError
from orgel.sim.allreduce import plan_allreduces, plan_gathers

_KIND_CODE = {"F": 0, "B": 1, "I": 2, "W": 3}


class PlanTopology:
    """The ops of ``plan`` and their dependencies, as index arrays (read-only).

    Per compute op ``op_rank``, ``op_stage``, ``op_kind`` (0..3 for F/B/I/W),
    ``op_microbatch``; ``rank_start[r]`` is the first compute op of rank ``r``;
    per message ``msg_src``, ``msg_dst``, ``msg_edge``, ``msg_send``/``msg_recv``
    (compute op indices); ``preds[v]`` and ``order`` describe the whole graph
    (``num_ops`` ops: the compute ops, the messages, the all-reduces, then the
    parameter all-gathers of sharded stages, ``gathers``).

    ``gathers`` (default: ``plan``'s own, :func:`~orgel.sim.allreduce.plan_gathers`) lets
    a pipeline be timed with the gathers of its sharded replicas
    (:func:`orgel.plan.replicated.replica_step`).
    """

    def __init__(self, plan: Plan, *, comm: CommPlan | None = None,
                 gathers: list[tuple[int, tuple[int, ...], list[tuple[int, int]]]]
                 | None = None) -> None:
        self.plan = plan
        self.comm = derive_comm(plan) if comm is None else comm
        graph = plan.stage_graph
        self.num_ranks = len(plan.schedule)
        self.num_stages = graph.num_stages
        if plan.num_ranks != self.num_ranks:
            raise PlanError(
                f"plan says num_ranks={plan.num_ranks} but its schedule has "
                f"{self.num_ranks} rank lists: make them agree"
            )
        for name, per_stage in (("placement", plan.placement), ("recompute", plan.recompute)):
            if len(per_stage) != self.num_stages:
                raise PlanError(f"plan.{name} has {len(per_stage)} entries but there are "
                                f"{self.num_stages} stages: give one per stage")
        self._build_compute(plan)
        self._build_messages(plan)
        self._build_allreduces(plan, plan_gathers(plan) if gathers is None else gathers)
        self._build_graph()

    def _build_compute(self, plan: Plan) -> None:
        rank, stage, kind, mb = [], [], [], []
        self.rank_start = np.zeros(self.num_ranks + 1, dtype=np.int64)
        for r, actions in enumerate(plan.schedule):
            self.rank_start[r + 1] = self.rank_start[r] + len(actions)
            for a in actions:
                rank.append(r)
                stage.append(a.stage)
                kind.append(_KIND_CODE[a.kind])
                mb.append(a.microbatch)
        self.num_compute = len(rank)
        self.op_rank = np.array(rank, dtype=np.int64)
        self.op_stage = np.array(stage, dtype=np.int64)
        self.op_kind = np.array(kind, dtype=np.int64)
        self.op_microbatch = np.array(mb, dtype=np.int64)
        # An op's duration is entry (stage, kind) of a small per-stage table.
        self.op_table_index = self.op_stage * 4 + self.op_kind
        replicas = np.array([len(p) for p in plan.placement], dtype=np.float64)
        self.stage_share = 1.0 / replicas
        #: each stage's recompute policy (False: none; see orgel.costs.recompute)
        self.policies: list[bool | str] = list(plan.recompute) or [False] * self.num_stages
        self.split_stage = np.zeros(self.num_stages, dtype=bool)
        self.split_stage[self.op_stage[self.op_kind >= 2]] = True

    def _build_messages(self, plan: Plan) -> None:
        msgs = self.comm.messages
        start = self.rank_start
        self.num_messages = len(msgs)
        self.channels = sorted(self.comm.channels)
        channel_index = {c: i for i, c in enumerate(self.channels)}
        self.msg_src = np.array([m.src_rank for m in msgs], dtype=np.int64)
        self.msg_dst = np.array([m.dst_rank for m in msgs], dtype=np.int64)
        self.msg_edge = np.array([m.edge for m in msgs], dtype=np.int64)
        self.msg_part_num = np.array([m.part[1] - m.part[0] for m in msgs], dtype=np.int64)
        self.msg_part_den = np.array([m.part[2] for m in msgs], dtype=np.int64)
        self.msg_grad = np.array([m.grad for m in msgs], dtype=bool)
        self.msg_channel = np.array(
            [channel_index[(m.src_rank, m.dst_rank)] for m in msgs], dtype=np.int64
        )
        self.msg_send = np.array([start[m.src_rank] + m.send_pos for m in msgs], dtype=np.int64)
        self.msg_recv = np.array([start[m.dst_rank] + m.recv_pos for m in msgs], dtype=np.int64)

    def _build_allreduces(self, plan: Plan,
                          gathers: list[tuple[int, tuple[int, ...], list[tuple[int, int]]]]
                          ) -> None:
        # a sharded stage's parameter all-gather on each of its ranks: ``(stage, ranks,
        # first F op)``, one op each. The runtime starts them at the step's start, one
        # after another in the order of the stages' first F on the rank (rank-major op
        # indices sort them so), and each first F waits for its own
        self.gathers = sorted(((s, ranks, int(self.rank_start[r]) + pos)
                               for s, ranks, firsts in gathers for r, pos in firsts
                               if r < self.num_ranks), key=lambda g: g[2])
        self.allreduces, last = plan_allreduces(plan)
        # Each all-reduce waits for the last backward (B or W) of its stages on every rank.
        self._allreduce_preds = [[int(self.rank_start[r]) + pos for r, pos in ps]
                                 for ps in last]

    def _build_graph(self) -> None:
        nc, nm = self.num_compute, self.num_messages
        self.num_ops = nc + nm + len(self.allreduces) + len(self.gathers)
        preds: list[list[int]] = [[] for _ in range(self.num_ops)]
        for r in range(self.num_ranks):
            for v in range(int(self.rank_start[r]) + 1, int(self.rank_start[r + 1])):
                preds[v].append(v - 1)
        for k in range(nm):
            preds[nc + k].append(int(self.msg_send[k]))
            preds[int(self.msg_recv[k])].append(nc + k)
        for indices in self.comm.channels.values():
            # one message at a time per channel, in the channel's (send == receive) order
            for before, after in zip(indices, indices[1:], strict=False):
                preds[nc + after].append(nc + before)
        for g, ps in enumerate(self._allreduce_preds):
            preds[nc + nm + g].extend(ps)
        last_on: dict[int, int] = {}  # rank -> its gather before (one at a time)
        for g, (_, _, first) in enumerate(self.gathers):
            v = self.gather_op(g)
            rank = int(self.op_rank[first])
            if rank in last_on:
                preds[v].append(last_on[rank])
            last_on[rank] = v
            preds[first].append(v)
        self.preds = preds
        self.order = self._topological_order(preds)

    def gather_op(self, g: int) -> int:
        """The op index of gather ``g`` (of :attr:`gathers`)."""
        return self.num_compute + self.num_messages + len(self.allreduces) + g

    def _topological_order(self, preds: list[list[int]]) -> list[int]:
        succs: list[list[int]] = [[] for _ in preds]
        indegree = [len(p) for p in preds]
        for v, ps in enumerate(preds):
            for u in ps:
                succs[u].append(v)
        ready = [v for v in range(len(preds)) if indegree[v] == 0]
        order: list[int] = []
        while ready:
            v = ready.pop()
            order.append(v)
            for w in succs[v]:
                indegree[w] -= 1
                if indegree[w] == 0:
                    ready.append(w)
        if len(order) != len(preds):
            raise PlanError(self._deadlock_message(set(order)))
        return order

    def _deadlock_message(self, done: set[int]) -> str:
        """Name the first action each stuck rank waits at (and for what)."""
        stuck = []
        for r in range(self.num_ranks):
            for v in range(int(self.rank_start[r]), int(self.rank_start[r + 1])):
                if v not in done:
                    pos = v - int(self.rank_start[r])
                    waits = [
                        f"rank {self.msg_src[u - self.num_compute]}"
                        for u in self.preds[v]
                        if u >= self.num_compute and u not in done
                    ]
                    why = f" waiting for a message from {', '.join(waits)}" if waits else ""
                    stuck.append(f"rank {r} at position {pos} ({self.plan.schedule[r][pos]}){why}")
                    break
        return "schedule deadlocks: " + "; ".join(stuck) + (
            ": reorder the actions so every message is sent before it is needed"
        )

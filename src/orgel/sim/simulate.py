"""Simulate one training step of a Plan: step time, critical path, timeline, busy time, memory.

The model (Pfeife §3.3, an operation dependency graph and its longest path):

* compute: each rank runs its action list in order; ``F`` takes the stage's
  ``fwd``, ``B`` its ``bwd``, ``I`` its input-grad part ``bwd - bwd_weight``,
  ``W`` its ``bwd_weight``, each plus ``costs.action_overhead``; the ``B``/``I``
  of a recomputed stage also pays ``fwd`` again; a replica of a stage on ``n``
  ranks does ``1/n`` of the work (time and activation memory);
* communication: one op per message of :func:`orgel.schedule.comm.derive_comm`,
  starting after the action that produces it and after the previous message on
  its (sender, receiver) channel, taking ``costs.link_between(src, dst).time(nbytes)``;
  the receiving action waits for it. Transfers do not occupy the compute of
  either rank (they run on their own streams);
* gradient all-reduce: a stage on ``n > 1`` ranks sums its gradients over its
  replicas once every replica's last ``B``/``W`` of the stage has finished;
  ring model, ``2(n-1)`` steps of ``grad_bytes/n`` each over the slowest link of
  the ring, i.e. about ``2(n-1)/n x grad_bytes`` per rank. Tied weights shared by
  stages on different ranks (``plan.tied``, e.g. ``[TiedWeight("emb.weight", (0, 3),
  N)]``) get the same all-reduce among the ranks holding them. The
  step ends when the last compute or all-reduce ends;
* FSDP (``plan.shard[s] == "fsdp"``): the stage's replicas reduce-scatter
  instead (``n-1`` steps), and each of its ranks gathers the stage's ``params`` over the
  replicas (``n-1`` steps of ``params/n``) from the step's start, a rank's sharded stages
  one after another in the order of their first ``F``; that ``F`` waits for its gather. Its
  memory is the costs' (:func:`orgel.costs.mesh.shard_costs` divides the
  optimizer state among the replicas). Tensor parallelism is in the costs
  too (:func:`orgel.costs.mesh.tp_costs`).

Memory is described in :mod:`orgel.sim.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orgel.schedule.comm import CommPlan
from orgel.schedule.costs import Costs
from orgel.schedule.ir import Plan
from orgel.schedule.validate import validate
from orgel.sim.compiled import CompiledPlan
from orgel.sim.timeline import Event, Timeline


@dataclass
class SimResult:
    """What :func:`simulate` predicts for one step of a plan.

    ``busy[r]`` is the fraction of the step rank ``r`` computes; its bubble is
    ``1 - busy[r]``; ``bubble_fraction`` is the idle share over all ranks.
    ``peak_memory[r]`` is in bytes; ``peak_inflight[r]`` is the most forwards
    whose backward has not finished on rank ``r`` (a micro-batch counts once per
    stage of the rank it is alive in). ``critical_path`` lists the ops (as
    timeline events) whose durations add up to ``step_time``.
    """

    step_time: float
    timeline: Timeline
    critical_path: list[Event]
    busy: list[float]
    bubble_fraction: float
    peak_memory: list[int]
    peak_inflight: list[int]
    memory_per_rank: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def bubble(self) -> list[float]:
        """Per-rank idle fraction ``1 - busy``."""
        return [1.0 - b for b in self.busy]

    @property
    def fits(self) -> bool:
        """Whether every rank's peak is within ``memory_per_rank`` (True if unknown)."""
        cap = self.memory_per_rank
        return cap is None or all(m <= cap for m in self.peak_memory)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no timeline; see ``timeline.to_dict()``)."""
        return {
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction,
            "memory_per_rank": self.memory_per_rank,
            "fits": self.fits,
            "per_rank": [
                {"rank": r, "busy": self.busy[r], "bubble": 1.0 - self.busy[r],
                 "peak_memory": self.peak_memory[r], "peak_inflight": self.peak_inflight[r]}
                for r in range(len(self.busy))
            ],
            "critical_path": [
                {"rank": e.rank, "track": e.track, "label": e.label, "start": e.start,
                 "end": e.end}
                for e in self.critical_path
            ],
        }


def simulate(
    plan: Plan,
    costs: Costs | None = None,
    *,
    compiled: CompiledPlan | None = None,
    comm: CommPlan | None = None,
    check: bool = True,
    receives_kept: bool = False,
) -> SimResult:
    """Simulate one step of ``plan`` under ``costs`` (default: ``plan.costs``).

    Pass ``compiled`` to reuse a :class:`CompiledPlan` of the same plan, or
    ``comm`` to reuse its derived messages. With ``check`` (default) the plan
    is validated first (:func:`orgel.schedule.validate.validate`: every action
    once, on a rank hosting its stage, after what it needs); a plan that is
    known valid can skip it. ``receives_kept``: every receive buffer is held
    all the step (gloo posts them at its start and keeps them across steps)
    instead of from its transfer until its receiving action starts. Raises
    :class:`PlanError` when the plan is
    invalid, has no costs, the costs do not match its stages, or the schedule
    deadlocks.
    """
    if check:
        derived = validate(plan)
        comm = derived if comm is None else comm
    cp = CompiledPlan(plan, comm=comm) if compiled is None else compiled
    costs, arrays = cp.stage_arrays(costs)
    alone = cp.durations(costs, arrays)
    dur, end, least = cp.shared_timeline(costs, alone)
    start = end - dur
    step = max(float(end.max()) if len(end) else 0.0, least)
    timeline, op_event = _timeline(cp, start, end)
    nc = cp.num_compute
    busy_ms = np.bincount(cp.op_rank, weights=dur[:nc], minlength=cp.num_ranks)
    busy = (busy_ms / step).tolist() if step > 0 else [0.0] * cp.num_ranks
    bubble = 1.0 - float(busy_ms.sum()) / (step * cp.num_ranks) if step > 0 else 0.0
    peak = cp.peak_memory(arrays, dur, end, receives_kept=receives_kept,
                          grad_bytes=costs.edge_grad_bytes)
    return SimResult(
        step_time=step,
        timeline=timeline,
        critical_path=_critical_path(cp, end, dur, op_event),
        busy=busy,
        bubble_fraction=bubble,
        peak_memory=[int(x) for x in peak],
        peak_inflight=[int(x) for x in cp.memory.peak_inflight],
        memory_per_rank=costs.memory_per_rank,
    )


def _timeline(
    cp: CompiledPlan, start: np.ndarray, end: np.ndarray
) -> tuple[Timeline, list[Event | None]]:
    """Events for every op with a duration; ``op_event[v]`` is op ``v``'s event (or None)."""
    plan = cp.plan
    tl = Timeline(num_ranks=cp.num_ranks, title=str(plan.meta.get("schedule", "")))
    op_event: list[Event | None] = [None] * cp.num_ops
    v = 0
    for r, actions in enumerate(plan.schedule):
        for a in actions:
            op_event[v] = tl.add_action(r, a, float(start[v]), float(end[v]))
            v += 1
    for k, m in enumerate(cp.comm.messages):
        v = cp.num_compute + k
        if end[v] > start[v]:
            what = "grad" if m.grad else "act"
            op_event[v] = tl.add(m.src_rank, "comm", f"{what} e{m.edge} mb{m.microbatch}"
                                 f" ->r{m.dst_rank}", float(start[v]), float(end[v]),
                                 microbatch=m.microbatch)
    for g, group in enumerate(cp.allreduces):
        v = cp.num_compute + cp.num_messages + g
        if end[v] > start[v]:
            events = [tl.add(r, "comm", group.label, float(start[v]), float(end[v]),
                             stage=group.stages[0] if len(group.stages) == 1 else None)
                      for r in group.ranks]
            op_event[v] = events[0]
    for g, (s, _, first) in enumerate(cp.gathers):
        v = cp.gather_op(g)
        if end[v] > start[v]:
            op_event[v] = tl.add(int(cp.op_rank[first]), "comm", f"gather s{s}",
                                 float(start[v]), float(end[v]), stage=s)
    return tl, op_event


def _critical_path(
    cp: CompiledPlan, end: np.ndarray, dur: np.ndarray, op_event: list[Event | None]
) -> list[Event]:
    """Walk back from the op that ends last through the predecessor that ends last.

    Ties go to the predecessor listed first (the previous action on the same
    rank), so a path stays on a rank unless a message really held it up.
    """
    if cp.num_ops == 0:
        return []
    v = int(np.argmax(end))
    path: list[Event] = []
    while True:
        event = op_event[v]
        if event is not None and dur[v] > 0:
            path.append(event)
        preds = cp.preds[v]
        begin = end[v] - dur[v]
        if not preds or begin <= 0:
            break
        v = max(preds, key=lambda u: (end[u], -preds.index(u)))
    path.reverse()
    return path

"""Measured timelines: per-rank events of a step, merged, summarised and exported.

Each rank records every action's start and end and each wait (for a receive,
for the sends at the end, for the gradient reductions) as an :class:`Event`
with wall-clock seconds. :func:`gather_events` merges them across ranks;
:func:`summary` reports the step time, bubble fraction and communication wait
per rank; :func:`save_views` writes a Chrome/Perfetto trace and a PNG of the
measured step beside the simulator's prediction for the same Plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from orgel.schedule.costs import Costs, StageCost
from orgel.schedule.ir import Action, Plan
from orgel.sim.timeline import Timeline

COMPUTE_KINDS = ("F", "B", "I", "W")


class Event(NamedTuple):
    """One measured interval on a rank: ``kind`` is F/B/I/W, wait, sync or optim."""

    rank: int
    kind: str
    name: str
    start: float  # wall-clock seconds
    end: float
    peer: int | None = None


@dataclass
class RankSummary:
    """Per-rank totals over one step, in milliseconds."""

    rank: int
    busy: float  # compute actions (F/B/I/W)
    wait: float  # waiting for receives, sends and reductions
    bubble_fraction: float  # 1 - busy / step time


def gather_events(events: list[Event]) -> list[Event]:
    """Every rank's events (collective: call on all ranks), times from the step start."""
    everything: list[list[Event] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, [tuple(e) for e in events])
    merged = [Event(*e) for part in everything for e in (part or [])]
    return normalise(merged)


def normalise(events: list[Event]) -> list[Event]:
    """Shift times so the earliest event starts at 0 (still seconds)."""
    if not events:
        return []
    t0 = min(e.start for e in events)
    return sorted((e._replace(start=e.start - t0, end=e.end - t0) for e in events),
                  key=lambda e: (e.rank, e.start))


def summary(events: list[Event]) -> tuple[float, list[RankSummary]]:
    """Step time (ms) and each rank's busy/wait time and bubble fraction."""
    events = normalise(events)
    if not events:
        return 0.0, []
    step = max(e.end for e in events) * 1e3
    ranks = sorted({e.rank for e in events})
    rows = []
    for r in ranks:
        mine = [e for e in events if e.rank == r]
        busy = sum(e.end - e.start for e in mine if e.kind in COMPUTE_KINDS) * 1e3
        wait = sum(e.end - e.start for e in mine if e.kind == "wait") * 1e3
        rows.append(RankSummary(r, busy, wait, 1.0 - busy / step if step > 0 else 0.0))
    return step, rows


def format_summary(events: list[Event]) -> str:
    """A small table: step time, then busy, wait and bubble per rank."""
    step, rows = summary(events)
    lines = [f"measured step {step:.1f} ms"]
    for row in rows:
        lines.append(f"  rank {row.rank}: busy {row.busy:.1f} ms, comm wait {row.wait:.1f} ms, "
                     f"bubble {row.bubble_fraction:.1%}")
    return "\n".join(lines)


def to_timeline(events: list[Event], num_ranks: int, title: str = "measured") -> Timeline:
    """The events as the simulator's :class:`~orgel.sim.timeline.Timeline` (milliseconds).

    Actions go on the compute track; waits, gradient reduction and the
    optimizer on the comm track (labelled with the peer waited on).
    """
    timeline = Timeline(num_ranks=num_ranks, title=title)
    for e in normalise(events):
        track = "compute" if e.kind in COMPUTE_KINDS else "comm"
        label = e.name if e.peer is None else f"{e.name} <- r{e.peer}"
        timeline.add(e.rank, track, label, e.start * 1e3, e.end * 1e3)
    return timeline


def measured_costs(plan: Plan, events: list[Event]) -> Costs:
    """Per-stage mean action times from the measurement, as Costs for the simulator."""
    times: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e.kind in COMPUTE_KINDS:
            action = Action.parse(e.name)
            times.setdefault((e.kind, action.stage), []).append((e.end - e.start) * 1e3)

    def mean(kind: str, s: int) -> float:
        xs = times.get((kind, s), [])
        return sum(xs) / len(xs) if xs else 0.0

    stages = []
    for s in range(plan.num_stages):
        if plan.uses_split_backward(s):
            weight = mean("W", s)
            stages.append(StageCost(fwd=mean("F", s), bwd=mean("I", s) + weight,
                                    bwd_weight=weight))
        else:
            stages.append(StageCost(fwd=mean("F", s), bwd=mean("B", s)))
    return Costs(stages=stages)


def save_views(plan: Plan, events: list[Event], *, trace: str | Path | None = None,
               png: str | Path | None = None) -> Timeline:
    """Write the measured step as a Chrome trace and/or PNG beside the simulator's prediction.

    The prediction simulates ``plan`` with the measured per-stage action times
    (or the plan's own costs when it carries them), so the picture shows how
    far the real step is from an ideal run of the same work. Returns it.
    """
    from orgel.sim.simulate import simulate

    measured = to_timeline(events, plan.num_ranks)
    costs = plan.costs if plan.costs is not None else measured_costs(plan, events)
    predicted = simulate(plan, costs).timeline
    predicted.title = "predicted (simulator, measured action times)"
    if trace is not None:
        data = measured.chrome_trace()
        offset = plan.num_ranks
        for ev in predicted.chrome_trace()["traceEvents"]:
            ev = dict(ev, pid=ev["pid"] + offset)
            if ev.get("name") == "process_name":
                ev["args"] = {"name": f"predicted rank {ev['pid'] - offset}"}
            data["traceEvents"].append(ev)
        Path(trace).write_text(json.dumps(data) + "\n")
    if png is not None:
        measured.save_png(png, below=predicted)
    return predicted

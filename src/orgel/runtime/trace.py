"""Measured timelines: per-rank events of a step, merged, summarised and exported.

Each rank records every action's start and end and each wait (for a receive,
for the sends at the end, for the gradient reductions) as an :class:`Event`
with wall-clock seconds. :func:`gather_events` merges them across ranks;
:func:`summary` reports the step time, bubble fraction and communication wait
per rank; :func:`chrome_trace` writes a Chrome/Perfetto trace (times in
microseconds, as the format wants; everything else in orgel is milliseconds).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

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


def chrome_trace(events: list[Event], path: str | Path | None = None,
                 predicted: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Chrome/Perfetto trace of the measured events (one process per rank).

    ``predicted`` (chrome ``X`` events from the simulator) is drawn as a second
    process group so the prediction sits beside the measurement.
    """
    trace: list[dict[str, Any]] = []
    for e in normalise(events):
        args: dict[str, Any] = {"kind": e.kind}
        if e.peer is not None:
            args["peer"] = e.peer
        trace.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": f"measured rank {e.rank}",
                      "tid": "wait" if e.kind == "wait" else "compute",
                      "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": args})
    for p in predicted or []:
        trace.append({**p, "pid": f"predicted {p.get('pid', '')}"})
    data = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(data))
    return data


def to_dicts(rows: list[RankSummary]) -> list[dict[str, Any]]:
    """Rank summaries as plain dicts (for JSON reports)."""
    return [asdict(r) for r in rows]

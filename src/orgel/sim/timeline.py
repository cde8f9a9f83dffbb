"""Timelines of one training step, simulated or measured, and their Chrome/Perfetto export.

A :class:`Timeline` is a flat list of :class:`Event`: what ran on which rank,
on which track ("compute" for actions, "comm" for transfers and all-reduces),
from when to when (milliseconds). The simulator builds one from its op graph;
the runtime builds one from measurements the same way::

    tl = Timeline(num_ranks=2, title="measured")
    tl.add(0, "compute", "F0.0", start=0.0, end=1.2, stage=0, microbatch=0)
    tl.add(0, "comm", "act e0 mb0 ->r1", start=1.2, end=1.3)
    tl.save_trace("step.json")       # chrome://tracing or ui.perfetto.dev
    tl.save_png("step.png")          # Gantt chart (orgel.sim.gantt)
    print(tl.ascii())                # terminal view (orgel.sim.ascii)

Times may start anywhere (a measured run starts at a wall-clock offset); the
views draw from the earliest start.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orgel.schedule.ir import Action

TRACKS = ("compute", "comm")
_ACTION_RE = re.compile(r"^[FBIW](\d+)\.(\d+)$")


@dataclass(frozen=True)
class Event:
    """One box on a timeline.

    ``label`` is the action's text (``F0.3``) on the compute track and free
    text on the comm track; ``stage``/``microbatch`` are set for actions (and
    may be for transfers). ``start``/``end`` are milliseconds.
    """

    rank: int
    track: str
    label: str
    start: float
    end: float
    stage: int | None = None
    microbatch: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """``F``/``B``/``I``/``W`` for an action, ``comm`` for anything on the comm track."""
        if self.track == "compute" and self.label[:1] in ("F", "B", "I", "W"):
            return self.label[0]
        return "comm"


@dataclass
class Timeline:
    """Events of one step; ``num_ranks`` defaults to one more than the highest rank seen."""

    events: list[Event] = field(default_factory=list)
    num_ranks: int | None = None
    title: str = ""

    def add(
        self,
        rank: int,
        track: str,
        label: str,
        start: float,
        end: float,
        *,
        stage: int | None = None,
        microbatch: int | None = None,
    ) -> Event:
        """Append an event (``track`` is ``"compute"`` or ``"comm"``) and return it.

        A compute event labelled in action text (``F1.3``) gets its stage and
        micro-batch from the label unless they are given.
        """
        if track == "compute" and stage is None and microbatch is None:
            match = _ACTION_RE.match(label)
            if match is not None:
                stage, microbatch = int(match.group(1)), int(match.group(2))
        if track not in TRACKS:
            raise ValueError(f"track must be one of {TRACKS}, got {track!r}")
        if end < start:
            raise ValueError(f"event {label!r} on rank {rank} ends ({end}) before it starts "
                             f"({start})")
        event = Event(int(rank), track, label, float(start), float(end), stage, microbatch)
        self.events.append(event)
        return event

    def add_action(self, rank: int, action: Action, start: float, end: float) -> Event:
        """Append a compute event for ``action`` (label, stage and micro-batch from it)."""
        return self.add(rank, "compute", str(action), start, end, stage=action.stage,
                        microbatch=action.microbatch)

    @property
    def ranks(self) -> int:
        if self.num_ranks is not None:
            return self.num_ranks
        return max((e.rank for e in self.events), default=-1) + 1

    def span(self) -> tuple[float, float]:
        """(earliest start, latest end); (0, 0) when empty."""
        if not self.events:
            return 0.0, 0.0
        return min(e.start for e in self.events), max(e.end for e in self.events)

    def on(self, rank: int, track: str | None = None) -> list[Event]:
        """Events of ``rank`` (optionally one track), by start time."""
        return sorted(
            (e for e in self.events if e.rank == rank and (track is None or e.track == track)),
            key=lambda e: (e.start, e.end),
        )

    def busy(self, rank: int) -> float:
        """Milliseconds ``rank`` spends computing."""
        return sum(e.duration for e in self.events if e.rank == rank and e.track == "compute")

    # -- JSON ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "num_ranks": self.ranks,
            "events": [asdict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        return cls(
            events=[Event(**e) for e in data.get("events", ())],
            num_ranks=data.get("num_ranks"),
            title=str(data.get("title", "")),
        )

    # -- views ---------------------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON: one process per rank, a thread per track lane (µs)."""
        origin = self.span()[0]
        out: list[dict[str, Any]] = []
        for r in range(self.ranks):
            out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                        "args": {"name": f"rank {r}"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0,
                        "args": {"sort_index": r}})
            tid = 0
            for track in TRACKS:
                for lane, events in enumerate(_lanes(self.on(r, track))):
                    name = track if lane == 0 else f"{track} {lane}"
                    out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                                "args": {"name": name}})
                    for e in events:
                        args: dict[str, Any] = {"start_ms": e.start, "end_ms": e.end}
                        if e.stage is not None:
                            args["stage"] = e.stage
                        if e.microbatch is not None:
                            args["microbatch"] = e.microbatch
                        out.append({
                            "ph": "X", "name": e.label, "cat": e.kind, "pid": r, "tid": tid,
                            "ts": (e.start - origin) * 1000.0,
                            "dur": e.duration * 1000.0, "args": args,
                        })
                    tid += 1
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"title": self.title}}

    def save_trace(self, path: str | Path) -> None:
        """Write :meth:`chrome_trace` to ``path`` (open in ui.perfetto.dev)."""
        Path(path).write_text(json.dumps(self.chrome_trace()) + "\n")

    def save_png(self, path: str | Path, *, below: Timeline | None = None,
                 width: float = 12.0) -> None:
        """A Gantt chart; with ``below``, a second timeline under this one (same scale)."""
        from orgel.sim.gantt import save_png

        save_png(path, [self] if below is None else [self, below], width=width)

    def ascii(self, *, width: int | None = None, max_width: int = 160,
              comm: bool = False) -> str:
        """The timeline as text, one row per rank (see :mod:`orgel.sim.ascii`)."""
        from orgel.sim.ascii import render

        return render(self, width=width, max_width=max_width, comm=comm)


def _lanes(events: list[Event]) -> list[list[Event]]:
    """Split events (sorted by start) into lanes without overlaps, first-fit."""
    lanes: list[list[Event]] = []
    for e in events:
        for lane in lanes:
            if lane[-1].end <= e.start:
                lane.append(e)
                break
        else:
            lanes.append([e])
    return lanes

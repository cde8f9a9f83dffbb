"""Timelines as plain text for terminals: one row per rank, one column per time slice.

::

    rank0 |F0 F1 F2 F3 B0    F4 B1    F5 B2 ...
    rank1 |.. F0 F1 F2 B0    F3 B1    F4 ...
          0                                   33 ms

Each action is a box that starts with its label (kind and micro-batch, plus
the stage when the rank hosts several and the box has room: ``F1.3``) cut to
the box's width; idle time is ``.``. With ``comm=True`` a second row per rank marks transfers with
``~``. Unless a width is given, the scale is chosen so the shortest action
gets room for its label, within ``max_width`` columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orgel.sim.timeline import Event, Timeline


def render(
    timeline: Timeline, *, width: int | None = None, max_width: int = 160, comm: bool = False
) -> str:
    """The text view of ``timeline`` (see the module docstring)."""
    origin, finish = timeline.span()
    total = finish - origin
    if not timeline.events or total <= 0:
        return "(empty timeline)"
    stages: dict[int, set[int | None]] = {}
    for e in timeline.events:
        if e.track == "compute":
            stages.setdefault(e.rank, set()).add(e.stage)
    labels = {id(e): _label(e, len(stages[e.rank]) > 1)
              for e in timeline.events if e.track == "compute"}
    if width is None:
        shortest = min((e.duration for e in timeline.events
                        if e.track == "compute" and e.duration > 0), default=total)
        longest_label = max((len(t) for t in labels.values()), default=2)
        width = min(max_width, max(20, round((longest_label + 1) * total / shortest)))
    scale = width / total
    name_width = len(f"rank{timeline.ranks - 1}")
    rows = []
    for r in range(timeline.ranks):
        row = ["."] * width
        for e in timeline.on(r, "compute"):
            lo, hi = _cells(e, origin, scale, width)
            text = labels[id(e)]
            if len(text) > hi - lo and e.microbatch is not None:
                text = f"{e.kind}{e.microbatch}"  # no room for the stage: keep the micro-batch
            row[lo:hi] = list(text[: hi - lo].ljust(hi - lo))
        rows.append(f"{f'rank{r}':<{name_width}} |" + "".join(row))
        if comm:
            line = [" "] * width
            for e in timeline.on(r, "comm"):
                lo, hi = _cells(e, origin, scale, width)
                line[lo:hi] = ["~"] * (hi - lo)
            if "~" in line:
                rows.append(f"{'':<{name_width}} |" + "".join(line))
    end_text = f"{total:g} ms"
    axis = "0".ljust(max(1, width - len(end_text))) + end_text
    rows.append(" " * name_width + "  " + axis)
    return "\n".join(rows)


def _label(e: Event, several_stages: bool) -> str:
    """``F3`` (kind, micro-batch), or the full ``F1.3`` when the rank hosts several stages."""
    if e.microbatch is None or e.kind == "comm" or several_stages:
        return e.label
    return f"{e.kind}{e.microbatch}"


def _cells(e: Event, origin: float, scale: float, width: int) -> tuple[int, int]:
    """Columns ``[lo, hi)`` of an event; at least one column when it has a duration."""
    lo = min(width - 1, round((e.start - origin) * scale))
    hi = min(width, round((e.end - origin) * scale))
    if hi <= lo and e.duration > 0:
        hi = lo + 1
    return lo, hi

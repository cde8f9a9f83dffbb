"""Gantt charts of timelines as PNG (matplotlib, Agg backend: no display needed).

One row per rank (rank 0 on top): actions as boxes coloured by kind (forward,
full backward, input-grad, weight-grad) with their micro-batch number when the
box is wide enough, transfers and all-reduces as a thin grey strip under the
row. Several timelines (e.g. predicted above measured) are drawn one above the
other on the same time scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from orgel.sim.timeline import Timeline

COLOURS = {
    "F": "#6baed6",  # forward: light blue
    "B": "#2171b5",  # full backward: dark blue
    "I": "#fd8d3c",  # input-grad half: orange
    "W": "#74c476",  # weight-grad half: green
    "comm": "#969696",
}
_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad",
          "comm": "communication"}


def save_png(path: str | Path, timelines: list[Timeline], *, width: float = 12.0) -> None:
    """Draw ``timelines`` stacked (same x scale, from each one's earliest start) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timelines:
        raise ValueError("save_png needs at least one timeline")
    heights = [max(1, tl.ranks) for tl in timelines]
    fig, axes = plt.subplots(
        len(timelines), 1, sharex=True, squeeze=False,
        figsize=(width, 0.9 + 0.45 * sum(heights) + 0.4 * len(timelines)),
        gridspec_kw={"height_ratios": heights},
    )
    horizon = max((tl.span()[1] - tl.span()[0] for tl in timelines), default=0.0) or 1.0
    kinds_seen: set[str] = set()
    for ax, tl in zip(axes[:, 0], timelines, strict=True):
        kinds_seen |= _draw(ax, tl, horizon)
    axes[-1, 0].set_xlabel("time (ms)")
    order = [k for k in ("F", "B", "I", "W", "comm") if k in kinds_seen]
    fig.legend(
        handles=[Patch(color=COLOURS[k], label=_NAMES[k]) for k in order],
        loc="upper right", ncol=len(order), fontsize=8, frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw(ax: Axes, tl: Timeline, horizon: float) -> set[str]:
    """Draw one timeline on ``ax``; return the kinds it contains."""
    origin = tl.span()[0]
    kinds: set[str] = set()
    min_label = horizon / 60  # boxes narrower than this get no number
    for e in tl.events:
        kind = e.kind
        kinds.add(kind)
        y = tl.ranks - 1 - e.rank  # rank 0 on top
        x = e.start - origin
        if e.track == "compute":
            ax.barh(y + 0.05, e.duration, left=x, height=0.7, color=COLOURS.get(kind, "#bbbbbb"),
                    edgecolor="white", linewidth=0.5)
            if e.duration >= min_label:
                text = str(e.microbatch) if e.microbatch is not None else e.label
                ink = "white" if kind == "B" else "black"
                ax.text(x + e.duration / 2, y + 0.05, text, ha="center", va="center",
                        fontsize=7, color=ink)
        else:
            ax.barh(y - 0.38, e.duration, left=x, height=0.12,
                    color=COLOURS["comm"], linewidth=0)
    ax.set_yticks(range(tl.ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(tl.ranks))])
    ax.set_ylim(-0.6, tl.ranks - 0.4)
    ax.set_xlim(0, horizon)
    if tl.title:
        ax.set_title(tl.title, loc="left", fontsize=9)
    return kinds

"""Timelines: construction, JSON round-trip, Chrome trace, ASCII picture and PNG Gantt chart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from orgel.schedule import Action, Costs
from orgel.schedule.families import build_schedule
from orgel.sim import Timeline, simulate


def tiny() -> Timeline:
    tl = Timeline(title="tiny")
    tl.add_action(0, Action("F", 0, 0), 0.0, 2.0)
    tl.add_action(0, Action("F", 0, 1), 2.0, 4.0)
    tl.add(0, "comm", "act e0 mb0 ->r1", 2.0, 3.0, microbatch=0)
    tl.add(0, "comm", "act e0 mb1 ->r1", 2.5, 4.5, microbatch=1)  # overlaps the first
    tl.add_action(1, Action("F", 1, 0), 3.0, 5.0)
    tl.add_action(1, Action("B", 1, 0), 5.0, 9.0)
    return tl


def test_add_checks_track_and_times() -> None:
    tl = Timeline()
    with pytest.raises(ValueError, match="track must be one of"):
        tl.add(0, "gpu", "F0.0", 0.0, 1.0)
    with pytest.raises(ValueError, match="ends"):
        tl.add(0, "compute", "F0.0", 2.0, 1.0)
    event = tl.add_action(3, Action("W", 2, 5), 1.0, 1.5)
    assert (event.kind, event.stage, event.microbatch, event.duration) == ("W", 2, 5, 0.5)
    assert tl.ranks == 4
    assert tl.busy(3) == 0.5
    measured = tl.add(0, "compute", "B1.7", 2.0, 3.0)  # a runtime passes only the label
    assert (measured.kind, measured.stage, measured.microbatch) == ("B", 1, 7)


def test_json_round_trip() -> None:
    tl = tiny()
    again = Timeline.from_dict(json.loads(json.dumps(tl.to_dict())))
    assert again.events == tl.events
    assert (again.title, again.ranks) == ("tiny", 2)


def test_chrome_trace_processes_tracks_and_microseconds(tmp_path: Path) -> None:
    tl = tiny()
    # a measured timeline starts at a wall-clock offset: the trace starts at 0
    shifted = Timeline([e.__class__(e.rank, e.track, e.label, e.start + 1000, e.end + 1000,
                                    e.stage, e.microbatch) for e in tl.events])
    trace = shifted.chrome_trace()["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace
             if e["name"] == "thread_name"}
    assert names == {(0, 0): "compute", (0, 1): "comm", (0, 2): "comm 1", (1, 0): "compute"}
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    boxes = {e["name"]: e for e in trace if e["ph"] == "X"}
    assert (boxes["B1.0"]["ts"], boxes["B1.0"]["dur"]) == (5000.0, 4000.0)
    assert boxes["B1.0"]["args"]["microbatch"] == 0
    assert boxes["act e0 mb1 ->r1"]["tid"] == 2  # overlapping transfer: its own lane
    path = tmp_path / "trace.json"
    shifted.save_trace(path)
    assert json.loads(path.read_text())["displayTimeUnit"] == "ms"


def test_ascii_picture() -> None:
    assert tiny().ascii(width=18, comm=True) == "\n".join([
        "rank0 |F0  F1  ..........",
        "      |    ~~~~~         ",
        "rank1 |......F0  B0      ",
        "       0             9 ms",
    ])
    assert Timeline().ascii() == "(empty timeline)"


def test_ascii_of_a_simulated_schedule_fits_its_labels() -> None:
    plan = build_schedule("interleaved", 2, 2, stages_per_rank=2)
    text = simulate(plan, Costs.uniform(4, 1.0, 2.0)).timeline.ascii()
    rows = text.splitlines()
    assert rows[0].startswith("rank0 |F0.0 F0.1 F2.0 F2.1")  # several stages: full labels
    assert rows[-1].rstrip().endswith(" ms")


def colour_area(pixels: np.ndarray, colour: str) -> int:
    """How many pixels of the image have ``colour`` (a #rrggbb string)."""
    rgb = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).sum())


def gantt_kinds(path: Path) -> dict[str, int]:
    """The area of each action kind's colour in a Gantt PNG that orgel wrote."""
    import matplotlib.image

    from orgel.sim.gantt import COLOURS

    pixels = matplotlib.image.imread(path)
    return {kind: colour_area(pixels, colour) for kind, colour in COLOURS.items()}


def test_png_gantt_draws_both_timelines_to_scale(tmp_path: Path) -> None:
    """The chart read back: forward and backward boxes in both panels, in proportion to
    their time (a backward takes twice a forward here), and the weight-grad colour only
    where a schedule splits the backward."""
    import matplotlib.image

    from orgel.sim.gantt import COLOURS

    costs = Costs.uniform(2, 1.0, 2.0, latency=0.1)
    predicted = simulate(build_schedule("1f1b", 2, 3, nbytes=1), costs).timeline
    measured = simulate(build_schedule("gpipe", 2, 3, nbytes=1), costs).timeline
    path = tmp_path / "gantt.png"
    predicted.save_png(path, below=measured)
    pixels = matplotlib.image.imread(path)
    top, bottom = pixels[: len(pixels) // 2], pixels[len(pixels) // 2:]
    for panel in (top, bottom):
        forward, backward = colour_area(panel, COLOURS["F"]), colour_area(panel, COLOURS["B"])
        assert forward > 500 and backward > 500
        assert 1.5 < backward / forward < 2.5  # boxes as wide as their times
    assert colour_area(pixels, COLOURS["W"]) < 10  # no weight-grad actions in these plans


def test_simulated_timeline_has_every_action_and_transfer() -> None:
    plan = build_schedule("1f1b", 3, 4, nbytes=1)
    result = simulate(plan, Costs.uniform(3, 1.0, 2.0, latency=0.5))
    compute = [e for e in result.timeline.events if e.track == "compute"]
    assert len(compute) == 3 * 4 * 2
    comm = [e for e in result.timeline.events if e.track == "comm"]
    assert len(comm) == 2 * 2 * 4  # 2 edges x (activation + gradient) x 4 micro-batches
    assert all(e.duration == 0.5 for e in comm)
    for r in range(3):
        boxes = result.timeline.on(r, "compute")
        assert all(a.end <= b.start for a, b in zip(boxes, boxes[1:], strict=False))

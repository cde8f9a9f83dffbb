"""Longest-path engines agree: plain loop, straight-line code, level-synchronous numpy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from orgel.schedule import Costs, Link
from orgel.schedule.families import build_schedule
from orgel.sim import CompiledPlan, simulate
from orgel.sim import compiled as compiled_module
from orgel.sim.longest import LevelPath, longest_path, make_straight_line, straight_line_for


def random_dag(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    preds = [sorted(rng.sample(range(v), min(v, rng.randrange(4)))) for v in range(n)]
    return preds, list(range(n))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engines_agree_on_random_dags(seed: int) -> None:
    preds, order = random_dag(300, seed)
    durations = [random.Random(seed + 10).uniform(0, 3) for _ in range(300)]
    expected = longest_path(preds, order, durations)
    assert make_straight_line(preds, order)(durations) == expected
    np.testing.assert_allclose(LevelPath(preds, order)(np.array(durations)), expected)


def test_straight_line_chunks_and_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    import orgel.sim.longest as longest

    monkeypatch.setattr(longest, "_CHUNK", 7)  # many chunks handing ends over
    preds, order = random_dag(100, 5)
    durations = [float(v % 5) for v in range(100)]
    assert make_straight_line(preds, order)(durations) == longest_path(preds, order, durations)
    assert straight_line_for(preds, order) is straight_line_for([list(p) for p in preds], order)


def test_compiled_plan_switches_to_straight_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_module, "STRAIGHT_LINE_AFTER", 2)
    plan = build_schedule("interleaved", 4, 8, stages_per_rank=2, nbytes=1 << 20)
    compiled = CompiledPlan(plan)
    rng = random.Random(3)
    for _ in range(5):
        costs = Costs.uniform(8, rng.uniform(0.5, 1), rng.uniform(1, 2), activations=10,
                              latency=rng.uniform(0, 0.2))
        costs.link = Link(latency=costs.link.latency, per_mib=0.3)
        step, peak = compiled.evaluate(costs)
        full = simulate(plan, costs)
        assert step == pytest.approx(full.step_time, abs=1e-9)
        assert peak.tolist() == full.peak_memory
    assert compiled._straight is not None

"""Exactness: every schedule family and model shape on 2, 3 and 4 gloo ranks equals one process.

One spawned process group per world size runs all of its scenarios (see
``test_runtime_nets.SCENARIOS``); each test then compares the parameters after
one and after three SGD-with-momentum steps with single-process gradient
accumulation. Tied copies and data-parallel replicas must all match.
"""

from __future__ import annotations

import pytest
import torch

from orgel.launch.spawn import spawn
from test_runtime_nets import SCENARIOS, build, reference, run_scenarios

pytestmark = pytest.mark.slow  # spawns gloo ranks

#: Largest difference relative to the tensor's scale, max|a-b| / (1 + max|b|), as in the zoo:
#: float32 sums in another order differ by a few ulps per step (1 ulp of 1.0 is 1.2e-7).
TOL = 1e-6
_cache: dict[int, dict[str, tuple[list[float], list[list[tuple[str, torch.Tensor]]]]]] = {}


def results(world: int) -> dict[str, tuple[list[float], list[list[tuple[str, torch.Tensor]]]]]:
    """All scenarios of one world size, run once per session (one process group)."""
    if world not in _cache:
        names = [n for n, spec in SCENARIOS.items() if spec[0] == world]
        per_rank = spawn(run_scenarios, world, names, timeout=30)
        merged: dict[str, tuple[list[float], list[list[tuple[str, torch.Tensor]]]]] = {}
        _cache[-world] = per_rank[0]  # type: ignore[assignment]
        for name in names:
            losses = [r[name][0] for r in per_rank]
            for other in losses[1:]:
                assert other == losses[0], f"{name}: ranks disagree on the loss"
            snaps = [[pair for r in per_rank for pair in r[name][1][k]]
                     for k in range(len(per_rank[0][name][1]))]
            merged[name] = (losses[0], snaps)
        _cache[world] = merged
    return _cache[world]


def _check(name: str, got: list[list[tuple[str, torch.Tensor]]], want: list[dict]) -> None:
    for step in (0, 2):
        seen = set()
        for qual, tensor in got[step]:
            expected = want[step][qual]
            diff = ((tensor - expected).abs().max() / (1 + expected.abs().max())).item()
            assert diff <= TOL, f"{name}: {qual} differs by {diff:.3g} after step {step + 1}"
            seen.add(qual)
        assert seen == set(want[step]), f"{name}: parameters missing: {set(want[step]) - seen}"


EXACT = [n for n in SCENARIOS if not n.startswith("dropout")]


@pytest.mark.parametrize("name", EXACT)
def test_matches_single_process(name: str) -> None:
    world, _, kind, *_ = SCENARIOS[name]
    losses, snaps = results(world)[name]
    net, _, plan, options = build(name)
    want = reference(net, kind, plan.microbatches, 3, options.get("max_norm"),
                     options.get("rows"))
    _check(name, snaps, want)
    assert len(losses) == 3 and losses[2] < losses[0]


def test_recompute_replays_dropout_exactly() -> None:
    plain = dict(results(2)["dropout"][1][2])
    recomputed = dict(results(2)["dropout-recompute"][1][2])
    assert plain.keys() == recomputed.keys()
    for qual, tensor in plain.items():
        assert torch.equal(tensor, recomputed[qual]), qual


def test_measured_timeline_has_every_action_once_and_a_bubble() -> None:
    from orgel.runtime.trace import summary

    results(2)
    events = _cache[-2]["events:1f1b"]
    _, _, plan, _ = build("1f1b")
    computed = sorted((e.rank, e.name) for e in events if e.kind in "FBIW")
    assert computed == sorted((r, str(a)) for r, acts in enumerate(plan.schedule) for a in acts)
    assert all(e.end >= e.start >= 0 for e in events)
    waits = [e for e in events if e.kind == "wait" and e.peer is not None]
    assert waits and all(e.peer == 1 - e.rank for e in waits)
    step, rows = summary(events)
    assert step > 0 and [r.rank for r in rows] == [0, 1]
    assert all(0 <= r.bubble_fraction < 1 and r.busy > 0 for r in rows)

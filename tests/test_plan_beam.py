"""Beam search over split points: brute-force agreement and Pfeife's Figure 4 shape."""

from __future__ import annotations

import itertools
import random

import pytest

from orgel.costs.blocks import BlockCosts
from orgel.plan.beam import _moves, beam_search
from orgel.plan.scorer import Scorer
from orgel.plan.splits import balanced_points, time_weights
from orgel.plan.templates import Template
from orgel.schedule.costs import Link
from orgel.schedule.families import build_schedule


def chain(fwd: list[float], *, latency: float = 0.0) -> BlockCosts:
    n = len(fwd)
    return BlockCosts(fwd=fwd, bwd=[2 * f for f in fwd], wgrad=list(fwd), params=[0] * n,
                      activations=[1] * n, output=[1] * n, temporary=[0] * n,
                      edges=[(i, i + 1) for i in range(n - 1)], link=Link(latency, 0.0))


def template(family: str, ranks: int, microbatches: int, **options: object) -> Template:
    return Template(family, family, dict(options), build_schedule(family, ranks, microbatches,
                                                                  **options))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family,options", [("1f1b", {}), ("looped", {"prefetch": [1, 1, 0]})])
def test_beam_within_two_percent_of_brute_force(seed: int, family: str,
                                                 options: dict[str, object]) -> None:
    rng = random.Random(seed)
    costs = chain([rng.uniform(0.2, 2.0) for _ in range(14)], latency=0.1)
    scorer = Scorer(costs)
    t = template(family, 3, 4, **options)
    brute = min(scorer.score_chain(t, p).step_time
                for p in itertools.combinations(range(1, 14), 2))
    start = balanced_points(time_weights(costs), 3)
    found = beam_search(scorer, t, [start], width=3)
    assert found is not None
    assert found.score.step_time <= brute * 1.02


def test_uneven_split_with_prefetch_beats_even_split_fig4() -> None:
    # Pfeife Fig. 4: 15 equal ops on 3 devices; backward = 2 x forward.
    costs = chain([1.0] * 15, latency=1.0)
    scorer = Scorer(costs)
    plain = template("1f1b", 3, 4)
    even = scorer.score_chain(plain, (5, 10)).step_time
    prefetch = template("looped", 3, 4, prefetch=[1, 1, 0])
    found = beam_search(scorer, prefetch, [(5, 10)])
    assert found is not None
    # The paper's optimum: 6, 5 and 4 ops, i.e. split points (6, 11).
    assert found.points == (6, 11)
    assert found.score.step_time < even
    # Uneven alone (no prefetch) helps less than uneven + prefetch.
    uneven_plain = scorer.score_chain(plain, (6, 11)).step_time
    assert found.score.step_time < uneven_plain <= even


def test_moves_single_and_proportional() -> None:
    moves = _moves((4, 8), 12, 3)
    # Single moves of each point by 1..3 blocks.
    assert {(3, 8), (5, 8), (1, 8), (4, 7), (4, 11)} <= set(moves)
    # Proportional: moving 4 -> 1 keeps the last stage's share of what follows
    # (4 of 8 blocks -> 6 of 11), moving 8 -> 11 scales the first point by 11/8.
    assert (1, 6) in moves and (6, 11) in moves
    assert all(0 < a < b < 12 for a, b in moves)


def test_beam_respects_memory() -> None:
    costs = chain([1.0] * 12)
    costs.activations = [100] * 6 + [10] * 6
    costs.memory_per_rank = 100 * 3 * 4 + 200
    scorer = Scorer(costs)
    t = template("1f1b", 3, 4)
    found = beam_search(scorer, t, [(4, 8), (2, 6)])
    assert found is not None
    assert found.score.peak_memory.max() <= costs.memory_per_rank

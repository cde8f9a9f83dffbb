"""Beam search over the split points of the linearised blocks, after Pfeife Algorithm 1.

For one schedule template (family + parameters) the search starts from a given
split (Pfeife: memory-balanced; we also start from the time-balanced one) and
repeatedly moves points: one point by ``k`` blocks (``0 < |k| <= max_move``),
or that point by ``k`` and every other point proportionally (points before it
scale with it, points after it keep their share of the rest), which shifts work
towards the front of the pipeline where it fills the bubble. A candidate
enters the beam when it beats the worst of the ``width`` best and fits memory;
the search ends when the beam stops changing.

What we do differently from the reference implementation: every beam member
is expanded once (re-expanding gives the same candidates), candidates are
deduplicated, a vectorised bound (the busiest rank's compute, the static
memory) rejects hopeless candidates before the simulator sees them, and the
simulator's graph is compiled once per template and re-evaluated with new
stage costs built from prefix sums of the block costs.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from orgel.plan.scorer import Score, Scorer
from orgel.plan.splits import Points, valid_points
from orgel.plan.templates import Template


@dataclass
class BeamResult:
    """The best split found for one template."""

    template: Template
    points: Points
    score: Score
    evaluations: int
    rounds: int


def _moves(points: Points, n: int, max_move: int) -> list[Points]:
    """All single and proportional moves of ``points`` (valid, in a fixed order)."""
    out: list[Points] = []
    count = len(points)
    for s in range(count):
        ps = points[s]
        for k in range(-max_move, max_move + 1):
            if k == 0:
                continue
            new = ps + k
            if not 0 < new < n:
                continue
            single = points[:s] + (new,) + points[s + 1:]
            if valid_points(single, n):
                out.append(single)
            before = tuple(round(p * new / ps) for p in points[:s])
            after = tuple(n - round((n - p) * (n - new) / (n - ps)) for p in points[s + 1:])
            prop = before + (new,) + after
            if prop != single and valid_points(prop, n):
                out.append(prop)
    return out


def beam_search(scorer: Scorer, template: Template, starts: list[Points], *,
                width: int = 4, max_move: int = 10, deadline: float | None = None,
                ceiling: float = math.inf,
                recompute: tuple[bool | str, ...] | None = None,
                per_member: int | None = None) -> BeamResult | None:
    """Best linear split for ``template`` from ``starts`` (see the module docstring).

    ``ceiling`` is a step time the caller already has: candidates whose bound
    cannot beat it are skipped. ``deadline`` (``time.perf_counter()`` value)
    stops the search early with the best so far. ``recompute`` flags stages that
    recompute their activations. ``per_member`` caps how many of a member's moves
    the simulator scores (those with the lowest bound first; default: all, as in
    Pfeife). Returns None when no start and no move fits memory.
    """
    if width < 1 or max_move < 1:
        raise ValueError(f"width and max_move must be >= 1, got {width} and {max_move}")
    n = scorer.bc.num_blocks
    before = scorer.evaluations
    seen: set[Points] = set()
    # The beam as a max-heap on step time (negated) so the worst member pops first.
    beam: list[tuple[float, Points]] = []
    scores: dict[Points, Score] = {}

    def threshold() -> float:
        return -beam[0][0] if len(beam) >= width else math.inf

    def offer(cands: list[Points], limit: int | None = None) -> bool:
        fresh = [c for c in cands if c not in seen]
        seen.update(fresh)
        if not fresh:
            return False
        arr = np.array(fresh, dtype=np.int64).reshape(len(fresh), len(fresh[0]))
        lb, fits = scorer.chain_bounds(template, arr)
        changed = False
        order = np.argsort(lb, kind="stable")
        for i in order if limit is None else order[:limit]:
            if beam and deadline is not None and time.perf_counter() > deadline:
                break  # out of time: a member's moves can take minutes on a big problem
            if not fits[i] or lb[i] >= min(threshold(), ceiling):
                continue
            cand = fresh[int(i)]
            score = scorer.score_chain(template, cand, recompute)
            if not score.feasible or score.step_time >= threshold():
                continue
            scores[cand] = score
            if len(beam) >= width:
                heapq.heapreplace(beam, (-score.step_time, cand))
            else:
                heapq.heappush(beam, (-score.step_time, cand))
            changed = True
        return changed

    starts = [p for p in starts if len(p) == template.num_stages - 1 and valid_points(p, n)]
    if not starts or (template.num_stages > 1 and not starts[0]):
        return None
    if template.num_stages == 1:
        score = scorer.score_chain(template, (), recompute)
        return BeamResult(template, (), score, scorer.evaluations - before, 0) \
            if score.feasible else None
    offer(starts)
    expanded: set[Points] = set()
    rounds = 0
    while True:
        members = [p for _, p in beam if p not in expanded]
        if not members:
            break
        rounds += 1
        for p in sorted(members, key=lambda q: scores[q].step_time):
            expanded.add(p)
            if p in scores and any(q == p for _, q in beam):
                offer(_moves(p, n, max_move), per_member)
            if deadline is not None and time.perf_counter() > deadline:
                break
        if deadline is not None and time.perf_counter() > deadline:
            break
    if not beam:
        return None
    step, best = max(beam)
    return BeamResult(template, best, scores[best], scorer.evaluations - before, rounds)

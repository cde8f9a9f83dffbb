"""The sequential planner: linear splits × schedule templates, searched by beam search.

1. Build the schedule templates (:mod:`orgel.plan.templates`).
2. Score every template at its time-balanced split and at a few *front-loaded*
   splits (stage ``s`` of ``S`` gets a share of the work proportional to
   ``1 + a (S - 1 - 2s) / (S - 1)``): uneven splits that give the first stages
   more work fill the pipeline's warm-up bubble (Pfeife §3.4, Fig. 4).
   Templates are screened in two steps: one representative per loop count
   (stages per rank), then every variant (family, ``B_l``, ``B_f``) of the best
   ``groups`` loop counts.
3. Beam-search the split points of the most promising templates (all within
   ``slack`` of the best start, at most ``top`` of them), each starting from its
   best ramp and from the memory-balanced split (Pfeife's start), with the
   best step time so far as a ceiling that prunes hopeless candidates.

When nothing fits memory, the same search runs with every stage recomputing
its activations (whole, or where that does not fit either and the table knows
its layers, one layer at a time), then relaxes each stage's recompute (largest
forward first) to the cheapest policy that still fits: none, ``"selective"``
(keep the matmul outputs), ``"layer"`` (keep each layer's inputs) or as it was.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from orgel.plan.beam import beam_search
from orgel.plan.scorer import Score, Scorer
from orgel.plan.splits import Points, balanced_points, memory_weights, time_weights
from orgel.plan.templates import Spec, Template, cached_template, schedule_key, template_specs

RAMPS = (0.0, 0.1, 0.2)


@dataclass
class SequentialResult:
    """Best linear plan: template, split points, recompute flags and score."""

    template: Template
    points: Points
    recompute: tuple[bool | str, ...] | None
    score: Score
    templates_tried: int
    templates_searched: int


def ramp_points(weights: np.ndarray, parts: int, slope: float) -> Points:
    """A split whose stage ``s`` gets a work share ∝ ``1 + slope (parts-1-2s)/(parts-1)``."""
    if parts == 1:
        return ()
    shares = np.array([1 + slope * (parts - 1 - 2 * s) / (parts - 1) for s in range(parts)])
    targets = np.cumsum(shares / shares.sum())[:-1] * weights.sum()
    cum = np.cumsum(weights)
    pts = np.searchsorted(cum, targets, side="left") + 1
    n = len(weights)
    out: list[int] = []
    prev = 0
    for i, p in enumerate(pts):
        low, high = prev + 1, n - (parts - 1 - i)
        q = int(min(max(p, low), high))
        out.append(q)
        prev = q
    return tuple(out)


def sequential_plan(scorer: Scorer, ranks: int, microbatches: int, *, max_loops: int = 8,
                    families: list[str] | None = None, width: int = 4, max_move: int = 10,
                    slack: float = 0.03, groups: int = 3, top: int = 3,
                    time_limit: float | None = None,
                    per_member: int | None = None) -> SequentialResult | None:
    """Best linear plan (see the module docstring); None if nothing fits memory.

    ``max_loops`` bounds the stages per rank; ``groups`` is how many loop counts
    (ranked by their representative schedule) get all their schedule variants
    scored, and ``top`` how many templates (within ``slack`` of the best start)
    are beam-searched. ``width``/``max_move``/``per_member`` go to
    :func:`~orgel.plan.beam.beam_search`; ``time_limit`` (seconds) ends the
    beam phase early with the best so far.
    """
    specs = template_specs(ranks, microbatches, scorer.bc.num_blocks, max_loops=max_loops,
                           families=families)
    args = (width, max_move, slack, groups, top, time_limit, per_member)
    result = _search(scorer, specs, ranks, microbatches, None, *args)
    if result is not None:
        return result
    result = _search(scorer, specs, ranks, microbatches, True, *args)
    if result is None and scorer.bc.recompute:  # one layer rebuilt at a time may fit where
        # a whole stage's activations rebuilt at once do not
        result = _search(scorer, specs, ranks, microbatches, "layer", *args)
    if result is None:
        return None
    return _relax_recompute(scorer, result)


def _start(scorer: Scorer, t: Template, recompute: tuple[bool | str, ...] | None
           ) -> tuple[Score, list[Points]] | None:
    """Score the ramps and the memory-balanced split; the best first in the list."""
    tw = time_weights(scorer.bc)
    best: tuple[Score, Points] | None = None
    tried: list[Points] = []
    for slope in RAMPS:
        pts = ramp_points(tw, t.num_stages, slope)
        if pts in tried:
            continue
        tried.append(pts)
        s = scorer.score_chain(t, pts, recompute)
        if s.feasible and (best is None or s.step_time < best[0].step_time):
            best = (s, pts)
    mem_pts = balanced_points(memory_weights(scorer.bc), t.num_stages)
    s = scorer.score_chain(t, mem_pts, recompute)
    if s.feasible and (best is None or s.step_time < best[0].step_time):
        best = (s, mem_pts)
    if best is None:
        return None
    return best[0], [best[1], mem_pts]


def _search(scorer: Scorer, specs: list[Spec], ranks: int, microbatches: int,
            recompute_all: bool | str | None, width: int, max_move: int, slack: float,
            groups: int, top: int, time_limit: float | None,
            per_member: int | None) -> SequentialResult | None:
    n = scorer.bc.num_blocks
    seen: set[tuple[object, ...]] = set()
    scored: list[tuple[float, int, Template, list[Points], Score]] = []
    tried = 0

    def score_spec(spec: Spec) -> float:
        nonlocal tried
        # both passes (and the baselines) share one Template per spec: compiled once
        t = cached_template(scorer.templates, spec, ranks, microbatches)
        if t is None or t.num_stages > n:
            return math.inf
        key = schedule_key(t)
        if key in seen:
            return math.inf
        seen.add(key)
        tried += 1
        rec = (recompute_all,) * t.num_stages if recompute_all else None
        got = _start(scorer, t, rec)
        if got is None:
            return math.inf
        scored.append((got[0].step_time, len(scored), t, got[1], got[0]))
        return got[0].step_time

    # Screen: one representative per loop count, then every variant of the best counts.
    by_group: dict[int, list[Spec]] = {}
    for spec in specs:
        by_group.setdefault(spec.group, []).append(spec)
    # With tied weights a group's representative may put the tied stages on two
    # ranks and pay their all-reduce while its V-shape keeps them on one: score
    # the V-shape too. DualPipeV holds fewer micro-batches' activations than the
    # interleaved representative, so under a memory cap it may fit where that does
    # not: score it too. A group ranks by the best of them.
    def represent(group: list[Spec]) -> float:
        best = score_spec(group[0])
        for spec in group[1:]:
            if spec.family == "dualpipev" or (scorer.bc.tied
                                              and spec.options.get("placement") == "v"):
                best = min(best, score_spec(spec))
        return best

    reps = sorted((represent(g), v) for v, g in by_group.items())
    # A group whose representative does not fit still gets its variants tried
    # (another schedule may need less memory).
    finite = [r for r in reps if r[0] < math.inf]
    chosen_groups = [v for t, v in finite if t <= finite[0][0] * (1 + slack)][:groups] \
        if finite else [v for _, v in reps]
    for v in chosen_groups:
        for spec in by_group[v][1:]:
            score_spec(spec)
    if not scored:
        return None
    scored.sort(key=lambda x: (x[0], x[1]))
    chosen = [s for s in scored if s[0] <= scored[0][0] * (1 + slack)][:top]
    step0, _, t0, pts0, score0 = scored[0]
    rec0 = (recompute_all,) * t0.num_stages if recompute_all else None
    best = SequentialResult(t0, pts0[0], rec0, score0, tried, 0)
    ceiling = step0
    # the beam's own time: screening the templates can take longer than the whole
    # budget on a big problem, and would leave the beam none
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    for searched, (_, _, t, pts, _) in enumerate(chosen, start=1):
        rec = (recompute_all,) * t.num_stages if recompute_all else None
        share = None
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            share = time.perf_counter() + left / (len(chosen) - searched + 1)
        found = beam_search(scorer, t, pts, width=width, max_move=max_move, deadline=share,
                            ceiling=ceiling, recompute=rec, per_member=per_member)
        best.templates_searched = searched
        if found is not None and found.score.step_time < best.score.step_time:
            best.template, best.points = t, found.points
            best.score, best.recompute = found.score, rec
            ceiling = found.score.step_time
    return best


def _relax_recompute(scorer: Scorer, result: SequentialResult) -> SequentialResult:
    """Choose each stage's recompute: first the fastest one policy for every stage that
    fits (none, ``"selective"`` or ``"layer"`` where the table has their facts), if it beats
    the search's; then, stage by stage, largest forward first, the cheapest policy in time
    (in that order, then the stage whole) that still fits memory and keeps the step no
    slower. The uniform start matters where memory is tight: relaxing stage by stage from
    every stage recomputed whole spends the memory on the first stages relaxed and leaves
    the rest recomputing whole (Llama-3.1-405B on 1024 H100s: 7.8 s a step where
    ``"selective"`` everywhere, which fits, takes 6.1)."""
    if result.recompute is None:
        return result
    stages = scorer.chain_stage_costs(result.points)
    policies: list[bool | str] = list(result.recompute)
    choices: list[bool | str] = [False, *scorer.partial_policies(result.template)]
    for policy in choices:
        uniform = (policy,) * len(policies)
        trial = scorer.score_chain(result.template, result.points, uniform)
        if trial.feasible and trial.step_time < result.score.step_time:
            result.score, policies = trial, list(uniform)
    for s in sorted(range(len(policies)), key=lambda i: -stages[i].fwd):
        kept = policies[s]
        for policy in choices:
            policies[s] = policy
            trial = scorer.score_chain(result.template, result.points, tuple(policies))
            if trial.feasible and trial.step_time <= result.score.step_time:
                result.score = trial
                break
        else:
            policies[s] = kept
    result.recompute = tuple(policies) if any(policies) else None
    return result

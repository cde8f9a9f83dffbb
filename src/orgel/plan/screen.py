"""The mesh search's first pass: every mesh priced by one quick plan, the best few searched.

A mesh is a tensor-parallel degree ``tp``, a pipeline depth ``P``, ``dp``
replicas of the pipeline and whether they shard their state (``shard``).
Planning one in full (templates screened, beam search, recompute relaxed
stage by stage) takes seconds to tens of seconds on a deep pipeline with many
micro-batches, and a joint search has tens of meshes. :func:`quick_step`
prices a mesh with a few fixed plans instead, the best that fits: 1F1B and
interleaved 1F1B (2, 4 and 8 stages per rank, :data:`QUICK_TEMPLATES`), each over
the time-balanced and the memory-balanced split of its TP'd (and sharded)
table, with the fewest first stages recomputing that let it fit (bisected: a
few scores); the best replicated and priced like the
planner's candidates (:func:`orgel.plan.replicated.replica_step`, the end of
step added). No beam, a few templates compiled.

:func:`screen` prices every mesh's 1F1B quick plan and the interleaved one
of the best few; :func:`shortlist` keeps the ``top`` meshes of the best quick
plans and
every mesh whose quick plan is within ``slack`` of the best. The quick plans
of the shortlist stay candidates beside the full search's (one can be the
faster: its first stages recompute, where the sequential planner recomputes
every stage and relaxes stage by stage). It is a
heuristic, not a proven bound: a mesh whose quick plan ranks below the
shortlist but whose searched plan would beat all of the shortlist's is missed
(another schedule family, another split or partial recompute can move a
mesh by more than the quick plans' spread; ``tests/test_plan_mesh.py``
checks it keeps the exhaustive search's choice on small tables, and
``docs/hardware.md`` compares the two at scale). A compute-only lower bound (the busiest
rank's share of the step's forward and backward) is a proven bound but
prunes nothing here: every mesh does the same work per GPU, and what
separates them is the bubble and the collectives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from orgel.costs.blocks import BlockCosts, chain_split
from orgel.costs.mesh import mesh_costs
from orgel.plan.predict import end_of_step, labelled, replicated
from orgel.plan.scorer import Score, Scorer
from orgel.plan.splits import Points, balanced_points, memory_weights, time_weights
from orgel.plan.templates import Spec, Template, cached_template
from orgel.schedule.ir import Plan

#: The schedules a quick plan tries: 1F1B, and interleaved 1F1B with 2, 4 and 8 stages per
#: rank (where the micro-batches are as many as the ranks, deeper interleaving shrinks the
#: bubble and holds no more activations: issue 36).
QUICK_TEMPLATES = (Spec("1f1b", "1f1b", {}, 1),
                   *(Spec(f"interleaved v={v}", "interleaved", {"stages_per_rank": v}, v)
                     for v in (2, 4, 8)))
#: Meshes the joint search plans in full by default (the best quick plans).
MESH_TOP = 4
#: ... and every mesh whose quick plan is within this fraction of the best one.
MESH_SLACK = 0.05

T = TypeVar("T")


def quick_step(costs: BlockCosts, pipeline: int, microbatches: int, *, tp: int = 1,
               dp: int = 1, shard: str = "none", memory: int | None = None,
               templates: Sequence[Spec] = QUICK_TEMPLATES) -> float:
    """ms of one step of the mesh's quick plan (:func:`quick_plan`); inf when none fits."""
    return quick_plan(costs, pipeline, microbatches, tp=tp, dp=dp, shard=shard, memory=memory,
                      templates=templates)[0]


def quick_plan(costs: BlockCosts, pipeline: int, microbatches: int, *, tp: int = 1,
               dp: int = 1, shard: str = "none", memory: int | None = None,
               templates: Sequence[Spec] = QUICK_TEMPLATES
               ) -> tuple[float, Plan | None, BlockCosts]:
    """The mesh's quick plan (module docstring): ``(ms of a step, plan, its table)``.

    The plan is whole (``dp`` replicas, ``plan.tp``, ``meta["mesh"]`` set),
    a candidate like the planner's; ``(inf, None, table)`` when none fits.

    ``costs`` is the whole micro-batch's table (each of the ``dp`` replicas
    takes ``1/dp`` of every micro-batch), as :func:`orgel.plan.planner.plan`
    takes it; ``memory`` overrides the table's memory per rank; ``templates``:
    the schedules to try.
    """
    from orgel.plan.replicated import replicated_step

    table = mesh_table(costs, tp, shard, dp)
    if pipeline > costs.num_blocks:
        return math.inf, None, table
    scorer = Scorer(table if dp == 1 else table.scaled(1.0 / dp), memory=memory)
    n = table.num_blocks
    found: tuple[Score, Template, Points, tuple[bool | str, ...] | None] | None = None
    for spec in templates:
        template = cached_template(scorer.templates, spec, pipeline, microbatches)
        if template is None or template.num_stages > n:
            continue
        for weights in (time_weights(scorer.bc), memory_weights(scorer.bc)):
            points = balanced_points(weights, template.num_stages)
            got = _fewest_recomputing(scorer, template, points)
            if got is not None and (found is None or got[0].step_time < found[0].step_time):
                found = got[0], template, points, got[1]
    if found is None:
        return math.inf, None, table
    score, template, points, recompute = found
    p = labelled(scorer.to_plan(template, chain_split(points, n), recompute), template)
    step = score.step_time
    if dp > 1:
        single, p = p, replicated(p, dp, table, scorer.memory, shard)
        priced = replicated_step(single, p, table)
        if scorer.memory is not None and priced[1].max() > scorer.memory:
            return math.inf, None, table
        step = priced[0]
    p = with_mesh(p, pipeline, tp, dp, shard)
    return float(step + end_of_step(table, p)), p, table


def _fewest_recomputing(scorer: Scorer, template: Template, points: Points
                        ) -> tuple[Score, tuple[bool | str, ...] | None] | None:
    """The fitting score with the fewest first stages recomputing (bisected); None: none fits.

    1F1B's stage ``s`` holds ``P - s`` micro-batches' activations, so the
    first stages are the ones to recompute: whole (``True``), or, where the table knows its
    layers, each layer (``"layer"``: it rebuilds one layer at a time, so it fits where a
    whole stage's recompute does not) or selectively (``"selective"``: the matmul outputs
    kept; not with a split backward), the fastest that fits.
    """
    stages = template.num_stages
    score = scorer.score_chain(template, points, None)
    if score.feasible:
        return score, None
    # whole first, then per layer and selectively: on equal steps the first found stays
    policies: list[bool | str] = [True, *reversed(scorer.partial_policies(template))]
    found: tuple[Score, tuple[bool | str, ...]] | None = None
    for policy in policies:
        def first(k: int, policy: bool | str = policy) -> tuple[bool | str, ...]:
            return tuple(policy if s < k else False for s in range(stages))

        best = scorer.score_chain(template, points, first(stages))
        if not best.feasible:
            continue
        low, high = 0, stages  # low does not fit, high does
        while high - low > 1:
            mid = (low + high) // 2
            trial = scorer.score_chain(template, points, first(mid))
            if trial.feasible:
                high, best = mid, trial
            else:
                low = mid
        if found is None or best.step_time < found[0].step_time:
            found = best, first(high)
    return found


def mesh_table(costs: BlockCosts, tp: int, shard: str, dp: int) -> BlockCosts:
    """The table the mesh search prices a mesh by: with ``tp > 1`` the plans it makes run
    sequence parallelism (:func:`with_mesh`), so the table prices it."""
    return mesh_costs(costs, tp=tp, shard=shard, replicas=dp, sequence_parallel=tp > 1)


def with_mesh(plan: Plan, pipeline: int, tp: int, dp: int, shard: str) -> Plan:
    """``plan`` on its mesh: ``tp`` processes per pipeline rank, with sequence parallelism
    (as :func:`mesh_table` prices it), and the mesh in its meta."""
    return dataclasses.replace(plan, tp=tp, sequence_parallel=tp > 1, meta={
        **plan.meta, "mesh": {"pp": pipeline, "tp": tp, "dp": dp, "shard": shard,
                              "sequence_parallel": tp > 1}})


def compute_bound(costs: BlockCosts, pipeline: int, microbatches: int, *, tp: int = 1,
                  dp: int = 1, shard: str = "none") -> float:
    """A proven lower bound on the mesh's step (ms): the busiest rank's compute at best.

    Every rank runs its actions one at a time, so a step takes at least the
    average rank's forward and backward: ``microbatches x sum(fwd + bwd) /
    pipeline`` of the TP'd table's share of a micro-batch (recompute,
    bubbles, collectives and the optimizer only add to it).
    """
    table = mesh_table(costs, tp, shard, dp)
    work = sum(table.fwd) + sum(table.bwd)
    return microbatches * work / dp / pipeline


def screen(meshes: Sequence[T], quick: Callable[[T, Sequence[Spec]], float], *,
           top: int = MESH_TOP, slack: float = MESH_SLACK,
           templates: Sequence[Spec] = QUICK_TEMPLATES,
           bound: Callable[[T], float] | None = None) -> list[T]:
    """The meshes worth a full search: every mesh's 1F1B quick plan, then the
    interleaved one for the best ``2 top`` of them and those where 1F1B does
    not fit (interleaved holds fewer micro-batches' activations; its deep
    templates are the slow ones to build), then :func:`shortlist`.

    ``quick(mesh, templates)`` is :func:`quick_step` of the mesh;
    ``templates``: the quick plans' schedules (the first for every mesh);
    ``bound(mesh)``: a proven lower bound on its quick step
    (:func:`compute_bound`): meshes are priced in its order, and one whose
    bound already keeps it off the shortlist is not priced (inf).
    """
    first, second = templates[:1], templates[1:]
    steps = [math.inf] * len(meshes)
    lows = [0.0 if bound is None else bound(m) for m in meshes]
    unfit = []  # priced, and the first schedule does not fit
    for i in sorted(range(len(meshes)), key=lambda i: lows[i]):
        found = sorted(x for x in steps if x < math.inf)
        if len(found) >= top and lows[i] > max(found[top - 1], found[0] * (1 + slack)):
            continue
        steps[i] = quick(meshes[i], first)
        if steps[i] == math.inf:
            unfit.append(i)
    order = sorted(range(len(meshes)), key=lambda i: steps[i])
    for i in [j for j in order[:2 * top] if steps[j] < math.inf] + unfit:
        if second:
            steps[i] = min(steps[i], quick(meshes[i], second))
    return shortlist(meshes, steps, top=top, slack=slack)


def shortlist(meshes: Sequence[T], steps: Sequence[float], *, top: int = MESH_TOP,
              slack: float = MESH_SLACK) -> list[T]:
    """The meshes worth a full search, best quick plan first (module docstring).

    ``steps[i]`` is mesh ``i``'s quick step time (inf: its quick plan does not
    fit). When no quick plan fits, every mesh is kept (a searched plan, with
    another schedule or partial recompute, may fit where the quick one does not).
    """
    if len(meshes) != len(steps):
        raise ValueError("one quick step time per mesh")
    order = sorted(range(len(meshes)), key=lambda i: steps[i])
    finite = [i for i in order if steps[i] < math.inf]
    if not finite:
        return list(meshes)
    best = steps[finite[0]]
    keep = [i for k, i in enumerate(finite) if k < top or steps[i] <= best * (1 + slack)]
    return [meshes[i] for i in keep]

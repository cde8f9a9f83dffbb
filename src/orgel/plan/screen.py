"""The mesh search's first pass: every mesh priced by one quick plan, the best few searched.

A mesh is a tensor-parallel degree ``tp``, a pipeline depth ``P``, ``dp``
replicas of the pipeline and whether they shard their state (``shard``).
Planning one in full (templates screened, beam search, recompute relaxed
stage by stage) takes seconds to tens of seconds on a deep pipeline with many
micro-batches, and a joint search has tens of meshes. :func:`quick_step`
prices a mesh with one plan instead: plain 1F1B over the time-balanced split
of its TP'd (and sharded) table, every stage keeping its activations or, when
that does not fit, every stage recomputing (then the memory-balanced split if
the time-balanced one still does not fit), replicated and priced like the
planner's candidates (:func:`orgel.plan.replicated.replica_step`, the end of
step added). No beam, one template compiled.

:func:`shortlist` keeps the ``top`` meshes of the best quick plans (the
searched plan of a mesh is never slower than its quick plan: the beam starts
from the time-balanced split and the baselines are among the candidates) and
every mesh whose quick plan is within ``slack`` of the best. It is a
heuristic, not a proven bound: a mesh whose quick plan ranks below the
shortlist but whose searched plan would beat all of the shortlist's is missed
(a schedule family other than 1F1B, or partial recompute, can move a mesh by
more than the quick plans' spread). A compute-only lower bound (the busiest
rank's share of the step's forward and backward) is a proven bound but
prunes nothing here: every mesh does the same work per GPU, and what
separates them is the bubble and the collectives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from orgel.costs.blocks import BlockCosts, chain_split
from orgel.costs.mesh import mesh_costs
from orgel.plan.scorer import Scorer
from orgel.plan.splits import balanced_points, memory_weights, time_weights
from orgel.plan.templates import one_f_one_b

#: Meshes the joint search plans in full by default (the best quick plans).
MESH_TOP = 4
#: ... and every mesh whose quick plan is within this fraction of the best one.
MESH_SLACK = 0.05

T = TypeVar("T")


def quick_step(costs: BlockCosts, pipeline: int, microbatches: int, *, tp: int = 1,
               dp: int = 1, shard: str = "none", memory: int | None = None) -> float:
    """ms of one step of the mesh's quick plan (module docstring); inf when it does not fit.

    ``costs`` is the whole micro-batch's table (each of the ``dp`` replicas
    takes ``1/dp`` of every micro-batch), as :func:`orgel.plan.planner.plan`
    takes it; ``memory`` overrides the table's memory per rank.
    """
    from orgel.plan.planner import _replicate, end_of_step
    from orgel.plan.replicated import replica_step
    from orgel.sim import simulate

    if pipeline > costs.num_blocks:
        return math.inf
    table = mesh_costs(costs, tp=tp, shard=shard, replicas=dp)
    scorer = Scorer(table if dp == 1 else table.scaled(1.0 / dp), memory=memory)
    template = one_f_one_b(pipeline, microbatches, scorer.templates)
    n = table.num_blocks
    everything = (True,) * template.num_stages
    tries = [(balanced_points(time_weights(scorer.bc), pipeline), None),
             (balanced_points(time_weights(scorer.bc), pipeline), everything),
             (balanced_points(memory_weights(scorer.bc), pipeline), everything)]
    for points, recompute in tries:
        score = scorer.score_chain(template, points, recompute)
        if score.feasible:
            break
    else:
        return math.inf
    p = scorer.to_plan(template, chain_split(points, n), recompute)
    step = score.step_time
    if dp > 1:
        single, p = p, _replicate(p, dp, table, scorer.memory, shard)
        got = replica_step(single, p)
        if got is None:
            full = simulate(p)
            got = full.step_time, np.asarray(full.peak_memory)
        if scorer.memory is not None and got[1].max() > scorer.memory:
            return math.inf
        step = got[0]
    return float(step + end_of_step(table, p))


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

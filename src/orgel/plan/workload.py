"""Plans for real models: profile, plan, then bind the plan to the captured graph.

A plan found on a block cost table names blocks; the runtime splits the
captured op graph by *nodes* and sends values by the names the split gives
them. :func:`attach_split` fills every stage's nodes (its blocks' nodes, in
graph order), splits the graph by the plan and takes the split's stage graph
(edge values named and sized as the runtime will send them), records the
parameters that stages on different ranks share (the plan's ``tied``, whose
gradient all-reduce the simulator then counts), then re-simulates.
:func:`auto_plan` is the hook ``orgel.pipeline`` calls when no plan is given.

Both profile with the intra-op thread count the ranks will train with
(:func:`orgel.profile.workload.rank_threads`), with the other ``ranks - 1``
ranks' work running meanwhile (:mod:`orgel.profile.contention`), and tell the
planner a micro-batch's row count, so it never gives a stage replicas that
cannot split a micro-batch evenly. Given no micro-batch count, both choose one
for the workload's whole example batch (:mod:`orgel.plan.batch`): each count
tried is captured and profiled at its micro-batch size (cached on disk).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from orgel.costs.blocks import BlockCosts
from orgel.graph.blocks import blocks_for
from orgel.plan.batch import microbatch_choices, search_microbatches
from orgel.plan.planner import PlanResult, plan
from orgel.plan.predict import predicted, with_prediction
from orgel.schedule.ir import Plan, StageGraph, TiedWeight
from orgel.schedule.validate import validate
from orgel.sim import SimResult, simulate
from orgel.workload import microbatch_rows


def attach_split(p: Plan, opgraph: Any, costs: BlockCosts | None = None) -> Plan:
    """``p`` with stage nodes, the named edges of the split of ``opgraph`` and its tied weights.

    ``tied`` is recomputed from the split (see :func:`tied_weights`):
    the planner's entry (:meth:`orgel.plan.scorer.Scorer.to_plan`, from the cost
    table's ``tied`` groups) is the same when the table was profiled from
    ``opgraph``; the split's modules decide when they differ.
    """
    if costs is not None:
        return _split_and_predict(p, opgraph, costs)[0]
    out = _with_split(p, opgraph)
    return with_prediction(out, simulate(out))


def _with_split(p: Plan, opgraph: Any) -> Plan:
    """``p`` with the split's stages, edges and tied weights, validated, not yet predicted."""
    from orgel.split import split_plan

    if not all(s.nodes for s in p.stage_graph.stages):
        raise ValueError("the plan's stages list no graph nodes: plan from a profiled "
                         "workload (its cost table knows each block's nodes)")
    split = split_plan(opgraph, p)
    stages = tuple(replace(st, name=p.stage_graph.stages[i].name,
                           blocks=p.stage_graph.stages[i].blocks)
                   for i, st in enumerate(split.stage_graph.stages))
    # the tied groups of an earlier split give way to this one's
    out = replace(p, stage_graph=StageGraph(stages, split.stage_graph.edges),
                  recompute=list(p.recompute), prediction=None, meta=dict(p.meta),
                  tied=tied_weights(split, p.placement), shard=list(p.shard),
                  costs=_costs_by_edge(p, split.stage_graph.edges))
    validate(out)
    return out


def _costs_by_edge(p: Plan, edges: Any) -> Any:
    """``p.costs`` with its gradient bytes per edge (the planner's stage graph's, by stage
    pair) for the split's ``edges``, which may hold pairs the planner's did not (a value
    the block graph did not see cross): those carry their values' gradient bytes."""
    costs = p.costs
    if costs is None or costs.edge_grad_bytes is None:
        return costs
    known = {(e.src, e.dst): g for e, g in zip(p.stage_graph.edges, costs.edge_grad_bytes,
                                               strict=False)}
    return replace(costs, edge_grad_bytes=[known.get((e.src, e.dst), e.grad_nbytes)
                                           for e in edges])


def _split_and_predict(p: Plan, opgraph: Any, costs: BlockCosts) -> tuple[Plan, SimResult]:
    """:func:`attach_split` with ``costs``, and the simulation of its prediction (run once)."""
    return predicted(_with_split(p, opgraph), costs)


def tied_weights(split: Any, placement: list[tuple[int, ...]]) -> list[TiedWeight]:
    """The parameters that stages on different ranks share, one entry per parameter.

    For each (its qualified name, the stages holding it, its bytes) the
    runtime sums the copies' gradients over the ranks of those stages
    (:mod:`orgel.runtime.optim`), one all-reduce of ``N`` bytes per parameter.
    A parameter whose stages all sit on one rank is summed locally and left out.
    """
    out: list[TiedWeight] = []
    for name in split.tied:
        stages: list[int] = []
        nbytes = 0
        for s, st in enumerate(split.stages):
            local = [k for k, qual in st.param_names.items() if qual == name]
            if local:
                stages.append(s)
                param = dict(st.module.named_parameters())[local[0]]
                nbytes = param.numel() * param.element_size()
        if len({r for s in stages for r in placement[s]}) > 1:
            out.append(TiedWeight(name, tuple(stages), nbytes))
    return out


def plan_workload(workload: Any, *, ranks: int, microbatches: int | None = None,
                  batch: int | None = None, blocks: int | None = None, memory: int | None = None,
                  planner: str = "auto", dp: int | None = 1, link: bool = True,
                  progress: bool = True, threads: int | None = None,
                  compiled: bool = False, **options: Any) -> PlanResult:
    """Profile ``workload`` (``"file.py:fn"`` or a Workload) and plan it, runnable as is.

    ``microbatches=None`` chooses the count for a global batch of ``batch``
    rows (default: the workload's example batch; other sizes are cut from it,
    so each micro-batch's rows must divide the example's); the plan's
    ``meta["microbatch_search"]`` lists the counts tried (:mod:`orgel.plan.batch`),
    each profiled at its micro-batch size with a progress line on stderr.
    ``threads``: intra-op threads per rank to profile with (default: what a
    local group of ``ranks`` gives each rank). ``compiled``: time each block compiled, as
    compiled stages run (:mod:`orgel.profile.compiled`). ``options`` go to
    :func:`~orgel.plan.planner.plan` (e.g. ``max_replicas=1`` for a pure
    pipeline); ``rows`` defaults to the workload's micro-batch rows.
    """
    from orgel.profile.workload import capture_workload, profile_graph, rank_threads

    threads = threads or rank_threads(ranks)
    blocks = blocks_for(ranks, blocks)
    if microbatches is None:
        result, _ = plan_batch(workload, ranks=ranks, batch=batch, blocks=blocks, link=link,
                               progress=progress, threads=threads, memory=memory,
                               planner=planner, dp=dp, compiled=compiled, **options)
        return result
    if batch is not None:
        raise ValueError("batch sets the micro-batch count's search: give microbatches=None "
                         "with it, or leave batch out")
    w, opgraph = capture_workload(workload, microbatches)
    costs = profile_graph(w, opgraph, microbatches=microbatches, blocks=blocks, link=link,
                          progress=progress, threads=threads, contention=ranks - 1,
                          ranks=ranks, compiled=compiled)
    if isinstance(workload, str):
        costs.meta["workload"] = workload
    options.setdefault("rows", costs.rows)
    result = plan(costs, ranks, microbatches, memory=memory, planner=planner, dp=dp, **options)
    result.plan, result.sim = _split_and_predict(result.plan, opgraph, costs)
    return result


def plan_batch(workload: Any, *, ranks: int, batch: int | None = None,
               blocks: int | None = None,
               link: bool = True, progress: bool = True, threads: int = 1,
               dp: int | None = 1, optimizer_factor: float = 4.0, source: Any = None,
               compiled: bool = False, **options: Any) -> tuple[PlanResult, Any]:
    """Choose the micro-batch count for ``batch`` rows of ``workload`` and plan it.

    Returns the runnable plan's result and the op graph captured at the chosen
    micro-batch size (what the runtime splits). ``options`` go to
    :func:`~orgel.plan.batch.search_microbatches` and on to the planner;
    ``optimizer_factor``, ``source`` (a meta model's values) and ``compiled`` to the
    profile (see :func:`auto_plan`).
    """
    from orgel.graph import capture
    from orgel.profile.workload import as_workload, profile_graph
    from orgel.workload import microbatches as split_batches
    from orgel.workload import named_inputs, validate_workload

    w = as_workload(workload)
    validate_workload(w, 1)
    blocks = blocks_for(ranks, blocks)
    example = microbatch_rows(w, 1)
    if example is None:
        raise ValueError("the workload's inputs have no batch dimension to cut into "
                         "micro-batches: give microbatches explicitly")
    batch = example if batch is None else batch
    choices = [m for m in microbatch_choices(batch, ranks, dp=dp)
               if example % (batch // m) == 0]
    if not choices:
        raise ValueError(f"no micro-batch of a {batch}-row batch can be cut from the example "
                         f"batch of {example} rows: give a batch that is a multiple of a "
                         f"divisor of {example}")
    graphs: dict[int, Any] = {}
    all_costs: dict[int, BlockCosts] = {}

    def costs_at(rows: int) -> BlockCosts:
        parts = example // rows
        inputs, _ = split_batches(w, parts)[0]
        graphs[rows] = capture(w.model, named_inputs(w.model, inputs), precision=w.precision,
                               shallow=True)
        costs = profile_graph(w, graphs[rows], microbatches=parts, blocks=blocks, link=link,
                              progress=progress, threads=threads, contention=ranks - 1,
                              ranks=ranks, optimizer_factor=optimizer_factor, source=source,
                              compiled=compiled and source is None)
        if isinstance(workload, str):
            costs.meta["workload"] = workload
        all_costs[rows] = costs
        return costs

    def say(text: str) -> None:
        if progress:
            print(f"orgel: profiling and planning {text} (batch {batch})", file=sys.stderr)

    result = search_microbatches(costs_at, batch, ranks, dp=dp, choices=choices, progress=say,
                                 **options)
    rows = batch // result.plan.microbatches
    result.plan, result.sim = _split_and_predict(result.plan, graphs[rows], all_costs[rows])
    return result, graphs[rows]


def planning_costs(workload: Any, graph: Any, *, ranks: int, microbatches: int,
                   blocks: int | None = None, threads: int | None = None, source: Any = None,
                   optimizer_factor: float = 4.0, compiled: bool = False) -> Any:
    """The block table :func:`auto_plan` plans ``graph`` from (profiled on this machine as
    ``ranks`` ranks will run it, or read from the profile cache); see :func:`auto_plan`
    for the arguments."""
    from orgel.profile.workload import profile_graph, rank_threads

    return profile_graph(workload, graph, microbatches=microbatches,
                         blocks=blocks_for(ranks, blocks), progress=False,
                         threads=threads or rank_threads(ranks), contention=ranks - 1,
                         ranks=ranks, source=source, optimizer_factor=optimizer_factor,
                         compiled=compiled and source is None)


def auto_plan(workload: Any, graph: Any = None, *, ranks: int, microbatches: int | None,
              memory: int | None = None, dp: int = 1, blocks: int | None = None,
              max_replicas: int | None = 1, rows: int | None = None,
              threads: int | None = None, planner: str = "auto", source: Any = None,
              optimizer_factor: float = 4.0, compiled: bool = False) -> Plan:
    """The planner's plan for a workload (``orgel.pipeline``'s hook).

    ``graph`` is the workload captured at ``microbatches`` micro-batches; with
    ``microbatches=None`` leave it out: the count is chosen for the whole
    example batch (:func:`plan_batch`, which captures each size it tries).
    ``dp=1``: the whole pipeline is not replicated. ``max_replicas`` (default
    1: a pure pipeline, every stage on one rank) caps a stage's intra-stage
    replicas: ``orgel.pipeline`` runs stages captured with fixed shapes and
    needs every stage to have the same replica count, which with ``dp=1`` leaves
    one; pass ``None`` to let the graph planner give some stages more ranks
    where the runtime allows it.
    ``rows`` (default: the workload's micro-batch rows) limits replica counts
    to its divisors. ``threads``: intra-op threads each rank trains with
    (default :func:`~orgel.profile.workload.rank_threads` of ``ranks``).
    ``source``: a meta model's values, profiled one block at a time
    (:func:`~orgel.profile.workload.profile_graph`). ``optimizer_factor``: a
    rank's weights, gradients and optimizer state per weight byte (4: Adam;
    :func:`~orgel.profile.memory.optimizer_factor` measures a user's optimizer).
    ``compiled``: the stages will run compiled (``compile=True``), so the blocks are timed
    compiled (:mod:`orgel.profile.compiled`; a meta model's are timed eagerly).
    """
    from orgel.profile.workload import rank_threads

    threads = threads or rank_threads(ranks)
    blocks = blocks_for(ranks, blocks)
    if microbatches is None:
        if graph is not None or rows is not None:
            raise ValueError("with microbatches=None the search captures every micro-batch "
                             "size it tries: leave graph and rows out")
        result, _ = plan_batch(workload, ranks=ranks, progress=False, threads=threads,
                               blocks=blocks, memory=memory, dp=dp, planner=planner,
                               max_replicas=max_replicas, optimizer_factor=optimizer_factor,
                               source=source, compiled=compiled)
        return result.plan
    if graph is None:
        raise ValueError("give the graph captured at microbatches micro-batches "
                         "(orgel.profile.workload.capture_workload), or microbatches=None")
    costs = planning_costs(workload, graph, ranks=ranks, microbatches=microbatches,
                           blocks=blocks, threads=threads, source=source,
                           optimizer_factor=optimizer_factor, compiled=compiled)
    if rows is None:
        rows = microbatch_rows(workload, microbatches)
    result = plan(costs, ranks, microbatches, memory=memory, dp=dp, planner=planner,
                  max_replicas=max_replicas, rows=rows)
    return attach_split(result.plan, graph, costs)

"""The flow's first half, written once: capture, plan (or take the plan), split.

:func:`prepare` is what every front end does before any rank starts: capture the model
on one micro-batch (sizes symbolic where the model allows), decide the plan and the loss
rule (:func:`decide`: in this process, in a planning child for CUDA ranks, or on
process 0 of a torchrun job, which broadcasts it), split the graph into the plan's
stages. The eval-mode capture waits for the first ``evaluate``
(:meth:`Prepared.lazy_evaluation`). The result, :class:`Prepared`, is what
:mod:`orgel.flow.start` launches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orgel.graph.glue_capture import release
from orgel.guard import untouched
from orgel.lossweights import WEIGHTED, Rule, rule_for, rule_name
from orgel.plan.transforms import mark_sharded, with_recompute
from orgel.runtime.sharding import check_sharded
from orgel.schedule.ir import Plan
from orgel.split.materialize import Init, Weights, WeightsArg
from orgel.worker.evaluation import LazyEvaluation
from orgel.workload import Workload


@dataclass
class Prepared:
    """A workload made ready to start: its plan, its stages and how it trains."""

    workload: Workload
    plan: Plan
    split: Any
    graph: Any
    loss_rule: Rule
    seed: int
    source: Weights | None = None
    keys: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)

    def lazy_evaluation(self, guard: Callable[[], Any] | None = None) -> LazyEvaluation:
        """The eval-mode split, made by the first ``evaluate`` in the process that asks
        (:mod:`orgel.worker.evaluation`), under ``guard()`` if given. (A forward of several
        graphs evaluates in its controller instead: :mod:`orgel.explicit.glued`.)"""
        def make(names: tuple[str, ...]) -> Any:
            from orgel.flow.capture import eval_split_for

            with guard() if guard is not None else contextlib.nullcontext():
                return eval_split_for(self.workload, self.plan, self.split, names)

        return LazyEvaluation(make)


#: How the plan, the loss rule and the seed are agreed: ``agree(decide)`` returns what
#: ``decide()`` returns, run where the front end says (here, or on process 0 and broadcast).
Agree = Callable[[Callable[[], tuple[Plan, Rule, int]]], tuple[Plan, Rule, int]]


def here(decide: Callable[[], tuple[Plan, Rule, int]]) -> tuple[Plan, Rule, int]:
    """Decide in this process."""
    return decide()


def on_process_zero(kind: str) -> Agree:
    """Decide on process 0 of a torchrun job (profiling on ``kind``) and broadcast the plan,
    the loss rule and process 0's seed (every rank initializes a tied tensor alike)."""

    def agree(decide: Callable[[], tuple[Plan, Rule, int]]) -> tuple[Plan, Rule, int]:
        import torch.distributed as dist

        from orgel.launch.devices import profiling_on

        text: list[Any] = [None, None, None]
        if dist.get_rank() == 0:
            with profiling_on(kind):
                the_plan, rule, seed = decide()
            # a weighted mean's function is each process's own: its name goes
            text = [the_plan.to_json(), rule_name(rule), seed]
        dist.broadcast_object_list(text, src=0)
        return Plan.from_json(str(text[0])), str(text[1]), int(text[2])

    return agree


def plan_only(workload: Workload, *, ranks: int, microbatches: int | str, memory: int | None,
              dp: int, source: Weights | None = None, optimizer: Any = None,
              compiled: bool = False, **_: Any) -> Plan:
    """Capture and plan, nothing more (the planning child's work for CUDA ranks)."""
    from orgel.flow.capture import capture_microbatch, resolve_plan

    with untouched(workload.model):
        graph = None if microbatches == "auto" else capture_microbatch(workload,
                                                                       int(microbatches))
        return resolve_plan(None, planned_workload(workload, graph), graph, ranks,
                            microbatches, memory, dp, source=source, optimizer=optimizer,
                            compiled=compiled)


def planned_workload(workload: Workload, graph: Any) -> Workload:
    """The workload the planner profiles: with graph breaks the graphs' outputs are not the
    model's output, so the loss stage is timed with a sum (``profiling_loss``)."""
    if graph is None or graph.glue is None:
        return workload
    from orgel.worker.closure import profiling_loss

    return Workload(workload.model, workload.inputs, workload.targets, profiling_loss,
                    workload.batch_dim, workload.replicated, workload.precision)


def prepare(workload: Workload, *, plan: Plan | str | Path | None, ranks: int, tp: int,
            microbatches: int | str, memory: int | None, dp: int, shard: str,
            loss_rule: Rule, optimizer: Any, source: Weights | None = None,
            agree: Agree = here, mark: bool = False,
            check_graph: Callable[[Any], None] | None = None, graph: Any = None,
            planner: str | None = None, recompute: bool | str = False,
            schedule: str | None = None, stages_per_rank: int = 2,
            replica_rows: bool = False, sequence_parallel: bool = False,
            compiled: bool = False) -> Prepared:
    """Capture, decide the plan and the loss rule, and split (evaluation waits: see Prepared).

    ``ranks`` counts pipeline ranks (processes // tp); ``sequence_parallel``: with ``tp``,
    the values between the split layers cut along the sequence. ``agree``: where the decision is
    made (:func:`here`, or :func:`on_process_zero` of a torchrun job). ``mark``: a given
    ``plan`` was planned for these options (by :func:`plan_only` in a planning child), so
    its stages take ``shard`` as a plan made here does. ``check_graph``: called on the
    capture before anything is planned (it raises for a graph the front end refuses).
    ``graph``: the capture, made already (``orgel.backend`` joins the graphs Dynamo handed
    it); then the plan must give every stage one rank (a replica's rows need a capture
    of their own), unless ``replica_rows`` says the capture is of one replica's rows (each
    closure of ``orgel.backend`` with graph breaks is one replica's micro-batch).
    ``planner``: the planner's name (default: its own choice).
    ``recompute``: every stage's recompute policy (:data:`orgel.schedule.ir.RECOMPUTE`;
    False: the plan's own). ``schedule``: a FLOP-balanced chain run by that family
    instead of the planner's plan (:func:`orgel.flow.capture.resolve_plan`), with
    ``stages_per_rank`` stages per rank where the family loops. ``compiled``: the stages
    will run compiled (``compile=True``): the planner times the blocks so.
    """
    from orgel.flow.capture import (
        capture_microbatch,
        replica_advice,
        replica_graph,
        resolve_plan,
        stage_replicas,
        takes_replica_rows,
    )
    from orgel.plan.transforms import runnable_recompute, with_tp
    from orgel.split import split_plan
    from orgel.split.split import names_other_nodes

    given, captured = plan, graph is not None
    try:
        with untouched(workload.model):
            if graph is None and microbatches != "auto":
                # with dp > 1 the stages take one replica's rows of a micro-batch; a capture
                # with symbolic sizes takes them too, one row included (size-oblivious sizes)
                graph = capture_microbatch(workload, int(microbatches), keep=True)
            if graph is not None and check_graph is not None:
                check_graph(graph)
            planned = planned_workload(workload, graph)

            def decide() -> tuple[Plan, Rule, int]:
                the_plan = resolve_plan(given, planned, graph, ranks, microbatches, memory, dp,
                                        planner=planner, source=source, optimizer=optimizer,
                                        schedule=schedule, stages_per_rank=stages_per_rank,
                                        compiled=compiled)
                if given is None or mark:  # a given plan's own shard fields rule
                    the_plan = mark_sharded(the_plan, shard)
                if recompute is not False:
                    the_plan = with_recompute(the_plan, [recompute] * the_plan.num_stages)
                return (with_tp(the_plan, tp, graph, sequence_parallel),
                        rule_for(workload, loss_rule),
                        torch.initial_seed())

            def agreed() -> tuple[Plan, Rule, int]:
                the_plan, rule, seed = agree(decide)
                if rule == WEIGHTED:  # found as a weighted mean: this process's own function
                    rule = loss_rule if callable(loss_rule) else rule_for(workload, WEIGHTED)
                return the_plan, rule, seed

            the_plan, rule, seed = agreed()
            if graph is None:
                graph = capture_microbatch(workload, the_plan.microbatches)
                if check_graph is not None:
                    check_graph(graph)
                if graph.glue is not None:
                    raise ValueError("the forward has graph breaks (Dynamo captures it as several "
                                     "graphs); give microbatches as an int, not 'auto'")
            # the glue of a forward of several graphs has the shapes of what the controller
            # runs: one replica's rows
            if replica_rows:
                stage_replicas(the_plan)  # every stage as many (else ValueError)
            elif captured and stage_replicas(the_plan) > 1:
                raise ValueError("this capture was made once, for whole micro-batches: plan one "
                                 "rank per stage (dp=1)")
            else:
                if graph.glue is not None and graph.glue.dynamic \
                        and not takes_replica_rows(workload, graph, the_plan):
                    # a forward of several graphs binds its sizes by value
                    # (orgel.graph.glue_sizes): a capture of a replica's rows would make
                    # other graphs than the plan's; both static (a given plan's replicas)
                    release(graph.glue)
                    graph = capture_microbatch(workload, the_plan.microbatches, dynamic=False,
                                               keep=True)
                    planned = planned_workload(workload, graph)
                    the_plan, rule, seed = agreed()
                replica = replica_graph(workload, graph, the_plan)
                if replica is not graph and given is None \
                        and names_other_nodes(replica, the_plan):
                    release(replica.glue)
                    raise ValueError(replica_advice(workload, the_plan))
                graph = replica
            split = split_plan(graph, the_plan)
            if recompute is False and (given is None or mark) and any(
                    isinstance(p, str) for p in the_plan.recompute):
                # the planner's per-layer or selective choices, where the runtime can run them
                the_plan = runnable_recompute(the_plan)
            check_sharded(the_plan, split)
    except BaseException:
        if not captured and graph is not None:
            release(graph.glue)  # the code a forward of several graphs kept for its controller
        raise
    return Prepared(workload, the_plan, split, graph, rule, seed, source)


def meta_weights(model: torch.nn.Module, init: Init | None,
                 weights: WeightsArg | None) -> Weights | None:
    """Where a meta model's values come from (None for a model with values); checks them."""
    from orgel.workload import on_meta

    if not on_meta(model):
        if init is not None or weights is not None:
            raise ValueError("init= and weights= are for a model built on the meta device "
                             "(with torch.device('meta'): model = ...); this model has values "
                             "already: leave them out, or load weights with "
                             "model.load_state_dict before orgel.pipeline")
        return None
    return Weights(model, init=init, weights=weights, seed=torch.initial_seed())

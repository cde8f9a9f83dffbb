"""The seams to capture, planning and split that every front end shares.

:func:`capture_microbatch` captures a workload's model on one micro-batch;
:func:`resolve_plan` checks a given plan against the options or plans;
:func:`replica_graph` is the capture a plan's stages are cut from (one replica's rows);
:func:`eval_split_for` cuts the eval-mode capture into the training split's stages;
:func:`shape_check` is the check ``step`` runs on a batch before any rank starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from orgel.guard import untouched
from orgel.schedule.ir import Plan
from orgel.split.materialize import Weights
from orgel.workload import Workload, named_inputs


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Each rank's optimizer when none is given: AdamW, learning rate 1e-3."""
    return torch.optim.AdamW(params, lr=1e-3)


def capture_microbatch(workload: Workload, microbatches: int, dynamic: bool = True,
                       keep: bool = False) -> Any:
    """The op graph of ``workload``'s model, measured on one micro-batch.

    ``dynamic``: with symbolic sizes where the model allows (:mod:`orgel.graph.sizes`),
    so the stages split from it take batches of other sizes; ``graph.shapes`` says which.
    ``keep``: a forward of several graphs keeps Dynamo's code for its controller
    (:func:`orgel.graph.capture.capture`).
    """
    from orgel.graph.capture import capture
    from orgel.workload import microbatches as slice_batches

    first_inputs, first_targets = slice_batches(workload, microbatches)[0]
    graph = capture(workload.model, first_inputs, precision=workload.precision,
                    dynamic=dynamic, keep=keep, shallow=True)
    if graph.glue is None:  # (with graph breaks the controller reads outputs too: all)
        graph.loss_reads = loss_reads(graph, workload.loss_fn, first_inputs, first_targets)
    return graph


def loss_reads(graph: Any, loss_fn: Any, inputs: dict[str, Any],
               targets: Any) -> frozenset[str] | None:
    """The outputs of ``graph`` that ``loss_fn`` takes a gradient from, found by calling it
    on fake tensors of the outputs' shapes (no arithmetic); None where that cannot tell
    (the loss reads a value, or raises): then every output counts as read."""
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensorMode

    from orgel.guard import quiet

    names = graph.outputs
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with quiet("torch._subclasses.fake_tensor"), torch.enable_grad(), mode:
            outs: list[torch.Tensor] = []
            for name in names:
                node = graph.nodes.get(name)
                if node is None:  # a model input the forward returns as it is
                    outs.append(mode.from_tensor(inputs[name]))
                    continue
                if not node.is_tensor or node.dtype is None:
                    return None
                out = torch.empty(node.shape, dtype=getattr(torch, node.dtype))
                outs.append(out.requires_grad_(node.requires_grad))
            fake_targets = pytree.tree_map_only(torch.Tensor, mode.from_tensor, targets)
            loss = loss_fn(graph.unflatten(names)(outs), fake_targets)
            wanted = [(n, o) for n, o in zip(names, outs, strict=True) if o.requires_grad]
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not wanted:
                return None
            grads = torch.autograd.grad(loss, [o for _, o in wanted], allow_unused=True)
    except Exception:  # noqa: BLE001 - the loss needs values: every output counts
        return None
    return frozenset(n for (n, _), g in zip(wanted, grads, strict=True) if g is not None)


def resolve_plan(plan: Plan | str | Path | None, workload: Workload, graph: Any, ranks: int,
                  microbatches: int | str, memory: int | None, dp: int,
                  planner: str | None = None, source: Weights | None = None,
                  optimizer: Any = None, schedule: str | None = None,
                  stages_per_rank: int = 2, compiled: bool = False) -> Plan:
    """The given plan (object or file), checked against the options, or the planner's.

    ``optimizer`` (the ranks' factory; default AdamW) sets how much state the
    planner counts per parameter byte (:func:`orgel.profile.memory.optimizer_factor`).
    ``schedule``: no profiling and no planner; ``graph`` cut into stages of equal FLOPs,
    run by that schedule family (:func:`orgel.plan.balanced.balanced_plan`; ``orgel run``
    plans so), with ``stages_per_rank`` stages per rank where the family loops.
    ``compiled``: the stages run compiled; the planner's profile times them so.
    """
    if schedule is not None:
        from orgel.plan.balanced import balanced_plan

        given = balanced_plan(graph, ranks=ranks, microbatches=int(microbatches),
                              schedule=schedule, dp=dp, stages_per_rank=stages_per_rank)
    elif isinstance(plan, Plan):
        given = plan
    elif plan is not None:
        given = Plan.load(plan)
    else:
        from orgel.plan import auto_plan

        # auto_plan reads the micro-batch rows and plans one rank per stage by
        # default (max_replicas=1): captured stages have fixed shapes.
        from orgel.profile.memory import optimizer_factor

        given = auto_plan(workload, graph, ranks=ranks,
                          microbatches=None if microbatches == "auto" else int(microbatches),
                          memory=memory, dp=dp, planner=planner or "auto", source=source,
                          optimizer_factor=optimizer_factor(optimizer or default_optimizer),
                          compiled=compiled)
    if given.num_ranks != ranks:
        raise ValueError(f"the plan is for {given.num_ranks} ranks but ranks={ranks}; "
                         "pass ranks to match or plan=None to plan again")
    if microbatches != "auto" and given.microbatches != microbatches:
        raise ValueError(f"the plan uses {given.microbatches} micro-batches but "
                         f"microbatches={microbatches}; make them agree")
    return given


def replica_graph(workload: Workload, graph: Any, plan: Plan) -> Any:
    """The capture ``plan``'s stages are cut from: ``graph`` (a capture of one micro-batch)
    where it takes one replica's rows of it (:func:`takes_replica_rows`), else a capture of
    those rows (a forward of several graphs keeps its code for the controller, and
    ``graph``'s is dropped). Plan and stages then read one capture wherever the sizes are
    symbolic."""
    if takes_replica_rows(workload, graph, plan):
        return graph
    from orgel.graph.glue_capture import release

    release(graph.glue)
    dynamic = graph.glue is None or graph.glue.dynamic
    return capture_microbatch(workload, plan.microbatches * stage_replicas(plan), dynamic,
                              keep=True)


def replica_advice(workload: Workload, plan: Plan) -> str:
    """Why the planner's ``plan`` cannot be cut from a capture of a replica's rows: the
    model's code captured other operations at that size (it specialises on a size of 1)."""
    from orgel.workload import microbatch_rows

    rows = microbatch_rows(workload, plan.microbatches)  # None: only the targets are cut
    replicas = stage_replicas(plan)
    each = (rows or 0) // replicas
    sizes = (f"one micro-batch ({rows} rows), but {each} row{'' if each == 1 else 's'} of it"
             if each else "one micro-batch, but a part of it")
    return (f"the planner planned on {sizes}, a "
            f"replica's share with dp={replicas}, makes the model's code capture other "
            "operations (it specialises on that size): give micro-batches of at least 2 rows "
            "per replica (fewer micro-batches or a smaller dp), or a schedule (schedule="
            "'1f1b': a plan cut from the replica's own capture)")


def takes_replica_rows(workload: Workload, graph: Any, plan: Plan) -> bool:
    """Whether ``graph``, captured on one micro-batch, takes one replica's rows of it (every
    stage has one rank; or its sizes are symbolic, and a replica's rows pass their checks:
    a size of 1 too, since both captures mark sizes size-oblivious)."""
    from orgel.graph.sizes import ShapeError, batch_check
    from orgel.workload import named_inputs

    replicas = stage_replicas(plan)
    if replicas == 1:
        return True
    if not graph.shapes.dynamic:
        return False
    check = batch_check(graph.shapes, plan.microbatches, replicas, workload.batch_dim,
                        workload.replicated)
    try:
        check(named_inputs(workload.model, workload.inputs), workload.targets)
    except ShapeError:
        return False
    return True


def stage_replicas(plan: Plan) -> int:
    """How many ranks every stage of ``plan`` has (the captures are of one replica's rows)."""
    counts = {len(ranks) for ranks in plan.placement}
    if len(counts) != 1:
        raise ValueError(f"the plan gives stages different replica counts {sorted(counts)}; "
                         "orgel's captured stages have fixed shapes: give every stage the "
                         "same number of ranks")
    return counts.pop()


def eval_split_for(workload: Workload, plan: Plan, split: Any,
                   names: Collection[str] | None = None) -> Any:
    """The model captured in eval mode, cut into ``split``'s stages (:mod:`orgel.split.evaluation`).

    Or, where that fails, a sentence saying why: the pipeline still trains, and
    ``evaluate`` raises with it. The capture is ``capture_microbatch``'s, of one
    replica's rows as in :func:`replica_graph`; ``names``: of the example batch with
    those inputs only (a batch without ``labels``), by default all of them.
    """
    from orgel.plan.transforms import check_forward
    from orgel.split.evaluation import eval_only, split_like
    from orgel.workload import on_meta

    if names is not None:
        named = named_inputs(workload.model, workload.inputs)
        if set(names) != set(named):
            workload = dataclasses.replace(workload, inputs={k: v for k, v in named.items()
                                                             if k in names})
    try:
        with untouched(workload.model):
            workload.model.eval()
            graph = capture_microbatch(workload, plan.microbatches * stage_replicas(plan))
    except Exception as exc:  # noqa: BLE001 - the reason goes to evaluate's caller
        return f"capturing the model in eval mode failed ({type(exc).__name__}: {exc})"
    if graph.glue is not None:
        return "the model's eval-mode forward has graph breaks (Dynamo captures several graphs)"
    try:
        evaluation = split_like(graph, split)
        check_forward(plan, evaluation)
    except ValueError as exc:  # SplitError, PlanError
        return str(exc)
    unmade = eval_only(evaluation, split)
    if unmade and on_meta(workload.model):
        return (f"the eval-mode forward of this meta model reads {unmade[:3]}, which no "
                "training stage makes")
    return evaluation


def shape_check(workload: Workload, split: Any, plan: Plan) -> Any:
    """The check ``Pipeline.step`` runs on a batch before any rank starts: the sizes the
    split's stages take (:class:`orgel.graph.sizes.Shapes`) against its micro-batches."""
    from orgel.graph.sizes import batch_check

    return batch_check(split.shapes, plan.microbatches, len(plan.placement[0]),
                       workload.batch_dim, workload.replicated, plan.row_unit)


# -- the seams to capture, planning and split -------------------------------------------------

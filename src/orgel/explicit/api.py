"""The explicit API: ``orgel.pipeline(model, inputs, targets, loss_fn, ranks=N)``, ``orgel.load``.

Two launch modes, chosen from the environment, with the same object and methods:

* **local spawn** (no ``RANK``/``WORLD_SIZE`` in the environment, e.g. ``python
  train.py``): the calling process is a single controller (Piper). It captures,
  profiles, plans and splits once, then forks ``ranks`` worker processes on
  this machine that inherit the stage modules; ``step`` sends the batch to
  every worker and returns the loss. Only the calling process runs the script.
* **SPMD** (under ``torchrun``): every rank runs the script. Rank 0 plans and
  broadcasts the plan as JSON so all ranks agree; each rank splits the model
  and keeps only its own stages. ``step`` runs this rank's action list and
  returns the loss on every rank.

Methods that gather (``state_dict``, ``timeline``) or write (``save``) involve
every rank in both modes; under torchrun call them on every rank. So do ``step``
and ``evaluate``; evaluation runs a second capture of the model, made in eval
mode when the pipeline starts (:func:`eval_split_for`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from orgel.batching import BatchDim
from orgel.guard import cuda_unused, untouched
from orgel.launch.devices import (
    backend_for,
    check_fork,
    profiling_on,
    rank_device,
    resolve_device,
)
from orgel.launch.processes import init_from_env, under_torchrun
from orgel.lossweights import check_rule, rule_for
from orgel.plan.transforms import mark_sharded
from orgel.precision import scales_loss
from orgel.runtime import checkpoint as ckpt
from orgel.runtime.optimizer import LearningRate, SchedulerFactory, check_loop_options
from orgel.runtime.sharding import (
    check_shard_option,
    check_sharded,
    check_tied_sharding,
)
from orgel.schedule.ir import Plan
from orgel.split.materialize import (
    Init,
    Weights,
    WeightsArg,
    materialize_stages,
    process_memory,
)
from orgel.worker.engine import OptimizerFactory, RankEngine
from orgel.worker.pipe import OwnRank, Pipeline
from orgel.worker.state import model_aliases, own_stage_copies
from orgel.workload import Workload, model_loss, validate_workload, with_precision


def check_options(ranks: int, microbatches: int | str, optimizer: Any, memory: Any, dp: int,
                   plan: Any) -> None:
    """Raise ValueError for options ``orgel.pipeline`` and ``orgel.backend`` cannot take."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    if microbatches != "auto" and (not isinstance(microbatches, int)
                                   or isinstance(microbatches, bool) or microbatches < 1):
        raise ValueError(f"microbatches must be a positive int or 'auto', got {microbatches!r}")
    if optimizer is not None and not callable(optimizer):
        raise ValueError("optimizer must be a function params -> torch.optim.Optimizer, e.g. "
                         "lambda params: torch.optim.AdamW(params, lr=1e-3)")
    if memory is not None and (not isinstance(memory, int) or memory <= 0):
        raise ValueError(f"memory must be bytes per rank (a positive int) or None, got {memory!r}")
    if not isinstance(dp, int) or dp < 1 or ranks % dp:
        raise ValueError(f"dp must be a positive int that divides ranks={ranks}, got {dp!r}")
    if plan is not None and not isinstance(plan, (Plan, str, Path)):
        raise ValueError("plan must be a Plan, a path to a plan JSON file, or None to plan")


def pipeline(
    model: torch.nn.Module,
    inputs: Any,
    targets: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    ranks: int = 2,
    microbatches: int | str = 4,
    optimizer: OptimizerFactory | None = None,
    memory: int | None = None,
    dp: int = 1,
    plan: Plan | str | Path | None = None,
    timeout_s: float = 300.0,
    threads: int | None = None,
    replicated: Sequence[str] = (),
    precision: str = "32",
    loss_scale: dict[str, float] | None = None,
    check_finite: bool = False,
    init: Init | None = None,
    weights: WeightsArg | None = None,
    scheduler: SchedulerFactory | None = None,
    lr: LearningRate | None = None,
    max_grad_norm: float | None = None,
    accumulate: int = 1,
    batch_dim: BatchDim = 0,
    device: str | None = None,
    tp: int = 1,
    shard: str = "none",
    compile: bool = False,
    loss_rule: str = "auto",
) -> Pipeline:
    """Capture, profile, plan (or take ``plan``), split and start ``model`` on ``ranks`` ranks.

    ``inputs``/``targets`` are one example batch (``inputs`` a tuple of
    positional tensors or a dict of keyword tensors, such as a Hugging Face batch
    ``{input_ids, attention_mask, labels}`` as a ``DataLoader`` gives it); ``loss_fn(outputs,
    targets)`` returns the batch's loss (a mean over rows or over the labels that are not
    -100, or a sum: ``loss_rule``). ``targets`` may be None (the labels are in the batch)
    and ``loss_fn`` too: the model's own ``outputs.loss`` is the loss
    (:func:`orgel.workload.model_loss`), as ``model(**batch).loss`` in one process.
    ``optimizer(params)`` builds each rank's optimizer (default: AdamW, lr 1e-3).
    ``memory`` caps bytes per rank for the planner; ``dp`` asks for that many
    data-parallel replicas.
    ``shard``: how a stage's data-parallel replicas hold its state: ``"none"``
    (default: each replica a whole copy, gradients all-reduced) or ``"fsdp"``
    (torch FSDP2 over the stage's replicas: parameters, gradients and optimizer
    state sharded, the weights gathered once per step and the gradients
    reduce-scattered once per step; :mod:`orgel.runtime.sharding`). ``"fsdp"``
    marks every stage of two or more replicas in the plan the planner makes (it
    needs ``dp`` >= 2); a given ``plan`` keeps its own per-stage ``shard`` fields.
    ``microbatches="auto"`` lets the planner choose the count for the example
    batch (each size it tries is profiled; ``pipe.plan.meta["microbatch_search"]``
    lists them); with a given ``plan``, "auto" takes the plan's count.
    Every input tensor whose size along its batch dimension is the batch size is
    split into micro-batches; name the inputs that are not batched (a lookup table,
    a temperature) in ``replicated`` and every micro-batch gets them whole.
    ``batch_dim``: the batch dimension, one int for every input and the targets
    (``batch_dim=1`` for sequence-first ``[T, B]`` data), or a dict by input name
    with a ``"targets"`` entry for the targets (names left out: 0); see
    :func:`orgel.batching.dim_of`. A batch of other sizes than the example (another
    sequence length or batch size) trains without planning again where the capture
    left those sizes symbolic (:mod:`orgel.graph.sizes`); ``step`` raises
    :class:`~orgel.graph.sizes.ShapeError` before any rank starts for one it cannot take.
    ``precision``: ``"32"`` (default), ``"bf16-mixed"`` (the forward and
    ``loss_fn`` under ``torch.autocast`` with bfloat16, as one process would run
    them) or ``"16-mixed"`` (float16, with GradScaler's loss scaling for the whole
    pipeline; ``pipe.loss_scale`` reports it); see :mod:`orgel.precision`.
    ``loss_scale`` takes GradScaler's options for 16-mixed (``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``; its defaults otherwise).
    ``check_finite`` stops the step at the first micro-batch whose loss is NaN or
    infinite, naming it (one sync per micro-batch on the loss rank).
    Under torchrun ``ranks`` must equal WORLD_SIZE. Returns a :class:`Pipeline`.
    ``device``: where the ranks compute, ``"cpu"``, ``"cuda"`` (local rank r on GPU
    r mod the GPU count; ranks that outnumber the GPUs share them, their messages
    staged through host memory) or ``"auto"`` (CUDA when present); by default the
    model's device (:mod:`orgel.launch.devices`). Local ranks are forked, so for
    CUDA build the model on the CPU (or meta) and pass ``device="cuda"``: each rank
    moves its own stages to its GPU, and this process never uses CUDA (a forked
    process of its own profiles on the GPU and plans: :mod:`orgel.explicit.device_plan`).

    The training loop (:mod:`orgel.runtime.optimizer`): ``optimizer`` receives the
    rank's parameters as a list that also has ``.names`` and ``.named()`` (their
    names in ``model``), so groups by name (no weight decay on biases) come out
    alike on every rank. ``scheduler(opt)`` returns a
    ``torch.optim.lr_scheduler.LRScheduler`` built over every rank's optimizer and
    stepped after every optimizer step; or ``lr(step)`` returns the learning rate
    of every group for optimizer step ``step`` (not both). ``max_grad_norm`` clips
    the gradients by their global norm over all ranks, as
    ``torch.nn.utils.clip_grad_norm_`` does (``pipe.grad_norm`` reports the norm).
    ``accumulate=k``: each ``step`` runs forward and backward of its batch and the
    optimizer steps on every k-th call with the gradients of the k calls, each
    call's loss counting ``1/k``; ``pipe.steps`` counts optimizer steps and
    ``pipe.lr`` reports the rates in force.

    A model built on the meta device (``with torch.device("meta"): model = ...``)
    is captured, planned and split without memory; each rank then makes only its
    own stages' tensors (:mod:`orgel.split.materialize`), from ``init`` (applied
    to each module that holds them, after its ``reset_parameters()``, seeded per
    module name from ``torch.initial_seed()``, so the values do not depend on the
    plan) and/or ``weights`` (a state_dict, a ``torch.save`` file read with mmap,
    or safetensors files; each rank reads only its own names). Planning it
    profiles one block at a time, each made from ``init``/``weights`` and freed.
    A meta model records no values, so ``init`` (or ``weights``) must also give the
    buffers a constructor computes (a causal mask, position ids); a tensor left
    unset is reported by name (:class:`orgel.split.materialize.MaterializeError`).

    ``tp``: tensor parallelism, ``tp`` processes per pipeline rank (``ranks`` counts
    every process, so ``tp`` divides it: ``ranks=4, tp=2`` is a pipeline of 2 ranks of 2
    processes each). Each stage's attention and MLP regions (read off the graph,
    :func:`orgel.graph.tensor_parallel.tp_regions`) are split over its rank's ``tp``
    processes with DTensor (:mod:`orgel.runtime.tensor_parallel`); ``state_dict`` and
    ``copy_to`` give whole tensors, and checkpoints hold them (a pipeline of any ``tp``
    resumes one). With ``dp > 1`` each replica is a pipeline rank of ``tp`` processes (``dp``
    divides ``ranks // tp``), and ``shard="fsdp"`` shards over the replicas on a 2-D mesh;
    ``evaluate`` splits the eval-mode stages alike. Not yet: a forward with graph breaks.

    ``compile=True`` runs every stage through Inductor: its forward, its backward and,
    for the schedules that split the backward (ZB-H1, DualPipeV), the backward's
    input and weight halves as separate compiled graphs (:mod:`orgel.runtime.compiled`).
    Each rank compiles a stage at its first step (and once more for a new input shape);
    ``pipe.compile_s`` reports the seconds by rank. Not yet with ``tp > 1`` or
    ``shard="fsdp"``.

    ``loss_rule``: how the micro-batches' and replicas' losses weigh in the batch's
    (:mod:`orgel.lossweights`): ``"auto"`` (default) finds it on a trial forward of the
    example batch (a mean over rows, a token mean over labels that are not -100, a causal
    LM's own shifted token mean, or a sum) and raises
    :class:`~orgel.lossweights.LossRuleError` for a loss none of them reproduces; or one
    of ``"rows"``, ``"items"``, ``"shifted"``, ``"sum"`` (a ``loss_fn`` may carry it as
    its attribute ``loss_rule``). A loss that depends on how the batch is cut (in-batch
    negatives) takes ``"rows"``: each micro-batch's loss then counts equally.
    """
    check_options(ranks, microbatches, optimizer, memory, dp, plan)
    check_shard_option(shard, dp)
    planned_here = plan is None  # a given plan's own shard fields rule

    from orgel.plan.transforms import pipeline_ranks, with_tp

    world, ranks = ranks, pipeline_ranks(ranks, tp, dp)
    # a tie the model's structure shows is refused before any capture or profiling
    check_tied_sharding(model, None if plan is None else
                        plan if isinstance(plan, Plan) else Plan.load(plan), shard, ranks // dp,
                        tp)
    if optimizer is None:
        optimizer = default_optimizer
    check_loop_options(optimizer=optimizer, scheduler=scheduler, lr=lr,
                       max_grad_norm=max_grad_norm, accumulate=accumulate)
    loop = {"scheduler": scheduler, "lr": lr, "max_grad_norm": max_grad_norm,
            "accumulate": accumulate}
    if loss_fn is None:  # the model computes its own loss (labels in the batch)
        loss_fn = model_loss
    workload = with_precision(Workload(model, inputs, targets, loss_fn, batch_dim=batch_dim,
                                       replicated=tuple(replicated)), precision)
    if loss_scale is not None and not scales_loss(precision):
        raise ValueError("loss_scale is for precision='16-mixed' (float16 needs it); "
                         f"precision={precision!r} does not scale the loss")
    scaling: bool | dict[str, Any] = scales_loss(precision) and (dict(loss_scale or {}) or True)
    executor_options = {"replicated": workload.replicated, "loss_scaling": scaling,
                        "check_finite": check_finite, "batch_dim": batch_dim,
                        "compile": compile, **loop}
    validate_workload(workload, 1 if microbatches == "auto" else int(microbatches))
    check_rule(loss_rule)
    executor_options["loss_rule"] = (loss_rule if loss_rule != "auto"
                                     else getattr(loss_fn, "loss_rule", "auto"))
    keys, aliases = model_aliases(model)
    source = meta_weights(model, init, weights)
    kind = resolve_device(device, model=model)
    spmd = under_torchrun()
    if not spmd:
        check_fork(kind)
        # how the pieces' losses make the batch's (orgel.lossweights): a trial forward
        executor_options["loss_rule"] = rule_for(workload, executor_options["loss_rule"])
    if spmd:
        return _spmd_pipeline(workload, ranks=world, microbatches=microbatches,
                              executor_options=executor_options, optimizer=optimizer,
                              memory=memory, dp=dp, plan=plan, timeout_s=timeout_s, keys=keys,
                              aliases=aliases, source=source, kind=kind, shard=shard,
                              tp=tp)
    from orgel.launch.processes import LocalGroup

    if kind == "cuda" and plan is None:  # timed on the GPU, by a process of its own
        from orgel.explicit.device_plan import plan_in_child

        def planned() -> Plan:
            with untouched(model):
                return _prepare(workload, None, ranks, microbatches, memory, dp, source,
                                optimizer)[0]

        plan = plan_in_child(planned, device=kind, timeout_s=timeout_s)
    # the workers fork afterwards, from the caller's own state; this process never uses
    # CUDA (a forked rank could not), so it profiles on the CPU
    with untouched(model), profiling_on("cpu"), cuda_unused():
        the_plan, split, graph = _prepare(workload, plan, ranks, microbatches, memory, dp,
                                          source, optimizer)
        the_plan = with_tp(the_plan, tp, graph)
    if planned_here:
        the_plan = mark_sharded(the_plan, shard)
    check_sharded(the_plan, split, loss_scaling=bool(scaling))
    if graph.glue is not None:  # several graphs: the controller runs the Python between them
        from orgel.explicit import glued

        if compile:
            raise ValueError("compile=True is not available for a forward of several graphs "
                             "(graph breaks) yet: pass compile=False")
        if check_finite:
            raise ValueError("check_finite is not available for a forward of several graphs "
                             "(the loss runs in this process): check the loss pipe.step returns")
        if kind != "cpu":
            raise ValueError("a forward of several graphs (graph breaks) runs on CPU ranks "
                             "only: pass device='cpu', or remove the graph breaks")
        glued_pipe = glued.start(workload, the_plan, split, graph.glue, optimizer=optimizer,
                                 timeout_s=timeout_s, threads=threads, keys=keys,
                                 aliases=aliases, options=loop)
        glued_pipe.loss_rule = executor_options["loss_rule"]
        return glued_pipe
    with cuda_unused():  # before the fork: ranks inherit it
        evaluation = eval_split_for(workload, the_plan, split)

    def make_engine(process: int) -> RankEngine:
        here = rank_device(kind, process)  # in the worker, after the fork
        rank = the_plan.pipeline_rank_of(process)
        made = _make_own_stages(split, the_plan, rank, source, here)
        engine = RankEngine(rank, the_plan, split, optimizer=optimizer,
                            loss_fn=workload.loss_fn, timeout_s=timeout_s, evaluation=evaluation,
                            executor_options={**executor_options, "device": here})
        engine.made = made
        return engine

    group = LocalGroup(world, make_engine, timeout_s=timeout_s, threads=threads,
                       backend=backend_for(kind, world))
    pipe = Pipeline(the_plan, group, model=workload.model,
                    loss_ranks=loss_processes(the_plan, split.loss_stage), state_keys=keys,
                    aliases=aliases, spmd=False, source=source, accumulate=accumulate,
                    workload=workload, outputs=split.unflatten_outputs,
                    evaluation=_unflatten(evaluation))
    pipe.check_sizes = shape_check(workload, split, the_plan)
    pipe.loss_rule = executor_options["loss_rule"]
    check_param_groups(pipe)
    return pipe


def loss_processes(plan: Plan, loss_stage: int) -> list[int]:
    """The processes whose step answers carry the loss: member 0 of the loss stage's ranks."""
    return [plan.process_of(r, 0) for r in plan.placement[loss_stage]]


def check_param_groups(pipe: Pipeline) -> None:
    """Raise ValueError (and stop the ranks) unless every rank's optimizer has as many
    parameter groups: the schedule, the checkpoint and a re-shard match groups by index."""
    counts = {r: n for r, n in enumerate(pipe.call_ranks("param_groups")) if n is not None}
    if len(set(counts.values())) > 1:
        pipe.close()
        raise ValueError(f"the optimizer factory built a different number of parameter groups "
                         f"on different ranks ({counts}, by rank): build the same groups on "
                         "every rank, leaving a group's list empty where a rank holds none of "
                         "its parameters")


def eval_split_for(workload: Workload, plan: Plan, split: Any) -> Any:
    """The model captured in eval mode, cut into ``split``'s stages (:mod:`orgel.split.evaluation`).

    Or, where that fails, a sentence saying why: the pipeline still trains, and
    ``evaluate`` raises with it. The capture is ``capture_microbatch``'s, of one
    replica's rows as in :func:`split_for`.
    """
    from orgel.plan.transforms import check_forward
    from orgel.split.evaluation import eval_only, split_like
    from orgel.workload import on_meta

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


def _unflatten(evaluation: Any) -> Any:
    return evaluation if isinstance(evaluation, str) else evaluation.unflatten_outputs


def _make_own_stages(split: Any, plan: Plan, rank: int, source: Weights | None,
                     device: torch.device | str = "cpu") -> dict[str, int]:
    """Give this rank's stages of a meta model their tensors (nothing for a model with
    values); the resident bytes before, and the bytes made (``RankEngine.made``)."""
    if source is None:
        return {}
    start = process_memory(reset_peak=True)["rss"]
    return {"start": start,
            "made": materialize_stages(split, plan.stages_on(rank), source, device)}


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


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Each rank's optimizer when none is given: AdamW, learning rate 1e-3."""
    return torch.optim.AdamW(params, lr=1e-3)


def _spmd_pipeline(workload: Workload, *, ranks: int, microbatches: int | str,
                   optimizer: OptimizerFactory, memory: int | None, dp: int,
                   plan: Plan | str | Path | None, timeout_s: float, keys: list[str],
                   aliases: dict[str, str], executor_options: dict[str, Any],
                   source: Weights | None = None, kind: str = "cpu",
                   shard: str = "none", tp: int = 1) -> Pipeline:

    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != ranks:
        raise ValueError(f"ranks={ranks} but torchrun started WORLD_SIZE={world} processes; "
                         f"pass ranks={world} or run torchrun --nproc-per-node {ranks}")
    owns_group = not dist.is_initialized()
    if owns_group:  # the backend and this rank's GPU by the launchers' one rule
        init_from_env(timeout=timeout_s, device=kind)
    from orgel.plan.transforms import with_tp

    process = dist.get_rank()
    with untouched(workload.model):
        graph = None if microbatches == "auto" else capture_microbatch(workload, int(microbatches))
        if graph is not None:
            one_graph_only(graph)
        text: list[Any] = [None, None, None]
        if process == 0:  # and rank 0's seed: every rank initializes a tied tensor alike
            with profiling_on(kind):
                resolved = resolve_plan(plan, workload, graph, ranks // tp, microbatches,
                                        memory, dp, source=source, optimizer=optimizer)
                if plan is None:
                    resolved = mark_sharded(resolved, shard)
                text = [with_tp(resolved, tp, graph).to_json(), torch.initial_seed(),
                        rule_for(workload, executor_options["loss_rule"])]
        dist.broadcast_object_list(text, src=0)
        executor_options = {**executor_options, "loss_rule": str(text[2])}
        the_plan = Plan.from_json(str(text[0]))
        if graph is None:
            graph = capture_microbatch(workload, the_plan.microbatches)
        one_graph_only(graph)
        split = split_for(workload, graph, the_plan)
        check_sharded(the_plan, split,
                      loss_scaling=bool(executor_options.get("loss_scaling")))
        evaluation = eval_split_for(workload, the_plan, split)
    rank = the_plan.pipeline_rank_of(process)
    if source is not None:
        source.seed = int(text[1])
    else:  # the stages train copies: the caller's model changes only through pipe.copy_to
        own_stage_copies(split.stages[s].module for s in the_plan.stages_on(rank))
    here = rank_device(kind, process)
    made = _make_own_stages(split, the_plan, rank, source, here)
    engine = RankEngine(rank, the_plan, split, optimizer=optimizer, loss_fn=workload.loss_fn,
                        executor_options={**executor_options, "device": here},
                        timeout_s=timeout_s, evaluation=evaluation)
    engine.made = made
    pipe = Pipeline(the_plan, OwnRank(engine, world, owns_group=owns_group),
                    model=workload.model, loss_ranks=loss_processes(the_plan, split.loss_stage),
                    state_keys=keys, aliases=aliases, spmd=True, source=source,
                    accumulate=int(executor_options.get("accumulate", 1)), workload=workload,
                    outputs=split.unflatten_outputs, evaluation=_unflatten(evaluation))
    pipe.check_sizes = shape_check(workload, split, the_plan)
    pipe.loss_rule = executor_options["loss_rule"]
    check_param_groups(pipe)
    return pipe


def shape_check(workload: Workload, split: Any, plan: Plan) -> Any:
    """The check ``Pipeline.step`` runs on a batch before any rank starts: the sizes the
    split's stages take (:class:`orgel.graph.sizes.Shapes`) against its micro-batches."""
    from orgel.graph.sizes import batch_check

    return batch_check(split.shapes, plan.microbatches, len(plan.placement[0]),
                       workload.batch_dim, workload.replicated)


def one_graph_only(graph: Any) -> None:
    """Refuse a graph of several Dynamo graphs (torchrun runs one graph)."""
    if graph.glue is not None:
        from orgel.graph.opgraph import GraphBreakError

        raise GraphBreakError(f"{graph.glue.reason} Under torchrun orgel needs one graph; a "
                              "forward of several graphs trains in local-spawn mode (python "
                              "train.py, without torchrun)")


# -- the seams to capture, planning and split -------------------------------------------------


def _prepare(workload: Workload, plan: Plan | str | Path | None, ranks: int,
             microbatches: int | str, memory: int | None,
             dp: int, source: Weights | None = None,
             optimizer: OptimizerFactory | None = None) -> tuple[Plan, Any, Any]:
    """Capture, plan (or check ``plan``) and split: the plan, the SplitModel and the graph."""
    # "auto": the planner captures every micro-batch size it tries; capture the chosen one.
    graph = None if microbatches == "auto" else capture_microbatch(workload, int(microbatches))
    planned = workload
    if graph is not None and graph.glue is not None:
        # the graphs' outputs are not the model's output: profile the loss stage with a sum
        from orgel.worker.closure import profiling_loss

        planned = Workload(workload.model, workload.inputs, workload.targets, profiling_loss,
                           workload.batch_dim, workload.replicated, workload.precision)
    the_plan = resolve_plan(plan, planned, graph, ranks, microbatches, memory, dp,
                            source=source, optimizer=optimizer)
    if graph is None:
        graph = capture_microbatch(workload, the_plan.microbatches)
        if graph.glue is not None:
            raise ValueError("the forward has graph breaks (Dynamo captures it as several "
                             "graphs); give microbatches as an int, not 'auto'")
    return the_plan, split_for(workload, graph, the_plan), graph


def capture_microbatch(workload: Workload, microbatches: int, dynamic: bool = True) -> Any:
    """The op graph of ``workload``'s model, measured on one micro-batch.

    ``dynamic``: with symbolic sizes where the model allows (:mod:`orgel.graph.sizes`),
    so the stages split from it take batches of other sizes; ``graph.shapes`` says which.
    """
    from orgel.graph.capture import capture
    from orgel.workload import microbatches as slice_batches

    first_inputs, _ = slice_batches(workload, microbatches)[0]
    return capture(workload.model, first_inputs, precision=workload.precision,
                   dynamic=dynamic)


def resolve_plan(plan: Plan | str | Path | None, workload: Workload, graph: Any, ranks: int,
                  microbatches: int | str, memory: int | None, dp: int,
                  planner: str | None = None, source: Weights | None = None,
                  optimizer: OptimizerFactory | None = None) -> Plan:
    """The given plan (object or file), checked against the options, or the planner's.

    ``optimizer`` (the ranks' factory; default AdamW) sets how much state the
    planner counts per parameter byte (:func:`orgel.profile.memory.optimizer_factor`).
    """
    if isinstance(plan, Plan):
        given = plan
    elif plan is not None:
        given = Plan.load(plan)
    else:
        from orgel.plan import auto_plan

        # auto_plan reads the micro-batch rows and plans one rank per stage by
        # default (max_replicas=1): captured stages have fixed shapes.
        if source is not None and microbatches == "auto":
            raise ValueError("a model on the meta device is planned for one micro-batch "
                             "count: give microbatches as an int, not 'auto'")
        from orgel.profile.memory import optimizer_factor

        given = auto_plan(workload, graph, ranks=ranks,
                          microbatches=None if microbatches == "auto" else int(microbatches),
                          memory=memory, dp=dp, planner=planner or "auto", source=source,
                          optimizer_factor=optimizer_factor(optimizer or default_optimizer))
    if given.num_ranks != ranks:
        raise ValueError(f"the plan is for {given.num_ranks} ranks but ranks={ranks}; "
                         "pass ranks to match or plan=None to plan again")
    if microbatches != "auto" and given.microbatches != microbatches:
        raise ValueError(f"the plan uses {given.microbatches} micro-batches but "
                         f"microbatches={microbatches}; make them agree")
    return given


def split_for(workload: Workload, graph: Any, plan: Plan) -> Any:
    """Split ``graph`` by ``plan``; with replicated stages, from a capture of one replica's rows.

    Captured graphs have fixed shapes, so a stage on ``r`` ranks needs the graph
    of ``1/r`` of a micro-batch, and every stage must have the same ``r``.
    """
    from orgel.split import split_plan

    replicas = stage_replicas(plan)
    if replicas > 1:
        graph = capture_microbatch(workload, plan.microbatches * replicas)
    return split_plan(graph, plan)


def stage_replicas(plan: Plan) -> int:
    """How many ranks every stage of ``plan`` has (the captures are of one replica's rows)."""
    counts = {len(ranks) for ranks in plan.placement}
    if len(counts) != 1:
        raise ValueError(f"the plan gives stages different replica counts {sorted(counts)}; "
                         "orgel's captured stages have fixed shapes: give every stage the "
                         "same number of ranks")
    return counts.pop()


def load(directory: str | Path, model: torch.nn.Module, inputs: Any, targets: Any = None,
         loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, *,
         ranks: int | None = None,
         plan: Plan | str | Path | None = None, **options: Any) -> Pipeline:
    """Start a pipeline and resume it from the checkpoint in ``directory``.

    With ``ranks`` left out, the checkpoint's rank count and plan are reused;
    with a different ``ranks`` (or ``plan``) the checkpoint is re-sharded by
    original parameter names, optimizer state included.
    """
    meta = ckpt.read_meta(directory)
    saved_plan = Plan.from_json(ckpt.read_plan_json(directory))
    if ranks is None:  # every process: the saved pipeline ranks of tp processes each
        ranks = int(meta["num_ranks"]) * saved_plan.tp
        if plan is None:
            plan = saved_plan
            options.setdefault("tp", saved_plan.tp)
    options.setdefault("microbatches", saved_plan.microbatches)
    pipe = pipeline(model, inputs, targets, loss_fn, ranks=ranks, plan=plan, **options)
    pipe.load(directory)
    return pipe

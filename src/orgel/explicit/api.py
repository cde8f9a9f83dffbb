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
  returns the loss on every rank. A forward of several graphs (graph breaks) has
  its controller on rank 0, beside rank 0's stages (:mod:`orgel.explicit.glued_job`).

Methods that gather (``state_dict``, ``timeline``) or write (``save``) involve
every rank in both modes; under torchrun call them on every rank. So do ``step``
and ``evaluate``; evaluation runs a second capture of the model, made in eval
mode by the first ``evaluate`` (:func:`orgel.flow.capture.eval_split_for`).

Both modes run the one flow of :mod:`orgel.flow`: :func:`orgel.flow.prepare.prepare`
(capture, plan, split) and :mod:`orgel.flow.start` (the ranks); this module only reads
the options.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from orgel.batching import BatchDim
from orgel.flow.capture import default_optimizer
from orgel.flow.prepare import meta_weights, on_process_zero, plan_only, prepare
from orgel.flow.start import executor_options as ranks_options
from orgel.flow.start import start_local, start_torchrun
from orgel.guard import cuda_unused
from orgel.launch.devices import check_fork, profiling_on, resolve_device
from orgel.launch.processes import init_from_env, under_torchrun
from orgel.lossweights import Rule, check_rule
from orgel.precision import check_around, loss_scaling
from orgel.runtime import checkpoint as ckpt
from orgel.runtime.checkpointing import check_policy
from orgel.runtime.optimizer import LearningRate, SchedulerFactory, check_loop_options
from orgel.runtime.sharding import check_shard_option, check_tied_sharding
from orgel.schedule.ir import Plan
from orgel.split.materialize import Init, WeightsArg
from orgel.worker.engine import OptimizerFactory
from orgel.worker.pipe import Pipeline
from orgel.worker.state import model_aliases
from orgel.workload import (
    Workload,
    plain_module,
    validate_workload,
    with_precision,
)

__all__ = ["Pipeline", "load", "pipeline"]


#: the device kinds whose local ranks fork before the caller captures, each preparing by
#: one plan (made by a forked process of its own): CUDA, for which a capture in the caller
#: can leave what forked processes inherit unusable (:func:`orgel.flow.start.fork_ranks`)
FORK_FIRST = frozenset({"cuda"})


@torch.enable_grad()  # built under the caller's no_grad too: the capture records gradients
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
    schedule: str | None = None,
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
    sequence_parallel: bool = False,
    shard: str = "none",
    compile: bool = False,
    loss_rule: Rule = "auto",
    recompute: bool | str = False,
) -> Pipeline:
    """Capture, profile, plan (or take ``plan``), split and start ``model`` on ``ranks`` ranks.

    ``model`` may be a ``torch.compile``'d module: orgel takes the module it wraps (it
    captures the model itself; ``compile=True`` compiles each stage), and names the state
    as that module does. ``inputs``/``targets`` are one example batch (``inputs`` a tuple of
    positional tensors or a dict of keyword tensors, such as a Hugging Face batch
    ``{input_ids, attention_mask, labels}`` as a ``DataLoader`` gives it; an input may be a
    dict or list of tensors, each named by its path, ``batch.pixels``:
    :mod:`orgel.nesting`); ``loss_fn(outputs, targets)`` returns the batch's loss (a mean
    over rows or over the labels that are not -100, or a sum: ``loss_rule``). ``targets``
    may be None (the labels are in the batch) and ``loss_fn`` too: the model's own
    ``outputs.loss`` is the loss (:func:`orgel.workload.model_loss`), as
    ``model(**batch).loss`` in one process.
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
    ``schedule``: skip profiling and the planner; cut the graph into stages of equal
    FLOPs, one per rank (two for ``"dualpipev"`` and the looped families), run by that
    schedule family (``"1f1b"``, ``"gpipe"``, ``"zb-h1"``, ...; as ``orgel run
    --schedule``): a quick start where the layers are alike.
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
    infinite, naming it (one sync per micro-batch on the loss rank; with graph breaks, in
    this process, which computes the loss).
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
    ``evaluate`` splits the eval-mode stages alike. A forward with graph breaks takes
    ``tp`` too (every process of a rank gets the controller's messages, member 0 answers).
    ``sequence_parallel=True`` (with ``tp > 1``) cuts what the regions leave whole (the
    residual stream, the norms) along the sequence over the members, as Megatron and
    torchtitan do: a reduce-scatter and an all-gather where each region all-reduced, and
    ``1/tp`` of those values per process (:mod:`orgel.runtime.sequence_parallel`).

    ``compile=True`` runs every stage through Inductor: its forward, its backward and,
    for the schedules that split the backward (ZB-H1, DualPipeV), the backward's
    input and weight halves as separate compiled graphs (:mod:`orgel.runtime.compiled`).
    Each rank compiles a stage at its first step, static graphs for its sizes, and once
    more at the first step of other sizes, graphs symbolic in the sizes that changed
    (a sequence length), which serve every later length
    (:mod:`orgel.runtime.compiled_shapes`); ``pipe.compile_s`` reports the seconds by
    rank. With ``tp > 1`` a DTensor weight enters the graphs as its local part, an
    FSDP-sharded stage is gathered before its compiled forward, and
    ``recompute="layer"``/``"selective"`` tag the graph's nodes for the partitioner. With
    graph breaks a stage is cut at its exchanges with the calling
    process, and the pieces between them are compiled
    (:class:`~orgel.runtime.compiled.SegmentedStage`).

    ``recompute``: how each stage's backward gets its activations (default False: the
    forward keeps them, or a given plan's own choice): ``"stage"`` (or True) runs the
    stage's forward again before its backward; ``"layer"`` checkpoints each layer (each
    element of a module list, such as one transformer block), so the forward keeps only
    the layers' inputs and the backward recomputes one layer at a time; ``"selective"``
    keeps the outputs of matrix products and attention and recomputes the rest
    (:mod:`orgel.runtime.checkpointing`). The results are the same as without it.

    ``loss_rule``: how the micro-batches' and replicas' losses weigh in the batch's
    (:mod:`orgel.lossweights`): ``"auto"`` (default) finds it on a trial forward of the
    example batch (a mean over rows, a token mean over labels that are not -100, a causal
    LM's own shifted token mean, or a sum) and raises
    :class:`~orgel.lossweights.LossRuleError` for a loss none of them reproduces; or one
    of ``"rows"``, ``"items"``, ``"shifted"``, ``"sum"`` (a ``loss_fn`` may carry it as
    its attribute ``loss_rule``). A class-weighted ``nn.CrossEntropyLoss(weight=w)`` or
    ``nn.NLLLoss`` is found as such (:class:`~orgel.lossweights.ClassWeights`); any other
    weighted mean takes a function of a part's ``(inputs, targets)`` that returns what
    that part's mean divides by (``lambda inputs, y: w[y].sum()``), checked on the
    trial. A loss that depends on how the batch is cut (in-batch negatives) takes
    ``"rows"``: each micro-batch's loss then counts equally.
    """
    from orgel.flow.options import check_options, refuse

    model = plain_module(model)  # a torch.compile'd model: the module it wraps
    check_options(ranks, microbatches, optimizer, memory, dp, plan, schedule)
    check_shard_option(shard, dp)
    recompute = check_policy(recompute)
    from orgel.plan.transforms import pipeline_ranks

    world, ranks = ranks, pipeline_ranks(ranks, tp, dp)
    # a tie the model's structure shows is refused before any capture or profiling
    if plan is not None:
        check_tied_sharding(model, plan if isinstance(plan, Plan) else Plan.load(plan))
    if optimizer is None:
        optimizer = default_optimizer
    check_loop_options(optimizer=optimizer, scheduler=scheduler, lr=lr,
                       max_grad_norm=max_grad_norm, accumulate=accumulate)
    loop = {"scheduler": scheduler, "lr": lr, "max_grad_norm": max_grad_norm,
            "accumulate": accumulate}
    # (loss_fn None: the model's own loss, by Workload's one rule)
    workload = with_precision(Workload(model, inputs, targets, cast(Any, loss_fn),
                                       batch_dim=batch_dim, replicated=tuple(replicated)),
                              precision)
    scaling = loss_scaling(precision, loss_scale)
    executor_options = ranks_options(workload, loss_scaling=scaling, check_finite=check_finite,
                                     compile=compile, scheduler=scheduler, lr=lr,
                                     max_grad_norm=max_grad_norm, accumulate=accumulate)
    check_around("orgel.pipeline", precision, trains=False)  # an autocast around the call
    validate_workload(workload, 1 if microbatches == "auto" else int(microbatches))
    check_rule(loss_rule)
    keys, aliases = model_aliases(model)
    source = meta_weights(model, init, weights)
    kind = resolve_device(device, model=model)
    spmd = under_torchrun()
    owns_group = False
    if spmd:
        import torch.distributed as dist

        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"ranks={world} but torchrun started WORLD_SIZE="
                             f"{os.environ['WORLD_SIZE']} processes; pass ranks="
                             f"{os.environ['WORLD_SIZE']} or run torchrun --nproc-per-node "
                             f"{world}")
        owns_group = not dist.is_initialized()
        if owns_group:  # the backend and this rank's GPU by the launchers' one rule
            init_from_env(timeout=timeout_s, device=kind)
    else:
        check_fork(kind)
    common: dict[str, Any] = dict(ranks=ranks, tp=tp, sequence_parallel=sequence_parallel,
                                  microbatches=microbatches,
                                  memory=memory, dp=dp, shard=shard, loss_rule=loss_rule,
                                  optimizer=optimizer, source=source,
                                  recompute=recompute,
                                  schedule=schedule, compiled=compile)
    def breaks_allowed(graph: Any) -> None:  # before anything is planned for them
        if graph.glue is not None:
            refuse("graph breaks", {"compile": compile, "device": kind})

    if spmd:
        prepared = prepare(workload, plan=plan, agree=on_process_zero(kind),
                           check_graph=breaks_allowed, **common)
    else:
        group = None
        if kind in FORK_FIRST:
            # a plan to make is timed on the GPU, by a process of its own; then the ranks
            # fork, each preparing by that plan, before this process captures anything
            # (flow.start.fork_ranks says why)
            from orgel.explicit.device_plan import plan_in_child
            from orgel.flow.start import fork_ranks

            if plan is None and schedule is None:  # a schedule's plan is FLOP-balanced:
                # every process makes the same, with no profiling
                plan = plan_in_child(lambda: plan_only(workload, **common), device=kind,
                                     timeout_s=timeout_s)
                common["mark"] = True  # as planned here: its stages get the shard option
            group = fork_ranks(
                lambda: prepare(workload, plan=plan, check_graph=breaks_allowed,
                                **common),
                kind, world, optimizer=optimizer, timeout_s=timeout_s, threads=threads,
                executor_options=executor_options)
        # this process profiles on the CPU. Where the ranks forked already it captures with
        # the GPUs in sight: hidden, PyTorch may count them then (0) and keep that count,
        # and this process could not use CUDA after (on an H200, the test's reference on
        # the GPU after the pipeline found none). Else it leaves CUDA alone, so that ranks
        # forked from it later can use it
        hide = cuda_unused() if group is None else contextlib.nullcontext()
        try:
            with profiling_on("cpu"), hide:
                prepared = prepare(workload, plan=plan, check_graph=breaks_allowed,
                                   **common)
        except BaseException:
            if group is not None:
                group.close()
            raise
    prepared.keys, prepared.aliases = keys, aliases
    glue = prepared.graph.glue
    if glue is not None:  # several graphs: the controller runs the Python between them
        # the ranks unscale what it scaled; their stages compile cut at the exchanges
        glued_loop = {**loop, "loss_scaling": scaling, "compile": compile}
        glued_pipe: Pipeline
        from orgel.graph.glue_capture import release

        try:
            if spmd:  # process 0 is the controller
                from orgel.explicit.glued_job import start_job

                glued_pipe = start_job(workload, prepared.plan, prepared.split, glue,
                                       optimizer=optimizer, timeout_s=timeout_s, keys=keys,
                                       aliases=aliases, options=glued_loop)
            else:
                from orgel.explicit import glued_start

                glued_pipe = glued_start.start(workload, prepared.plan, prepared.split, glue,
                                               optimizer=optimizer, timeout_s=timeout_s,
                                               threads=threads, keys=keys, aliases=aliases,
                                               options=glued_loop)
        finally:
            release(glue)  # the capture's code, where no controller of this process took it
        glued_pipe.loss_rule = prepared.loss_rule
        from orgel.explicit.glued import GluedPipeline

        if isinstance(glued_pipe, GluedPipeline):  # the controller computes the loss
            glued_pipe.check_finite = check_finite
        return glued_pipe
    if spmd:
        return start_torchrun(prepared, kind, optimizer=optimizer, timeout_s=timeout_s,
                              executor_options=executor_options, owns_group=owns_group)
    return start_local(prepared, kind, optimizer=optimizer, timeout_s=timeout_s,
                       threads=threads, executor_options=executor_options, group=group)


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
        if plan is None and options.get("schedule") is None:
            plan = saved_plan
            options.setdefault("tp", saved_plan.tp)
            options.setdefault("sequence_parallel", saved_plan.sequence_parallel)
    options.setdefault("microbatches", saved_plan.microbatches)
    pipe = pipeline(model, inputs, targets, loss_fn, ranks=ranks, plan=plan, **options)
    pipe.load(directory)
    return pipe

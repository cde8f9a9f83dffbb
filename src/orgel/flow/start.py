"""The flow's second half, written once: start the ranks of a prepared workload.

:func:`start_local` forks the ranks from this process (the caller drives them);
:func:`start_torchrun` makes this process one rank of a torchrun job. Both build each
rank's :class:`~orgel.worker.engine.RankEngine` with :func:`engine_for` and return the
same :class:`~orgel.worker.pipe.Pipeline`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from orgel.flow.prepare import Prepared
from orgel.launch.devices import backend_for, rank_device
from orgel.schedule.ir import Plan
from orgel.split.materialize import Weights, materialize_stages, process_memory
from orgel.worker.engine import RankEngine
from orgel.worker.own_rank import OwnRank
from orgel.worker.pipe import Pipeline
from orgel.workload import named_inputs

if TYPE_CHECKING:
    from orgel.launch.processes import LocalGroup


def executor_options(workload: Any, *, loss_scaling: bool | dict[str, Any], check_finite: bool,
                     compile: bool, scheduler: Any = None, lr: Any = None,
                     max_grad_norm: float | None = None, accumulate: int = 1) -> dict[str, Any]:
    """What every rank's executor is built with besides its plan, stages and optimizer
    (:class:`~orgel.runtime.executor.Executor`'s keywords, and the training loop's)."""
    return {"replicated": workload.replicated, "loss_scaling": loss_scaling,
            "check_finite": check_finite, "batch_dim": workload.batch_dim, "compile": compile,
            "scheduler": scheduler, "lr": lr, "max_grad_norm": max_grad_norm,
            "accumulate": accumulate}


def loss_processes(plan: Plan, loss_stage: int) -> list[int]:
    """The processes whose step answers carry the loss: member 0 of the loss stage's ranks."""
    return [plan.process_of(r, 0) for r in plan.placement[loss_stage]]


def check_param_groups(pipe: Any) -> None:
    """Raise ValueError (and stop the ranks) unless every rank's optimizer has as many
    parameter groups: the schedule, the checkpoint and a re-shard match groups by index."""
    counts = {r: n for r, n in enumerate(pipe.call_ranks("param_groups")) if n is not None}
    if len(set(counts.values())) > 1:
        pipe.close()
        raise ValueError(f"the optimizer factory built a different number of parameter groups "
                         f"on different ranks ({counts}, by rank): build the same groups on "
                         "every rank, leaving a group's list empty where a rank holds none of "
                         "its parameters")


def make_own_stages(split: Any, plan: Plan, rank: int, source: Weights | None,
                    device: torch.device | str = "cpu") -> dict[str, int]:
    """Give this rank's stages of a meta model their tensors (nothing for a model with
    values); the resident bytes before, and the bytes made (``RankEngine.made``)."""
    if source is None:
        return {}
    start = process_memory(reset_peak=True)["rss"]
    return {"start": start,
            "made": materialize_stages(split, plan.stages_on(rank), source, device)}


def engine_for(prepared: Prepared, process: int, kind: str, *, optimizer: Any,
               timeout_s: float, executor_options: dict[str, Any],
               evaluation: Any) -> RankEngine:
    """Process ``process``'s engine: its pipeline rank's stages, made on its device;
    ``evaluation``: its eval-mode split, or the :class:`LazyEvaluation` that makes it."""
    plan, split = prepared.plan, prepared.split
    here = rank_device(kind, process)
    rank = plan.pipeline_rank_of(process)
    made = make_own_stages(split, plan, rank, prepared.source, here)
    engine = RankEngine(rank, plan, split, optimizer=optimizer,
                        loss_fn=prepared.workload.loss_fn, timeout_s=timeout_s,
                        evaluation=evaluation,
                        executor_options={**executor_options, "loss_rule": prepared.loss_rule,
                                          "device": here})
    engine.made = made
    return engine


def _pipeline(prepared: Prepared, ranks: Any, *, spmd: bool, accumulate: int,
              evaluation: Any) -> Pipeline:
    from orgel.flow.capture import shape_check

    split, plan = prepared.split, prepared.plan
    pipe = Pipeline(plan, ranks, model=prepared.workload.model,
                    loss_ranks=loss_processes(plan, split.loss_stage),
                    state_keys=prepared.keys, aliases=prepared.aliases, spmd=spmd,
                    source=prepared.source, accumulate=accumulate,
                    workload=prepared.workload, outputs=split.unflatten_outputs,
                    evaluation=evaluation)
    pipe.check_sizes = shape_check(prepared.workload, split, plan)
    pipe.loss_rule = prepared.loss_rule
    check_param_groups(pipe)
    return pipe


def fork_ranks(prepare_here: Callable[[], Prepared], kind: str, world: int, *,
               optimizer: Any, timeout_s: float, threads: int | None,
               executor_options: dict[str, Any]) -> LocalGroup:
    """Fork ``world`` ranks before this process captures anything; each prepares the
    workload itself by the one plan ``prepare_here`` holds, as every process of a torchrun
    job does, then makes its engine.

    For CUDA ranks. The caller captures with the GPUs hidden (:func:`orgel.guard.cuda_unused`),
    and PyTorch's C++ side may read the GPU count then (0) and keep it: ranks forked after
    that found no GPU (an H200 with torch 2.11). Had the GPUs not been hidden, the capture
    would have initialized CUDA, which a forked child cannot use either. Forked first, the
    ranks do not depend on what this process does after.
    """
    from orgel.launch.devices import profiling_on
    from orgel.launch.processes import LocalGroup

    def make_engine(process: int) -> RankEngine:  # in the worker, after the fork
        rank_device(kind, process)  # this rank's GPU, before its capture asks CUDA
        with profiling_on("cpu"):  # as the caller prepares: the same graph and split
            prepared = prepare_here()
            evaluation = prepared.lazy_evaluation()
            if kind != "cpu":  # now, while the model is on the CPU: engine_for moves this
                # rank's stages (the model's own tensors) to its device, and a capture
                # after that sees two devices (seen on an H200)
                evaluation.get(named_inputs(prepared.workload.model, prepared.workload.inputs))
        return engine_for(prepared, process, kind, optimizer=optimizer, timeout_s=timeout_s,
                          executor_options=executor_options, evaluation=evaluation)

    return LocalGroup(world, make_engine, timeout_s=timeout_s, threads=threads,
                      backend=backend_for(kind, world))


def start_local(prepared: Prepared, kind: str, *, optimizer: Any, timeout_s: float,
                threads: int | None, executor_options: dict[str, Any],
                group: LocalGroup | None = None) -> Pipeline:
    """Fork the plan's processes from this one (or take those :func:`fork_ranks` forked);
    the caller drives them."""
    from orgel.guard import cuda_unused
    from orgel.launch.processes import LocalGroup

    ranks_evaluation = prepared.lazy_evaluation()  # each rank makes its own, if asked

    def make_engine(process: int) -> RankEngine:  # in the worker, after the fork
        return engine_for(prepared, process, kind, optimizer=optimizer, timeout_s=timeout_s,
                          executor_options=executor_options, evaluation=ranks_evaluation)

    world = prepared.plan.world_size
    if group is None:
        group = LocalGroup(world, make_engine, timeout_s=timeout_s, threads=threads,
                           backend=backend_for(kind, world))
    elif group.num_ranks != world:
        group.close()
        raise AssertionError(f"{group.num_ranks} ranks forked for a plan of {world}")
    # this process makes it for the outputs' structure, never touching CUDA (later forks)
    return _pipeline(prepared, group, spmd=False,
                     accumulate=int(executor_options.get("accumulate", 1)),
                     evaluation=prepared.lazy_evaluation(cuda_unused))


def start_torchrun(prepared: Prepared, kind: str, *, optimizer: Any, timeout_s: float,
                   executor_options: dict[str, Any], owns_group: bool) -> Pipeline:
    """This process as its rank of a torchrun job (every rank runs the script)."""
    import torch.distributed as dist

    from orgel.worker.state import own_stage_copies

    process = dist.get_rank()
    plan, split = prepared.plan, prepared.split
    if prepared.source is not None:  # every rank initializes a tied tensor alike
        prepared.source.seed = prepared.seed
    else:  # the stages train copies: the caller's model changes only through pipe.copy_to
        rank = plan.pipeline_rank_of(process)
        own_stage_copies(split.stages[s].module for s in plan.stages_on(rank))
    evaluation = prepared.lazy_evaluation()  # one capture serves the rank and the pipeline
    engine = engine_for(prepared, process, kind, optimizer=optimizer, timeout_s=timeout_s,
                        executor_options=executor_options, evaluation=evaluation)
    return _pipeline(prepared, OwnRank(engine, dist.get_world_size(), owns_group=owns_group),
                     spmd=True, accumulate=int(executor_options.get("accumulate", 1)),
                     evaluation=evaluation)

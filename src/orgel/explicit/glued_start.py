"""Starting the ranks of a forward of several graphs (graph breaks), and its controller.

:func:`start` forks one closure engine per rank (each with the exchanges of its
stages) and returns the controller's pipeline: a :class:`~orgel.explicit.glued.GluedPipeline`
for ``orgel.pipeline``, a :class:`~orgel.explicit.closures.ClosurePipeline` for
``orgel.backend``'s closures.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from orgel.batching import single_dim, split_microbatches
from orgel.explicit.closures import ClosurePipeline
from orgel.explicit.glued import GluedPipeline
from orgel.workload import named_inputs


def start(workload: Any, plan: Any, split: Any, glue: Any, *, optimizer: Any, timeout_s: float,
          threads: int | None, keys: list[str], aliases: dict[str, str],
          closures: bool = False, options: dict[str, Any] | None = None) -> GluedPipeline:
    """Fork the ranks for ``split`` (closure engines with exchanges); the pipeline object.

    ``closures``: a :class:`ClosurePipeline`, for ``orgel.backend``. ``options``: the
    training loop's executor options (``scheduler``, ``lr``, ``max_grad_norm``,
    ``accumulate``: the controller counts each call ``1/accumulate``, in its backward or,
    with ``closures``, in the gradients it sends the ranks, so the ranks' loss stages take
    its gradients as they are).
    """
    import multiprocessing as mp

    from orgel.launch.processes import LocalGroup

    make = engine_maker(workload, plan, split, glue, optimizer=optimizer, timeout_s=timeout_s,
                        options=options, closures=closures)
    pipes = [mp.get_context("fork").Pipe() for _ in range(plan.world_size)]  # by process
    group = LocalGroup(plan.world_size, lambda process: make(process, pipes[process][1]),
                       timeout_s=timeout_s, threads=threads)
    return controller(ClosurePipeline if closures else GluedPipeline, workload, plan, split,
                      glue, group, [here for here, _ in pipes], timeout_s=timeout_s, keys=keys,
                      aliases=aliases, options=options)


def engine_maker(workload: Any, plan: Any, split: Any, glue: Any, *, optimizer: Any,
                 timeout_s: float, options: dict[str, Any] | None,
                 closures: bool = False) -> Callable[[int, Any], Any]:
    """``make(process, conn)``: process ``process``'s closure engine (a tensor-parallel
    member of its pipeline rank where ``plan.tp`` > 1), talking to the controller over
    ``conn``; raises first for what the controller's runtime refuses."""
    from orgel.worker.closure import ClosureEngine

    accumulate = int((options or {}).get("accumulate", 1))
    dim = batch_dim_of(workload)
    # the ranks cut the batch by the workload's rule too: what it names replicated goes whole
    engine_options = {**(options or {}), "replicated": tuple(workload.replicated)}

    def make(process: int, conn: Any) -> Any:
        engine = ClosureEngine(plan.pipeline_rank_of(process), plan, split, optimizer=optimizer,
                               conn=conn, timeout_s=timeout_s, glue_info=glue,
                               model=workload.model, options=engine_options, batch_dim=dim,
                               closures=closures)
        # the controller scaled the gradients by 1/accumulate: undo the loss stage's own
        engine.surrogate.divisor *= accumulate
        return engine

    return make


def batch_dim_of(workload: Any) -> int:
    """The one batch dimension a forward of several graphs is cut along (else ValueError)."""
    dim = single_dim(workload.batch_dim)
    if dim is None:  # the graphs' arguments are not the model's inputs: one dimension
        raise ValueError(f"batch_dim={workload.batch_dim!r} gives inputs different batch "
                         "dimensions; a forward of several graphs (graph breaks) is cut along "
                         "one: give one int batch_dim")
    return dim


def controller(cls: type[GluedPipeline], workload: Any, plan: Any, split: Any, glue: Any,
               group: Any, conns: list[Connection], *, timeout_s: float, keys: list[str],
               aliases: dict[str, str], options: dict[str, Any] | None) -> GluedPipeline:
    """The controller's pipeline of class ``cls`` over ``group`` (the ranks' commands) and
    ``conns`` (the controller's ends of their exchange pipes, by rank)."""
    dim = batch_dim_of(workload)
    pipe = cls(plan, group, conns, glue=glue, split=split, model=workload.model,
               loss_fn=workload.loss_fn, replicated=workload.replicated, timeout_s=timeout_s,
               state_keys=keys, aliases=aliases, batch_dim=dim,
               accumulate=int((options or {}).get("accumulate", 1)),
               loss_scaling=(options or {}).get("loss_scaling", False))
    if not issubclass(cls, ClosurePipeline):  # refuse first a batch the static graphs cannot take
        from orgel.graph.sizes import batch_check, static_shapes

        first = split_microbatches(named_inputs(workload.model, workload.inputs),
                                   workload.targets, pipe.pieces, dim,
                                   workload.replicated)[0][0]
        pipe._workload = workload
        shapes = split.shapes if glue.dynamic else static_shapes(first)
        pipe.check_sizes = batch_check(shapes, pipe.pieces, 1, dim,
                                       workload.replicated)
    return pipe

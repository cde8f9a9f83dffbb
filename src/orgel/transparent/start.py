"""Starting ``orgel.backend``'s ranks on its first step, from the graphs Dynamo handed it.

:func:`start_glued` joins the graphs of micro-batch 0's closure (one, or several where
the compiled model has graph breaks) and starts them as :mod:`orgel.explicit.glued_start`
does for ``orgel.pipeline``'s forward of several graphs: one runtime for both, the closures
running the Python around and between the graphs. Under torchrun it makes this process its
rank of the job, process 0 running the closures (:mod:`orgel.transparent.job`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from orgel.batching import batch_rows, side_by_side
from orgel.explicit.closures import closure_tensors
from orgel.explicit.glued_start import start
from orgel.flow.prepare import here, on_process_zero, prepare
from orgel.graph.capture import with_glue
from orgel.graph.glue import join_calls
from orgel.graph.glue_sizes import glue_shapes, size_roles
from orgel.graph.measure import measure
from orgel.guard import untouched
from orgel.launch.processes import under_torchrun
from orgel.transparent.graph_model import register_state
from orgel.transparent.job import join
from orgel.transparent.slicing import rows_at, whole_inputs
from orgel.worker.closure import profiling_loss
from orgel.worker.state import model_aliases
from orgel.workload import Workload

if TYPE_CHECKING:
    from orgel.transparent.backend import Backend


def flow_options(backend: Backend, torchrun: bool) -> dict[str, Any]:
    """What :func:`orgel.flow.prepare.prepare` takes from ``backend``'s options: pipeline
    ranks (``ranks`` counts processes), the ranks' micro-batches (the closures' over ``dp``;
    replica ``r`` of the ranks' micro-batch ``j`` is closure ``j * dp + r``'s); the closures
    weigh their own loss (``"rows"`` is never applied)."""
    return dict(plan=backend.given_plan, ranks=backend.ranks // backend.tp, tp=backend.tp,
                sequence_parallel=backend.sequence_parallel,
                microbatches=backend.microbatches // backend.dp, memory=backend.memory,
                dp=backend.dp, shard=backend.shard, loss_rule="rows",
                optimizer=backend.optimizer, recompute=backend.recompute,
                schedule=backend.schedule, compiled=bool(backend.loop["compile"]),
                agree=on_process_zero("cpu") if torchrun else here)


def start_glued(backend: Backend) -> Any:
    """Join, plan and split the graphs of ``backend``'s first step (one or several); fork
    its ranks.

    Parameters of the compiled module that no graph reads are trained from the closures'
    gradients (:class:`orgel.explicit.closures.ClosurePipeline`).
    """
    torchrun = under_torchrun()
    join(backend.timeout_s)
    assert backend._found is not None
    # the caller's parameters and buffers by original name: the compiled module, or
    # (a compiled function) a module holding what its graphs read
    holder = backend._module or torch.nn.Module()
    calls = []
    named: dict[str, int] = {}  # name -> id of the tensor it stands for
    for gm, _, roles, args, outs in backend._found:
        given: list[tuple[str, Any] | None] = []
        for (kind, name), a in zip(roles, args, strict=True):
            if kind in ("param", "buffer"):
                if name not in named:
                    named[name] = id(a)
                    if backend._module is None:
                        register_state(holder, kind, name, a)
                elif named[name] != id(a):
                    # a compiled function: Dynamo names a resumed frame's tensors
                    # after its locals, which can give two tensors one name
                    raise RuntimeError(
                        f"two tensors of the compiled function's graphs are both named "
                        f"{name!r}: compile the module (torch.compile(model, backend=pipe)) "
                        "so that orgel names them as the model does")
                given.append((kind, name))
            else:  # model inputs and what the Python between graphs made: exchanged
                given.append(None)
        calls.append((gm, list(args), outs, given))
    # parameters no graph reads: Dynamo ran the code that uses them (an embedding) between
    # its graphs, in the closures; their gradients come from there (ClosurePipeline)
    read = set(named.values())
    outside = [] if backend._module is None else [
        n for n, p in backend._module.named_parameters() if p.requires_grad and id(p) not in read]
    reason = (f"torch.compile captured the compiled model as {len(calls)} graphs that "
              "read parameters.")
    # an autocast the closures open around the model: the graphs hold no casts, so the
    # joined graph opens it and every stage re-enters it (the closures' Python is in it)
    batch, whole = replica_batch(backend)
    named_inputs = closure_tensors(backend._pieces[0])  # micro-batch 0's, as its graphs ran
    values = backend._glue_values
    # sizes found symbolic: each bound to a dimension of a closure argument (else CaptureError)
    dims = size_roles(calls, named_inputs) if values else None
    raw, glue = join_calls(calls, reason, eager=outside, region=backend._region, dims=dims,
                           values=values)
    if values:
        raw[0].meta["orgel_shapes"] = glue_shapes(named_inputs, calls[0][0], calls[0][3])
    # the batch one replica's stages run: its closures' arguments (profiled per closure)
    workload = Workload(holder, batch, rows_at(batch_rows(batch, None, backend.batch_dim, whole),
                                               backend.batch_dim),
                        profiling_loss, batch_dim=backend.batch_dim, replicated=whole)
    with untouched(holder):
        graph = with_glue(measure(holder, named_inputs, raw, [reason], "dynamo"), glue,
                          named_inputs)
    # the flow every front end runs, from the joined capture: plan, checks, split
    # each closure's graphs are of one replica's rows: with dp, the ranks' micro-batch j is
    # closures j*dp ... j*dp+dp-1 side by side (GluedPipeline.feed)
    prepared = prepare(workload, graph=graph, planner="beam", replica_rows=True,
                       **flow_options(backend, torchrun))
    plan, split = prepared.plan, prepared.split
    keys, aliases = model_aliases(holder)
    if torchrun:  # process 0's closures run the Python between the graphs
        from orgel.explicit.glued_job import start_job

        return start_job(workload, plan, split, glue, optimizer=backend.optimizer,
                         timeout_s=backend.timeout_s, keys=keys, aliases=aliases,
                         options=backend.loop, closures=True)
    return start(workload, plan, split, glue, optimizer=backend.optimizer,
                 timeout_s=backend.timeout_s, threads=backend.threads, keys=keys,
                 aliases=aliases, closures=True, options=backend.loop)



def replica_batch(backend: Backend) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The closures' tensor arguments (:func:`closure_tensors`) as the joined graph's model
    inputs: those of the closures of the first replica (dp) side by side (the rows one
    replica's stages run, each closure's its micro-batch's); and the names of those every
    closure takes whole (:func:`whole_inputs`, and the ``replicated`` arguments).

    Every tensor the graphs take is handed over at their calls; where Dynamo found them with
    symbolic sizes (:attr:`~orgel.transparent.finding.FindsGraphs._glue_values`), each size
    is bound to a dimension of one of these (:func:`orgel.graph.glue_sizes.size_roles`):
    the ranks read it off their shapes (each step's stand-ins), and the closures' graph calls
    are checked against them, so a later batch of another length or batch size runs the
    same graphs.
    """
    dim, first = backend.batch_dim, backend._pieces[0]
    given = [closure_tensors(args) for args in backend._pieces]
    # the replicated arguments, named (whole even where one closure leaves none shared)
    named = {*closure_tensors([a if i in backend.replicated else None
                               for i, a in enumerate(first)]), *whole_inputs(given, dim)}
    whole = tuple(n for n in given[0] if n in named)
    return side_by_side(given[::backend.dp], whole, dim), whole

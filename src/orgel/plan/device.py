"""Plan a workload for a device model instead of profiling it (``orgel plan --device``).

:func:`device_costs` captures one micro-batch of a workload (built on the meta
device for models of any size, or on real tensors) and estimates its block
cost table on a :class:`~orgel.costs.devices.Device` by roofline
(:mod:`orgel.profile.roofline`); :func:`plan_on_device` hands that table to the
same planners and simulator as a profiled one. The plan names blocks and
nodes of the capture; it is a prediction for hardware not at hand, not bound
to a split of the graph (nothing here runs it).
"""

from __future__ import annotations

from typing import Any

from orgel.costs.blocks import BlockCosts
from orgel.costs.devices import Device, load_device
from orgel.graph.blocks import blocks_for
from orgel.plan.planner import PlanResult, plan
from orgel.plan.workload import microbatch_rows


def device_costs(workload: Any, device: Device | str, *, microbatches: int,
                 blocks: int | str = 32, tf32: bool = False) -> BlockCosts:
    """``workload`` (``"file.py:fn"`` or a Workload) estimated on ``device`` per micro-batch.

    ``blocks``: how many blocks to coarsen into, balanced by FLOPs, or ``"layers"``: one
    per layer (:func:`orgel.graph.blocks.layer_blocks`), every cut between two layers.
    """
    from orgel.graph.blocks import layer_blocks
    from orgel.profile.roofline import estimate_costs

    if isinstance(blocks, str) and blocks != "layers":
        raise ValueError(f"blocks must be a number or 'layers', got {blocks!r}")
    dev = load_device(device) if isinstance(device, str) else device
    w, opgraph = capture_meta(workload, microbatches)

    bg = layer_blocks(opgraph) if blocks == "layers" else None
    costs = estimate_costs(opgraph, dev, blocks=1 if bg is not None else int(blocks),
                           blockgraph=bg, tf32=tf32, rows=microbatch_rows(w, microbatches))
    costs.meta["workload"] = workload if isinstance(workload, str) else type(w.model).__name__
    costs.meta["microbatches"] = microbatches
    return costs


def plan_on_device(workload: Any, device: Device | str, *, ranks: int, microbatches: int,
                   blocks: int | str | None = None, tf32: bool = False,
                   **options: Any) -> PlanResult:
    """The planner's best plan of ``workload`` on ``ranks`` of ``device`` (estimated costs).

    ``blocks``: as :func:`device_costs` takes it (default: :func:`blocks_for` the ranks).
    ``options`` go to :func:`~orgel.plan.planner.plan` (``dp``, ``memory``,
    ``planner``, ``max_replicas``, ...); ``rows`` defaults to a micro-batch's rows.
    """
    count = blocks if isinstance(blocks, str) else blocks_for(ranks, blocks)
    costs = device_costs(workload, device, microbatches=microbatches, blocks=count, tf32=tf32)
    options.setdefault("rows", costs.rows)
    return plan(costs, ranks, microbatches, **options)


def capture_meta(workload: Any, microbatches: int) -> tuple[Any, Any]:
    """Load (if named) and capture one micro-batch: ``(Workload, OpGraph)``.

    A model on the meta device skips the workload check's trial forward (eager
    code may read a value, ``.item()``, which meta tensors do not have; the
    capture traces instead); any other goes through
    :func:`~orgel.profile.workload.capture_workload` and its checks.
    """
    import torch

    from orgel.graph import capture
    from orgel.graph.capture import CaptureError
    from orgel.profile.workload import as_workload, capture_workload
    from orgel.workload import microbatches as split_batches
    from orgel.workload import named_inputs, on_meta

    w = as_workload(workload)
    if not on_meta(w.model):
        return capture_workload(w, microbatches)
    batch = microbatch_rows(w, 1)
    if batch is None or batch % microbatches:
        raise ValueError(f"the workload's batch ({batch} rows) does not split into "
                         f"{microbatches} micro-batches: choose a count that divides it")
    inputs, _ = split_batches(w, microbatches)[0]
    named = named_inputs(w.model, inputs)
    # static sizes: a plan is made for these; symbolic ones took 1.5-2.5x the time
    try:  # without torch.device("meta") around it: Dynamo traces that mode's hook at every
        # torch call, which took 100 of 129 s of a 20-layer Llama's capture
        graph = capture(w.model, named, precision=w.precision, dynamic=False, shallow="costs")
    except CaptureError:  # a tensor made without naming a device (torch.arange(n)) met meta
        with torch.device("meta"):
            graph = capture(w.model, named, precision=w.precision, dynamic=False, shallow="costs")
    return w, graph

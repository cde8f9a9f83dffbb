"""The fixed cost of one action through the runtime itself, fitted with the simulator.

Two gloo ranks run a pipeline of two stages that do almost nothing (a 1 x 1
linear layer each) with the real executor, 1F1B over ``microbatches``
micro-batches; the median step time is what dispatch, Python, bookkeeping and
the sends/receives cost. The simulator then finds the per-action overhead
that reproduces that step on the same plan (binary search: the step grows with
the overhead). Planners use it so that stages too small to keep a rank busy
lose on their own (no fixed threshold). Cached per host by
:func:`orgel.profile.workload.runtime_overhead`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from orgel.schedule.costs import Costs, Link, StageCost


def _workload() -> Any:
    from orgel.workload import Workload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    return Workload(model, (torch.randn(16, 1),), torch.randn(16, 1), nn.functional.mse_loss)


def _split_plan(microbatches: int) -> tuple[Any, Any, Any]:
    from orgel.graph import capture, coarsen
    from orgel.schedule.families import build_schedule
    from orgel.split import split_model
    from orgel.workload import microbatches as split_batches
    from orgel.workload import named_inputs

    w = _workload()
    inputs, _ = split_batches(w, microbatches)[0]
    graph = capture(w.model, named_inputs(w.model, inputs))
    blocks = coarsen(graph, 2)
    split = split_model(blocks, [0, 1])
    plan = build_schedule("1f1b", 2, microbatches, stage_graph=split.stage_graph)
    return w, split, plan


def _rank(rank: int, world: int, microbatches: int, steps: int) -> list[float]:
    from orgel.runtime.executor import Executor
    from orgel.workload import named_inputs

    w, split, plan = _split_plan(microbatches)
    executor = Executor(plan, split, loss_fn=w.loss_fn, timeout=60.0, check_plan=False)
    inputs = named_inputs(w.model, w.inputs)
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        executor.step(inputs, w.targets)
        times.append((time.perf_counter() - t0) * 1000.0)
    return times[2:]


def fit_overhead(measured: float, microbatches: int, link: Link) -> float:
    """The per-action overhead (ms) that makes the two-stage 1F1B plan take ``measured``."""
    from orgel.schedule.families import build_schedule
    from orgel.sim import CompiledPlan

    plan = build_schedule("1f1b", 2, microbatches)
    compiled = CompiledPlan(plan)
    stage = StageCost(fwd=0.0, bwd=0.0)

    def step(overhead: float) -> float:
        costs = Costs(stages=[stage, stage], link=link, action_overhead=overhead)
        return compiled.evaluate(costs)[0]

    lo, hi = 0.0, max(measured, 1e-3)
    if step(0.0) >= measured:
        return 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if step(mid) < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def measure_overhead(link: Link, *, microbatches: int = 8, steps: int = 5) -> float:
    """Run the empty pipeline on two gloo ranks and fit the per-action overhead (ms)."""
    from orgel.runtime.launch import spawn

    results = spawn(_rank, 2, microbatches, steps, timeout=120.0, threads=1)
    per_step = [max(r[i] for r in results) for i in range(steps)]
    return fit_overhead(statistics.median(per_step), microbatches, link)

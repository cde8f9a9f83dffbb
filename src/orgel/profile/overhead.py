"""The fixed cost of one action through the runtime itself, fitted with the simulator.

Two gloo ranks run a pipeline of two stages that do almost nothing (a 1 x 1
linear layer each) with the real executor, 1F1B over ``microbatches``
micro-batches; the median step time is what dispatch, Python, bookkeeping and
the sends/receives cost. The simulator then finds the per-action overhead
that reproduces that step on the same plan (binary search: the step grows with
the overhead). Run at two micro-batch counts, the difference fixes the
per-action part and the rest is what every step pays once (its setup, the
loss all-reduce at its end). Planners use it so that stages too small to keep a rank busy
lose on their own (no fixed threshold). A property of the host and the runtime, not of
a model: :func:`orgel.profile.workload.runtime_overhead` caches it per host, torch and
orgel version, as the links are.
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


def _rank(rank: int, world: int, counts: tuple[int, ...], steps: int) -> list[list[float]]:
    from orgel.runtime.executor import Executor
    from orgel.workload import named_inputs

    executors = []
    for m in counts:
        w, split, plan = _split_plan(m)
        executors.append(Executor(plan, split, loss_fn=w.loss_fn, timeout=60.0,
                                  check_plan=False))
    inputs = named_inputs(w.model, w.inputs)
    times: list[list[float]] = [[] for _ in counts]
    for i in range(steps + 2):
        # Alternate the plans, so a change in the machine's load hits both alike.
        for executor, out in zip(executors, times, strict=True):
            t0 = time.perf_counter()
            executor.step(inputs, w.targets)
            if i >= 2:
                out.append((time.perf_counter() - t0) * 1000.0)
    return times


def _simulated(microbatches: int, link: Link) -> Any:
    """Step time of the empty two-stage 1F1B plan as a function of the overhead."""
    from orgel.schedule.families import build_schedule
    from orgel.sim import CompiledPlan

    compiled = CompiledPlan(build_schedule("1f1b", 2, microbatches))
    stage = StageCost(fwd=0.0, bwd=0.0)

    def step(overhead: float) -> float:
        costs = Costs(stages=[stage, stage], link=link, action_overhead=overhead)
        return float(compiled.evaluate(costs)[0])

    return step


def _solve(f: Any, target: float, hi: float) -> float:
    """The x in [0, hi] where the increasing ``f`` reaches ``target`` (0 if it starts above)."""
    lo = 0.0
    if f(0.0) >= target:
        return 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_overhead(measured: float, microbatches: int, link: Link) -> float:
    """The per-action overhead (ms) that makes the two-stage 1F1B plan take ``measured``."""
    return _solve(_simulated(microbatches, link), measured, max(measured, 1e-3))


def fit_overheads(measured: dict[int, float], link: Link) -> tuple[float, float]:
    """``(per action, per step)`` ms from the empty plan's step at two micro-batch counts.

    ``measured`` maps the micro-batch count to the step's ms. The difference
    between the two steps is actions only (the per-step part cancels): it
    fixes the per-action overhead; what the smaller step has beyond its
    simulation is the per-step part (the step's setup, the loss all-reduce,
    the end of step: what :func:`orgel.plan.planner.end_of_step` adds).
    """
    if len(measured) != 2:
        raise ValueError(f"give the step time at exactly two micro-batch counts, got "
                         f"{sorted(measured)}")
    (m1, t1), (m2, t2) = sorted(measured.items())
    if m1 == m2:
        raise ValueError("the two micro-batch counts must differ")
    small, large = _simulated(m1, link), _simulated(m2, link)
    action = _solve(lambda o: large(o) - small(o), t2 - t1, max(t2, 1e-3))
    return action, max(0.0, t1 - small(action))


def measure_overhead(link: Link, *, counts: tuple[int, int] = (4, 16),
                     steps: int = 8) -> tuple[float, float]:
    """Run the empty pipeline on two gloo ranks: ``(per action, per step)`` ms.

    The pipeline runs with ``counts`` micro-batches in turn (see
    :func:`fit_overheads`); each count's median step counts, as the step the
    planner predicts is a median one. (The lower quartile, used before,
    left out the wake-ups and scheduler delays that every other step pays:
    the median step of the models in ``benchmarks/cost_model_accuracy.py``
    came out 4-18% above its prediction.)
    """
    from orgel.launch.spawn import spawn

    # forked, not spawned: the ranks run gloo on the CPU, and a fork skips their imports
    results = spawn(_rank, 2, tuple(counts), steps, timeout=120.0, threads=1, context="fork")
    measured = {m: statistics.median(max(r[k][i] for r in results) for i in range(steps))
                for k, m in enumerate(counts)}
    return fit_overheads(measured, link)

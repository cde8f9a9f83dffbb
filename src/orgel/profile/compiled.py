"""Timing blocks as compiled stages run them (``compile=True``): the planner plans what runs.

With ``compile=True`` every stage runs through Inductor
(:func:`orgel.runtime.compiled.compiled_stage`), and a compiled block's forward, backward
and backward halves take other times than the eager ones (fused elementwise kernels,
fewer launches): on a GPU often a fraction. So the profiler times each block the same
way: :func:`runners` compiles each block as a stage of its own, and
:func:`compiled_jobs` builds the block's timed jobs from it, as the runtime runs its
actions:

* ``fwd``: the compiled forward;
* ``bwd``: the whole compiled backward (the runtime's ``B``);
* ``inp`` and ``wgrad``: the input half and the weight half of the backward as
  separate compiled graphs (the runtime's ``I`` and ``W``,
  :func:`~orgel.runtime.compiled.compiled_input_backward`); a block that no input
  gradient leaves (the first one) has an empty ``I`` and its whole backward in ``W``.

Each graph is compiled once, before the timing, and every later call runs the compiled
code. The bytes a block keeps are still measured on the eager block (the compiled
backward saves what AOTAutograd's partitioner chooses, which may differ). Blocks with the same
graph (the layers of a deep stack) hit Inductor's cache of compiled graphs after the
first, so compiling every block costs about the distinct blocks' compile time (the
table records the seconds, ``compile_s``).

A block timed alone pays a compiled call's host cost (the autograd node, the boxed call of
Inductor's code) for each job, where a stage of many blocks pays it once per action: the
table takes :func:`call_overhead` off each block's jobs (:func:`less_calls`) and counts it
in the action overhead instead.

The one other import of the runtime by the profiler, beside
:mod:`orgel.profile.overhead`: it times what the runtime runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from orgel.profile.blocks import _float
from orgel.profile.timing import Job
from orgel.split.types import StageModule


def runners(stages: list[StageModule]) -> list[Callable[..., Any]]:
    """Each block's compiled stage (each graph compiled at its first call)."""
    from orgel.runtime.compiled import compiled_stage

    return [compiled_stage(stage.module) for stage in stages]


def compiled_jobs(run: Callable[..., Any], stage: StageModule, args: list[Any],
                  constant: list[bool]) -> tuple[dict[str, Job], float]:
    """The timed jobs of one block run through its compiled stage ``run``, and the seconds
    compiling them took (each graph is compiled here, before any job is timed).

    ``constant[i]`` marks an input that takes no gradient (a model input), as for the
    eager block (:func:`orgel.profile.blocks.block_probe`).
    """
    from orgel.runtime.compiled import compiled_input_backward

    params = [p for p in stage.module.parameters() if p.requires_grad]

    def fresh_inputs() -> list[Any]:
        return [a.detach().requires_grad_(True) if _float(a) and not c else a
                for a, c in zip(args, constant, strict=True)]

    def forward(inputs: list[Any]) -> list[Any]:
        out = run(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    started = time.perf_counter()
    outs = forward(fresh_inputs())  # compiles the forward (and the whole backward, traced)
    grad_outs = [torch.randn_like(o) if _float(o) and o.requires_grad else None
                 for o in outs]
    del outs
    jobs: dict[str, Job] = {"fwd": (fresh_inputs, forward)}
    inputs_grad = any(_float(a) and not c for a, c in zip(args, constant, strict=True))
    if not any(g is not None for g in grad_outs) or not (params or inputs_grad):
        return jobs, time.perf_counter() - started

    def setup() -> tuple[list[Any], list[Any]]:
        ins = fresh_inputs()
        return ins, forward(ins)

    def parts(state: tuple[list[Any], list[Any]]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The outputs that take a gradient, their gradients, and the inputs that do."""
        ins, out = state
        pairs = [(o, g) for o, g in zip(out, grad_outs, strict=True) if g is not None]
        leaves = [a for a in ins if isinstance(a, torch.Tensor) and a.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs], leaves

    def whole(state: tuple[list[Any], list[Any]]) -> None:
        tensors, grads, leaves = parts(state)
        torch.autograd.backward(tensors, grads, inputs=[*leaves, *params])

    def input_half(state: tuple[list[Any], list[Any]]) -> Callable[[], None] | None:
        tensors, grads, leaves = parts(state)
        return compiled_input_backward(tensors, list(grads), leaves)[1]

    def weight_half(work: Callable[[], None] | None) -> None:
        if work is not None:
            work()

    jobs["bwd"] = (setup, whole)
    jobs["inp"] = (setup, input_half)
    if params:
        jobs["wgrad"] = (lambda: input_half(setup()), weight_half)
    # compile the whole backward and both halves now, not inside the timed rounds
    whole(setup())
    weight_half(input_half(setup()))
    for p in params:
        p.grad = None
    return jobs, time.perf_counter() - started


class _Scale(torch.nn.Module):
    """A block with (almost) no work: one elementwise op, so that its graphs are not empty."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def call_overhead(timer: Any) -> dict[str, float]:
    """ms of each job of a compiled block that does nothing (one elementwise op on one
    element): the host's cost of a compiled call (the autograd node, the boxed call of
    Inductor's code), which each block timed alone pays and a stage of many blocks pays
    once (:func:`orgel.profile.measure.measure_table` takes it off each block and counts
    it in the action overhead)."""
    from orgel.profile.timing import interleaved
    from orgel.runtime.compiled import compiled_stage

    module = _Scale()
    stage = StageModule(index=0, module=module, inputs=["x"], outputs=["y"])
    x = torch.zeros(1, device=timer.device)
    jobs, _ = compiled_jobs(compiled_stage(module), stage, [x], [False])
    return interleaved([jobs], timer)[0]


def less_calls(times: list[dict[str, float]], n: int, calls: dict[str, float]) -> None:
    """Take a compiled call's cost (:func:`call_overhead`) off each job of the first ``n``
    blocks' ``times`` and off the blocks in sequence (``times[n]["whole"]``), in place,
    keeping at least a tenth of each."""
    for job in times[:n]:
        for key, t in job.items():
            job[key] = max(t - calls.get(key, 0.0), 0.1 * t)
    whole = times[n]["whole"]
    times[n]["whole"] = max(whole - n * (calls["fwd"] + calls["bwd"]), 0.1 * whole)

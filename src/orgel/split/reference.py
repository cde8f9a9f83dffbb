"""One training step two ways in one process: the unmodified model, and its stages.

:func:`reference_step` runs the model itself over the micro-batches with
gradient accumulation. :func:`stages_step` runs a :class:`SplitModel`'s stages
one after another with exactly the boundary protocol of the runtime:

* every value received from another stage is ``detach()``-ed and, if it carries
  a gradient (``split.requires_grad``), marked ``requires_grad`` — each
  consumer gets its own leaf, as if it arrived over the wire;
* in backward, a stage's output gradient is the explicit sum of the gradients
  its consumers hand back (in consumer-stage order), passed to
  ``torch.autograd.backward`` together with the loss on the loss stage;
* each micro-batch's loss is scaled by 1/microbatches before backward.

Both return the summed loss and gradients keyed by the ORIGINAL parameter
names, so the two can be compared directly (:func:`compare`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from orgel.nesting import call
from orgel.split.types import SplitModel

Batch = tuple[dict[str, torch.Tensor], Any]


@dataclass
class StepResult:
    """Loss (sum of the scaled micro-batch losses), gradients and buffers by original name."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def reference_step(
    model: torch.nn.Module, batches: Sequence[Batch], loss_fn: Callable[[Any, Any], torch.Tensor]
) -> StepResult:
    """Run ``model`` on each micro-batch, accumulating ``loss/len(batches)`` gradients."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for inputs, targets in batches:
        loss = loss_fn(call(model, inputs), targets) / len(batches)
        loss.backward()
        total = total + loss.detach()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return StepResult(total, grads, buffers)


def copy_stages(split: SplitModel) -> SplitModel:
    """A copy whose stages own separate copies of their parameters, as on separate ranks.

    Tied parameters become one copy per stage that holds them, like on a real
    pipeline; :func:`stages_step` sums their gradients.
    """
    stages = [copy.copy(s) for s in split.stages]
    for s in stages:
        s.module = copy.deepcopy(s.module)
    result = copy.copy(split)
    result.stages = stages
    return result


def stages_step(
    split: SplitModel, batches: Sequence[Batch], loss_fn: Callable[[Any, Any], torch.Tensor]
) -> StepResult:
    """Run the stages (forward all micro-batches, then backward) with the runtime's protocol."""
    graph = split.stage_graph
    order = graph.topological_order()
    m = len(batches)
    for stage in split.stages:
        stage.module.zero_grad(set_to_none=True)
    # consumers[s][name]: stages that receive value ``name`` from stage ``s``.
    consumers: dict[int, dict[str, list[int]]] = {s: {} for s in range(graph.num_stages)}
    for e in graph.edges:
        for v in e.values:
            consumers[e.src].setdefault(v.name, []).append(e.dst)
    total = torch.zeros(())
    saved: list[tuple[dict[int, dict[str, torch.Tensor]], dict[tuple[int, str], torch.Tensor],
                      torch.Tensor]] = []
    for inputs, targets in batches:
        outputs: dict[int, dict[str, torch.Tensor]] = {}
        received: dict[tuple[int, str], torch.Tensor] = {}
        for s in order:
            stage = split.stages[s]
            args = []
            for name in stage.inputs:
                if name in stage.model_inputs:
                    args.append(inputs[name])
                    continue
                if name in stage.sizes:  # a size the capture left symbolic
                    args.append(split.with_sizes(inputs)[name])
                    continue
                src = next(e.src for e in graph.edges if e.dst == s
                           and any(v.name == name for v in e.values))
                value = outputs[src][name].detach()
                if split.requires_grad.get(name, False):
                    value.requires_grad_()
                received[(s, name)] = value
                args.append(value)
            outs = stage.module(*args)
            outputs[s] = dict(zip(stage.outputs, outs, strict=True))
        model_out = split.unflatten_outputs(
            [outputs[split.loss_stage][n] for n in split.output_names]
        )
        loss = loss_fn(model_out, targets) / m
        total = total + loss.detach()
        saved.append((outputs, received, loss))
    for outputs, received, loss in saved:
        for s in reversed(order):
            stage = split.stages[s]
            tensors: list[torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            if s == split.loss_stage:
                tensors.append(loss)
                grads.append(None)
            for name, dsts in consumers[s].items():
                if not split.requires_grad.get(name, False):
                    continue
                parts = [g for d in dsts if (g := received[(d, name)].grad) is not None]
                if not parts:
                    continue
                grad = parts[0]
                for g in parts[1:]:
                    grad = grad + g
                tensors.append(outputs[s][name])
                grads.append(grad)
            if tensors:
                torch.autograd.backward(tensors, grads)
    grads_by_name: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for stage in split.stages:
        for local, p in stage.module.named_parameters():
            if p.grad is None:
                continue
            name = stage.param_names.get(local, local)
            if name in grads_by_name:
                grads_by_name[name] = grads_by_name[name] + p.grad
            else:
                grads_by_name[name] = p.grad.detach().clone()
        for local, b in stage.module.named_buffers():
            qual = stage.buffer_names.get(local)
            if qual is not None and qual not in buffers:
                buffers[qual] = b.detach().clone()
    return StepResult(total, grads_by_name, buffers)


def compare(a: StepResult, b: StepResult) -> dict[str, float]:
    """Largest absolute differences: ``loss``, ``grad`` (over all parameters), ``buffer``.

    Raises ValueError when the two do not have gradients for the same parameters.
    """
    if set(a.grads) != set(b.grads):
        only_a = sorted(set(a.grads) - set(b.grads))
        only_b = sorted(set(b.grads) - set(a.grads))
        raise ValueError(f"gradients differ in names: only first {only_a}, only second {only_b}")

    def diff(x: torch.Tensor, y: torch.Tensor) -> float:
        if x.shape != y.shape:
            raise ValueError(f"shape mismatch {tuple(x.shape)} vs {tuple(y.shape)}")
        return float((x.double() - y.double()).abs().max()) if x.numel() else 0.0

    common = sorted(set(a.buffers) & set(b.buffers))
    return {
        "loss": diff(a.loss, b.loss),
        "grad": max((diff(a.grads[n], b.grads[n]) for n in a.grads), default=0.0),
        "buffer": max((diff(a.buffers[n], b.buffers[n]) for n in common), default=0.0),
    }

"""What the messages between stages carry, as every rank works it out alone.

:func:`check_gradient_values` holds a plan's gradient messages to the split
(which values carry a gradient); :func:`message_shapes` computes a rank's
incoming messages' shapes for a new batch from the size symbols of a symbolic
capture, so that the ranks need not exchange them.
"""

from __future__ import annotations

from typing import Any

import torch

from orgel.schedule.comm import CommPlan
from orgel.schedule.ir import Plan
from orgel.split.types import SplitModel


def check_gradient_values(plan: Plan, split: SplitModel) -> None:
    """Raise ValueError where ``plan`` sends no gradient for a value whose gradient counts.

    A value the plan marks ``grad=False`` has no gradient message (none at all
    when its edge has no other value), so the split must agree that it carries
    none (``split.requires_grad``), or its consumers' gradients would be lost. The
    other way round is harmless: a plan written without the flags sends a
    gradient message that carries fewer tensors, or none.
    """
    for e in plan.stage_graph.edges:
        for v in e.values:
            if not v.grad and split.requires_grad.get(v.name, True):
                raise ValueError(
                    f"the plan says value {v.name} of edge {e.src}->{e.dst} carries no "
                    "gradient, but the split's stages differentiate it: the plan was made "
                    "for another capture of the model; plan again for this one")


def reach_mask(names: list[str], unreached: set[str], device: torch.device) -> torch.Tensor:
    """The last tensor of a gradient message whose loss is known only as it runs: 1 for
    each of ``names`` (the message's values, in order) that a gradient reached, 0 for one
    that only carries zeros in its place (the receiver takes it as no gradient)."""
    return torch.tensor([n not in unreached for n in names], dtype=torch.uint8, device=device)


def message_shapes(plan: Plan, split: SplitModel, comm: CommPlan, rank: int,
                   inputs: list[dict[str, Any]], *, reach_flags: bool = False,
                   ) -> dict[int, list[tuple[tuple[int, ...], torch.dtype]]] | None:
    """Rank ``rank``'s incoming messages' shapes for the micro-batches of ``inputs`` (each
    one's model inputs: a smaller last batch's micro-batches differ), from the values'
    shapes in the size symbols (symbolic capture); None where they are unknown (then the
    ranks exchange them). The same answer on every rank: all or none.
    ``reach_flags``: each gradient message ends with its :func:`reach_mask`."""
    from orgel.graph.sizes import evaluate_shape

    shapes, known = split.shapes, split.value_shapes
    if shapes is None or not known or any(len(r) > 1 for r in plan.placement):
        return None
    by_microbatch: list[dict[Any, int]] = []
    for mb in inputs:
        values: dict[Any, int] = {}
        for name, dims in shapes.inputs.items():
            t = mb.get(name)
            for d, sym in enumerate(dims):
                if isinstance(sym, str):
                    if not isinstance(t, torch.Tensor) or sym not in shapes.symbols:
                        return None
                    values[shapes.symbols[sym]] = int(t.shape[d])
        by_microbatch.append(values)
    out: dict[int, list[tuple[tuple[int, ...], torch.dtype]]] = {}
    for i, msg in enumerate(comm.messages):
        values = by_microbatch[msg.microbatch]
        specs = []
        for v in plan.stage_graph.edges[msg.edge].values:
            if v.name not in known:
                return None
            shape, dtype = known[v.name]
            carries = ((dtype.is_floating_point or dtype.is_complex)
                       and split.requires_grad.get(v.name, True))
            if msg.grad and not carries:
                continue
            size = evaluate_shape(shape, values)
            if size is None:
                return None
            specs.append((size, dtype))
        if msg.grad and reach_flags:
            specs.append(((len(specs),), torch.uint8))
        if msg.dst_rank == rank:
            out[i] = specs
    return out

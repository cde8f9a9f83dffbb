"""What the split hands the runtime: one module per stage and how they connect.

This is the seam between capture/split (:mod:`orgel.graph`, :mod:`orgel.split`)
and the runtime (:mod:`orgel.runtime`). Values are matched by name everywhere:
a stage's inputs are named (model inputs by their keyword in the model's
signature, cross-stage values by their producing graph node), never by position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from orgel.schedule.ir import StageGraph


@dataclass
class StageModule:
    """One stage of a split model.

    ``module(*args)`` takes one tensor per name in ``inputs`` (same order) and
    returns a tuple with one tensor per name in ``outputs`` (same order).
    ``inputs`` mixes the model's own inputs (names in ``model_inputs``, fed from
    the micro-batch on whichever rank hosts the stage) and values received from
    other stages (produced under the same name by the stage graph's edges).
    ``param_names``/``buffer_names`` map the module's own parameter/buffer names
    (``module.named_parameters()``) to qualified names in the original model;
    ``written`` lists the module's buffers its forward updates in place (BatchNorm
    statistics), which a recompute must not update a second time.
    """

    index: int
    module: torch.nn.Module
    inputs: list[str]
    outputs: list[str]
    model_inputs: list[str] = field(default_factory=list)
    param_names: dict[str, str] = field(default_factory=dict)
    buffer_names: dict[str, str] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    #: inputs that are sizes (symbolic capture): name -> (model input, dim) whose size it is
    sizes: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: the module's nodes in runs of one layer each (:func:`orgel.graph.blocks.layer_runs`):
    #: what ``recompute="layer"`` checkpoints one at a time
    layers: list[tuple[str | None, list[str]]] = field(default_factory=list)


@dataclass
class SplitModel:
    """All stages, the stage DAG between them and how to rebuild the output.

    ``stage_graph`` is the Plan IR's stage graph (edge values named as in the
    stages' ``inputs``/``outputs``, with bytes per micro-batch). Exactly one
    stage, ``loss_stage``, produces the model's outputs; ``output_names`` lists
    them and ``unflatten_outputs`` turns those tensors (in that order) back into
    the structure the unmodified model returns, so ``loss_fn`` sees the same
    object. ``tied`` lists the original parameter names that several stages
    hold a copy of (one tensor used in several places, e.g. tied input/output
    embeddings): each copy appears in those stages' ``param_names``, and the
    runtime sums their gradients so the copies stay equal.
    """

    stages: list[StageModule]
    stage_graph: StageGraph
    loss_stage: int
    output_names: list[str]
    unflatten_outputs: Callable[[list[torch.Tensor]], Any]
    model_input_names: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    #: For every value sent between stages, whether it carries a gradient: the
    #: receiver marks it ``requires_grad`` and sends a gradient back only if True
    #: (integer ids, masks and values computed under ``no_grad`` carry none). The
    #: stage graph's values say the same (``Value.grad``), so that an edge of such
    #: values has no gradient message at all.
    requires_grad: dict[str, bool] = field(default_factory=dict)
    #: every size input of any stage: name -> (model input, dim) whose size it is
    sizes: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: the input sizes the stages take (:class:`orgel.graph.sizes.Shapes`; None: unknown)
    shapes: Any = None
    #: the shape of each value sent between stages, in the size symbols (symbolic capture):
    #: each rank computes a new batch's message shapes itself instead of exchanging them
    value_shapes: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def with_sizes(self, named: dict[str, Any]) -> dict[str, Any]:
        """``named`` model inputs and, for every size input, its value on them."""
        from orgel.graph.sizes import size_values

        return {**named, **size_values({k: v for k, v in self.sizes.items() if v[0] in named},
                                       named)}

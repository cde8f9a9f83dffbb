"""The cached blocks table's columns, and the loss as the block that computes it takes it."""

from __future__ import annotations

from typing import Any

import torch

from orgel.profile.blocks import BlockMeasure, LossProbe


def loss_probe(split: Any, loss_fn: Any, targets: Any) -> LossProbe:
    """The loss as its block's probe takes it: from that block's outputs (:func:`block_probe`)."""
    stage = split.stages[split.loss_stage]
    at = [stage.outputs.index(n) for n in split.output_names]

    def fn(outs: list[Any]) -> torch.Tensor:
        value: torch.Tensor = loss_fn(split.unflatten_outputs([outs[i] for i in at]), targets)
        return value

    return fn, frozenset(at)


def moved(value: Any, dev: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dev)
    if isinstance(value, (list, tuple)):
        return type(value)(moved(v, dev) for v in value)
    if isinstance(value, dict):
        return {k: moved(v, dev) for k, v in value.items()}
    return value


def table_columns(measures: list[BlockMeasure], times: list[dict[str, float]], *,
                  loss_stage: int, loss_times: dict[str, float] | None, saved: int,
                  overhead: float, wall_per_cpu: float) -> dict[str, Any]:
    """The cached table's columns from each block's measure and its timed jobs.

    ``I`` then ``W`` as measured (``split_input``/``split_weight``): together they
    take 30-45% more than one backward on a fed block (the input half's graph walk,
    one autograd call per parameter group), which ``bwd``/``wgrad`` leave out. The
    loss (``loss_times``, ``saved`` bytes) runs in the stage that produces the
    model's outputs: its forward there, its backward (the outputs' gradient) in
    that stage's input half.
    """
    out = block_columns(measures)
    # a block whose halves were not timed (BlockMeasure.note): its whole backward is its I
    out["split_input"] = [t.get("inp", t.get("bwd", 0.0)) for t in times]
    out["split_weight"] = [t.get("wgrad", 0.0) for t in times]
    out["notes"] = [f"block {b}: {m.note}" for b, m in enumerate(measures) if m.note]
    out["action_overhead"] = overhead
    out["wall_per_cpu"] = wall_per_cpu
    if loss_times is not None:
        out["fwd"][loss_stage] += loss_times.get("fwd", 0.0)
        out["bwd"][loss_stage] += loss_times.get("bwd", 0.0)
        out["split_input"][loss_stage] += loss_times.get("bwd", 0.0)
        out["activations"][loss_stage] += saved
    return out


def block_columns(measures: list[BlockMeasure]) -> dict[str, Any]:
    """Per-block measures as the cached table's columns."""
    keys = ("fwd", "bwd", "wgrad", "params", "activations", "output", "temporary", "weight_kept",
            "input_saved", "output_unsaved")
    return {k: [getattr(m, k) for m in measures] for k in keys}

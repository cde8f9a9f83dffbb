"""Profile a model built on the meta device one block at a time, never holding it whole.

A meta model has no values to run, and may not fit in one process. The
controller profiles it block by block: each block's tensors are made from the
pipeline's ``init``/``weights`` (:func:`orgel.split.materialize.materialized`),
the block runs on the previous blocks' real outputs, is measured as
:mod:`orgel.profile.workload` measures a block (:func:`~orgel.profile.blocks.block_probe`,
its jobs timed in :func:`~orgel.profile.blocks.interleaved` rounds) and its
tensors are freed before the next block's are made. So the controller's peak is
one block's parameters plus the activations still to be read.

What the whole-model profile adds is left out: no companion processes run
meanwhile (``contention``; the table still says how many cores the ranks
share, ``BlockCosts.cores``), blocks are not timed in sequence (the in-sequence scale is 1), and the
optimizer is timed on a few of the largest parameters' shapes only.
"""

from __future__ import annotations

from typing import Any

import torch

from orgel.profile.blocks import (
    Timer,
    action_overhead,
    block_probe,
    interleaved,
    loss_jobs,
    spin_up,
)
from orgel.split.materialize import Weights, materialized

#: bytes of parameters the optimizer's step is timed on (largest tensors first, at least one)
OPTIMIZER_SAMPLE = 64 << 20


def measure_blocks(split: Any, named: dict[str, Any], source: Weights, dev: torch.device, *,
                   warmup: int, repeats: int,
                   loss: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """The cached table's columns for every block of ``split`` (one stage per block)."""
    from orgel.profile.columns import loss_probe, moved, table_columns

    timer = Timer(dev, warmup=warmup, repeats=repeats)
    values: dict[str, Any] = {k: moved(v, dev) for k, v in split.with_sizes(named).items()}
    last_read = {name: b for b, stage in enumerate(split.stages) for name in stage.inputs}
    last_read.update(dict.fromkeys(split.output_names, len(split.stages)))
    measures, times_of = [], []
    saved, loss_times = 0, {}
    spin_up(dev)
    for b, stage in enumerate(split.stages):
        with materialized(split, [b], source, dev):
            args = [values[name] for name in stage.inputs]
            with torch.no_grad():
                result = stage.module(*args)
            outs = list(result) if isinstance(result, (tuple, list)) else [result]
            values.update(zip(stage.outputs, outs, strict=True))
            probe_loss = None
            if loss is not None and b == split.loss_stage:
                probe_loss = loss_probe(split, loss[0], moved(loss[1], dev))
            probe = block_probe(stage, args, dev, constant=[n in named for n in stage.inputs],
                                loss=probe_loss)
            jobs = [dict(probe.jobs)]
            if probe_loss is not None and loss is not None:
                group, saved = loss_jobs(split, values, loss[0], moved(loss[1], dev))
                jobs.append(group)
            timed = interleaved(jobs, timer)
            measures.append(probe.result(timed[0]))
            times_of.append(timed[0])
            if len(timed) > 1:
                loss_times = timed[1]
            del probe, jobs, args, outs, result
            stage.module.zero_grad(set_to_none=True)
        for name in [n for n in values if last_read.get(n, -1) <= b and n not in named]:
            del values[name]  # no later block reads it
    out = table_columns(measures, times_of, loss_stage=split.loss_stage,
                        loss_times=loss_times if loss is not None else None, saved=saved,
                        overhead=action_overhead(timer), wall_per_cpu=1.0)
    out["in_sequence_scale"] = 1.0
    out["whole_ms"] = sum(out["fwd"]) + sum(out["bwd"])
    return out


def optimizer_sample(model: torch.nn.Module) -> list[torch.Tensor]:
    """Zero tensors shaped as the model's largest parameters, up to :data:`OPTIMIZER_SAMPLE`."""
    out: list[torch.Tensor] = []
    total = 0
    for p in sorted(model.parameters(), key=lambda p: -p.numel()):
        if out and total + p.numel() * p.element_size() > OPTIMIZER_SAMPLE:
            break
        out.append(torch.zeros(p.shape, dtype=p.dtype))
        total += p.numel() * p.element_size()
    return out

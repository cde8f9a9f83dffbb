"""A forward of several graphs evaluated in the controller (:mod:`orgel.explicit.glued`).

The Python between the graphs lives in the calling process, so evaluation runs there:
the controller's own copy of the model, holding the ranks' values, runs each micro-batch
eagerly in eval mode under ``torch.no_grad()``; the ranks do nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel import guard
from orgel.batching import batch_rows, micro_sizes, split_microbatches
from orgel.lossweights import batch_weights, weigh
from orgel.nesting import call
from orgel.runtime.outputs import keep, merge
from orgel.workload import named_inputs


def evaluate_here(pipe: Any, model: torch.nn.Module, inputs: Any, targets: Any,
                  outputs: bool) -> Any:
    """``pipe.evaluate(inputs, targets, outputs=outputs)`` on ``model`` (the controller's
    copy with the ranks' values): each micro-batch's loss weighed as ``step`` weighs it."""
    named = named_inputs(pipe._model, inputs)
    pipe._check_batch(named, targets, "pipe.evaluate")
    parts = split_microbatches(named, targets, pipe.pieces, pipe.batch_dim,
                               pipe.replicated)
    with_loss = targets is not None or not outputs
    weights = batch_weights(pipe.loss_rule, [p for p, _ in parts], [t for _, t in parts], 1,
                            pipe.batch_dim, pipe.replicated) if with_loss else {}
    loss, outs = 0.0, []
    with guard.untouched(model), torch.no_grad(), guard.no_autocast_cache():
        model.eval()
        for m, (x, y) in enumerate(parts):
            with pipe.glue.autocast():
                out = call(model, x)
            if with_loss:
                loss += float(weigh(pipe.loss_fn(out, y), weights[(m, 0)]))
            outs.append(out)
    if not outputs:
        return loss
    merged = merged_outputs(outs, batch_rows(named, targets, pipe.batch_dim, pipe.replicated))
    return (loss, merged) if with_loss else merged


def merged_outputs(outputs: list[Any], rows: int) -> Any:
    """The whole batch's model outputs (of ``rows`` rows) from each micro-batch's (as the
    ranks merge theirs)."""
    _, spec = pytree.tree_flatten(outputs[0])
    shares = [keep(m, 0, size, 0, pytree.tree_flatten(out)[0])
              for m, (out, size) in enumerate(zip(outputs, micro_sizes(rows, len(outputs)),
                                                  strict=True))]
    return merge(shares, lambda leaves: pytree.tree_unflatten(leaves, spec))

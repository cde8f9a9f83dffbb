"""The model's outputs of a step or an evaluation, brought back from the loss stage.

Asked for (``pipe.step(x, y, outputs=True)``, ``pipe.evaluate(x, outputs=True)``),
each rank hosting the loss stage keeps, for every micro-batch it computes, its
replica's share of the model's output leaves, detached and copied to the CPU
(:class:`Share`). Nothing is kept or sent when they are not asked for.

:func:`merge` rebuilds the output of the whole batch from all shares: in
micro-batch order, and inside a micro-batch in replica order (a loss stage on
several ranks: each replica's rows). A leaf that has the batch rows along the
batch dimension in every share is concatenated along it; any other leaf (a 0-dim
tensor such as a loss the model returns, a tensor without the batch
dimension, a non-tensor) comes back as a list with one entry per share, in that
same order.
The structure is the model's own (tensor, tuple, dict, a Hugging Face
``ModelOutput``), rebuilt by the split's ``unflatten_outputs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Share:
    """One replica's part of one micro-batch's output leaves (on the CPU)."""

    microbatch: int
    replica: int
    rows: int  # the batch rows of this share
    dim: int  # the batch dimension
    leaves: list[Any]


def keep(microbatch: int, replica: int, rows: int, dim: int, leaves: list[Any]) -> Share:
    """A :class:`Share` of ``leaves``: tensors as detached copies on the CPU (receive
    buffers get reused), anything else as it is."""
    return Share(microbatch, replica, rows, dim,
                 [t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t
                  for t in leaves])


def merge(shares: list[Share], unflatten: Callable[[list[Any]], Any]) -> Any:
    """The whole batch's output from every share (see the module docstring)."""
    if not shares:
        raise ValueError("no rank kept the outputs of the loss stage")
    shares = sorted(shares, key=lambda s: (s.microbatch, s.replica))
    leaves: list[Any] = []
    for k in range(len(shares[0].leaves)):
        column = [s.leaves[k] for s in shares]
        dim = shares[0].dim
        batched = all(isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == s.rows
                      for t, s in zip(column, shares, strict=True))
        leaves.append(torch.cat(column, dim=dim) if batched else column)
    return unflatten(leaves)

"""Train a pipeline and one process on the same batches, side by side (shared by tests)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch


def train_both(pipe: Any, model: torch.nn.Module, loss_fn: Any, opt: torch.optim.Optimizer,
               batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Each ``(inputs, targets)`` batch through ``pipe.step`` and through ``model`` in one
    process (``loss_fn``, backward, ``opt``), the losses alike; each batch's rows."""
    sizes = []
    for inputs, targets in batches:
        sizes.append(len(inputs))
        loss = pipe.step(inputs, targets)
        ref = loss_fn(model(inputs), targets)
        ref.backward()
        opt.step()
        opt.zero_grad()
        assert loss == pytest.approx(ref.item(), rel=1e-5)
    return sizes

"""A plain single-process training loop, for the examples' ``python examples/X.py`` mode."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch


def example_arguments(
    description: str | None, *, steps: int = 50, batch_size: int = 16, lr: float = 1e-3
) -> argparse.ArgumentParser:
    """The options every example takes: ``--steps``, ``--batch-size``, ``--lr``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--lr", type=float, default=lr)
    return parser


def train_one_process(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Iterator[tuple[Any, Any]],
    *,
    steps: int,
    lr: float,
) -> list[float]:
    """AdamW over the trainable parameters for ``steps`` batches; prints and returns losses.

    Each batch is ``(inputs, targets)``; ``inputs`` is a tensor, a tuple of
    positional tensors or a dict of keyword tensors, as in a workload.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        inputs, targets = next(batches)
        if isinstance(inputs, dict):
            outputs = model(**inputs)
        elif isinstance(inputs, tuple):
            outputs = model(*inputs)
        else:
            outputs = model(inputs)
        loss = loss_fn(outputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 1 or step % 10 == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    print(f"{steps} steps in {(time.perf_counter() - start) * 1000:.0f} ms")
    return losses

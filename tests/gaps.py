"""How far orgel's numbers are from one process's: one rule for the tests, the scripts they
run under torchrun (``tests/`` is on their path) and the fuzzer's verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def largest_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between two tensors, in float64 (infinite for other shapes).

    Where both hold the same value (an infinity, or NaN on both sides) there is no gap; a
    NaN or an infinity only one side has is an infinite gap (Python's ``max`` over floats
    would keep or drop a NaN by its place in the list)."""
    if a.shape != b.shape:
        return math.inf
    if not a.numel():
        return 0.0
    if not a.is_floating_point() and not b.is_floating_point():
        return float((a.long() - b.long()).abs().max())
    a64, b64 = a.detach().double(), b.detach().double()
    gaps = torch.where((a64 == b64) | (a64.isnan() & b64.isnan()), 0.0, (a64 - b64).abs())
    return float(gaps.nan_to_num(nan=math.inf).max())


def state_gap(state: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> float:
    """The largest gap over the tensors of ``want``; one ``state`` lacks is an infinite gap."""
    return max((largest_gap(state[n], v) if n in state else math.inf
                for n, v in want.items()), default=0.0)

"""Linear splits of the block sequence: balanced by a weight, and the comparison baselines.

A linear split of ``n`` blocks into ``k`` stages is given by its *points*
(:mod:`orgel.split.points`): the first block of stages 1..k-1. The baselines
follow the usual partitioners: uniform layers (same number of blocks per stage),
uniform parameters (DeepSpeed's ``parameters`` method) and uniform time (the
balanced split of forward + backward time), each run with 1F1B.
"""

from __future__ import annotations

import numpy as np

from orgel.costs.blocks import BlockCosts
from orgel.split.points import Points, balanced_points, uniform_points, valid_points

# the cut points themselves live in orgel.split.points (split and runtime cut there too)
__all__ = ["BASELINES", "Points", "balanced_points", "baseline_points", "memory_weights",
           "time_weights", "uniform_points", "valid_points"]


def time_weights(bc: BlockCosts) -> np.ndarray:
    """Forward + backward time per block, the weight of the uniform-time split."""
    return np.asarray(bc.fwd) + np.asarray(bc.bwd)


def memory_weights(bc: BlockCosts) -> np.ndarray:
    """Weights + grads + optimizer state + saved activations per block (Pfeife's start)."""
    return (np.asarray(bc.params, dtype=np.float64) * bc.optimizer_factor
            + np.asarray(bc.activations, dtype=np.float64)
            + np.asarray(bc.input_saved, dtype=np.float64))


#: Baseline name -> how it weighs blocks (None: equal counts).
BASELINES = ("uniform-layers", "uniform-params", "uniform-time")


def baseline_points(bc: BlockCosts, name: str, parts: int) -> Points:
    """Points of a baseline split (see :data:`BASELINES`)."""
    n = bc.num_blocks
    if name == "uniform-layers":
        return uniform_points(n, parts)
    if name == "uniform-params":
        params = np.asarray(bc.params, dtype=np.float64)
        return balanced_points(params, parts) if params.sum() > 0 else uniform_points(n, parts)
    if name == "uniform-time":
        return balanced_points(time_weights(bc), parts)
    raise ValueError(f"unknown baseline {name!r}: choose one of {', '.join(BASELINES)}")

"""Capture: a model → an op graph with per-node facts; coarsening into blocks."""

from orgel.graph.blocks import Block, BlockEdge, BlockGraph, coarsen, from_groups
from orgel.graph.capture import CaptureError, GraphBreakError, capture
from orgel.graph.opgraph import OpGraph, OpNode

__all__ = [
    "Block",
    "BlockEdge",
    "BlockGraph",
    "CaptureError",
    "GraphBreakError",
    "OpGraph",
    "OpNode",
    "capture",
    "coarsen",
    "from_groups",
]

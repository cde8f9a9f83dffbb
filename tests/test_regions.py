"""Autocast and vmap regions and in-place activations in a captured forward, cut everywhere.

An autocast region (transformers 4.x Llama's rotary embedding turns autocast
off locally) that a stage boundary cuts must be re-entered by the later stage;
a ``torch.vmap`` traced inline (transformers 4.x GPT-2's masks) must run whole
in one stage; an in-place activation on a stage's input (``nn.ReLU6(inplace=True)``
calls ``F.hardtanh(x, 0.0, 6.0, True)``, the flag passed by position) must update
a copy of the received leaf. Each is checked at every cut against one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from orgel.graph import capture
from orgel.split import split_model
from orgel.split.assign import stages_from_cuts
from orgel.split.reference import compare, copy_stages, reference_step, stages_step
from orgel.workload import Workload, microbatches


class AutocastOff(nn.Module):
    """Layers around a region with autocast switched off, as Llama's rotary embedding does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            h = torch.tanh(h.float()) * 2
            h = self.b(h) + h
        return self.c(h)


class VmapMask(nn.Module):
    """A mask built with torch.vmap between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        rows = torch.arange(h.shape[0])
        keep = torch.vmap(lambda r: (torch.arange(6) <= r % 6).float())(rows)
        return self.b(h * keep)


class InplaceOnInput(nn.Module):
    """Blocks that start with an in-place ReLU6 (MobileNetV2) or hardswish (MobileNetV3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.relu6, self.hardswish = nn.ReLU6(inplace=True), nn.Hardswish(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu6(self.a(x) * 4)
        h = self.hardswish(self.b(h) * 4)
        return self.c(h)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


@pytest.mark.parametrize("model_cls", [AutocastOff, VmapMask, InplaceOnInput])
def test_every_two_stage_cut_matches_one_process(model_cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = model_cls()
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    w = Workload(model, (x,), y, _mse)
    batches = microbatches(w, 2)
    graph = capture(model, batches[0][0])
    expected = reference_step(model, batches, _mse)
    names = list(graph.nodes)
    for cut in range(1, len(names)):
        split = split_model(graph, dict(zip(names, stages_from_cuts(len(names), [cut]),
                                            strict=True)))
        got = stages_step(copy_stages(split), batches, _mse)
        diff = compare(expected, got)
        assert diff["loss"] <= 1e-6 and diff["grad"] <= 1e-6, (cut, diff)


def test_a_cut_inside_an_autocast_region_enters_it_again() -> None:
    torch.manual_seed(0)
    model = AutocastOff()
    graph = capture(model, (torch.randn(2, 6),))
    inside = [n for n, node in graph.nodes.items() if node.autocast]
    assert inside, "the region's nodes carry its autocast arguments"
    names = list(graph.nodes)
    cut = names.index(inside[1])  # the second stage starts inside the region
    split = split_model(graph, dict(zip(names, stages_from_cuts(len(names), [cut]), strict=True)))
    first, second = (s.module.code for s in split.stages)
    assert "_enter_autocast" in first and "_exit_autocast" in first
    assert "_enter_autocast" in second and "_exit_autocast" in second


def test_a_vmap_region_is_one_node() -> None:
    graph = capture(VmapMask(), (torch.randn(2, 6),))
    assert sum(node.op == "transform_region" for node in graph.nodes.values()) == 1
    assert not any("nesting" in node.op or "batch_dim" in node.op
                   for node in graph.nodes.values())

"""The I/W backward split equals a full backward, stage by stage, for every model shape."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from orgel.backward import input_backward, weight_backward
from test_runtime_nets import C2, batch, ce_loss, clip, gpt, split, unet

CASES = {
    "gpt": (gpt, C2, "gpt"),
    "tied": (lambda: gpt(tied=True), C2, "gpt"),
    "clip": (clip, {"i0": 0, "i1": 0, "t0": 1, "t1": 1, "join": 2, "out": 2}, "clip"),
    "unet": (unet, {"d0": 0, "d1": 1, "mid": 1, "u1": 2, "u0": 2, "out": 2}, "image"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_input_then_weight_equals_full_backward(name: str) -> None:
    make, assignment, kind = CASES[name]
    model = split(make(), assignment)
    inputs, targets = batch(kind)
    for s, stage in enumerate(model.stages):
        full, halves = stage.module, copy.deepcopy(stage.module)
        torch.manual_seed(5)
        args_full, args_halves = [], []
        for n in stage.inputs:
            if n in stage.model_inputs:
                args_full.append(inputs[n])
                args_halves.append(inputs[n])
            else:
                x = torch.randn(8, 4, 8)
                args_full.append(x.clone().requires_grad_())
                args_halves.append(x.clone().requires_grad_())
        out_full, out_halves = full(*args_full), halves(*args_halves)
        if s == model.loss_stage:
            roots_full, roots_halves = [ce_loss(out_full[0], targets)], [ce_loss(out_halves[0],
                                                                                 targets)]
            grads: list[torch.Tensor | None] = [None]
        else:
            grads = [torch.randn_like(o) for o in out_full]
            roots_full, roots_halves = list(out_full), list(out_halves)
        torch.autograd.backward(roots_full, grads)
        leaves = [a for a in args_halves if a.requires_grad]
        leaf_grads, work = input_backward(roots_halves, grads, leaves,
                                          list(halves.parameters()))
        assert all(p.grad is None for p in halves.parameters()), "I must not touch weights"
        weight_backward(work)
        for a, g in zip([a for a in args_full if a.requires_grad], leaf_grads, strict=True):
            assert torch.equal(a.grad, g)
        for (qual, p_full), p_halves in zip(full.named_parameters(), halves.parameters(),
                                            strict=True):
            assert p_halves.grad is not None, qual
            assert (p_full.grad - p_halves.grad).abs().max().item() < 1e-7, qual


_CHANNELS_LAST_GROUP_NORM = """
import torch
from orgel.backward import input_backward, weight_backward
torch.manual_seed(0)
norm, conv = torch.nn.GroupNorm(8, 32), torch.nn.Conv2d(32, 32, 3, padding=1)
params = [*norm.parameters(), *conv.parameters()]
x = torch.randn(2, 32, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
out = conv(torch.nn.functional.silu(norm(x * 1.5)))
g = torch.randn_like(out)
want = torch.autograd.grad(out, [x, *params], g, retain_graph=True)
got, work = input_backward([out], [g], [x], params)
weight_backward(work)
for a, b in zip(want, [got[0], *(p.grad for p in params)], strict=True):
    assert torch.equal(a, b)
print("equal")
"""


@pytest.mark.slow
def test_weight_half_of_a_channels_last_group_norm_does_not_crash() -> None:
    """A GroupNorm on a channels-last CPU input, asked for its weights' gradients alone,
    writes its input gradient through a null pointer in PyTorch's kernel (a diffusers
    UNet's profile died of it): ``W`` asks for the input gradient too. In a subprocess,
    so that a regression fails this test instead of killing the test run."""
    done = subprocess.run([sys.executable, "-c", _CHANNELS_LAST_GROUP_NORM],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip() == "equal"

"""float16 through ``orgel.backend``: the closure scales its loss as GradScaler does.

``precision="16-mixed"`` runs the compiled model under a float16 autocast; the closure's
backward starts from ``pipe.scale(loss)`` (``scaler.scale(loss)`` in one process) and the
ranks unscale, skip an overflowing step and back the scale off, as ``scaler.step`` and
``scaler.update`` do. Checked against one process with ``torch.amp.GradScaler`` over the
same micro-batches, with a first scale that overflows on purpose.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import orgel.transparent.backend as ob
from orgel.models import build

pytestmark = pytest.mark.slow
M = 2
INIT = 2.0 ** 17  # float16 gradients of this GPT overflow at it and at 2**16 (measured)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # dynamo remembers shapes per code object across tests


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _reference(model: torch.nn.Module, loss_fn: Any, batch: tuple[torch.Tensor, torch.Tensor],
               steps: int) -> tuple[list[list[float]], list[float]]:
    """One process: the model under a float16 autocast, its loss outside it, GradScaler."""
    opt = _sgd(list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT)
    losses, scales = [], []
    for _ in range(steps):
        opt.zero_grad()
        step = []
        for tokens, targets in zip(*(t.chunk(M) for t in batch), strict=True):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(tokens)
            loss = loss_fn(out, targets) / M
            scaler.scale(loss).backward()
            step.append(loss.item())
        scaler.step(opt)
        scaler.update()
        losses.append(step)
        scales.append(scaler.get_scale())
    return losses, scales


def test_fp16_closures_scale_their_loss_and_skip_as_grad_scaler() -> None:
    model, (tokens,), targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                               d_model=32)
    ref_losses, ref_scales = _reference(copy.deepcopy(model), loss_fn, (tokens, targets), 4)
    assert ref_scales[0] < INIT and ref_scales[-1] == ref_scales[-2]  # skipped, then trained
    pipe = ob.backend(ranks=2, microbatches=M, optimizer=_sgd, threads=1, schedule="1f1b",
                      precision="16-mixed", loss_scale={"init_scale": INIT})
    compiled = torch.compile(model, backend=pipe)

    def closure(tokens: torch.Tensor, targets: torch.Tensor) -> float:
        loss = loss_fn(compiled(tokens), targets) / M
        pipe.scale(loss).backward()
        return loss.item()

    try:
        for step in range(4):
            assert pipe.step(closure, tokens, targets) == pytest.approx(ref_losses[step],
                                                                        rel=1e-5)
            state = pipe.loss_scale
            assert state is not None and state["scale"] == ref_scales[step]
            before = INIT if step == 0 else ref_scales[step - 1]
            assert state["skipped"] == (ref_scales[step] < before)
        got = pipe.state_dict()
    finally:
        pipe.close()
    ref = copy.deepcopy(model)
    _reference(ref, loss_fn, (tokens, targets), 4)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_an_unscaled_fp16_backward_is_refused_with_what_to_write() -> None:
    model, (tokens,), targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                               d_model=32)
    pipe = ob.backend(ranks=2, microbatches=M, optimizer=_sgd, threads=1, schedule="1f1b",
                      precision="16-mixed", timeout_s=60)
    compiled = torch.compile(model, backend=pipe)

    def closure(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        (loss_fn(compiled(tokens), targets) / M).backward()

    try:
        with pytest.raises(RuntimeError, match=r"start the closure's backward from "
                                               r"pipe.scale\(loss\)"):
            pipe.step(closure, tokens, targets)
    finally:
        pipe.close()
    with pytest.raises(ValueError, match="loss_scale is for precision='16-mixed'"):
        ob.backend(ranks=2, precision="bf16-mixed", loss_scale={"init_scale": 8.0})

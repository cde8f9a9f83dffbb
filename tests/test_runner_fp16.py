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
               steps: int, init: float = INIT) -> tuple[list[list[float]], list[float]]:
    """One process: the model under a float16 autocast, its loss outside it, GradScaler."""
    opt = _sgd(list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=init)
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


def test_fp16_closures_with_graph_breaks_scale_their_loss_as_grad_scaler() -> None:
    """A compiled model with graph breaks: the closure opens the float16 autocast (the
    Python between the graphs is the closure's) and ``precision="16-mixed"`` turns the
    loss scaling on; the first step overflows at 2**16 and is skipped, as GradScaler's."""
    model, (x,), y, loss_fn = build("graphbreak", batch_size=8, seed=0)
    init, steps = 2.0 ** 16, 3
    ref = copy.deepcopy(model)
    want, scales = _reference(ref, loss_fn, (x, y), steps, init)
    assert scales[0] < init  # the first step overflowed and was skipped
    pipe = ob.backend(ranks=2, microbatches=M, optimizer=_sgd, threads=1, timeout_s=60,
                      precision="16-mixed", loss_scale={"init_scale": init})
    compiled = torch.compile(model, backend=pipe)

    def closure(xs: torch.Tensor, ys: torch.Tensor, scaled: bool = True) -> float:
        with torch.autocast("cpu", dtype=torch.float16):
            out = compiled(xs)
        loss = loss_fn(out, ys) / M
        (pipe.scale(loss) if scaled else loss).backward()
        return loss.item()

    try:
        for step in range(steps):
            assert pipe.step(closure, x, y) == pytest.approx(want[step], rel=1e-5)
            state = pipe.loss_scale
            assert state is not None and state["scale"] == scales[step]
        assert len(pipe.pipe.glue.calls) > 1  # it ran as several graphs
        got = pipe.state_dict()
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=name)
        with pytest.raises(RuntimeError, match=r"backward from pipe.scale\(loss\)"):
            pipe.step(lambda xs, ys: closure(xs, ys, scaled=False), x, y)
    finally:
        pipe.close()
    # the closure's autocast and precision= must agree (the closure's is the one that runs)
    pipe = ob.backend(ranks=2, microbatches=M, optimizer=_sgd, threads=1, timeout_s=60,
                      precision="bf16-mixed")
    compiled = torch.compile(copy.deepcopy(model), backend=pipe)
    try:
        with pytest.raises(RuntimeError, match="make the two agree"):
            pipe.step(closure, x, y)
    finally:
        pipe.close()

"""The torch.compile backend and closure runner: CLIP with a frozen text tower in the closure.

The closure against one process, its errors, a closure that hangs, the pre-processing of
later micro-batches overlapping the pipeline, and a checkpoint resumed by a new runner.
The helpers the other runner tests share (``M``, ``_sgd``, ``_backend`` and the fixture
that resets Dynamo) are defined here; ``test_runner_graph_breaks.py`` and
``test_runner_replicated.py`` import them.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import orgel.transparent.backend as ob
from orgel.models import build
from orgel.models.clip import contrastive_loss

pytestmark = pytest.mark.slow
M = 2
LR = 0.05


class ImageHead(nn.Module):
    """The trainable side of CLIP: image tower and temperature against given text features."""

    def __init__(self, image_tower: nn.Module, logit_scale: nn.Parameter) -> None:
        super().__init__()
        self.image_tower = image_tower
        self.logit_scale = logit_scale

    def forward(self, text: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        image = self.image_tower(pixels)
        return (image @ text.t()) * self.logit_scale.exp()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    # dynamo remembers shapes per code object across tests and would go dynamic
    torch._dynamo.reset()


def _clip() -> tuple[nn.Module, ImageHead, Any]:
    model, inputs, weights, _ = build("clip", batch_size=8, seed=0)
    text_tower = model.text_tower.requires_grad_(False)
    return text_tower, ImageHead(model.image_tower, model.logit_scale), (inputs, weights)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _backend(**options: Any) -> ob.Backend:
    """orgel.backend on 2 ranks, M closures per step, SGD; a FLOP-balanced 1F1B chain (no
    profiling: these tests are about the closures, not the plan)."""
    return ob.backend(ranks=2, microbatches=M, optimizer=_sgd, threads=1, schedule="1f1b",
                      **options)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 128, (8, 16), generator=g), torch.randn(8, 3, 16, 16, generator=g),
            torch.ones(8))


def _make_closure(text_tower: nn.Module, head: Any, printed: list[str]) -> Any:
    def closure(tokens: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor) -> Any:
        with torch.no_grad():
            text = text_tower(tokens)  # frozen pre-processing, in the calling process
        logits = head(text, pixels)
        loss = contrastive_loss(logits, weights) / M
        loss.backward()
        printed.append(f"loss {loss.item():.4f}")  # side effects are allowed
        return loss.detach()

    return closure


def test_frozen_text_tower_in_the_closure_matches_single_process() -> None:
    text_tower, head, _ = _clip()
    ref_head = copy.deepcopy(head)
    ref_opt = _sgd(list(ref_head.parameters()))
    pipe = _backend()
    compiled = torch.compile(head, backend=pipe)
    printed: list[str] = []
    closure = _make_closure(text_tower, compiled, printed)
    ref_closure = _make_closure(text_tower, ref_head, [])
    try:
        for step in range(2):
            batch = _batch(step)
            losses = pipe.step(closure, *batch)
            ref_opt.zero_grad()
            ref_losses = [ref_closure(*(t.chunk(M)[m] for t in batch)) for m in range(M)]
            ref_opt.step()
            assert len(losses) == M
            for got, want in zip(losses, ref_losses, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert len(printed) == 2 * M
        assert pipe.plan.num_ranks == 2
        state = pipe.state_dict()
        for name, t in ref_head.state_dict().items():
            torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-6, msg=name)
        # outside step the compiled model evaluates, here, on the values the ranks trained
        tokens, pixels, _ = _batch(5)
        compiled.eval()
        ref_head.eval()
        with torch.no_grad():
            text = text_tower(tokens)
            torch.testing.assert_close(compiled(text, pixels), ref_head(text, pixels),
                                       rtol=1e-4, atol=1e-5)
        with pytest.raises(RuntimeError, match="only evaluates: call it under torch.no_grad"):
            compiled(text, pixels)
        # left in eval mode, a step would train as the ranks were built, where one process
        # trains in eval mode: refused, and back in training mode it trains on
        with pytest.raises(ValueError, match=r"switched between training and eval mode.*"
                                             r"call model.train\(\) before the next step"):
            pipe.step(closure, *_batch(2))
        compiled.train()
        assert len(pipe.step(closure, *_batch(2))) == M
    finally:
        pipe.close()


def test_closure_errors_and_misuse_are_reported() -> None:
    """A closure that raises (before, inside or after the pipelined model's part of its
    micro-batch) reaches the caller, every rank drops that step, and the pipeline trains
    on: after three failed steps between two good ones, every weight is one process's
    after the two good steps."""
    text_tower, head, _ = _clip()
    ref_head = copy.deepcopy(head)
    ref_opt = _sgd(list(ref_head.parameters()))
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(head, backend=pipe)

    def closure_failing(where: str) -> Any:
        def closure(tokens: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor) -> None:
            second = bool(weights[0] == 2)  # micro-batch 1's rows
            if where == "before" and second:
                raise KeyError("before the model")
            with torch.no_grad():
                text = text_tower(tokens)
            loss = contrastive_loss(compiled(text, pixels), torch.ones_like(weights)) / M
            if where == "inside" and not second:
                raise KeyError("between the model and the backward")
            loss.backward()
            if where == "after" and second:
                raise KeyError("after the backward")

        return closure

    def ref_step(step: int) -> None:
        ref_opt.zero_grad()
        for m in range(M):
            _make_closure(text_tower, ref_head, [])(*(t.chunk(M)[m] for t in _batch(step)))
        ref_opt.step()

    def evaluating(tokens: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor) -> Any:
        with torch.no_grad():
            return compiled(text_tower(tokens), pixels)

    try:
        with pytest.raises(RuntimeError, match="without calling the compiled model"):
            pipe.step(lambda tokens, pixels, weights: None, *_batch(0))
        with pytest.raises(RuntimeError, match="first step's closure called the compiled "
                           "model under torch.no_grad"):  # it finds the graphs to train
            pipe.step(evaluating, *_batch(0))
        # the first step failed before the ranks started: the next one starts them
        assert len(pipe.step(_make_closure(text_tower, compiled, []), *_batch(0))) == M
        ref_step(0)
        tokens, pixels, weights = _batch(1)
        weights[4:] = 2
        for where, words in [("before", "before the model"),
                             ("inside", "between the model and the backward"),
                             ("after", "after the backward")]:
            with pytest.raises(KeyError, match=words):
                pipe.step(closure_failing(where), tokens, pixels, weights)
            assert pipe.steps == 1, where  # dropped on every rank
        # a no_grad or an autocast around step reaches no closure (threads of their own)
        with torch.no_grad(), pytest.raises(RuntimeError, match="under torch.no_grad"):
            pipe.step(_make_closure(text_tower, compiled, []), *_batch(1))
        with (torch.autocast("cpu", dtype=torch.bfloat16),
              pytest.raises(RuntimeError, match="inside the closure")):
            pipe.step(_make_closure(text_tower, compiled, []), *_batch(1))
        assert pipe.steps == 1
        with pytest.raises(RuntimeError, match="without calling the compiled model"):
            pipe.step(lambda tokens, pixels, weights: None, *_batch(1))
        pipe.step(_make_closure(text_tower, compiled, []), *_batch(2))
        ref_step(2)
        assert pipe.steps == 2
        state = pipe.state_dict()
        for name, t in ref_head.state_dict().items():
            torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        pipe.close()
    with pytest.raises(ValueError, match="a batch of 1 row cannot fill the pipeline's 2"):
        ob.backend(microbatches=2).step(lambda x: x, torch.ones(1))


def test_a_closure_that_hangs_is_reported_within_the_timeout() -> None:
    """The runner never waits on a closure forever: one that hangs before calling the
    compiled model (here micro-batch 1, on the first step) ends the step after the
    timeout with an error naming it."""
    text_tower, head, _ = _clip()
    pipe = _backend(timeout_s=3)
    compiled = torch.compile(head, backend=pipe)
    release, left = threading.Event(), threading.Event()

    def closure(tokens: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor) -> None:
        if weights[0] == 2:  # micro-batch 1's rows: hang until released, then leave
            release.wait(60)  # (without compiling: the next test's Dynamo must be alone)
            left.set()
            return
        with torch.no_grad():
            text = text_tower(tokens)
        (contrastive_loss(compiled(text, pixels), weights) / M).backward()

    tokens, pixels, weights = _batch(0)
    weights[4:] = 2
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="the closure for micro-batch 1 neither called "
                           "the compiled model nor returned within 3 s"):
            pipe.step(closure, tokens, pixels, weights)
        assert time.monotonic() - start < 3 + 30  # the timeout, not the closure's 60 s
    finally:
        release.set()
        assert left.wait(10)
        pipe.close()


def test_a_start_up_longer_than_the_timeout_is_not_a_closure_timing_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``timeout_s`` bounds a wait on the ranks, not the first step's capture, plan and
    fork (minutes under torchrun on a busy machine): the ranks start on micro-batch 0's
    graphs before any closure of the step runs. Here the start takes longer than the
    timeout; the step trains as one process does."""
    import orgel.transparent.start as starting

    slow = starting.start_glued

    def start_glued(backend: ob.Backend) -> Any:
        time.sleep(6)  # past the timeout below, as a slow capture would be
        return slow(backend)

    monkeypatch.setattr(starting, "start_glued", start_glued)
    text_tower, head, _ = _clip()
    ref_head = copy.deepcopy(head)
    ref_opt = _sgd(list(ref_head.parameters()))
    pipe = _backend(timeout_s=5)
    closure = _make_closure(text_tower, torch.compile(head, backend=pipe), [])
    ref_closure = _make_closure(text_tower, ref_head, [])
    try:
        batch = _batch(0)
        losses = pipe.step(closure, *batch)
        ref_opt.zero_grad()
        ref_losses = [ref_closure(*(t.chunk(M)[m] for t in batch)) for m in range(M)]
        ref_opt.step()
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
        state = pipe.state_dict()
        for name, t in ref_head.state_dict().items():
            torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        pipe.close()


def test_a_graphs_placeholders_keep_the_models_names() -> None:
    from orgel.transparent.graph_model import roles_of

    _, head, _ = _clip()
    found: list[list[tuple[str, str]]] = []

    def grab(gm: torch.fx.GraphModule, example: list[Any]) -> Any:
        found.append(roles_of([n for n in gm.graph.nodes if n.op == "placeholder"], example))
        return gm.forward

    text, pixels = torch.randn(2, 32), torch.randn(2, 3, 16, 16)
    torch.compile(head, backend=grab)(text, pixels)
    (roles,) = found
    assert (sorted(n for kind, n in roles if kind == "param")
            == sorted(n for n, _ in head.named_parameters()))
    assert sorted(n for kind, n in roles if kind == "input") == ["pixels", "text"]


def test_preprocessing_of_later_microbatches_overlaps_the_pipeline() -> None:
    """The last micro-batch's pre-processing overlaps the pipeline's work on the first.
    The closures reach the compiled model in micro-batch order, even where micro-batch 0
    pre-processes longest (two threads looking up Dynamo's cache at once can miss an
    entry, see orgel.explicit.slots.Turns): after an evaluation outside step, the one
    case where that lookup reorders the cache."""
    text_tower, head, _ = _clip()
    pipe = _backend()
    compiled = torch.compile(head, backend=pipe)
    first_out = threading.Event()
    waited: list[bool] = []
    order: list[int] = []
    order_step: list[bool] = []  # the third step: micro-batch 0 pre-processes longest

    def closure(tokens: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor) -> None:
        m = int(weights[0].item())
        if m == M - 1 and pipe.pipe is not None and not order_step:
            # still "pre-processing" the last micro-batch: only an overlapping pipeline
            # can hand micro-batch 0 its outputs meanwhile
            waited.append(first_out.wait(timeout=60))
        if m == 0 and order_step:
            time.sleep(0.5)
        with torch.no_grad():
            text = text_tower(tokens)
        order.append(m)
        loss = contrastive_loss(compiled(text, pixels), torch.ones_like(weights))
        if m == 0:
            first_out.set()
        loss.backward()

    try:
        tokens, pixels, _ = _batch(0)
        index = torch.arange(M).repeat_interleave(8 // M).float()  # weights carry m
        pipe.step(closure, tokens, pixels, index)
        first_out.clear()
        pipe.step(closure, tokens, pixels, index)
        with torch.no_grad():
            compiled(text_tower(tokens), pixels)  # an evaluation: its own Dynamo entry
        order.clear()
        order_step.append(True)
        pipe.step(closure, tokens, pixels, index)
    finally:
        pipe.close()
    assert waited == [True, True]  # the first step's too: the ranks start on micro-batch 0
    assert order == list(range(M))


def test_checkpoint_resumes_a_new_runner_bit_identically(tmp_path: Path) -> None:
    def run(steps: range, *, save: Path | None = None,
            load: Path | None = None) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        text_tower, head, _ = _clip()
        pipe = _backend()
        if load is not None:
            assert pipe.load(load) is None  # applied when the ranks start
        compiled = torch.compile(head, backend=pipe)
        closure = _make_closure(text_tower, compiled, [])
        try:
            for step in steps:
                pipe.step(closure, *_batch(step))
            if save is not None:
                pipe.save(save)
            return pipe.state_dict()
        finally:
            pipe.close()

    straight = run(range(3))
    run(range(2), save=tmp_path)
    resumed = run(range(2, 3), load=tmp_path)
    for name, t in straight.items():
        assert torch.equal(resumed[name], t), name


def test_a_rank_whose_work_raises_drops_the_step_and_trains_on() -> None:
    """A token id past the vocabulary raises in rank 0's embedding: ``step`` raises
    :class:`orgel.StepError` naming it, every rank dropped the step, and the next steps
    train as one process that skipped that batch."""
    from orgel import StepError

    model, (x,), y, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
    reference = copy.deepcopy(model)
    ref_opt = _sgd(list(reference.parameters()))
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(model, backend=pipe)

    def closure(xm: torch.Tensor, ym: torch.Tensor) -> float:
        loss = loss_fn(compiled(xm), ym) / M
        loss.backward()
        return float(loss.detach())

    bad = x.clone()
    bad[5, 3] = 10**6  # micro-batch 1's rows
    try:
        pipe.step(closure, x, y)
        with pytest.raises(StepError, match="rank 0 failed in step: .*index"):
            pipe.step(closure, bad, y)
        pipe.step(closure, x.flip(0), y.flip(0))
        assert pipe.steps == 2
        for batch in [(x, y), (x.flip(0), y.flip(0))]:
            ref_opt.zero_grad()
            for xm, ym in zip(batch[0].chunk(M), batch[1].chunk(M), strict=True):
                (loss_fn(reference(xm), ym) / M).backward()
            ref_opt.step()
        state = pipe.state_dict()
        for name, t in reference.state_dict().items():
            torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        pipe.close()

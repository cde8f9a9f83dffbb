"""The torch.compile backend and closure runner: CLIP with a frozen text tower in the closure."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel.transparent.backend as ob
from orgel.explicit.glued import GlueError
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
    finally:
        pipe.close()


def test_closure_errors_and_misuse_are_reported() -> None:
    text_tower, head, _ = _clip()
    pipe = _backend()
    compiled = torch.compile(head, backend=pipe)
    try:
        with pytest.raises(RuntimeError, match="without calling the compiled model"):
            pipe.step(lambda tokens, pixels, weights: None, *_batch(0))

        def fails(tokens: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor) -> None:
            with torch.no_grad():
                text = text_tower(tokens)
            compiled(text, pixels)
            raise KeyError("from the closure")

        with pytest.raises(KeyError, match="from the closure"):
            pipe.step(fails, *_batch(0))
    finally:
        pipe.close()
    with pytest.raises(ValueError, match="not divisible into 2 micro-batches"):
        ob.backend(microbatches=2).step(lambda x: x, torch.ones(3))


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


def test_graph_model_keeps_original_parameter_names() -> None:
    _, head, _ = _clip()
    graphs: list[ob.GraphModel] = []

    def grab(gm: torch.fx.GraphModule, example: list[Any]) -> Any:
        graphs.append(ob.GraphModel(gm, example))
        return gm.forward

    text, pixels = torch.randn(2, 32), torch.randn(2, 3, 16, 16)
    expected = head(text, pixels)
    torch.compile(head, backend=grab)(text, pixels)
    (gmodel,) = graphs
    assert [n for n, _ in gmodel.named_parameters()] == [n for n, _ in head.named_parameters()]
    assert sorted(gmodel.input_names) == ["pixels", "text"]
    (out,) = gmodel(text=text, pixels=pixels)
    torch.testing.assert_close(out, expected)


def test_preprocessing_of_later_microbatches_overlaps_the_pipeline() -> None:
    text_tower, head, _ = _clip()
    pipe = _backend()
    compiled = torch.compile(head, backend=pipe)
    first_out = threading.Event()
    waited: list[bool] = []

    def closure(tokens: torch.Tensor, pixels: torch.Tensor, weights: torch.Tensor) -> None:
        m = int(weights[0].item())
        if m == M - 1 and pipe.pipe is not None:
            # still "pre-processing" the last micro-batch: only an overlapping pipeline
            # can hand micro-batch 0 its outputs meanwhile
            waited.append(first_out.wait(timeout=60))
        with torch.no_grad():
            text = text_tower(tokens)
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
    finally:
        pipe.close()
    assert waited == [True]


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


class BreakBN(nn.Module):
    """BatchNorm on both sides of a graph break (``.item()``), and a side output of graph 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.bn_a = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 8)
        self.bn_b = nn.BatchNorm1d(8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.bn_a(self.a(x)))
        scale = 2.0 if h.mean().item() > 0 else 0.5  # a graph break; the branch is glue
        g = torch.tanh(self.bn_b(self.b(h * scale)))
        return self.c(g), h


def _train_both(closure_for: Any, model: nn.Module, batches: list[tuple[torch.Tensor, ...]],
                extra: nn.Module | None = None) -> tuple[Any, dict[str, Any], list[Any], list[Any]]:
    """``closure_for(model)`` on orgel.backend (2 ranks) and in one process, compared.

    Returns the (closed) runner, its final state and both runs' closure results.
    """
    ref = copy.deepcopy(model)
    ref_extra = copy.deepcopy(extra)
    ref_opt = _sgd([*ref.parameters(), *(ref_extra.parameters() if ref_extra else [])])
    extra_opt = _sgd(list(extra.parameters())) if extra is not None else None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(model, backend=pipe)
    got, want = [], []
    try:
        for batch in batches:
            got.append(pipe.step(closure_for(compiled, extra), *batch))
            # the calling process's first step leaves the caller's model as it was
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            if extra_opt is not None:
                extra_opt.step()
                extra_opt.zero_grad()
            ref_opt.zero_grad()
            ref_closure = closure_for(ref, ref_extra)
            want.append([ref_closure(*(t.chunk(M)[m] for t in batch)) for m in range(M)])
            ref_opt.step()
        state = pipe.state_dict()
    finally:
        pipe.close()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    if extra is not None:
        for (name, p), q in zip(extra.named_parameters(), ref_extra.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    return pipe, state, got, want


def _break_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(2)]


def test_a_compiled_model_with_graph_breaks_trains_exactly_buffers_included() -> None:
    """Dynamo compiles the forward as two graphs; each is split across the ranks, the
    Python between them runs in each closure, BatchNorm statistics move once per
    micro-batch; the side output of graph 0 reaches the loss past graph 1."""
    torch.manual_seed(0)

    def closure_for(model: Any, _: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out, h = model(x)
            loss = (F.mse_loss(out, y) + 0.1 * h.pow(2).mean()) / M
            loss.backward()
            return loss.detach()

        return closure

    pipe, state, got, want = _train_both(closure_for, BreakBN(), _break_batches())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.stack(g), torch.stack(w), rtol=1e-5, atol=1e-6)
    assert len(pipe.pipe.glue.calls) == 2  # several graphs, one pipeline
    assert state["bn_b.num_batches_tracked"].item() == 2 * M


def test_graph_calls_the_loss_does_not_reach_get_zero_gradients() -> None:
    """A loss of graph 0's side output only (graph 1's backward never runs by itself), and a
    closure with no backward at all: the pipeline runs those backwards with zero gradients."""
    torch.manual_seed(1)

    def side_only(model: Any, _: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> None:
            _, h = model(x)
            (h.pow(2).mean() / M).backward()

        return closure

    _train_both(side_only, BreakBN(), _break_batches())

    def no_backward(model: Any, _: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> float:
            return float(F.mse_loss(model(x)[0], y))

        return closure

    torch._dynamo.reset()
    _, _, got, want = _train_both(no_backward, BreakBN(), _break_batches()[:1])
    assert got == want


def test_trainable_preprocessing_and_two_calls_per_closure() -> None:
    """The closure's own layer feeds the compiled model (its output requires grad) and the
    compiled model runs twice per closure: its gradient comes back to the closure."""
    torch.manual_seed(2)
    embed = nn.Linear(4, 6)

    def closure_for(model: Any, pre: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> None:
            first, _ = model(pre(x))
            second, _ = model(pre(x.flip(0)))
            (F.mse_loss(first + second, y) / M).backward()

        return closure

    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g))]
    pipe, _, _, _ = _train_both(closure_for, BreakBN(), batches, extra=embed)
    assert len(pipe.pipe.glue.calls) == 4


@torch._dynamo.disable
def _eagerly(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer(h)


class EagerNorm(BreakBN):
    """BreakBN with a LayerNorm that Dynamo runs outside every graph, between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().forward(_eagerly(self.norm, x))


def test_parameters_only_the_python_between_graphs_uses_are_trained_too() -> None:
    """Parameters no graph reads (Dynamo ran the LayerNorm between its graphs, in the
    closures): their gradient is summed over the micro-batches in order and a rank steps
    them with the rest; their new values come back into the caller's module, which the
    closures run. Two steps match one process."""
    torch.manual_seed(4)
    model = EagerNorm()
    ref = copy.deepcopy(model)
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(model, backend=pipe)

    def closure_for(net: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> None:
            (F.mse_loss(net(x)[0], y) / M).backward()

        return closure

    ref_opt = _sgd(list(ref.parameters()))
    try:
        for x, y in _break_batches()[:2]:
            pipe.step(closure_for(compiled), x, y)
            ref_opt.zero_grad()
            for m in range(M):
                closure_for(ref)(x.chunk(M)[m], y.chunk(M)[m])
            ref_opt.step()
        state = pipe.state_dict()
    finally:
        pipe.close()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    for name in ("norm.weight", "norm.bias"):
        p = model.get_parameter(name)
        torch.testing.assert_close(p.detach(), ref.get_parameter(name).detach(), rtol=1e-5,
                                   atol=1e-6, msg=name)
        assert p.grad is None, name  # stepped on a rank, not left for the caller


class NormTwice(EagerNorm):
    """EagerNorm whose LayerNorm a graph reads too (as a tied embedding looked up eagerly)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, h = super().forward(x)
        return out + self.norm(x).sum(1, keepdim=True), h


def test_a_parameter_both_a_graph_and_the_python_between_use_is_named() -> None:
    """Its gradient from the Python between graphs reaches no rank: a warning names it."""
    torch.manual_seed(4)
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(NormTwice(), backend=pipe)

    def closure(x: torch.Tensor, y: torch.Tensor) -> None:
        (F.mse_loss(compiled(x)[0], y) / M).backward()

    try:
        with pytest.warns(ob.UntrainedWarning, match=r"\['norm.weight', 'norm.bias'\]"):
            pipe.step(closure, *_break_batches()[0])
    finally:
        pipe.close()


def test_an_autocast_the_closure_opens_around_the_model_is_honoured() -> None:
    """bf16 autocast around the compiled model's call, as a user writes it: the ranks run the
    graph under the same autocast, and the step matches one process; with graph breaks it
    is a clear error."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))

    def closure_for(net: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(net(x).float(), y) / M
            loss.backward()
            return loss.detach()

        return closure

    _, _, got, want = _train_both(closure_for_both(closure_for), model, _break_batches())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.stack(g), torch.stack(w), rtol=1e-5, atol=1e-6)
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(BreakBN(), backend=pipe)

    def with_breaks(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = compiled(x)
        F.mse_loss(out.float(), y).backward()

    try:
        with pytest.raises(RuntimeError, match="has graph breaks and runs under torch.autocast"):
            pipe.step(with_breaks, *_break_batches()[0])
    finally:
        pipe.close()


def test_precision_bf16_mixed_runs_the_compiled_model_under_autocast() -> None:
    """orgel.backend(precision="bf16-mixed") with a closure that opens no autocast equals one
    process whose closure opens it around the model call; float16 is refused."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    pipe = _backend(timeout_s=60,
                      precision="bf16-mixed")
    compiled = torch.compile(model, backend=pipe)
    x, y = _break_batches()[0]

    def closure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(compiled(x).float(), y) / M
        loss.backward()
        return loss.detach()

    try:
        got = pipe.step(closure, x, y)
        state = pipe.state_dict()
    finally:
        pipe.close()
    ref_opt = _sgd(list(ref.parameters()))
    want = []
    for m in range(M):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ref(x.chunk(M)[m])
        loss = F.mse_loss(out.float(), y.chunk(M)[m]) / M
        loss.backward()
        want.append(loss.detach())
    ref_opt.step()
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="float16 needs the closure's own backward"):
        ob.backend(precision="16-mixed")


def test_a_compiled_function_with_graph_breaks_whose_names_clash_is_refused() -> None:
    """Dynamo names a resumed frame's parameters after its locals: two layers held in locals
    of the same name in two frames would share one name; orgel refuses rather than mix them."""
    torch.manual_seed(7)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)

    def part(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        h = layer(h)
        if h.sum() > 0:  # a graph break: the rest runs in a resumed frame
            h = h * 2
        return torch.tanh(layer(h))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return part(second, part(first, x))

    pipe = _backend(timeout_s=60)
    compiled = torch.compile(forward, backend=pipe)

    def closure(x: torch.Tensor) -> None:
        compiled(x).sum().backward()

    try:
        with pytest.raises(RuntimeError, match="compile the module"):
            pipe.step(closure, torch.randn(4, 4))
    finally:
        pipe.close()


def closure_for_both(make: Any) -> Any:
    """``_train_both``'s closure maker from one that takes only the model."""
    return lambda net, _extra: make(net)


def test_a_closure_that_takes_another_branch_is_a_clear_error() -> None:
    torch.manual_seed(3)
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(BreakBN(), backend=pipe)

    def closure(x: torch.Tensor) -> None:
        out, _ = compiled(x)
        if x[0, 0] > 0:  # micro-batch 1 calls the model a second time
            out = out + compiled(x)[0]
        out.sum().backward()

    x = torch.cat([-torch.ones(2, 6), torch.ones(2, 6)])
    try:
        with pytest.raises(GlueError, match="expected no graph after the last of 2"):
            pipe.step(closure, x)
    finally:
        pipe.close()


class LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(torch.tanh(self.inp(x)))[0])


def test_an_lstm_compiles_as_one_graph_and_matches_single_process() -> None:
    """Dynamo breaks the graph at nn.LSTM by default; the runner steps with allow_rnn."""
    torch.manual_seed(0)
    model = LSTMTagger()
    ref = copy.deepcopy(model)
    ref_opt = _sgd(list(ref.parameters()))
    x, y = torch.randn(4, 5, 6), torch.randn(4, 5, 3)
    pipe = ob.backend(ranks=2, microbatches=2, optimizer=_sgd, threads=1)
    compiled = torch.compile(model, backend=pipe)

    def closure(x: torch.Tensor, y: torch.Tensor) -> None:
        (F.mse_loss(compiled(x), y) / 2).backward()

    try:
        pipe.step(closure, x, y)
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            (F.mse_loss(ref(xm), ym) / 2).backward()
        ref_opt.step()
        state = pipe.state_dict()
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        pipe.close()


def test_replicated_arguments_reach_every_closure_whole() -> None:
    """Class weights ``[C]`` whose size is the batch size: ``replicated=[2]`` gives every
    closure all of them (they used to be cut like the batch), as one process does."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    ref_opt = _sgd(list(ref.parameters()))
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])  # 4 classes, a batch of 4
    seen: list[torch.Tensor] = []

    def closure_for(net: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            seen.append(w)
            loss = F.cross_entropy(net(x), y, weight=w) / M
            loss.backward()
            return loss.detach()

        return closure

    with pytest.raises(ValueError, match=r"replicated must be a list of step's argument"):
        ob.backend(replicated="w")  # type: ignore[arg-type]
    pipe = _backend(timeout_s=60,
                      replicated=[2])
    with pytest.raises(ValueError, match=r"positions \[2\] but step got 2"):
        pipe.step(closure_for(model), x, y)  # refused before any closure runs
    compiled = torch.compile(model, backend=pipe)
    try:
        for _ in range(2):
            got = pipe.step(closure_for(compiled), x, y, weights)
            ref_opt.zero_grad()
            want = [closure_for(ref)(xm, ym, weights)
                    for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
            ref_opt.step()
            torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5,
                                       atol=1e-6)
        state = pipe.state_dict()
    finally:
        pipe.close()
    assert all(torch.equal(w, weights) for w in seen)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    other = _backend()
    with pytest.raises(ValueError, match=r"argument 2\[dim 0\].*replicated=\[i"):
        other.step(closure_for(model), x, y, weights[:3])  # 3 rows beside 4: named, refused


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x) + table.sum(0)))  # table: (3, 8), not batched


def test_a_replicated_argument_the_closure_passes_to_the_model_goes_whole() -> None:
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g),
                torch.randn(3, 8, generator=g)) for _ in range(2)]
    model = WithTable()
    ref = copy.deepcopy(model)
    ref_opt = _sgd(list(ref.parameters()))

    def closure_for(net: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(net(x, table), y) / M
            loss.backward()
            return loss.detach()

        return closure

    pipe = _backend(timeout_s=60,
                      replicated=[2])
    compiled = torch.compile(model, backend=pipe)
    try:
        for x, y, table in batches:
            got = pipe.step(closure_for(compiled), x, y, table)
            ref_opt.zero_grad()
            want = [closure_for(ref)(xm, ym, table)
                    for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
            ref_opt.step()
            torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5,
                                       atol=1e-6)
        state = pipe.state_dict()
    finally:
        pipe.close()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)

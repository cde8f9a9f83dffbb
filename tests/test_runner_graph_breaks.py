"""The closure runner with several graphs: Dynamo's graph breaks, the Python between graphs.

A compiled model Dynamo splits into several graphs trains exactly (BatchNorm buffers
included); graph calls the loss does not reach, trainable pre-processing and two calls per
closure; parameters only the Python between graphs uses (with ``accumulate`` too), or both
it and a graph; an
autocast the closure opens and ``precision="bf16-mixed"``; names that clash across resumed
frames; a closure that takes another branch; an LSTM compiled as one graph. The shared
helpers come from ``test_runner.py``.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel.transparent.backend as ob
from orgel.explicit.fallback import GlueError
from orgel.flow.options import REFUSED
from test_runner import (
    M,
    _backend,
    _fresh_dynamo,  # noqa: F401 - autouse: Dynamo reset before each test
    _sgd,
)

pytestmark = pytest.mark.slow


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


def _output_mse(net: Any) -> Any:
    """The closure these tests train with: ``mse(net(x)[0], y) / M``, backward."""
    def closure(x: torch.Tensor, y: torch.Tensor) -> None:
        (F.mse_loss(net(x)[0], y) / M).backward()

    return closure


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
    _norm_trains_as_one_process(EagerNorm(), _break_batches()[:2])


def _norm_trains_as_one_process(model: EagerNorm,
                                batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``model`` through ``orgel.backend`` and a copy in one process over ``batches``: every
    tensor agrees, and so does the caller's LayerNorm, stepped on a rank (no gradient left
    for the caller) and written back into ``model``."""
    ref = copy.deepcopy(model)
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(model, backend=pipe)
    ref_opt = _sgd(list(ref.parameters()))
    try:
        for x, y in batches:
            pipe.step(_output_mse(compiled), x, y)
            ref_opt.zero_grad()
            for m in range(M):
                _output_mse(ref)(x.chunk(M)[m], y.chunk(M)[m])
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
        assert p.grad is None, name


_CLOSURE = threading.local()  # the micro-batch a closure thread runs


@torch._dynamo.disable
def _between(h: torch.Tensor) -> torch.Tensor:
    """The Python between two graphs: micro-batch 0 takes longest when asked; each
    micro-batch notes when it leaves, just before Dynamo looks up the next frame."""
    m = getattr(_CLOSURE, "m", None)
    if m is not None:
        if m == 0 and _CLOSURE.slow:
            time.sleep(0.5)
        _CLOSURE.order.append(m)
    return h


class SlowBetween(nn.Module):
    """Python between two graphs, and after the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _between(self.b(_between(torch.tanh(self.a(x)))))


def test_closures_reach_each_later_frame_in_micro_batch_order() -> None:
    """After an evaluation outside ``step`` put its own Dynamo entries in front, the
    closures look up each frame after a graph break one after another (two at once can
    miss the matching entry and recompile mid-step: orgel.explicit.slots.Turns), even
    where micro-batch 0's Python between the graphs takes longest (``dp=2``: the two
    micro-batches go to different replicas, so nothing on the ranks orders them), and the
    frames after the last graph once the micro-batch before began its backward; the steps
    around the evaluation train as one process."""
    torch.manual_seed(6)
    model = SlowBetween()
    ref = copy.deepcopy(model)
    ref_opt = _sgd(list(ref.parameters()))
    pipe = _backend(timeout_s=60, dp=2)
    compiled = torch.compile(model, backend=pipe)
    order: list[int] = []
    slow: list[bool] = []

    def closure(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> None:
        _CLOSURE.m, _CLOSURE.slow, _CLOSURE.order = int(index[0]), bool(slow), order
        try:
            (F.mse_loss(compiled(x), y) / M).backward()
        finally:
            _CLOSURE.m = None

    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 7, generator=g)) for _ in range(3)]
    index = torch.arange(M).repeat_interleave(8 // M)
    try:
        for i, (x, y) in enumerate(batches):
            if i == 2:
                compiled.eval()
                with torch.no_grad():
                    compiled(x)  # an evaluation: Dynamo entries of its own, put in front
                compiled.train()
                order.clear()
                slow.append(True)
            pipe.step(closure, x, y, index)
            ref_opt.zero_grad()
            for m in range(M):
                (F.mse_loss(ref(x.chunk(M)[m]), y.chunk(M)[m]) / M).backward()
            ref_opt.step()
        state = pipe.state_dict()
    finally:
        pipe.close()
    assert order == [0, 1, 0, 1]  # after graph 0, after graph 1 (M = 2)
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_graph_breaks_accumulate_over_step_calls_as_one_process() -> None:
    """``accumulate=3``: three step calls, one optimizer step, each call's gradient counted
    1/3, for the graphs' parameters (on the ranks) and for those only the Python between
    graphs uses (kept in the closures), as one process accumulating the same."""
    torch.manual_seed(4)
    model = EagerNorm()
    ref = copy.deepcopy(model)
    pipe = _backend(timeout_s=60, accumulate=3)
    compiled = torch.compile(model, backend=pipe)

    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g))
               for _ in range(3)]
    ref_opt = _sgd(list(ref.parameters()))
    try:
        for x, y in batches:
            pipe.step(_output_mse(compiled), x, y)
            for m in range(M):
                _output_mse(ref)(x.chunk(M)[m], y.chunk(M)[m])
        assert pipe.steps == 1
        state = pipe.state_dict()
    finally:
        pipe.close()
    for p in ref.parameters():
        p.grad /= 3
    ref_opt.step()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    for name in ("norm.weight", "norm.bias"):
        torch.testing.assert_close(model.get_parameter(name).detach(),
                                   ref.get_parameter(name).detach(), rtol=1e-5, atol=1e-6,
                                   msg=name)


class NormTwice(EagerNorm):
    """EagerNorm whose LayerNorm a graph reads too (as a tied embedding looked up eagerly)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, h = super().forward(x)
        return out + self.norm(x).sum(1, keepdim=True), h


def test_a_parameter_both_a_graph_and_the_python_between_use_trains_exactly() -> None:
    """The LayerNorm runs between the graphs and a graph reads it too (as a tied embedding
    looked up eagerly and read by the head): the gradient the Python between graphs gives
    it joins the ranks' on its home rank, and its new value comes back into the caller's
    module after each optimizer step, so the next step's Python between graphs reads it
    (a warning said the ranks stepped the graphs' share alone, and the caller's copy kept
    its first value). Three steps match one process."""
    torch.manual_seed(4)
    model = NormTwice()
    g = torch.Generator().manual_seed(6)
    _norm_trains_as_one_process(model, [(torch.randn(8, 6, generator=g),
                                         torch.randn(8, 3, generator=g)) for _ in range(3)])


def test_an_autocast_the_closure_opens_around_the_model_is_honoured() -> None:
    """bf16 autocast around the compiled model's call, as a user writes it: the ranks run the
    graphs under the same autocast, and the step matches one process, with graph breaks too
    (the Python between the graphs runs in the closure, inside its autocast; BatchNorm's
    statistics included); ``precision=`` with graph breaks is refused from the table."""
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

    def with_breaks(net: Any, _: Any) -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out, h = net(x)
            loss = (F.mse_loss(out.float(), y) + 0.1 * h.float().pow(2).mean()) / M
            loss.backward()
            return loss.detach()

        return closure

    torch.manual_seed(0)
    pipe, state, got, want = _train_both(with_breaks, BreakBN(), _break_batches())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.stack(g), torch.stack(w), rtol=1e-5, atol=1e-6)
    assert len(pipe.pipe.glue.calls) == 2 and pipe.pipe.glue.region == ("cpu", torch.bfloat16)
    pipe = _backend(timeout_s=60, precision="bf16-mixed")
    compiled = torch.compile(BreakBN(), backend=pipe)

    def no_autocast(x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(compiled(x)[0].float(), y).backward()

    try:
        with pytest.raises(RuntimeError) as info:
            pipe.step(no_autocast, *_break_batches()[0])
        assert str(info.value) == REFUSED[("backend graph breaks", "precision")]
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


def test_a_closure_that_raises_or_leaves_the_graphs_drops_the_step_and_trains_on() -> None:
    """With graph breaks too, a closure that raises (before the model, between it and the
    backward, after the backward) or whose forward leaves the captured graphs (a second
    call) reaches the caller; every rank drops that step (BatchNorm statistics put back)
    and the pipeline trains on: after four failed steps between two good ones, every
    weight and buffer is one process's after the two good steps."""
    torch.manual_seed(3)
    model = BreakBN()
    ref = copy.deepcopy(model)
    ref_opt = _sgd(list(ref.parameters()))
    pipe = _backend(timeout_s=60)
    compiled = torch.compile(model, backend=pipe)

    def closure_for(net: Any, where: str = "") -> Any:
        def closure(x: torch.Tensor, y: torch.Tensor) -> None:
            second = bool(y[0, 0] == 1000)  # micro-batch 1's rows of a failing step
            if where == "before" and second:
                raise KeyError("before the model")
            out, h = net(x)
            if where == "branch" and second:
                out = out + net(x)[0]
            loss = (F.mse_loss(out, y) + 0.1 * h.pow(2).mean()) / M
            if where == "inside" and not second:
                raise KeyError("between the model and the backward")
            loss.backward()
            if where == "after" and second:
                raise KeyError("after the backward")

        return closure

    good = _break_batches()
    x, y = good[0][0] * 2, good[0][1].clone()
    y[M * 2:, 0] = 1000  # (rows 4.. are micro-batch 1's)
    try:
        for step, batch in enumerate(good):
            if step == 1:  # the failing steps, between the good ones
                for where, error, words in [
                        ("before", KeyError, "before the model"),
                        ("inside", KeyError, "between the model and the backward"),
                        ("after", KeyError, "after the backward"),
                        ("branch", GlueError, "expected no graph after the last of 2")]:
                    with pytest.raises(error, match=words):
                        pipe.step(closure_for(compiled, where), x, y)
                    assert pipe.steps == 1, where  # dropped on every rank
            pipe.step(closure_for(compiled), *batch)
            ref_opt.zero_grad()
            for m in range(M):
                closure_for(ref)(*(t.chunk(M)[m] for t in batch))
            ref_opt.step()
        assert pipe.steps == 2
        state = pipe.state_dict()
    finally:
        pipe.close()
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)
    assert state["bn_b.num_batches_tracked"].item() == 2 * M


def test_graphs_dynamo_made_with_symbolic_sizes_train_and_take_other_batch_sizes() -> None:
    """Dynamo compiles code it ran on other shapes before in this process with symbolic
    sizes (its automatic dynamic shapes): the graphs join with their sizes read off the
    closure's arguments and the step trains, and so does a later batch of another size on
    the same graphs; under ``dynamic=False`` too (orgel finds the graphs with the closure's
    sizes symbolic either way)."""
    for rows in (3, 5):  # the same forward, compiled before on other batch sizes
        torch.compile(BreakBN(), backend="eager")(torch.randn(rows, 6))
    x, wider = torch.randn(8, 6), torch.randn(12, 6)

    def closure_for(compiled: Any) -> Any:
        def closure(xm: torch.Tensor) -> None:
            compiled(xm)[0].sum().backward()
        return closure

    torch.manual_seed(3)
    for dynamic in (None, False):
        pipe = _backend(timeout_s=60)
        try:
            closure = closure_for(torch.compile(BreakBN(), backend=pipe, dynamic=dynamic))
            assert len(pipe.step(closure, x)) == M
            assert pipe.pipe.glue.dynamic
            calls = [c.code for c in pipe.pipe.glue.calls]
            assert len(pipe.step(closure, wider)) == M
            assert pipe.pipe.off_path == []
            assert [c.code for c in pipe.pipe.glue.calls] == calls
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

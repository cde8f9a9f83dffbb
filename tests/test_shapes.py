"""Batches of other sizes than the captured one: orgel.pipeline on 2 forked ranks vs one process.

The graph is captured with symbolic sizes (:mod:`orgel.graph.sizes`), so a pipeline
planned at one sequence length and batch size trains exactly on others; a size the
model's code fixes gets a clear error in the caller before any rank starts, and the
pipeline trains on afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from orgel.explicit.api import pipeline
from orgel.explicit.glued import GluedPipeline
from orgel.flow.capture import capture_microbatch
from orgel.graph.sizes import ShapeError
from orgel.models import build
from orgel.workload import Workload

pytestmark = pytest.mark.slow
LR = 0.05
VOCAB = 64


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _batch(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, shape, generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _reference(make: Callable[[], Any], batches: list[tuple[Any, torch.Tensor]],
               call: Callable[[nn.Module, torch.Tensor], Any]) -> tuple[nn.Module, list[float]]:
    model, _, _, loss_fn = make()
    opt = _sgd(list(model.parameters()))
    losses = []
    for tokens, targets in batches:
        opt.zero_grad()
        loss = loss_fn(call(model, tokens), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _assert_close(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    for name, t in expected.items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


def _gpt() -> Any:
    return build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32, vocab_size=VOCAB,
                 seq_len=64)


#: (batch, length): planned at 8 x 16 (micro-batches of 2 x 16); longer, shorter,
#: more rows per micro-batch, and the same element count in another shape
GPT_SHAPES = [(8, 16), (8, 40), (8, 5), (16, 16), (32, 3), (8, 12), (4, 64)]


def test_gpt_trains_exactly_on_other_lengths_and_batch_sizes() -> None:
    model, _, _, loss_fn = _gpt()
    tokens, targets = _batch((8, 16), 0)
    batches = [_batch(s, 10 + i) for i, s in enumerate(GPT_SHAPES)]
    with pipeline(model, (tokens,), targets, loss_fn, ranks=2, microbatches=4, optimizer=_sgd,
                  threads=1) as pipe:
        losses = [pipe.step((x,), y) for x, y in batches]
        reference, ref_losses = _reference(_gpt, batches, lambda m, x: m(x))
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)


def test_replicated_stages_take_their_share_of_other_sizes() -> None:
    """dp=2: each replica reads its sizes off its own rows of the micro-batch."""
    model, _, _, loss_fn = _gpt()
    tokens, targets = _batch((8, 16), 0)
    shapes = [(8, 16), (8, 40), (16, 7), (8, 16)]
    batches = [_batch(s, 40 + i) for i, s in enumerate(shapes)]
    with pipeline(model, (tokens,), targets, loss_fn, ranks=2, dp=2, microbatches=2,
                  optimizer=_sgd, threads=1) as pipe:
        assert all(len(r) == 2 for r in pipe.plan.placement)
        losses = [pipe.step((x,), y) for x, y in batches]
        reference, ref_losses = _reference(_gpt, batches, lambda m, x: m(x))
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)


class Branchy(nn.Module):
    """A model whose code fixes the sequence length: it branches on it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if tokens.shape[1] == 6:  # a guard: the captured graph holds for length 6 only
            h = h * 2
        return self.out(torch.relu(self.mid(h)))


class LongEnough(Branchy):
    """A model whose code branches on a bound: the graph holds for lengths above 4 only."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if tokens.shape[1] > 4:
            h = h * 2
        return self.out(torch.relu(self.mid(h)))


def _branchy(kind: type[Branchy] = Branchy) -> Any:
    torch.manual_seed(0)
    model = kind()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    tokens, targets = _batch((8, 6), 0)
    return model, (tokens,), targets, loss_fn


@pytest.mark.parametrize(("kind", "ok_len", "error"), [
    (Branchy, 6, r"input 'tokens' has size 3 along dim 1.*fixed to size 6.*this step did not run"),
    (LongEnough, 9, r"'tokens' dim 1 has size 3, but the captured graph holds for sizes >= 5 "
                    r"there only.*this step did not run"),
])
def test_a_size_the_model_fixes_is_refused_before_the_step_and_training_goes_on(
        kind: type[Branchy], ok_len: int, error: str) -> None:
    model, inputs, targets, loss_fn = _branchy(kind)
    # other batch sizes (dim 0 is free), and for LongEnough another length above 4
    ok = [_batch((8, 6), 1), _batch((16, ok_len), 2)]
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=4, optimizer=_sgd,
                  threads=1) as pipe:
        first = pipe.step((ok[0][0],), ok[0][1])
        # 8 x 3 micro-batches where 2 x 6 were captured: the same element count, and a
        # length for which one process takes the other branch
        bad = _batch((32, 3), 3)
        with pytest.raises(ShapeError, match=error):
            pipe.step((bad[0],), bad[1])
        second = pipe.step((ok[1][0],), ok[1][1])
        reference, ref_losses = _reference(lambda: _branchy(kind), ok, lambda m, x: m(x))
        assert [first, second] == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)


class OneRow(Branchy):
    """Position ids of one row, expanded where the batch has more (transformers' check):
    captured on one-row micro-batches, the graph holds for one row only."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]).unsqueeze(0) % VOCAB
        if tokens.shape[0] != positions.shape[0]:
            positions = positions.expand(tokens.shape[0], -1)
        h = self.emb(tokens) + self.emb(positions)
        return self.out(torch.relu(self.mid(h)))


def test_a_size_captured_at_one_is_refused_with_what_to_build_instead() -> None:
    """Captured on micro-batches of one row, where the model's code took its path for
    exactly one: a batch of two-row micro-batches is refused before the step, and the
    error says to build the pipeline on micro-batches of two rows or more."""
    model, _, _, loss_fn = _branchy(OneRow)
    tokens, targets = _batch((4, 6), 0)
    with pipeline(model, (tokens,), targets, loss_fn, ranks=2, microbatches=4, optimizer=_sgd,
                  threads=1) as pipe:
        bad = _batch((8, 6), 1)
        with pytest.raises(ShapeError, match=r"tokens.shape\[0\] was 1 in the example batch.*"
                                             r"micro-batches have 2 or more there"):
            pipe.step((bad[0],), bad[1])
        pipe.step((tokens,), targets)  # the captured sizes still train


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        use_cache=False, bos_token_id=0, eos_token_id=1, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)

    def loss_fn(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    tokens, targets = _batch((8, 32), 0)
    return model, {"input_ids": tokens}, targets, loss_fn


@pytest.mark.hf
def test_hf_llama_planned_at_32_trains_exactly_at_other_lengths() -> None:
    model, inputs, targets, loss_fn = _llama()
    # the flow's capture: two of the 4 layers traced with symbolic sizes, the others copied
    graph = capture_microbatch(Workload(model, inputs, targets, loss_fn), 4)
    assert any("traced two of the 4 layers" in note for note in graph.notes), graph.notes
    shapes = [(8, 32), (8, 48), (8, 32), (8, 20), (16, 32), (8, 96)]
    batches = [_batch(s, 20 + i) for i, s in enumerate(shapes)]
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=4, optimizer=_sgd,
                  threads=1) as pipe:
        losses = [pipe.step({"input_ids": x}, y) for x, y in batches]
        reference, ref_losses = _reference(_llama, batches, lambda m, x: m(input_ids=x))
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)


class SeqFirst(nn.Module):
    """A sequence-first model: tokens ``[T, B]`` -> logits ``[T, B, vocab]`` (an nn.LSTM)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = nn.LSTM(16, 24)  # batch_first=False: [T, B, features]
        self.out = nn.Linear(24, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(tokens))
        return self.out(h)


def _seq_first() -> Any:
    torch.manual_seed(0)
    model = SeqFirst()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    tokens, targets = _batch((12, 8), 0)  # [T, B]
    return model, (tokens,), targets, loss_fn


def test_sequence_first_inputs_train_exactly_with_batch_dim_1() -> None:
    model, inputs, targets, loss_fn = _seq_first()
    # [T, B] batches of other batch sizes (the LSTM, unrolled over time, fixes T)
    batches = [_batch(s, 30 + i) for i, s in enumerate([(12, 8), (12, 8), (12, 4), (12, 16)])]
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2, optimizer=_sgd,
                  threads=1, batch_dim=1) as pipe:
        losses = [pipe.step((x,), y) for x, y in batches]
        reference, ref_losses = _reference(_seq_first, batches, lambda m, x: m(x))
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)


def test_a_wrong_batch_dim_is_refused_in_the_caller() -> None:
    from orgel.workload import WorkloadError

    model, inputs, targets, loss_fn = _seq_first()
    # the default batch_dim=0 would cut [T, B] along time
    with pytest.raises(WorkloadError,
                       match=r"cut along batch_dim=0.*the batch is dim 1.*batch_dim=1"):
        pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2, threads=1)
    with pytest.raises(WorkloadError, match=r"batch_dim names \['ids'\].*inputs are \['tokens'\]"):
        pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2, threads=1,
                 batch_dim={"ids": 1, "targets": 1})
    # a dict with the right dimensions is the same as the int
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2, optimizer=_sgd,
                  threads=1, batch_dim={"tokens": 1, "targets": 1}) as pipe:
        loss = pipe.step(inputs, targets)
    _, [expected] = _reference(_seq_first, [(inputs[0], targets)], lambda m, x: m(x))
    assert loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.hf
def test_hf_opt_whose_code_reads_tensor_sizes_trains_exactly_at_other_lengths() -> None:
    """OPT calls ``hidden_states.size()``: capture writes it with the size placeholders.

    Under transformers 4.x OPT's forward is several graphs (layerdrop's Python between the
    layers), captured with symbolic sizes too: they train at other lengths exactly."""
    from archzoo import archs

    make = archs()["hf_opt"]
    model, inputs, targets, loss_fn = tuple(make())[:4]
    vocab = model.config.vocab_size
    shapes = [(4, 16), (4, 24), (8, 9), (4, 16)]
    batches = []
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(50 + i)
        tokens = torch.randint(0, vocab, shape, generator=g)
        batches.append((tokens, torch.roll(tokens, -1, dims=1)))
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2, optimizer=_sgd,
                  threads=1) as pipe:
        if isinstance(pipe, GluedPipeline):  # transformers 4.x
            assert pipe.glue.dynamic
        losses = [pipe.step({"input_ids": x}, y) for x, y in batches]
        reference, ref_losses = _reference(lambda: tuple(make())[:4], batches,
                                           lambda m, x: m(input_ids=x))
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)


def test_a_forward_of_several_graphs_takes_other_batch_sizes_and_refuses_a_fixed_one() -> None:
    """The graphs of a forward with graph breaks are captured with symbolic sizes: a batch
    of twice the rows trains exactly on them, and a feature size the model's weights fix
    is refused before any rank runs, naming the size; the pipeline trains on exactly."""
    def make() -> Any:
        return build("graphbreak", batch_size=8, seed=0)

    model, inputs, targets, loss_fn = make()
    x = inputs[0]
    # the branch the capture took (it reads the data): the same rows, twice
    batches = [(x, targets), (torch.cat([x, x]), torch.cat([targets, targets])), (x, targets)]
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2, optimizer=_sgd,
                  threads=1) as pipe:
        assert isinstance(pipe, GluedPipeline) and pipe.glue.dynamic
        losses = [pipe.step((batches[0][0],), batches[0][1])]
        losses.append(pipe.step((batches[1][0],), batches[1][1]))
        assert pipe.off_path == []  # on the captured graphs, at 8 rows a micro-batch
        with pytest.raises(ShapeError, match=f"fixed to size {x.shape[1]}"):
            pipe.step((torch.randn(8, x.shape[1] + 1),), targets)
        losses.append(pipe.step((batches[2][0],), batches[2][1]))
        reference, ref_losses = _reference(make, batches, lambda m, x: m(x))
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)

"""A DataLoader's last batch: fewer rows than the others, and not a multiple of the
micro-batch count (a data set of 23 rows in batches of 8 ends with 7). One process trains
it as it trains every batch; so does a pipeline, whose micro-batches then differ by a row
(and its replicas' shares by one), each loss weighed by its share of the batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import orgel
from orgel.graph.sizes import ShapeError
from orgel.models import build
from orgel.workload import WorkloadError
from side_by_side import train_both

ROWS, LENGTH, VOCAB = 23, 16, 128


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    return DataLoader(TensorDataset(tokens, torch.roll(tokens, -1, dims=1)), batch_size=8)


def _adamw(params: Any) -> torch.optim.Optimizer:
    # (eps: Adam would turn the rounding noise of the key bias's zero gradient into a step)
    return torch.optim.AdamW(list(params), lr=1e-2, eps=1e-6, weight_decay=0.1)


def _compare(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    # Adam turns the rounding noise of near-zero gradients (the tied embedding's rows that no
    # token of a batch reads) into steps of up to 2e-5 after three batches, even batches too;
    # a micro-batch weighed wrong is off by 1e-3 here, and its loss by far more
    bad = {n: float((state[n] - t).abs().max()) for n, t in model.state_dict().items()
           if not torch.allclose(state[n], t, rtol=1e-4, atol=1e-4)}
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "dp", "microbatches"), [(2, 1, 4), (2, 2, 2)])
def test_a_dataloaders_last_batch_trains_like_one_process(ranks: int, dp: int,
                                                          microbatches: int) -> None:
    """Batches of 8, 8 and 7 rows through ``orgel.pipeline``: 4 micro-batches of one rank
    each (the last batch cut 2, 2, 2, 1) or 2 micro-batches of 2 replicas (cut 4, 3: two
    rows per replica, then two and one), against one process over the same batches."""
    w = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
    model = copy.deepcopy(w.model)
    opt = _adamw(model.parameters())
    tokens, targets = next(iter(_data()))
    with orgel.pipeline(w.model, (tokens,), targets, w.loss_fn, ranks=ranks, dp=dp,
                        microbatches=microbatches, schedule="1f1b", optimizer=_adamw,
                        threads=1) as pipe:
        sizes = train_both(pipe, model, w.loss_fn, opt, _data())
        state = pipe.state_dict()
    assert sizes == [8, 8, 7]
    _compare(state, model)


@pytest.mark.slow
def test_a_batch_too_small_for_the_micro_batches_is_refused_with_what_to_do() -> None:
    """3 rows cannot fill 4 micro-batches: refused before any rank sees it, naming the
    sizes and ``drop_last=True``; the pipeline trains on after."""
    w = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
    tokens, targets = next(iter(_data()))
    with orgel.pipeline(w.model, (tokens,), targets, w.loss_fn, ranks=2, microbatches=4,
                        schedule="1f1b", threads=1) as pipe:
        with pytest.raises(WorkloadError, match=r"3 rows.*4 micro-batches.*drop_last=True"):
            pipe.step(tokens[:3], targets[:3])
        pipe.step(tokens, targets)


class Broken(torch.nn.Module):
    """A model whose forward breaks Dynamo's graph before the GPT: several graphs, the
    Python between them run by the calling process."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens + 0
        torch._dynamo.graph_break()
        return self.gpt(tokens)


@pytest.mark.slow
def test_a_forward_with_graph_breaks_trains_a_smaller_last_batch() -> None:
    """The same batches of 8, 8 and 7 rows through a forward of two graphs (the controller
    cuts the micro-batches, the ranks cut the stand-ins alike) against one process."""
    torch._dynamo.reset()
    w = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
    net = Broken(w.model)
    model = copy.deepcopy(net)
    opt = _adamw(model.parameters())
    tokens, targets = next(iter(_data()))
    with orgel.pipeline(net, (tokens,), targets, w.loss_fn, ranks=2, microbatches=4,
                        schedule="1f1b", optimizer=_adamw, threads=1) as pipe:
        assert train_both(pipe, model, w.loss_fn, opt, _data()) == [8, 8, 7]
        state = pipe.state_dict()
    _compare({n.removeprefix("gpt."): t for n, t in state.items()}, model.gpt)


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_orgel_backend_gives_its_closures_a_smaller_last_batch_cut_as_tensor_split(
        dp: int) -> None:
    """``orgel.backend``: each closure gets its micro-batch of the last batch of 7 rows,
    cut as ``torch.tensor_split`` cuts it (2, 2, 2, 1; with ``dp=2`` the ranks' two
    micro-batches are closures 0 and 1, 2 and 3, side by side); trained as one process
    running the same closures on the same pieces."""
    torch._dynamo.reset()
    w = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
    model = copy.deepcopy(w.model)
    opt = _adamw(model.parameters())
    pipe = orgel.backend(ranks=2, dp=dp, microbatches=4, schedule="1f1b", optimizer=_adamw,
                         threads=1)
    compiled = torch.compile(w.model, backend=pipe)
    seen: list[int] = []

    def closure(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(len(tokens))
        loss = w.loss_fn(compiled(tokens), targets) / 4
        loss.backward()
        return loss.detach()

    try:
        for tokens, targets in _data():
            seen.clear()
            losses = pipe.step(closure, tokens, targets)
            ref = []
            for x, y in zip(torch.tensor_split(tokens, 4), torch.tensor_split(targets, 4),
                            strict=True):
                loss = w.loss_fn(model(x), y) / 4
                loss.backward()
                ref.append(loss.item())
            opt.step()
            opt.zero_grad()
            # (the first step runs closure 0 once more first, to find the graphs)
            assert sorted(seen[-4:]) == sorted(len(x) for x in torch.tensor_split(tokens, 4))
            assert [float(x) for x in losses] == pytest.approx(ref, rel=1e-5)
        state = pipe.state_dict()
    finally:
        pipe.close()
    _compare(state, model)


@pytest.mark.slow
def test_a_validation_loop_evaluates_every_batch_the_last_one_smaller() -> None:
    """``pipe.evaluate`` over the same DataLoader (8, 8 and 7 rows), with and without the
    outputs, against one process in eval mode. Two passes at one size, then another size,
    failed before on rank 1 with the shapes of an earlier pass: the first rank, which
    receives nothing in a forward-only pass, counted a shape exchange at every pass."""
    w = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
    model = copy.deepcopy(w.model).eval()
    tokens, targets = next(iter(_data()))
    with orgel.pipeline(w.model, (tokens,), targets, w.loss_fn, ranks=2, microbatches=4,
                        schedule="1f1b", threads=1) as pipe:
        for tokens, targets in _data():
            with torch.no_grad():
                logits = model(tokens)
                ref = w.loss_fn(logits, targets).item()
            assert pipe.evaluate(tokens, targets) == pytest.approx(ref, rel=1e-5)
            loss, out = pipe.evaluate(tokens, targets, outputs=True)
            assert loss == pytest.approx(ref, rel=1e-5)
            torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_hugging_face_llamas_last_batch_of_one_row_micro_batches_trains() -> None:
    """HF Llama's own loss copies ``labels[..., 1:]`` where it is not contiguous, and Dynamo
    recorded that for more than one row as a guard (``labels.shape[0] != 1``): a last batch
    of 6 rows in 4 micro-batches (2, 2, 1, 1) was refused with ShapeError. That guard is the
    op's layout, not a branch of the model's: with the attention mask a tokenizer gives, the
    batch trains as one process on it. Without one, transformers' own code compares the
    batch size with the position ids' single row (a branch taken for more than one row):
    refused in the caller, naming the cut and ``drop_last=True``; the pipeline trains on."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    one = copy.deepcopy(model)
    opt = _adamw(one.parameters())
    ids = next(iter(_data()))[0]
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b}
               for b in (ids, ids[:6])]
    with orgel.pipeline(model, batches[0], ranks=2, microbatches=4, schedule="1f1b",
                        optimizer=_adamw, threads=1) as pipe:
        losses = [pipe.step(batch) for batch in batches]
        state = pipe.state_dict()
    expected = []
    for batch in batches:
        loss = one(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    assert losses == pytest.approx(expected, rel=1e-5)
    _compare(state, one)
    with orgel.pipeline(model, {"input_ids": ids, "labels": ids}, ranks=2, microbatches=4,
                        schedule="1f1b", threads=1) as pipe:
        with pytest.raises(ShapeError, match=r"take 2, 2, 1, 1 rows.*drop_last=True"):
            pipe.step({"input_ids": ids[:6], "labels": ids[:6]})
        pipe.step({"input_ids": ids, "labels": ids})

"""Large outputs of ``orgel.backend``'s compiled model stay on their rank until read.

A language model's logits (here 2 rows x 16 tokens x 16384 words, 2 MiB a micro-batch,
more than a message carries by value) are handed to the closure as
:class:`orgel.explicit.lazy.LazyOutput`: fetched from the loss rank the first time an
operation reads them, never where the closure trains on the model's own ``.loss``. Each
test trains a Hugging Face Llama through ``orgel.backend`` as people write the loop, against
one process doing the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import orgel
from orgel.explicit.lazy import LazyOutput

pytestmark = [pytest.mark.slow, pytest.mark.hf]

VOCAB, ROWS, TOKENS, M = 16384, 4, 16, 2


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=TOKENS, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batches() -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (ROWS, TOKENS), generator=torch.Generator().manual_seed(s))
            for s in range(2)]


def _reference(model: torch.nn.Module, loss_of: Any) -> tuple[list[list[Any]], dict[str, Any]]:
    """One process: each batch's micro-batches through ``loss_of(model, ids)`` (which calls
    backward and returns what the closure returns), then an AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    results = []
    for ids in _batches():
        results.append([loss_of(model, part) for part in ids.chunk(M)])
        opt.step()
        opt.zero_grad()
    return results, model.state_dict()


def _train(loss_of: Any) -> tuple[list[list[Any]], dict[str, Any]]:
    """The same through ``orgel.backend`` (2 ranks, ``M`` micro-batches)."""
    pipe = orgel.backend(ranks=2, microbatches=M, schedule="1f1b")
    compiled = torch.compile(_llama(), backend=pipe)
    try:
        results = [pipe.step(lambda ids: loss_of(compiled, ids), ids) for ids in _batches()]
        return results, pipe.state_dict()
    finally:
        pipe.close()


def _flat(results: list[list[Any]]) -> list[float]:
    return [float(x) for step in results for r in step
            for x in (r if isinstance(r, tuple) else (r,))]


def _same_weights(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def test_logits_the_closure_never_reads_stay_on_the_rank() -> None:
    """The closure trains on ``outputs.loss``: the logits it is handed are never fetched,
    and training is one process's."""
    def loss_of(model: Any, ids: torch.Tensor) -> tuple[float, bool]:
        out = model(input_ids=ids, labels=ids)
        loss = out.loss / M
        loss.backward()
        held = isinstance(out.logits, LazyOutput) and not out.logits.fetched
        return loss.item(), held

    got, weights = _train(loss_of)
    want, ref = _reference(_llama(), lambda m, ids: loss_of(m, ids)[0])
    assert [[h for _, h in step] for step in got] == [[True] * M] * 2  # held, never read
    assert [loss for step in got for loss, _ in step] == pytest.approx(_flat(want), abs=1e-6)
    _same_weights(weights, ref)


def test_a_closure_that_reads_the_logits_trains_exactly() -> None:
    """The loss from the logits (their gradient goes back to the rank), and a metric read
    after the backward (the rank has moved on; it answers at its next wait)."""
    def loss_of(model: Any, ids: torch.Tensor) -> tuple[float, float]:
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) / M
        loss.backward()
        spread = logits.detach().logsumexp(-1).mean()  # a metric of every logit
        return loss.item(), spread.item()

    got, weights = _train(loss_of)
    want, ref = _reference(_llama(), loss_of)
    assert _flat(got) == pytest.approx(_flat(want), abs=1e-5)
    _same_weights(weights, ref)


def test_logits_kept_past_the_step_keep_their_values() -> None:
    """A closure returns the logits unread: they are fetched as the step ends (the rank
    forgets its outputs when its next step begins) and equal one process's."""
    def loss_of(model: Any, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
        out = model(input_ids=ids, labels=ids)
        loss = out.loss / M
        loss.backward()
        return loss.item(), out.logits

    def here(model: Any, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
        loss, logits = loss_of(model, ids)
        return loss, logits.detach()

    got, weights = _train(loss_of)
    want, ref = _reference(_llama(), here)
    for step, expected in zip(got, want, strict=True):
        for (loss, logits), (ref_loss, ref_logits) in zip(step, expected, strict=True):
            assert isinstance(logits, LazyOutput) and logits.fetched
            assert loss == pytest.approx(ref_loss, abs=1e-6)
            torch.testing.assert_close(logits.detach(), ref_logits, rtol=0, atol=1e-5)
    _same_weights(weights, ref)

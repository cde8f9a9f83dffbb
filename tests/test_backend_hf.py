"""``orgel.backend`` on a Hugging Face model, written as people write a compiled training loop.

The first step finds the compiled model's graphs with every size of the closure's
arguments symbolic. Dynamo makes any int equal to such a size symbolic too, so a model
int that happens to equal one (a Llama of 2 layers trained on 2-row closures) can make
Dynamo fail where the static capture works; the first step then finds the graphs static.
"""

from __future__ import annotations

import copy

import pytest
import torch

import orgel

pytestmark = [pytest.mark.slow, pytest.mark.hf]


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("before", [False, True], ids=["fresh", "compiled-before"])
def test_a_model_int_equal_to_a_closures_rows_trains_exactly(before: bool) -> None:
    """Two layers and two rows a closure: ``self.layers[: config.num_hidden_layers]``
    crashed Dynamo with that 2 symbolic; the graphs are found static and train as one
    process does (two AdamW steps, two micro-batches each). ``compiled-before``: the
    process had compiled a model of the same class on two other shapes first (Dynamo then
    makes those frames' sizes symbolic on its own; the static capture was refused)."""
    if before:
        other = torch.compile(_llama(), backend="eager")
        for shape in [(3, 6), (5, 10)]:
            other(input_ids=torch.randint(0, 64, shape))
    model = _llama()
    ref = copy.deepcopy(model)
    batches = [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(c))
               for c in range(2)]
    pipe = orgel.backend(ranks=2, microbatches=2)
    compiled = torch.compile(model, backend=pipe)

    def closure(ids: torch.Tensor) -> torch.Tensor:
        loss = compiled(input_ids=ids, labels=ids).loss / pipe.microbatches
        loss.backward()
        return loss.detach()

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    try:
        for ids in batches:
            losses = pipe.step(closure, ids)
            expected = []
            for part in ids.chunk(2):
                loss = ref(input_ids=part, labels=part).loss / 2
                loss.backward()
                expected.append(loss.item())
            opt.step()
            opt.zero_grad()
            assert [float(v) for v in losses] == pytest.approx(expected, rel=1e-5)
        state = pipe.pipe.state_dict()
    finally:
        pipe.close()
    bad = {n: float((state[n] - t).abs().max()) for n, t in ref.state_dict().items()
           if not torch.allclose(state[n], t, rtol=1e-5, atol=1e-6)}
    assert not bad, bad

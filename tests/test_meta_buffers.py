"""Meta models with buffers their constructors compute (a causal mask, position ids).

Built under ``torch.device("meta")``, ``init`` must write them: a buffer it leaves unset
is reported by name, with its dtype and what to write. Built inside
``orgel.build_on_meta()``, each rank makes them as the constructor did and ``init`` sets
weights only. Either way a meta GPT with such buffers trains like one process. The shared
helpers (``initialized``, ``_sgd``) come from ``test_meta.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import orgel
from orgel.explicit.api import pipeline
from orgel.split.materialize import MaterializeError, Weights
from test_meta import _sgd, initialized


class CausalAttention(torch.nn.Module):
    """Single-head attention with a registered causal mask (bool), as many GPTs have."""

    def __init__(self, d: int, length: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(length, length, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~self.mask, float("-inf"))
        return x + self.proj(torch.softmax(scores, dim=-1) @ v)


class Positions(torch.nn.Module):
    """Position embeddings read through registered position ids (int64)."""

    def __init__(self, d: int, length: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(length, d)
        self.register_buffer("ids", torch.arange(length), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table(self.ids)


class MaskedGPT(torch.nn.Module):
    def __init__(self, vocab: int = 16, d: int = 16, length: int = 6) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = Positions(d, length)
        self.blocks = torch.nn.ModuleList(CausalAttention(d, length) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.pos(self.emb(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def masked_init(m: torch.nn.Module) -> None:
    """Weights as usual, and the buffers the constructors compute: one in place, one assigned."""
    if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(m.weight, std=0.1)
    if isinstance(m, CausalAttention):
        m.mask.copy_(torch.tril(torch.ones_like(m.mask)))
    if isinstance(m, Positions):
        m.ids = torch.arange(m.ids.numel())


def weights_only(m: torch.nn.Module) -> None:  # sets no buffer
    if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(m.weight, std=0.1)


class Rotary(torch.nn.Module):
    """Buffers computed through several ops: rotary frequencies, a write through a view."""

    def __init__(self, dim: int = 8, base: float = 10000.0) -> None:
        super().__init__()
        steps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.register_buffer("inv_freq", 1.0 / (base ** steps), persistent=False)
        keep = torch.ones(4, 4)
        keep[:, :2].fill_(0)
        self.register_buffer("keep", keep.T)
        self.lin = torch.nn.Linear(dim, dim)


def _lm_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())


def test_a_buffer_init_does_not_write_is_reported_by_name() -> None:
    with torch.device("meta"):
        model = MaskedGPT()
    source = Weights(model, init=weights_only)
    with pytest.raises(MaterializeError, match=r"init left blocks\.0\.mask unset \(a torch\.bool"
                       r" tensor .*causal mask.*build_on_meta.*m\.mask\.copy_"):
        source.tensors(["blocks.0.qkv.weight", "blocks.0.mask"])
    with pytest.raises(MaterializeError, match=r"init left pos\.ids unset \(a torch\.int64"):
        source.tensors(["pos.ids"])

    def through_data(m: torch.nn.Module) -> None:  # writes that bypass the version counter
        if isinstance(m, Positions):
            m.ids.data.copy_(torch.arange(m.ids.numel()))

    made = Weights(model, init=through_data).tensors(["pos.ids"])["pos.ids"]
    assert made.tolist() == list(range(6))
    made = Weights(model, init=masked_init).tensors(["blocks.1.mask", "pos.ids"])
    assert torch.equal(made["blocks.1.mask"], torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert made["pos.ids"].tolist() == list(range(6))


def _trains_like_one_process(model: torch.nn.Module,
                             init: Callable[[torch.nn.Module], None]) -> None:
    """Two steps of the meta ``model`` on 2 ranks with ``init`` equal one process's
    MaskedGPT given its values by the documented rule (reset, then init, seeded)."""
    ids = torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(ids, -1, dims=1)
    reference = MaskedGPT()
    for name, module in reference.named_modules():
        if module._parameters or module._buffers:
            initialized(module, name, 6, init)
    torch.manual_seed(6)
    with pipeline(model, (ids,), targets, _lm_loss, ranks=2, microbatches=2, optimizer=_sgd,
                  threads=1, init=init) as pipe:
        losses = [pipe.step((ids,), targets) for _ in range(2)]
        state = pipe.state_dict()
    opt = _sgd(list(reference.parameters()))
    for loss in losses:
        opt.zero_grad()
        expected = _lm_loss(reference(ids), targets)
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert list(state) == list(reference.state_dict())
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_meta_gpt_with_a_causal_mask_buffer_trains_like_one_process(cache: Path) -> None:
    ids = torch.randint(0, 16, (8, 6))
    with torch.device("meta"):
        model = MaskedGPT()
    with pytest.raises(MaterializeError, match=r"init left (pos\.ids|blocks\.\d\.mask) unset"):
        pipeline(model, (ids,), ids, _lm_loss, ranks=2, microbatches=2, optimizer=_sgd,
                 threads=1, init=lambda m: None)  # in the caller, before any rank starts
    _trains_like_one_process(model, masked_init)


def test_buffers_built_on_meta_are_made_as_the_constructor_made_them() -> None:
    """Inside build_on_meta, init sets weights only: each buffer comes out as the real
    constructor makes it, through several ops and a write through a view; init may still
    overwrite one; a buffer made outside the block is reported as before."""
    with orgel.build_on_meta():
        model, rotary = MaskedGPT(), Rotary()
    assert model.pos.ids.is_meta
    real, real_rotary = MaskedGPT(), Rotary()
    made = Weights(model, init=weights_only).tensors(["blocks.1.mask", "pos.ids"])
    assert torch.equal(made["blocks.1.mask"], real.blocks[1].mask)
    assert torch.equal(made["pos.ids"], real.pos.ids)
    made = Weights(rotary, init=lambda m: None).tensors(["inv_freq", "keep", "lin.weight"])
    assert torch.equal(made["inv_freq"], real_rotary.inv_freq)
    assert torch.equal(made["keep"], real_rotary.keep)
    assert not made["lin.weight"].isnan().any()  # reset_parameters, as on any meta model
    params = {n: torch.zeros(p.shape) for n, p in real.named_parameters()}
    from_file = Weights(model, weights=params).tensors(["pos.ids", "blocks.0.mask"])
    assert torch.equal(from_file["pos.ids"], real.pos.ids)  # weights without the buffers
    assert torch.equal(from_file["blocks.0.mask"], real.blocks[0].mask)

    def shifted(m: torch.nn.Module) -> None:
        if isinstance(m, Positions):
            m.ids.add_(1)

    assert Weights(model, init=shifted).tensors(["pos.ids"])["pos.ids"].tolist() == [
        1, 2, 3, 4, 5, 6]
    with orgel.build_on_meta():
        later = MaskedGPT()
    with torch.device("meta"):
        later.pos.ids = later.pos.ids * 1  # made outside the block: not recorded
    with pytest.raises(MaterializeError, match=r"init left pos\.ids unset"):
        Weights(later, init=weights_only).tensors(["pos.ids"])


@pytest.mark.slow
def test_a_gpt_built_on_meta_trains_like_one_process_with_init_setting_weights_only(
        cache: Path) -> None:
    with orgel.build_on_meta():
        model = MaskedGPT()
    _trains_like_one_process(model, weights_only)


def test_a_hugging_face_llama_built_on_meta_gets_its_rotary_frequencies() -> None:
    """A Hugging Face Llama's rotary ``inv_freq`` (non-persistent, computed in the
    constructor) comes out on a rank as the real constructor makes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with orgel.build_on_meta():
        model = LlamaForCausalLM(config)
    real = dict(LlamaForCausalLM(config).named_buffers())
    names = [n for n, _ in model.named_buffers()]
    assert any(n.endswith("inv_freq") for n in names)
    made = Weights(model, init=weights_only).tensors(names)
    for name in names:
        assert torch.equal(made[name], real[name]), name

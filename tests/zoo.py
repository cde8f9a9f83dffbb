"""Tiny workloads for tests: every orgel zoo model plus Hugging Face GPT-2, BERT and Llama.

Import from a test module in ``tests/`` as ``from zoo import workload, NAMES``.
Every workload is ``(model, inputs, targets, loss_fn)`` with random weights
from a config (no downloads), small enough for a forward+backward in well
under a second on one CPU core. The Hugging Face models use no dropout (so
runs are deterministic and comparable) and ``attn_implementation="sdpa"``,
which ``torch.compile(fullgraph=True)`` captures as one graph on torch 2.13.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from orgel.models import NAMES as ZOO_NAMES
from orgel.models import ZooWorkload, build

HF_NAMES = ("hf_gpt2", "hf_bert", "hf_llama")
#: Every tiny workload name: the zoo's own and the Hugging Face ones.
NAMES: tuple[str, ...] = (*ZOO_NAMES, *HF_NAMES)
#: Workloads whose forward must break the graph; all others capture as one graph.
GRAPH_BREAKING: tuple[str, ...] = ("graphbreak",)
CAPTURABLE: tuple[str, ...] = tuple(n for n in NAMES if n not in GRAPH_BREAKING)

_VOCAB = 128
_SEQ = 16


def hf_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a causal-LM ModelOutput's ``logits``."""
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def hf_classification_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on a sequence-classification ModelOutput's ``logits``."""
    return F.cross_entropy(output.logits, labels)


def _tokens(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(input_ids, next_ids)`` of shape ``(batch_size, _SEQ)``."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, _VOCAB, (batch_size, _SEQ + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def hf_gpt2(*, batch_size: int = 4, seed: int = 0) -> ZooWorkload:
    """Hugging Face GPT2LMHeadModel: 2 layers, hidden 32, vocab 128 (tied LM head)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=_VOCAB, n_positions=_SEQ, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=_VOCAB - 1, eos_token_id=_VOCAB - 1, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    ids, targets = _tokens(batch_size, seed)
    return ZooWorkload(model, {"input_ids": ids}, targets, hf_lm_loss)


def hf_bert(*, batch_size: int = 4, seed: int = 0) -> ZooWorkload:
    """Hugging Face BertForSequenceClassification: 2 layers, hidden 32, 3 labels."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=_SEQ, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    ids, _ = _tokens(batch_size, seed)
    labels = torch.randint(0, 3, (batch_size,), generator=torch.Generator().manual_seed(seed))
    return ZooWorkload(model, {"input_ids": ids}, labels, hf_classification_loss)


def hf_llama(*, batch_size: int = 4, seed: int = 0) -> ZooWorkload:
    """Hugging Face LlamaForCausalLM: 2 layers, hidden 32, 4 heads / 2 KV heads, vocab 128."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=_SEQ,
        use_cache=False, bos_token_id=0, eos_token_id=1, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    ids, targets = _tokens(batch_size, seed)
    return ZooWorkload(model, {"input_ids": ids}, targets, hf_lm_loss)


_HF: dict[str, Callable[..., ZooWorkload]] = {
    "hf_gpt2": hf_gpt2,
    "hf_bert": hf_bert,
    "hf_llama": hf_llama,
}


def workload(name: str, *, batch_size: int = 4, seed: int = 0) -> ZooWorkload:
    """The tiny workload ``name`` (any of :data:`NAMES`) with the zoo's default sizes."""
    if name in _HF:
        return _HF[name](batch_size=batch_size, seed=seed)
    return build(name, batch_size=batch_size, seed=seed)


def call(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...] | dict[str, torch.Tensor]) -> Any:
    """Run ``model`` on positional (tuple) or keyword (dict) inputs."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def loss_of(w: ZooWorkload, model: torch.nn.Module | None = None) -> torch.Tensor:
    """``loss_fn(model(inputs), targets)`` for ``w`` (optionally with another model)."""
    return w.loss_fn(call(model if model is not None else w.model, w.inputs), w.targets)

"""Big models built on the meta device (no memory, no weights, nothing downloaded).

Workloads for ``orgel plan --device``: transformers configs built here, the
model under ``torch.device("meta")``, so capture reads shapes, FLOPs and
saved bytes without allocating a byte of the model. Each function takes the
whole step's batch (``rows`` sequences or images); the defaults are small
enough to type on the command line, e.g.::

    orgel plan examples/big.py:llama3_70b --device h100-80gb --ranks 64 --dp 8 \\
        --microbatches 16 --precision bf16-mixed

``attn`` picks transformers' attention implementation: ``"sdpa"`` (fused, the
default) or ``"eager"`` (the attention matrix materialised, as Pfeife's runs
used it).
"""

from __future__ import annotations

from typing import Any

import torch

from orgel.workload import Workload


def _lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _cls_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.nn.functional.cross_entropy(logits, targets)


def _lm(config: Any, cls: Any, rows: int, seq: int, attn: str) -> Workload:
    config.use_cache = False
    with torch.device("meta"):
        model = cls._from_config(config, attn_implementation=attn)
        tokens = torch.empty(rows, seq, dtype=torch.long)
        targets = torch.empty(rows, seq, dtype=torch.long)
    return Workload(model, {"input_ids": tokens}, targets, _lm_loss)


def llama(rows: int = 8, seq: int = 4096, *, hidden: int = 8192, layers: int = 80,
          heads: int = 64, kv_heads: int = 8, ffn: int = 28672, vocab: int = 128256,
          attn: str = "sdpa") -> Workload:
    """A Llama decoder (default: Llama-3-70B's shape) on ``rows`` sequences of ``seq`` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         vocab_size=vocab, max_position_embeddings=max(seq, 2048))
    return _lm(config, LlamaForCausalLM, rows, seq, attn)


def llama3_70b(rows: int = 8, seq: int = 4096) -> Workload:
    """Llama-3-70B: 80 layers, hidden 8192, FFN 28672, 64 heads (8 KV), vocab 128256."""
    return llama(rows, seq)


def llama3_1_405b(rows: int = 8, seq: int = 8192) -> Workload:
    """Llama-3.1-405B: 126 layers, hidden 16384, FFN 53248, 128 heads (8 KV), vocab 128256."""
    return llama(rows, seq, hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248)


def llama3_1_8b(rows: int = 8, seq: int = 8192) -> Workload:
    """Llama-3.1-8B: 32 layers, hidden 4096, FFN 14336, 32 heads (8 KV), vocab 128256."""
    return llama(rows, seq, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336)


def llama2_7b(rows: int = 8, seq: int = 1024, attn: str = "eager") -> Workload:
    """Llama-2-7B as Pfeife trained it: LlamaConfig's defaults (32 layers, 4096, 11008,
    vocab 32000), eager attention."""
    return llama(rows, seq, hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008,
                 vocab=32000, attn=attn)


def gpt(rows: int = 8, seq: int = 2048, *, hidden: int = 12288, layers: int = 96,
        heads: int = 96, vocab: int = 50257, attn: str = "sdpa") -> Workload:
    """A GPT-2-style decoder (default: GPT-3 175B's shape, 2048 context)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
                        n_positions=seq)
    return _lm(config, GPT2LMHeadModel, rows, seq, attn)


def gpt3_175b(rows: int = 8, seq: int = 2048) -> Workload:
    """GPT-3 175B: 96 layers, hidden 12288, 96 heads, 2048 tokens (GPT-2 blocks)."""
    return gpt(rows, seq)


def gpt2_large(rows: int = 16, seq: int = 512, attn: str = "eager") -> Workload:
    """GPT2-large (36 layers, 1280, 20 heads) on ``seq``-token sequences, as in Pfeife's Table 5."""
    return gpt(rows, seq, hidden=1280, layers=36, heads=20, attn=attn)


def vit_g14(rows: int = 48, attn: str = "eager") -> Workload:
    """ViT-g/14 as Pfeife built it (hidden 1408, 32 layers, MLP 6144, 16 heads, 224 px,
    10 classes), on ``rows`` images."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=1408, image_size=224, intermediate_size=int(1408 * 48 / 11),
                       num_attention_heads=16, qkv_bias=True, num_labels=10, num_channels=3,
                       num_hidden_layers=32, patch_size=14, hidden_act="gelu")
    with torch.device("meta"):
        model = ViTForImageClassification._from_config(config, attn_implementation=attn)
        images = torch.empty(rows, 3, 224, 224)
        labels = torch.empty(rows, dtype=torch.long)
    return Workload(model, {"pixel_values": images}, labels, _cls_loss)

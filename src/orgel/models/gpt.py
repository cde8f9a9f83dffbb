"""GPT-like decoder language model and its next-token workload.

Token + learned position embedding, ``n_layers`` pre-LN blocks with causal
self-attention, a final LayerNorm and an LM head (optionally tied to the token
embedding). The loss is cross-entropy over next tokens, averaged over every
position of every sequence in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models.layers import (
    Encoder,
    ZooWorkload,
    check_heads,
    check_positive,
    init_gpt_style,
    make_config,
)


@dataclass(frozen=True)
class GPTConfig:
    """Size of a GPT; the defaults are a tiny model for tests."""

    vocab_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    mlp_ratio: int = 4
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        check_positive(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            mlp_ratio=self.mlp_ratio,
        )
        check_heads(self.d_model, self.n_heads)


#: The configuration benchmarks use: 8 layers, d_model 256, sequence 128, vocab 1000.
BENCHMARK_CONFIG = GPTConfig(vocab_size=1000, d_model=256, n_layers=8, n_heads=8, seq_len=128)


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(tokens[B, T]) -> logits[B, T, vocab]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.encoder = Encoder(
            config.d_model, config.n_heads, config.n_layers, causal=True,
            mlp_ratio=config.mlp_ratio,
        )
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # One parameter used at both ends of the graph: a pipeline split puts
            # the two uses on different stages and must sum their gradients.
            self.lm_head.weight = self.tok_emb.weight
        init_gpt_style(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        return self.lm_head(self.encoder(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` ids."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_tokens(
    batch_size: int, seq_len: int, vocab_size: int, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(tokens, next_tokens)``, both ``(batch_size, seq_len)`` int64."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def build_gpt(*, batch_size: int = 4, seed: int = 0, **config: object) -> ZooWorkload:
    """GPT workload with random weights and random tokens; ``config`` is GPTConfig fields."""
    check_positive(batch_size=batch_size)
    cfg = make_config(GPTConfig, "GPT", config)
    torch.manual_seed(seed)
    model = GPT(cfg)
    tokens, targets = random_tokens(batch_size, cfg.seq_len, cfg.vocab_size, seed=seed)
    return ZooWorkload(model, (tokens,), targets, lm_loss)

"""Shared building blocks for the model zoo: the workload tuple, attention, transformer blocks.

Everything here is written so that ``torch.compile(fullgraph=True)`` captures a
whole forward as one graph: shapes come from ``tensor.shape`` (static or
symbolic), never from tensor values, and there is no Python branching on data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

Inputs = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
Targets = torch.Tensor | tuple[torch.Tensor, ...]
C = TypeVar("C")


class ZooWorkload(NamedTuple):
    """A training workload: ``loss_fn(model(*inputs) or model(**inputs), targets)``.

    ``inputs`` is a tuple of positional tensors or a dict of keyword tensors,
    every tensor batched along dim 0; ``loss_fn`` returns a scalar averaged over
    the batch (so micro-batch losses scaled by 1/m add up to the full-batch loss).
    It unpacks like a plain 4-tuple: ``model, inputs, targets, loss_fn = w``.
    """

    model: nn.Module
    inputs: Inputs
    targets: Targets
    loss_fn: Callable[[Any, Any], torch.Tensor]


def check_positive(**values: int) -> None:
    """Raise ValueError naming the first option that is not a positive int."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def make_config(cls: type[C], what: str, options: dict[str, Any]) -> C:
    """``cls(**options)`` for a config dataclass, naming the valid options if one is unknown."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown {what} option(s) {unknown}; valid: {sorted(names)}")
    return cls(**options)


def check_heads(d_model: int, n_heads: int, *, what: str = "d_model") -> None:
    """Raise ValueError unless ``n_heads`` divides ``d_model``."""
    if d_model % n_heads != 0:
        raise ValueError(
            f"{what}={d_model} is not divisible by n_heads={n_heads}; "
            f"pick n_heads that divides {what}"
        )


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int, *, causal: bool) -> None:
        super().__init__()
        check_heads(d_model, n_heads)
        self.n_heads = n_heads
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, T, 3, H, D) -> (3, B, H, T, D): one matmul for q, k and v.
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Two-layer feed-forward network with GELU."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.out = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int, *, causal: bool, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, causal=causal)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Encoder(nn.Module):
    """A stack of transformer blocks followed by a final LayerNorm."""

    def __init__(
        self, d_model: int, n_heads: int, n_layers: int, *, causal: bool, mlp_ratio: int = 4
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, causal=causal, mlp_ratio=mlp_ratio) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def init_gpt_style(module: nn.Module, *, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) for linear and embedding weights, zero biases.

    Keeps initial logits small, so a fresh LM's loss starts near ln(vocab), also
    when the LM head shares the embedding matrix.
    """
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``(B, C)`` logits against ``(B,)`` integer labels."""
    return F.cross_entropy(logits, labels)

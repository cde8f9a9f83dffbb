"""DLRM-like recommendation model with 8 branches, and its click-prediction workload.

Branch 0 is a bottom MLP over the dense features; branches 1-7 each look up a
bag of ids in their own embedding table and average it (an EmbeddingBag
written as ``nn.Embedding`` + mean, which captures as plain graph ops). Each
branch reads only its own input. The eight vectors meet in a pairwise
dot-product interaction, then a top MLP predicts a click logit (BCE loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models.layers import ZooWorkload, check_positive, make_config

#: Names of the sparse inputs, in order; the dense input is called ``dense``.
SPARSE_NAMES = tuple(f"sparse_{i}" for i in range(7))


@dataclass(frozen=True)
class DLRMConfig:
    """Sizes of the DLRM; the defaults are tiny for tests."""

    dense_features: int = 13
    embedding_dim: int = 16
    table_rows: int = 100
    bag_size: int = 4
    bottom_hidden: int = 32
    top_hidden: int = 32

    def __post_init__(self) -> None:
        check_positive(
            dense_features=self.dense_features, embedding_dim=self.embedding_dim,
            table_rows=self.table_rows, bag_size=self.bag_size,
            bottom_hidden=self.bottom_hidden, top_hidden=self.top_hidden,
        )


def _mlp(sizes: list[int]) -> nn.Sequential:
    """Linear layers with ReLU between them (none after the last)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``forward(dense[B, F], sparse_0..sparse_6[B, bag]) -> click logits[B]``."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        d = config.embedding_dim
        self.bottom = _mlp([config.dense_features, config.bottom_hidden, d])
        self.tables = nn.ModuleList(nn.Embedding(config.table_rows, d) for _ in SPARSE_NAMES)
        n = len(SPARSE_NAMES) + 1
        # Fixed indices of the strictly upper triangle: the distinct feature pairs.
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.pair_rows: torch.Tensor
        self.pair_cols: torch.Tensor
        self.top = _mlp([d + n * (n - 1) // 2, config.top_hidden, config.top_hidden, 1])

    def forward(
        self,
        dense: torch.Tensor,
        sparse_0: torch.Tensor,
        sparse_1: torch.Tensor,
        sparse_2: torch.Tensor,
        sparse_3: torch.Tensor,
        sparse_4: torch.Tensor,
        sparse_5: torch.Tensor,
        sparse_6: torch.Tensor,
    ) -> torch.Tensor:
        sparse = (sparse_0, sparse_1, sparse_2, sparse_3, sparse_4, sparse_5, sparse_6)
        x = self.bottom(dense)
        bags = [table(ids).mean(dim=1) for table, ids in zip(self.tables, sparse, strict=True)]
        vectors = [x, *bags]
        stacked = torch.stack(vectors, dim=1)  # (B, 8, d)
        dots = stacked @ stacked.transpose(1, 2)  # (B, 8, 8)
        pairs = dots[:, self.pair_rows, self.pair_cols]  # (B, 28)
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


def bce_loss(logits: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of click logits ``(B,)`` against 0/1 floats ``(B,)``."""
    return F.binary_cross_entropy_with_logits(logits, clicks)


def build_dlrm(*, batch_size: int = 8, seed: int = 0, **config: object) -> ZooWorkload:
    """DLRM workload: inputs ``{"dense", "sparse_0", ..., "sparse_6"}``, targets clicks."""
    check_positive(batch_size=batch_size)
    cfg = make_config(DLRMConfig, "DLRM", config)
    torch.manual_seed(seed)
    model = DLRM(cfg)
    gen = torch.Generator().manual_seed(seed)
    inputs = {"dense": torch.randn(batch_size, cfg.dense_features, generator=gen)}
    for name in SPARSE_NAMES:
        shape = (batch_size, cfg.bag_size)
        inputs[name] = torch.randint(0, cfg.table_rows, shape, generator=gen)
    clicks = torch.randint(0, 2, (batch_size,), generator=gen).float()
    return ZooWorkload(model, inputs, clicks, bce_loss)

"""Four-branch multimodal transformer (GraphPipe's MMT, scaled down) and its workload.

Each modality has its own input projection, position embedding and
transformer stack, reading only its own input ``(B, seq_len_i, feature_dim)``;
the four mean-pooled features are concatenated and a head classifies them.
GraphPipe (Appendix A.2) uses 4 branches of 8 layers, hidden 1024, 16 heads,
sequence 256; the defaults here are tiny, and ``seq_lens`` may differ per
branch to make the branches unequal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from orgel.models.layers import (
    Encoder,
    ZooWorkload,
    check_heads,
    check_positive,
    classification_loss,
    make_config,
)

#: Names of the four modality inputs, in order.
MODALITY_NAMES = ("modality_0", "modality_1", "modality_2", "modality_3")


@dataclass(frozen=True)
class MMTConfig:
    """Sizes of the MMT; ``seq_lens`` has one length per modality."""

    feature_dim: int = 16
    seq_lens: tuple[int, int, int, int] = (8, 8, 8, 8)
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_classes: int = 10
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        check_positive(
            feature_dim=self.feature_dim, d_model=self.d_model, n_layers=self.n_layers,
            n_heads=self.n_heads, n_classes=self.n_classes, mlp_ratio=self.mlp_ratio,
        )
        check_heads(self.d_model, self.n_heads)
        if len(self.seq_lens) != len(MODALITY_NAMES):
            raise ValueError(f"seq_lens needs one length per modality (4), got {self.seq_lens}")
        check_positive(**{f"seq_lens[{i}]": n for i, n in enumerate(self.seq_lens)})


class Branch(nn.Module):
    """One modality: ``(B, T, feature_dim)`` -> mean-pooled ``(B, d_model)``."""

    def __init__(self, config: MMTConfig, seq_len: int) -> None:
        super().__init__()
        self.proj = nn.Linear(config.feature_dim, config.d_model)
        self.pos = nn.Parameter(torch.randn(1, seq_len, config.d_model) * 0.02)
        self.encoder = Encoder(
            config.d_model, config.n_heads, config.n_layers, causal=False,
            mlp_ratio=config.mlp_ratio,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.proj(x) + self.pos).mean(dim=1)


class MMT(nn.Module):
    """``forward(modality_0..modality_3) -> logits[B, n_classes]``."""

    def __init__(self, config: MMTConfig) -> None:
        super().__init__()
        self.config = config
        self.branches = nn.ModuleList(Branch(config, n) for n in config.seq_lens)
        self.head = nn.Sequential(
            nn.LayerNorm(4 * config.d_model), nn.Linear(4 * config.d_model, config.n_classes)
        )

    def forward(
        self,
        modality_0: torch.Tensor,
        modality_1: torch.Tensor,
        modality_2: torch.Tensor,
        modality_3: torch.Tensor,
    ) -> torch.Tensor:
        xs = (modality_0, modality_1, modality_2, modality_3)
        pooled = [branch(x) for branch, x in zip(self.branches, xs, strict=True)]
        return self.head(torch.cat(pooled, dim=1))


def build_mmt(*, batch_size: int = 4, seed: int = 0, **config: object) -> ZooWorkload:
    """MMT workload: inputs ``{"modality_0", ..., "modality_3"}``, integer labels."""
    check_positive(batch_size=batch_size)
    if isinstance(config.get("seq_lens"), list):
        config["seq_lens"] = tuple(config["seq_lens"])  # type: ignore[arg-type]
    cfg = make_config(MMTConfig, "MMT", config)
    torch.manual_seed(seed)
    model = MMT(cfg)
    gen = torch.Generator().manual_seed(seed)
    inputs = {
        name: torch.randn(batch_size, n, cfg.feature_dim, generator=gen)
        for name, n in zip(MODALITY_NAMES, cfg.seq_lens, strict=True)
    }
    labels = torch.randint(0, cfg.n_classes, (batch_size,), generator=gen)
    return ZooWorkload(model, inputs, labels, classification_loss)

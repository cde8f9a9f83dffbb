"""Vision Transformer (ViT) classifier and its classification workload.

Patches come from a strided Conv2d (one matmul per patch), a learned CLS token
and position embedding are added, pre-LN transformer blocks run over the
sequence, and a linear head reads the final CLS vector.
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


@dataclass(frozen=True)
class ViTConfig:
    """Size of a ViT; the defaults are a tiny model for tests."""

    image_size: int = 16
    patch_size: int = 4
    channels: int = 3
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_classes: int = 10
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        check_positive(
            image_size=self.image_size, patch_size=self.patch_size, channels=self.channels,
            d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
            n_classes=self.n_classes, mlp_ratio=self.mlp_ratio,
        )
        check_heads(self.d_model, self.n_heads)
        if self.image_size % self.patch_size != 0:
            raise ValueError(
                f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}"
            )

    @property
    def n_patches(self) -> int:
        """Patches per image."""
        return (self.image_size // self.patch_size) ** 2


class ViTBackbone(nn.Module):
    """Pixels ``(B, C, H, W)`` -> the final CLS feature ``(B, d_model)``."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.patch = nn.Conv2d(
            config.channels, config.d_model, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.cls = nn.Parameter(torch.zeros(1, 1, config.d_model))
        self.pos = nn.Parameter(torch.randn(1, config.n_patches + 1, config.d_model) * 0.02)
        self.encoder = Encoder(
            config.d_model, config.n_heads, config.n_layers, causal=False,
            mlp_ratio=config.mlp_ratio,
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # (B, patches, d)
        cls = self.cls.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos
        return self.encoder(x)[:, 0]


class ViT(nn.Module):
    """ViT classifier: ``forward(pixels[B, C, H, W]) -> logits[B, n_classes]``."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.backbone = ViTBackbone(config)
        self.head = nn.Linear(config.d_model, config.n_classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(pixels))


def random_images(
    batch_size: int, config: ViTConfig, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixels ``(B, C, H, W)`` and integer labels ``(B,)``."""
    gen = torch.Generator().manual_seed(seed)
    size = config.image_size
    pixels = torch.randn(batch_size, config.channels, size, size, generator=gen)
    labels = torch.randint(0, config.n_classes, (batch_size,), generator=gen)
    return pixels, labels


def build_vit(*, batch_size: int = 4, seed: int = 0, **config: object) -> ZooWorkload:
    """ViT workload with random weights, images and labels; ``config`` is ViTConfig fields."""
    check_positive(batch_size=batch_size)
    cfg = make_config(ViTConfig, "ViT", config)
    torch.manual_seed(seed)
    model = ViT(cfg)
    pixels, labels = random_images(batch_size, cfg, seed=seed)
    return ZooWorkload(model, (pixels,), labels, classification_loss)

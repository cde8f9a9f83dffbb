"""U-Net with long skip connections and its denoising (regression) workload.

The encoder halves the resolution ``depth`` times; the decoder doubles it back
and concatenates, at each level, the encoder feature of the same resolution.
Those long skips are edges that jump over most of the graph: a pipeline split
must send them straight to the stage that needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models.layers import ZooWorkload, check_positive, make_config


@dataclass(frozen=True)
class UNetConfig:
    """Size of a U-Net; the defaults are tiny for tests."""

    image_size: int = 16
    channels: int = 3
    base_width: int = 8
    depth: int = 2
    groups: int = 4

    def __post_init__(self) -> None:
        check_positive(
            image_size=self.image_size, channels=self.channels, base_width=self.base_width,
            depth=self.depth, groups=self.groups,
        )
        if self.image_size % (2**self.depth) != 0:
            raise ValueError(
                f"image_size={self.image_size} must be divisible by 2**depth={2**self.depth}"
            )
        if self.base_width % self.groups != 0:
            raise ValueError(
                f"base_width={self.base_width} must be divisible by groups={self.groups}"
            )


class ConvBlock(nn.Module):
    """Two 3x3 convolutions, each followed by GroupNorm and SiLU."""

    def __init__(self, c_in: int, c_out: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    """``forward(images[B, C, H, W]) -> images[B, C, H, W]``."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.base_width * 2**i for i in range(config.depth + 1)]
        self.down = nn.ModuleList()
        c_in = config.channels
        for width in widths[:-1]:
            self.down.append(ConvBlock(c_in, width, config.groups))
            c_in = width
        self.middle = ConvBlock(widths[-2], widths[-1], config.groups)
        self.upsample = nn.ModuleList()
        self.up = nn.ModuleList()
        for width in reversed(widths[:-1]):
            self.upsample.append(nn.ConvTranspose2d(width * 2, width, 2, stride=2))
            # Input is the upsampled feature concatenated with the encoder skip.
            self.up.append(ConvBlock(width * 2, width, config.groups))
        self.out = nn.Conv2d(widths[0], config.channels, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        skips = []
        x = images
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.middle(x)
        for upsample, block, skip in zip(self.upsample, self.up, reversed(skips), strict=True):
            x = block(torch.cat([upsample(x), skip], dim=1))
        return self.out(x)


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over every element (so also averaged over the batch)."""
    return F.mse_loss(prediction, target)


def build_unet(
    *, batch_size: int = 4, seed: int = 0, noise: float = 0.5, **config: object
) -> ZooWorkload:
    """Denoising workload: inputs are clean images plus noise, targets the clean images."""
    check_positive(batch_size=batch_size)
    cfg = make_config(UNetConfig, "UNet", config)
    torch.manual_seed(seed)
    model = UNet(cfg)
    gen = torch.Generator().manual_seed(seed)
    size = cfg.image_size
    clean = torch.rand(batch_size, cfg.channels, size, size, generator=gen)
    noisy = clean + noise * torch.randn(clean.shape, generator=gen)
    return ZooWorkload(model, (noisy,), clean, mse_loss)

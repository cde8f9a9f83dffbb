"""ResNet-style CNN with BatchNorm and residual blocks, and its classification workload.

BatchNorm keeps running statistics (buffers updated in the forward), which
makes this the zoo's model with mutable state. Its batch statistics also make
a micro-batched step differ from one full-batch step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models.layers import ZooWorkload, check_positive, classification_loss, make_config


@dataclass(frozen=True)
class ResNetConfig:
    """Size of a ResNet; ``widths`` has one entry per stage (each stage halves H and W)."""

    image_size: int = 16
    channels: int = 3
    widths: tuple[int, ...] = (8, 16)
    blocks_per_stage: int = 1
    n_classes: int = 10

    def __post_init__(self) -> None:
        check_positive(
            image_size=self.image_size, channels=self.channels,
            blocks_per_stage=self.blocks_per_stage, n_classes=self.n_classes,
        )
        if not self.widths:
            raise ValueError("widths must name at least one stage width, e.g. (16, 32)")
        check_positive(**{f"widths[{i}]": w for i, w in enumerate(self.widths)})


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity (or 1x1 conv) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """``forward(images[B, C, H, W]) -> logits[B, n_classes]``."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        first = config.widths[0]
        self.stem = nn.Sequential(
            nn.Conv2d(config.channels, first, 3, padding=1, bias=False),
            nn.BatchNorm2d(first),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        c_in = first
        for i, width in enumerate(config.widths):
            for j in range(config.blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(BasicBlock(c_in, width, stride))
                c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, config.n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(images))
        return self.fc(x.mean(dim=(2, 3)))


def build_resnet(*, batch_size: int = 4, seed: int = 0, **config: object) -> ZooWorkload:
    """ResNet workload with random weights, images and labels; ``config`` is ResNetConfig."""
    check_positive(batch_size=batch_size)
    if isinstance(config.get("widths"), list):
        config["widths"] = tuple(config["widths"])  # type: ignore[arg-type]
    cfg = make_config(ResNetConfig, "ResNet", config)
    torch.manual_seed(seed)
    model = ResNet(cfg)
    gen = torch.Generator().manual_seed(seed)
    size = cfg.image_size
    images = torch.randn(batch_size, cfg.channels, size, size, generator=gen)
    labels = torch.randint(0, cfg.n_classes, (batch_size,), generator=gen)
    return ZooWorkload(model, (images,), labels, classification_loss)

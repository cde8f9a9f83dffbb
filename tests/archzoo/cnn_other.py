"""Compact CNNs beyond classifying images: U-Net, the DCGAN pair, an MLP with BatchNorm, ConvNeXt.

A U-Net against a binary mask, a DCGAN generator from a latent and discriminator on
real-or-fake labels, Linear-BatchNorm1d layers on features, and ConvNeXt with
LayerNorm over channels; built as :mod:`archzoo.cnn` describes (its shared layers
and :func:`~archzoo.cnn.registrar`). Their data and losses are defined here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from archzoo.cnn import (
    BATCH,
    CLASSES,
    LRELU,
    SIZE,
    _images,
    _labels,
    _network,
    conv_bn_act,
    registrar,
)
from orgel.models import ZooWorkload


def _mse_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(outputs, targets)


def _bce_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy with logits, every element weighted the same."""
    return F.binary_cross_entropy_with_logits(outputs.flatten(), targets.flatten())


def _image_mask(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 3, 32, 32)`` images and a binary ``(4, 1, 32, 32)`` mask."""
    gen = torch.Generator().manual_seed(seed + 2000)
    return _images(seed), (torch.rand((BATCH, 1, SIZE, SIZE), generator=gen) > 0.5).float()


def _latent_image(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(4, 16, 1, 1)`` latent and a ``(4, 3, 32, 32)`` target image in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((BATCH, 16, 1, 1), generator=gen), torch.tanh(_images(seed + 2000))


def _image_real_fake(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 3, 32, 32)`` images and float 0/1 real-or-fake labels."""
    return _images(seed), _labels(seed, 2).float()


def _feature_labels(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 32)`` standard-normal features and 10-class labels."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((BATCH, 32), generator=gen), _labels(seed)


BUILDERS: dict[str, Callable[[], ZooWorkload]] = {}
_register = registrar(BUILDERS)


# --- U-Net, DCGAN, ConvNeXt ------------------------------------------------------------------


def double_conv(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 conv-BN-ReLU."""
    return nn.Sequential(conv_bn_act(cin, cout), conv_bn_act(cout, cout))


class Up(nn.Module):
    """U-Net up step: 2x2 transposed conv, concatenate the skip, double conv."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = double_conv(cin, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """U-Net with BatchNorm: three max-pool downs, three transposed-conv ups, skip concats."""

    def __init__(self, cin: int = 3, cout: int = 1, width: int = 8) -> None:
        super().__init__()
        w = [width * 2**i for i in range(4)]
        self.inc = double_conv(cin, w[0])
        self.down1 = nn.Sequential(nn.MaxPool2d(2), double_conv(w[0], w[1]))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), double_conv(w[1], w[2]))
        self.down3 = nn.Sequential(nn.MaxPool2d(2), double_conv(w[2], w[3]))
        self.up1 = Up(w[3], w[2])
        self.up2 = Up(w[2], w[1])
        self.up3 = Up(w[1], w[0])
        self.outc = nn.Conv2d(w[0], cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x = self.up1(self.down3(x3), x3)
        x = self.up2(x, x2)
        return self.outc(self.up3(x, x1))


def _convt_bn_relu(cin: int, cout: int, stride: int, padding: int) -> nn.Sequential:
    """4x4 ConvTranspose2d (no bias), BatchNorm2d, ReLU."""
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, stride, padding, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (permute to NHWC and back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                         self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, channels-last LayerNorm, Linear-GELU-Linear, layer scale, residual."""

    def __init__(self, dim: int, layer_scale: float = 0.1) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))
        self.drop_path = nn.Identity()  # drop-path probability 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.gamma * self.pwconv2(self.act(self.pwconv1(h)))
        return x + self.drop_path(h.permute(0, 3, 1, 2))


# --- models (each registered as a builder under its name) ------------------------------------


@_register(18, _image_mask, _bce_loss)
def unet_bn() -> nn.Module:
    """U-Net with BatchNorm on images against a binary mask, BCE with logits."""
    return UNet()


@_register(19, _latent_image, _mse_loss)
def dcgan_generator() -> nn.Module:
    """DCGAN generator: a 16x1x1 latent to a 3x32x32 image (transposed conv-BN-ReLU, Tanh)."""
    return nn.Sequential(_convt_bn_relu(16, 64, 1, 0), _convt_bn_relu(64, 32, 2, 1),
                         _convt_bn_relu(32, 16, 2, 1),
                         nn.ConvTranspose2d(16, 3, 4, 2, 1, bias=False), nn.Tanh())


@_register(20, _image_real_fake, _bce_loss)
def dcgan_discriminator() -> nn.Module:
    """DCGAN discriminator: stride-2 conv-BN-LeakyReLU (no BN first), one logit per image."""
    return nn.Sequential(nn.Conv2d(3, 8, 4, 2, 1, bias=False), LRELU(),
                         conv_bn_act(8, 16, 4, 2, act=LRELU, padding=1),
                         conv_bn_act(16, 32, 4, 2, act=LRELU, padding=1),
                         nn.Conv2d(32, 1, 4, 1, 0, bias=False), nn.Flatten(0))


@_register(21, _feature_labels)
def mlp_bn() -> nn.Module:
    """Linear-BatchNorm1d-ReLU stack and a classifier on ``(4, 32)`` features."""
    layers: list[nn.Module] = []
    for cin, cout in ((32, 64), (64, 64), (64, 32)):
        layers += [nn.Linear(cin, cout, bias=False), nn.BatchNorm1d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Linear(32, CLASSES))


@_register(22)
def convnext_like() -> nn.Module:
    """ConvNeXt: 4x4 patchify stem, LayerNorm2d + 2x2 conv downsampling, ConvNeXt blocks."""
    stages: list[nn.Module] = []
    dims = (16, 32, 64)
    for i, dim in enumerate(dims):
        down = [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, 2)] if i else []
        stages.append(nn.Sequential(*down, ConvNeXtBlock(dim), ConvNeXtBlock(dim)))
    stem = nn.Sequential(nn.Conv2d(3, 16, 4, 4), LayerNorm2d(16, eps=1e-6))
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.LayerNorm(64, eps=1e-6),
                         nn.Linear(64, CLASSES))
    return _network(stem, stages, head)

"""Compact mobile and multi-branch CNNs: inverted residuals, shuffle units, OSA, fire, inception.

MobileNetV2 and V3, MNASNet, EfficientNet, ShuffleNetV2, VoVNetV2, SqueezeNet 1.1,
VGG with BatchNorm and a GoogLeNet-like net: images and 10-class labels, built as
:mod:`archzoo.cnn` describes (its shared layers and :func:`~archzoo.cnn.registrar`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from archzoo.cnn import (
    CLASSES,
    HSWISH,
    RELU,
    RELU6,
    SILU,
    Act,
    SqueezeExcite,
    _head,
    _network,
    conv_bn_act,
    registrar,
)
from orgel.models import ZooWorkload

BUILDERS: dict[str, Callable[[], ZooWorkload]] = {}
_register = registrar(BUILDERS)


# --- inverted residuals: MobileNetV2 / V3, MNASNet, EfficientNet -------------------------------


def _se_v3(hidden: int, cin: int) -> nn.Module:
    """MobileNetV3 squeeze-excite: squeeze to hidden/4 rounded up to 8, ReLU, Hardsigmoid."""
    return SqueezeExcite(hidden, (hidden // 4 + 7) // 8 * 8, RELU, nn.Hardsigmoid)


def _se_effnet(hidden: int, cin: int) -> nn.Module:
    """EfficientNet squeeze-excite: squeeze to a quarter of the block input, SiLU, Sigmoid."""
    return SqueezeExcite(hidden, max(1, cin // 4), SILU, nn.Sigmoid)


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand, depthwise kxk, optional SE, linear 1x1 projection."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, k: int, act: Act,
                 se: Callable[[int, int], nn.Module] | None = None) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(conv_bn_act(cin, hidden, 1, act=act))
        layers.append(conv_bn_act(hidden, hidden, k, stride, groups=hidden, act=act))
        if se is not None:
            layers.append(se(hidden, cin))
        layers.append(conv_bn_act(hidden, cout, 1, act=None))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = nn.Identity()  # drop-path probability 0
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + self.stochastic_depth(out) if self.use_residual else out


def _mb_stages(cin: int, specs: Sequence[tuple[int, int, int, int, int]], act: Act,
               se: Callable[[int, int], nn.Module] | None = None) -> tuple[list[nn.Module], int]:
    """Stages of MBConv from ``(expand, kernel, cout, repeats, stride)``; returns them and cout."""
    stages: list[nn.Module] = []
    for expand, k, cout, n, stride in specs:
        blocks = [MBConv(cin if i == 0 else cout, cout, stride if i == 0 else 1, expand, k, act, se)
                  for i in range(n)]
        stages.append(nn.Sequential(*blocks))
        cin = cout
    return stages, cin


# --- ShuffleNetV2, VoVNet, SqueezeNet, Inception ---------------------------------------------


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Interleave the channels of ``groups`` groups (view, transpose, contiguous, view)."""
    b, c, h, w = x.shape
    x = x.view(b, groups, c // groups, h, w).transpose(1, 2).contiguous()
    return x.view(b, c, h, w)


class ShuffleBlock(nn.Module):
    """ShuffleNetV2 unit: split (stride 1) or duplicate (stride 2) the input, concat, shuffle."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        half = cout // 2
        self.stride = stride
        self.branch1 = nn.Sequential()
        if stride > 1:
            self.branch1 = nn.Sequential(conv_bn_act(cin, cin, 3, stride, cin, act=None),
                                         conv_bn_act(cin, half, 1))
        c2 = cin if stride > 1 else half
        self.branch2 = nn.Sequential(conv_bn_act(c2, half, 1),
                                     conv_bn_act(half, half, 3, stride, half, act=None),
                                     conv_bn_act(half, half, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class EffectiveSE(nn.Module):
    """VoVNetV2 eSE: global pool, one 1x1 conv, Hardsigmoid gate multiplied into ``x``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc = nn.Conv2d(channels, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc(x.mean((2, 3), keepdim=True)))


class OSAModule(nn.Module):
    """One-shot aggregation: a chain of 3x3 convs, all outputs concatenated once, 1x1, eSE."""

    def __init__(self, cin: int, mid: int, cout: int, n: int = 3, residual: bool = False) -> None:
        super().__init__()
        self.convs = nn.ModuleList(conv_bn_act(cin if i == 0 else mid, mid) for i in range(n))
        self.concat = conv_bn_act(cin + n * mid, cout, 1)
        self.ese = EffectiveSE(cout)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        h = x
        for conv in self.convs:
            h = conv(h)
            features.append(h)
        out = self.ese(self.concat(torch.cat(features, dim=1)))
        return out + x if self.residual else out


class Fire(nn.Module):
    """SqueezeNet fire module: 1x1 squeeze, then 1x1 and 3x3 expands concatenated."""

    def __init__(self, cin: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], dim=1)


class InceptionBlock(nn.Module):
    """GoogLeNet inception: 1x1, 1x1->3x3, 1x1->5x5 and maxpool->1x1 branches concatenated."""

    def __init__(self, cin: int, c1: int, c3: tuple[int, int], c5: tuple[int, int],
                 pool: int) -> None:
        super().__init__()
        self.branch1 = conv_bn_act(cin, c1, 1)
        self.branch3 = nn.Sequential(conv_bn_act(cin, c3[0], 1), conv_bn_act(c3[0], c3[1], 3))
        self.branch5 = nn.Sequential(conv_bn_act(cin, c5[0], 1), conv_bn_act(c5[0], c5[1], 5))
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), conv_bn_act(cin, pool, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = (self.branch1, self.branch3, self.branch5, self.branch_pool)
        return torch.cat([branch(x) for branch in branches], dim=1)


# --- models (each registered as a builder under its name) ------------------------------------


@_register(9)
def mobilenet_v2() -> nn.Module:
    """MobileNetV2: ReLU6 inverted residuals with linear bottlenecks, 1x1 conv to 64."""
    specs = [(1, 3, 8, 1, 1), (6, 3, 12, 2, 2), (6, 3, 16, 2, 2), (6, 3, 24, 1, 1)]
    stages, c = _mb_stages(16, specs, RELU6)
    stages.append(conv_bn_act(c, 64, 1, act=RELU6))
    return _network(conv_bn_act(3, 16, 3, 2, act=RELU6), stages, _head(64))


@_register(10)
def mobilenet_v3() -> nn.Module:
    """MobileNetV3: ReLU stages, then Hardswish stages with Hardsigmoid squeeze-excite."""
    early, c = _mb_stages(16, [(1, 3, 16, 1, 2), (4, 3, 24, 2, 2)], RELU)
    late, c = _mb_stages(c, [(4, 5, 32, 2, 2), (6, 3, 40, 1, 1)], HSWISH, _se_v3)
    stages = [*early, *late, conv_bn_act(c, 96, 1, act=HSWISH)]
    return _network(conv_bn_act(3, 16, 3, 2, act=HSWISH), stages, _head(96, 64, HSWISH))


@_register(11)
def mnasnet() -> nn.Module:
    """MNASNet: ReLU inverted residuals with 3x3 and 5x5 depthwise kernels."""
    specs = [(1, 3, 8, 1, 1), (3, 3, 12, 2, 2), (3, 5, 20, 2, 2), (6, 5, 24, 1, 1)]
    stages, c = _mb_stages(16, specs, RELU)
    stages.append(conv_bn_act(c, 64, 1))
    return _network(conv_bn_act(3, 16, 3, 2), stages, _head(64))


@_register(12)
def efficientnet() -> nn.Module:
    """EfficientNet: SiLU MBConv with squeeze-excite, stochastic depth 0."""
    specs = [(1, 3, 8, 1, 1), (6, 3, 12, 2, 2), (6, 5, 20, 2, 2), (6, 3, 24, 1, 1)]
    stages, c = _mb_stages(16, specs, SILU, _se_effnet)
    stages.append(conv_bn_act(c, 64, 1, act=SILU))
    return _network(conv_bn_act(3, 16, 3, 2, act=SILU), stages, _head(64))


@_register(13)
def shufflenet_v2() -> nn.Module:
    """ShuffleNetV2: conv + max-pool stem, three stages of shuffle units, 1x1 conv5."""
    stages: list[nn.Module] = []
    cin = 16
    for cout in (32, 64, 96):
        stages.append(nn.Sequential(ShuffleBlock(cin, cout, 2), ShuffleBlock(cout, cout, 1)))
        cin = cout
    stages.append(conv_bn_act(cin, 128, 1))
    stem = nn.Sequential(conv_bn_act(3, 16, 3, 2), nn.MaxPool2d(3, 2, 1))
    return _network(stem, stages, _head(128))


@_register(14)
def vovnet() -> nn.Module:
    """VoVNetV2: OSA modules with eSE, max pool between stages, identity on repeated modules."""
    pool = partial(nn.MaxPool2d, 3, 2, ceil_mode=True)
    stages = [OSAModule(16, 8, 32),
              nn.Sequential(pool(), OSAModule(32, 12, 48), OSAModule(48, 12, 48, residual=True)),
              nn.Sequential(pool(), OSAModule(48, 16, 64))]
    stem = nn.Sequential(conv_bn_act(3, 16, 3, 2), conv_bn_act(16, 16))
    return _network(stem, stages, _head(64))


@_register(15)
def squeezenet() -> nn.Module:
    """SqueezeNet 1.1: fire modules between max pools, a 1x1-conv classifier with ReLU."""
    pool = partial(nn.MaxPool2d, 3, 2, ceil_mode=True)
    stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2), nn.ReLU(inplace=True), pool())
    stages = [nn.Sequential(Fire(16, 4, 8), Fire(16, 4, 8), pool()),
              nn.Sequential(Fire(16, 8, 16), Fire(32, 8, 16), pool()), Fire(32, 12, 24)]
    head = nn.Sequential(nn.Dropout(0.0), nn.Conv2d(48, CLASSES, 1), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
    return _network(stem, stages, head)


@_register(16)
def vgg_bn() -> nn.Module:
    """VGG with BatchNorm: conv-BN-ReLU stacks and max pools, a 3-layer MLP classifier."""
    stages: list[nn.Module] = []
    cin = 16
    for cout, n in ((16, 1), (32, 2), (64, 2)):
        convs = [conv_bn_act(cin if i == 0 else cout, cout) for i in range(n)]
        stages.append(nn.Sequential(*convs, nn.MaxPool2d(2, 2)))
        cin = cout
    head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(1),
                         nn.Linear(64 * 4, 64), nn.ReLU(inplace=True), nn.Dropout(0.0),
                         nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Dropout(0.0),
                         nn.Linear(64, CLASSES))
    return _network(conv_bn_act(3, 16), stages, head)


@_register(17)
def inception_like() -> nn.Module:
    """GoogLeNet-like: inception blocks with BN, a max pool between them."""
    stages = [InceptionBlock(16, 8, (8, 12), (4, 6), 6),
              nn.Sequential(nn.MaxPool2d(3, 2, 1), InceptionBlock(32, 12, (12, 16), (4, 8), 8)),
              InceptionBlock(44, 16, (12, 20), (4, 8), 8)]
    return _network(conv_bn_act(3, 16, 3, 2), stages, _head(52))

"""Compact convolutional networks written from their papers, for coverage of ``orgel.pipeline``.

Each builder returns a :class:`orgel.models.ZooWorkload` with random weights
(``torch.manual_seed(0)``), a batch of 4 images (or latents, or features) from a
seeded generator, dropout and stochastic depth at 0, and a loss averaged over
the batch. The widths are tiny, but the module structure and the ops are the
real ones: BatchNorm in train mode, in-place activations, grouped and depthwise
convolutions, channel split and shuffle, squeeze-excite gates, split attention,
dense concatenation, U-Net skips, transposed convolutions, GroupNorm and
LayerNorm over channels. Every model is a sequence of several stages, so it can
be cut into two pipeline stages.

This module holds what the CNN modules share (the images and labels, the
classification loss, :func:`registrar`, ``conv_bn_act``, the head and the
squeeze-excite gate) and the ResNet family and DenseNet; :mod:`archzoo.cnn_mobile`
has the MobileNets, EfficientNet, ShuffleNetV2, VoVNet, SqueezeNet, VGG and an
Inception net; :mod:`archzoo.cnn_other` the U-Net, the DCGAN pair, an MLP with
BatchNorm and ConvNeXt. Each has its own :data:`BUILDERS`.

Each model function (``resnet``, ``densenet``, ...) builds the bare module;
``@_register`` puts a builder of the same name into its module's :data:`BUILDERS`.
All of them are captured by ``torch.compile(fullgraph=True)`` as one graph.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models import ZooWorkload

BATCH = 4
CLASSES = 10
SIZE = 32

Act = Callable[[], nn.Module]
Block = Callable[[int, int, int], nn.Module]
RELU: Act = partial(nn.ReLU, inplace=True)
RELU6: Act = partial(nn.ReLU6, inplace=True)
HSWISH: Act = partial(nn.Hardswish, inplace=True)
SILU: Act = partial(nn.SiLU, inplace=True)
LRELU: Act = partial(nn.LeakyReLU, 0.2, inplace=True)


# --- data, losses, shared layers -------------------------------------------------------------


def _images(seed: int) -> torch.Tensor:
    """Standard-normal images of shape ``(BATCH, 3, SIZE, SIZE)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((BATCH, 3, SIZE, SIZE), generator=gen)


def _labels(seed: int, classes: int = CLASSES) -> torch.Tensor:
    """Random class labels of shape ``(BATCH,)``."""
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, classes, (BATCH,), generator=gen)


def _classify_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``(B, C)`` logits against ``(B,)`` labels."""
    return F.cross_entropy(outputs, targets)


def _image_labels(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 3, 32, 32)`` images and 10-class labels."""
    return _images(seed), _labels(seed)


Maker = Callable[[], nn.Module]
Data = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Register = Callable[..., Callable[[Maker], Maker]]


def registrar(builders: dict[str, Callable[[], ZooWorkload]]) -> Register:
    """A module's ``_register`` decorator, adding its builders to ``builders``."""

    def _register(seed: int, data: Data = _image_labels,
                  loss_fn: Loss = _classify_loss) -> Callable[[Maker], Maker]:
        """Decorator: add a builder for ``make`` to BUILDERS under its name; ``make`` is
        unchanged.

        The builder seeds torch with 0, builds the model in train mode and pairs it
        with ``data(seed)`` (a fresh ``(inputs, targets)`` each call) and ``loss_fn``.
        """

        def register(make: Maker) -> Maker:
            def build() -> ZooWorkload:
                torch.manual_seed(0)
                model = make().train()
                inputs, targets = data(seed)
                return ZooWorkload(model, (inputs,), targets, loss_fn)

            build.__name__ = build.__qualname__ = make.__name__
            build.__doc__ = make.__doc__
            builders[make.__name__] = build
            return make

        return register

    return _register


BUILDERS: dict[str, Callable[[], ZooWorkload]] = {}
_register = registrar(BUILDERS)


def conv_bn_act(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1,
                act: Act | None = RELU, padding: int | None = None) -> nn.Sequential:
    """Conv2d (no bias), BatchNorm2d and an optional activation."""
    pad = k // 2 if padding is None else padding
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, pad, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


def _head(cin: int, hidden: int = 0, act: Act = RELU) -> nn.Sequential:
    """Global average pool, flatten, an optional hidden Linear, Dropout(0) and the classifier."""
    layers: list[nn.Module] = [nn.AdaptiveAvgPool2d(1), nn.Flatten(1)]
    if hidden:
        layers += [nn.Linear(cin, hidden), act()]
        cin = hidden
    layers += [nn.Dropout(0.0), nn.Linear(cin, CLASSES)]
    return nn.Sequential(*layers)


def _network(stem: nn.Module, stages: Sequence[nn.Module], head: nn.Module) -> nn.Sequential:
    """``stem``, ``stage1`` ... ``stageN`` and ``head`` as named children of one Sequential."""
    layers: OrderedDict[str, nn.Module] = OrderedDict(stem=stem)
    for i, stage in enumerate(stages):
        layers[f"stage{i + 1}"] = stage
    layers["head"] = head
    return nn.Sequential(layers)


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """Identity, or a 1x1 conv + BN projection when the shape changes."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return conv_bn_act(cin, cout, 1, stride, act=None)


class SqueezeExcite(nn.Module):
    """Squeeze-excite: pool, 1x1 reduce, activation, 1x1 expand, gate; scales ``x`` per channel."""

    def __init__(self, channels: int, squeeze: int, act: Act, gate: Act) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.act = act()
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.act(self.fc1(self.avgpool(x)))))
        return x * scale


# --- ResNet family ---------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv-BN, shortcut added in place, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv_bn_act(cin, cout, 3, stride)
        self.conv2 = conv_bn_act(cout, cout, 3, act=None)
        self.downsample = _shortcut(cin, cout, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.conv1(x))
        out += self.downsample(x)
        return self.relu(out)


class SplitAttention(nn.Module):
    """ResNeSt split attention: a radix-grouped 3x3 conv, softmax over the radix of a pooled gap."""

    def __init__(self, cin: int, cout: int, stride: int, radix: int = 2, groups: int = 1) -> None:
        super().__init__()
        self.radix, self.groups = radix, groups
        attn = max(cin * radix // 4, 8)
        self.conv = conv_bn_act(cin, cout * radix, 3, stride, groups=groups * radix)
        self.fc1 = nn.Conv2d(cout, attn, 1, groups=groups)
        self.bn1 = nn.BatchNorm2d(attn)
        self.act1 = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(attn, cout * radix, 1, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        b, rc, h, w = x.shape
        x = x.view(b, self.radix, rc // self.radix, h, w)
        gap = x.sum(dim=1).mean((2, 3), keepdim=True)
        attn = self.fc2(self.act1(self.bn1(self.fc1(gap))))
        attn = attn.view(b, self.groups, self.radix, -1).transpose(1, 2).softmax(dim=1)
        return (x * attn.reshape(b, self.radix, rc // self.radix, 1, 1)).sum(dim=1)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (grouped, or split attention when ``radix`` > 1), 1x1 expand, shortcut.

    ``width`` is the middle width as a fraction of ``cout``; ``group_width``, when set,
    fixes the channels per group (RegNet) instead of the number of groups (ResNeXt).
    """

    def __init__(self, cin: int, cout: int, stride: int, width: float = 0.25, groups: int = 1,
                 group_width: int = 0, radix: int = 1) -> None:
        super().__init__()
        mid = int(cout * width)
        groups = mid // group_width if group_width else groups
        self.conv1 = conv_bn_act(cin, mid, 1)
        self.conv2: nn.Module = (SplitAttention(mid, mid, stride, radix, groups) if radix > 1
                                 else conv_bn_act(mid, mid, 3, stride, groups))
        self.conv3 = conv_bn_act(mid, cout, 1, act=None)
        self.downsample = _shortcut(cin, cout, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv3(self.conv2(self.conv1(x)))
        out += self.downsample(x)
        return self.relu(out)


def _resnet_stem(width: int) -> nn.Sequential:
    """The ResNet stem: 7x7 stride-2 conv-BN-ReLU and a 3x3 stride-2 max pool."""
    return nn.Sequential(conv_bn_act(3, width, 7, 2), nn.MaxPool2d(3, 2, 1))


def _resnet(block: Block, widths: Sequence[int], stem: nn.Module, cin: int,
            depth: int = 2) -> nn.Sequential:
    """``depth`` blocks per stage; every stage after the first starts with a stride-2 block."""
    stages: list[nn.Module] = []
    for i, cout in enumerate(widths):
        first = block(cin, cout, 2 if i else 1)
        stages.append(nn.Sequential(first, *(block(cout, cout, 1) for _ in range(depth - 1))))
        cin = cout
    return _network(stem, stages, _head(cin))


def _swap_norm(module: nn.Module, groups: int = 4) -> nn.Module:
    """Replace every BatchNorm2d under ``module`` with GroupNorm(groups, C), in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, nn.GroupNorm(groups, child.num_features))
        else:
            _swap_norm(child, groups)
    return module


# --- DenseNet --------------------------------------------------------------------------------


class DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1 then BN-ReLU-Conv3x3 on the concatenation of all previous features."""

    def __init__(self, cin: int, growth: int, bn_size: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
            nn.Conv2d(cin, bn_size * growth, 1, bias=False),
            nn.BatchNorm2d(bn_size * growth), nn.ReLU(inplace=True),
            nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return self.layers(torch.cat(features, 1))


class DenseBlock(nn.Module):
    """``n`` dense layers; returns all features (input and every layer's output) concatenated."""

    def __init__(self, cin: int, n: int, growth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


def _transition(cin: int, cout: int) -> nn.Sequential:
    """DenseNet transition: BN-ReLU-Conv1x1 and a 2x2 average pool."""
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True),
                         nn.Conv2d(cin, cout, 1, bias=False), nn.AvgPool2d(2, 2))


# --- models (each registered as a builder under its name) ------------------------------------


def _bottleneck_resnet(width: float = 0.25, groups: int = 1) -> nn.Module:
    """ResNet with two Bottleneck blocks per stage of the given middle width and groups."""
    block = partial(Bottleneck, width=width, groups=groups)
    return _resnet(block, [32, 64, 128], _resnet_stem(16), 16)


@_register(1)
def resnet() -> nn.Module:
    """ResNet-18-style: BasicBlocks, 1x1 conv + BN downsample shortcuts."""
    return _resnet(BasicBlock, [16, 32, 64], _resnet_stem(16), 16)


@_register(2)
def resnet_bottleneck() -> nn.Module:
    """ResNet-50-style: Bottleneck blocks with expansion 4."""
    return _bottleneck_resnet()


@_register(3)
def resnext() -> nn.Module:
    """ResNeXt: Bottleneck blocks with a 4-group 3x3 conv at half the output width."""
    return _bottleneck_resnet(width=0.5, groups=4)


@_register(4)
def wide_resnet() -> nn.Module:
    """Wide ResNet-50-2-style: Bottleneck blocks with a doubled middle width."""
    return _bottleneck_resnet(width=0.5)


@_register(5)
def resnet_gn() -> nn.Module:
    """The BasicBlock ResNet with GroupNorm(4, C) in place of every BatchNorm2d."""
    return _swap_norm(resnet())


@_register(6)
def regnet() -> nn.Module:
    """RegNetX: 3x3 stride-2 stem, X blocks (bottleneck ratio 1, group width 8)."""
    block = partial(Bottleneck, width=1.0, group_width=8)
    return _resnet(block, [16, 32, 64], conv_bn_act(3, 16, 3, 2), 16)


@_register(7)
def resnest() -> nn.Module:
    """ResNeSt: deep 3-conv stem, Bottleneck blocks with radix-2 split attention."""
    stem = nn.Sequential(conv_bn_act(3, 8, 3, 2), conv_bn_act(8, 8), conv_bn_act(8, 16),
                         nn.MaxPool2d(3, 2, 1))
    return _resnet(partial(Bottleneck, radix=2), [32, 64, 128], stem, 16)


@_register(8)
def densenet() -> nn.Module:
    """DenseNet-BC: two dense blocks of 4 layers (growth 8) with a compressing transition."""
    stages = [DenseBlock(16, 4, 8), _transition(48, 24), DenseBlock(24, 4, 8),
              nn.Sequential(nn.BatchNorm2d(56), nn.ReLU(inplace=True))]
    return _network(conv_bn_act(3, 16, 3, 2), stages, _head(56))

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

Each model function below (``resnet``, ``densenet``, ...) builds the bare
module; ``@_register`` puts a builder of the same name into :data:`BUILDERS`.
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


def _mse_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(outputs, targets)


def _bce_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy with logits, every element weighted the same."""
    return F.binary_cross_entropy_with_logits(outputs.flatten(), targets.flatten())


def _image_labels(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(4, 3, 32, 32)`` images and 10-class labels."""
    return _images(seed), _labels(seed)


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


Maker = Callable[[], nn.Module]
Data = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BUILDERS: dict[str, Callable[[], ZooWorkload]] = {}


def _register(seed: int, data: Data = _image_labels,
              loss_fn: Loss = _classify_loss) -> Callable[[Maker], Maker]:
    """Decorator: add a builder for ``make`` to BUILDERS under its name; ``make`` is unchanged.

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
        BUILDERS[make.__name__] = build
        return make

    return register


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

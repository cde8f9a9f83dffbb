"""Small hand-written models: regions, unusual inputs and outputs, routing, frozen parameters.

Autocast (float32 and bf16) and no-grad regions, dict and tuple outputs, top-2 mixture
of experts routing with a balancing loss, ``nn.EmbeddingBag`` on keyword inputs,
frozen parameters beside unused ones, an MLP-Mixer and one BatchNorm encoder applied
to two views. Built as :mod:`archzoo.misc` describes, from its data and layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from archzoo.misc import (
    BATCH,
    CLASSES,
    DIM,
    SEQ,
    ResidualMLP,
    _ce_loss,
    _features,
    _labels,
    _mlp,
    _workload,
)
from orgel.models import ZooWorkload


def _dict_loss(outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on ``logits`` plus MSE of ``score`` against the label as a float."""
    return _ce_loss(outputs["logits"], targets) + F.mse_loss(outputs["score"], targets.float())


def _moe_loss(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the logits plus 0.01 times the load-balancing loss."""
    logits, aux = outputs
    return _ce_loss(logits, targets) + 0.01 * aux


class AutocastRegion(nn.Module):
    """Rotary-style float32 math under ``autocast(enabled=False)`` (or a bf16 middle Linear)."""

    inv_freq: torch.Tensor

    def __init__(self, bf16: bool) -> None:
        super().__init__()
        self.bf16 = bf16
        self.inp = nn.Linear(16, DIM)
        self.mid = nn.Linear(DIM, DIM)
        if not bf16:
            self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(0, DIM, 2) / DIM))
        self.mlp = ResidualMLP()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = h + self.mid(h).float()
        else:
            with torch.autocast("cpu", enabled=False):
                t = torch.arange(h.shape[1], device=h.device, dtype=torch.float32)
                angles = torch.outer(t, self.inv_freq.float())
                cos, sin = angles.cos(), angles.sin()
                h1, h2 = h.float().chunk(2, dim=-1)
                h = torch.cat((h1 * cos - h2 * sin, h1 * sin + h2 * cos), dim=-1)
            h = self.mid(h)
        return self.head(self.mlp(h).mean(1))


class NoGradRegion(nn.Module):
    """A positional table computed under ``no_grad``, the rest under ``enable_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.pos = nn.Linear(1, DIM)
        self.blocks = nn.Sequential(ResidualMLP(), ResidualMLP())
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.no_grad():
            t = torch.arange(h.shape[1], device=h.device, dtype=h.dtype)[:, None]
            table = torch.sin(self.pos(t))
        with torch.enable_grad():
            h = h + table
            h = self.blocks(h)
        return self.head(h.mean(1))


class TwoHeads(nn.Module):
    """A shared MLP trunk returning a dict of classification logits and a scalar score."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _mlp([16, DIM, DIM, DIM])
        self.logits = nn.Linear(DIM, CLASSES)
        self.score = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.gelu(self.trunk(x))
        return {"logits": self.logits(h), "score": self.score(h).squeeze(-1)}


class TopKMoE(nn.Module):
    """Top-2 of 4 experts per token, combined with ``index_add``; returns a balancing loss."""

    def __init__(self, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(_mlp([DIM, 2 * DIM, DIM]) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        n, e = tokens.shape[0], len(self.experts)
        probs = self.router(tokens).softmax(-1)
        weights, chosen = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        outs = torch.stack([expert(tokens) for expert in self.experts], dim=1)
        index = chosen[..., None].expand(n, self.k, tokens.shape[-1])
        picked = outs.gather(1, index) * weights[..., None]
        rows = torch.arange(n, device=x.device).repeat_interleave(self.k)
        mixed = torch.zeros_like(tokens).index_add(0, rows, picked.reshape(n * self.k, -1))
        routed = torch.zeros_like(probs).scatter(1, chosen, 1.0).mean(0) / self.k
        aux = e * (routed * probs.mean(0)).sum()
        return mixed.reshape(x.shape), aux


class MoEModel(nn.Module):
    """Linear, residual MLP, top-2 MoE, residual MLP, head; returns ``(logits, aux)``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, DIM)
        self.pre = ResidualMLP()
        self.moe = TopKMoE()
        self.post = ResidualMLP()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.pre(self.inp(x))
        mixed, aux = self.moe(h)
        return self.head(self.post(h + mixed).mean(1)), aux


class DLRMLike(nn.Module):
    """Bottom MLP for dense features, 3 EmbeddingBags, pairwise dot interaction, top MLP."""

    pairs: torch.Tensor

    def __init__(self, tables: int = 3, rows: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.bottom = _mlp([8, DIM, dim])
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        pairs = (tables + 1) * tables // 2
        self.top = _mlp([dim + pairs, DIM, DIM, 2])
        self.register_buffer("pairs", torch.triu_indices(tables + 1, tables + 1, 1),
                             persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        b, _, k = sparse.shape
        offsets = torch.arange(0, b * k, k, device=sparse.device)
        x = F.gelu(self.bottom(dense))
        feats = [x] + [bag(sparse[:, i].reshape(-1), offsets) for i, bag in enumerate(self.bags)]
        t = torch.stack(feats, dim=1)
        z = t @ t.transpose(1, 2)
        dots = z[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat((x, dots), dim=1))


class FrozenBackbone(nn.Module):
    """A frozen 2-layer backbone (``requires_grad=False``) followed by trainable layers.

    Like many Hugging Face models it also holds tensors its forward never reads:
    a spare head (a pooler) and a buffer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _mlp([16, DIM, DIM])
        self.backbone.requires_grad_(False)
        self.neck = ResidualMLP()
        self.hidden = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)
        self.unused_pooler = nn.Linear(DIM, DIM)
        self.register_buffer("unused_ids", torch.arange(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.neck(F.gelu(self.backbone(x)))
        return self.head(F.gelu(self.hidden(h)))


class MixerBlock(nn.Module):
    """MLP-Mixer block: token mixing across the transposed sequence, then channel mixing."""

    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.tokens = _mlp([tokens, 2 * tokens, tokens])
        self.channels = ResidualMLP(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return self.channels(x)


class Mixer(nn.Module):
    """Stem, 3 mixer blocks, LayerNorm, mean over tokens, head."""

    def __init__(self, tokens: int = 16, dim: int = DIM) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim) for _ in range(3)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.stem(x))).mean(1))


class SiameseBN(nn.Module):
    """One encoder with BatchNorm applied to two views (SimCLR-style): its statistics move
    twice per forward, so every update of them must stay in one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, DIM), nn.BatchNorm1d(DIM), nn.ReLU(),
                                     nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.GELU())
        self.head = nn.Linear(2 * DIM, CLASSES)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.encoder(a), self.encoder(b)], dim=-1))


def autocast_region() -> ZooWorkload:
    """Rotary-style float32 math under ``torch.autocast("cpu", enabled=False)``."""
    return _workload(lambda: AutocastRegion(bf16=False), (_features(11, (SEQ, 16)),),
                     _labels(11), _ce_loss)


def autocast_bf16_region() -> ZooWorkload:
    """A middle Linear under ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    return _workload(lambda: AutocastRegion(bf16=True), (_features(12, (SEQ, 16)),),
                     _labels(12), _ce_loss)


def no_grad_region() -> ZooWorkload:
    """A positional table under ``no_grad``, then ``enable_grad``."""
    return _workload(NoGradRegion, (_features(13, (SEQ, 16)),), _labels(13), _ce_loss)


def multi_output_dict() -> ZooWorkload:
    """Two heads returned in a dict; the loss combines both."""
    return _workload(TwoHeads, (_features(14, (16,)),), _labels(14), _dict_loss)


def moe_topk() -> ZooWorkload:
    """Top-2 of 4 experts with a load-balancing loss returned beside the logits."""
    return _workload(MoEModel, (_features(15, (SEQ, 16)),), _labels(15), _moe_loss)


def dlrm_like() -> ZooWorkload:
    """DLRM-style: dense ``(4, 8)`` and sparse ``(4, 3, 3)`` indices as keyword inputs."""
    gen = torch.Generator().manual_seed(16)
    sparse = torch.randint(0, 20, (BATCH, 3, 3), generator=gen)
    inputs = {"dense": _features(16, (8,)), "sparse": sparse}
    return _workload(DLRMLike, inputs, _labels(16, 2), _ce_loss)


def frozen_part() -> ZooWorkload:
    """Frozen backbone followed by trainable layers; a pooler and a buffer left unused."""
    return _workload(FrozenBackbone, (_features(17, (16,)),), _labels(17), _ce_loss)


def siamese_batchnorm() -> ZooWorkload:
    """One BatchNorm encoder applied to two views, a head on both."""
    return _workload(SiameseBN, (_features(19, (16,)), _features(20, (16,))), _labels(19),
                     _ce_loss)


def layernorm_gelu_mlp_mixer() -> ZooWorkload:
    """MLP-Mixer on a ``(4, 16, 32)`` input."""
    return _workload(Mixer, (_features(18, (16, DIM)),), _labels(18), _ce_loss)

BUILDERS: dict[str, Callable[[], ZooWorkload]] = {
    build.__name__: build
    for build in (
        autocast_region, autocast_bf16_region, no_grad_region, multi_output_dict, moe_topk,
        dlrm_like, frozen_part, layernorm_gelu_mlp_mixer, siamese_batchnorm,
    )
}

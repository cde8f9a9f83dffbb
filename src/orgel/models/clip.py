"""CLIP-like two-tower model (text and image) and its contrastive workload.

The two towers are independent branches of the graph: ``text_tower`` reads only
the token ids, ``image_tower`` reads only the pixels, and they meet only at the
similarity logits at the end of ``forward``. A planner can therefore put the
towers on different ranks and run them concurrently; a user can freeze one
(``model.text_tower.requires_grad_(False)``).

The contrastive loss takes the other pairs of the same batch as negatives, so
it depends on how a batch is cut into micro-batches (as real CLIP training
depends on the per-device batch): a micro-batched step is not the same as one
full-batch step for this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models.layers import (
    Encoder,
    ZooWorkload,
    check_heads,
    check_positive,
    make_config,
)
from orgel.models.vit import ViTBackbone, ViTConfig


@dataclass(frozen=True)
class CLIPConfig:
    """Sizes of both towers and the shared embedding; defaults are tiny for tests."""

    embed_dim: int = 32
    # text tower
    vocab_size: int = 128
    text_len: int = 16
    text_d_model: int = 32
    text_layers: int = 2
    text_heads: int = 4
    # image tower
    image_size: int = 16
    patch_size: int = 4
    channels: int = 3
    image_d_model: int = 32
    image_layers: int = 2
    image_heads: int = 4

    def __post_init__(self) -> None:
        check_positive(
            embed_dim=self.embed_dim, vocab_size=self.vocab_size, text_len=self.text_len,
            text_d_model=self.text_d_model, text_layers=self.text_layers,
            text_heads=self.text_heads,
        )
        check_heads(self.text_d_model, self.text_heads, what="text_d_model")
        try:
            self.image_config()
        except ValueError as err:  # ViT names its own options; say which tower they are
            raise ValueError(f"image tower (image_* / patch_size options): {err}") from None

    def image_config(self) -> ViTConfig:
        """The image tower's ViT configuration (its class count is unused)."""
        return ViTConfig(
            image_size=self.image_size, patch_size=self.patch_size, channels=self.channels,
            d_model=self.image_d_model, n_layers=self.image_layers, n_heads=self.image_heads,
        )


class TextTower(nn.Module):
    """Token ids ``(B, T)`` -> unit-norm embedding ``(B, embed_dim)``.

    Causal blocks; the feature of the last position summarises the sequence
    (fixed-length inputs, so no data-dependent end-of-text lookup).
    """

    def __init__(self, config: CLIPConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.text_d_model)
        self.pos = nn.Parameter(torch.randn(1, config.text_len, config.text_d_model) * 0.02)
        self.encoder = Encoder(
            config.text_d_model, config.text_heads, config.text_layers, causal=True
        )
        self.proj = nn.Linear(config.text_d_model, config.embed_dim, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos[:, : tokens.shape[1]]
        return F.normalize(self.proj(self.encoder(x)[:, -1]), dim=-1)


class ImageTower(nn.Module):
    """Pixels ``(B, C, H, W)`` -> unit-norm embedding ``(B, embed_dim)``."""

    def __init__(self, config: CLIPConfig) -> None:
        super().__init__()
        self.backbone = ViTBackbone(config.image_config())
        self.proj = nn.Linear(config.image_d_model, config.embed_dim, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(self.backbone(pixels)), dim=-1)


class CLIP(nn.Module):
    """``forward(tokens, pixels) -> logits[B_image, B_text]``, scaled cosine similarities."""

    def __init__(self, config: CLIPConfig) -> None:
        super().__init__()
        self.config = config
        self.text_tower = TextTower(config)
        self.image_tower = ImageTower(config)
        # Learned temperature, stored as a log like CLIP (initial scale 1/0.07).
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, tokens: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        text = self.text_tower(tokens)
        image = self.image_tower(pixels)
        return self.logit_scale.exp() * image @ text.t()


def contrastive_loss(logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE over the ``(B, B)`` logits, pair ``i`` weighted by ``weights[i]``.

    Pair ``i`` (row ``i``, column ``i``) is the positive; every other pair in the
    batch is a negative. With all weights 1 this is CLIP's loss.
    """
    labels = torch.arange(logits.shape[0], device=logits.device)
    per_pair = F.cross_entropy(logits, labels, reduction="none") + F.cross_entropy(
        logits.t(), labels, reduction="none"
    )
    return (weights * per_pair).mean() / 2


# the other pairs of the batch are the negatives, so no weighting of the micro-batches'
# losses gives the whole batch's: each counts equally (orgel.lossweights)
contrastive_loss.loss_rule = "rows"  # type: ignore[attr-defined]


def build_clip(*, batch_size: int = 4, seed: int = 0, **config: object) -> ZooWorkload:
    """CLIP workload: inputs ``{"tokens", "pixels"}``, targets per-pair weights (ones)."""
    check_positive(batch_size=batch_size)
    cfg = make_config(CLIPConfig, "CLIP", config)
    torch.manual_seed(seed)
    model = CLIP(cfg)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.text_len), generator=gen)
    size = cfg.image_size
    pixels = torch.randn(batch_size, cfg.channels, size, size, generator=gen)
    weights = torch.ones(batch_size)
    return ZooWorkload(model, {"tokens": tokens, "pixels": pixels}, weights, contrastive_loss)

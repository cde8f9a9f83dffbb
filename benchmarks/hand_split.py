"""The workloads of ``auto_vs_hand.py`` and their hand split for torch.distributed.pipelining.

Each workload is a model (random weights, built from a seed), one batch and a
loss, plus the model written as a *chain of pieces* the way a user prepares it
for torch's pipelining, which runs only a chain of stages: every piece takes
the previous piece's outputs as positional arguments. Some pieces are *layers*
(a transformer block, a U-Net conv block); the rest (embeddings, heads, glue
between two towers) ride with the layer next to them. :func:`cut` gives every
stage an equal number of layers, the embedding on the first stage and the head
on the last, as torch's documentation teaches. What is not a chain is carried
through: the U-Net's skips ride through every stage between their producer and
consumer; CLIP's pixels ride through the text tower's stages, the text
embedding through the image tower's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from orgel.models import build

State = tuple[torch.Tensor, ...]


class Piece(nn.Module):
    """``fn(module, *state) -> state``: one link of the chain, owning ``module``."""

    def __init__(self, module: nn.Module | None, fn: Callable[..., Any], layer: bool) -> None:
        super().__init__()
        self.inner = module if module is not None else nn.Identity()
        self.fn = fn
        self.layer = layer

    def forward(self, *state: torch.Tensor) -> Any:
        return self.fn(self.inner, *state)


class Stage(nn.Module):
    """Consecutive pieces; a tuple output of one piece is the next one's arguments."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, *state: torch.Tensor) -> Any:
        out: Any = state
        for piece in self.pieces:
            out = piece(*(out if isinstance(out, tuple) else (out,)))
        # torch's gloo receives need contiguous gradient buffers, made like the outputs
        if isinstance(out, tuple):
            return tuple(t.contiguous() for t in out)
        return out.contiguous()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    A user's workaround: torch sends each stage input's ``.grad`` as autograd left
    it, and a skip concatenated downstream gets a strided slice of the concat's
    gradient, which gloo refuses to send or receive ("input tensor has to be
    contiguous"). Applied where a received skip is concatenated; not to every
    stage input, since a skip that only passes through would then leave as a view
    of its input, which torch's zero-bubble schedules cannot detach in place.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """``x``, with a contiguous gradient if it needs one (see :class:`_ContiguousGrad`)."""
    return _ContiguousGrad.apply(x) if x.requires_grad else x


def cut(pieces: list[Piece], stages: int) -> list[Stage]:
    """An equal number of layers per stage (the first stages take one more if uneven).

    A piece that is not a layer goes with the next layer (so the embedding is on
    the first stage); those after the last layer (the head) go on the last stage.
    """
    layers = sum(p.layer for p in pieces)
    if layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} stages")
    per, extra = divmod(layers, stages)
    quota = [per + (s < extra) for s in range(stages)]
    groups: list[list[Piece]] = [[] for _ in range(stages)]
    s, seen = 0, 0
    for piece in pieces:
        if piece.layer and seen == quota[s]:
            s, seen = s + 1, 0
        groups[s].append(piece)
        seen += piece.layer
    return [Stage(g) for g in groups]


@dataclass
class Workload:
    """A model, one batch (``inputs`` as orgel takes them), its loss and its chain of pieces.

    ``args`` are the inputs in the order the first piece takes them.
    """

    name: str
    model: nn.Module
    inputs: Any
    targets: torch.Tensor
    loss_fn: Callable[[Any, Any], torch.Tensor]
    pieces: list[Piece]
    args: tuple[torch.Tensor, ...]
    stage_loss: Callable[[Any, Any], torch.Tensor]  # the loss on the last hand-cut stage


# -- GPT-like with a large vocabulary head --------------------------------------------------

def gpt(batch: int, quick: bool) -> Workload:
    """GPT-like: 8 blocks of 256, vocabulary 8192 (the head costs about three blocks)."""
    size = (dict(vocab_size=512, d_model=32, n_layers=4, n_heads=2, seq_len=16) if quick else
            dict(vocab_size=8192, d_model=256, n_layers=8, n_heads=8, seq_len=64))
    model, inputs, targets, loss_fn = build("gpt", batch_size=batch, seed=0, **size)

    def embed(m: Any, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return m.tok_emb(tokens) + m.pos_emb(positions)

    pieces = [Piece(_Params(model, ("tok_emb", "pos_emb"), ()), embed, False)]
    pieces += [Piece(b, lambda m, x: m(x), True) for b in model.encoder.blocks]
    pieces.append(Piece(nn.ModuleDict({"ln_f": model.encoder.ln_f, "head": model.lm_head}),
                        lambda m, x: m["head"](m["ln_f"](x)), False))
    return Workload("GPT-like", model, inputs, targets, loss_fn, pieces, tuple(inputs),
                    loss_fn)


# -- Hugging Face Llama ------------------------------------------------------------------------

def llama(batch: int, quick: bool) -> Workload:
    """transformers' LlamaForCausalLM from a config: 8 layers of 256, vocabulary 8192, SDPA."""
    import transformers

    layers, hidden, vocab, seq = (4, 32, 512, 16) if quick else (8, 256, 8192, 64)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=8 if not quick else 4,
        num_key_value_heads=4 if not quick else 2, max_position_embeddings=seq * 2,
        bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False,
        attention_dropout=0.0, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (batch, seq + 1), generator=gen)
    tokens, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def loss(output: Any, y: torch.Tensor) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output
        return F.cross_entropy(logits.flatten(0, -2), y.flatten())

    rotary = model.model.rotary_emb

    def layer(m: Any, x: torch.Tensor) -> torch.Tensor:
        # what LlamaModel.forward does around each layer: rotary tables, causal SDPA
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return m(x, attention_mask=None, position_embeddings=rotary(x, positions),
                 position_ids=positions)

    pieces = [Piece(model.model.embed_tokens, lambda m, t: m(t), False)]
    pieces += [Piece(block, layer, True) for block in model.model.layers]
    pieces.append(Piece(nn.ModuleList([model.model.norm, model.lm_head]),
                        lambda m, x: m[1](m[0](x)), False))
    return Workload("HF Llama", model, {"input_ids": tokens}, targets, loss, pieces,
                    (tokens,), loss)


# -- ViT-like ---------------------------------------------------------------------------------

def vit(batch: int, quick: bool) -> Workload:
    """ViT-like: 8 blocks of 192 on 32x32 images in 4x4 patches, 10 classes."""
    size = (dict(image_size=8, patch_size=4, d_model=16, n_layers=4, n_heads=2) if quick else
            dict(image_size=32, patch_size=4, d_model=192, n_layers=8, n_heads=6))
    model, inputs, targets, loss_fn = build("vit", batch_size=batch, seed=0, **size)
    bb = model.backbone

    def embed(m: Any, pixels: torch.Tensor) -> torch.Tensor:
        x = m.patch(pixels).flatten(2).transpose(1, 2)
        return torch.cat([m.cls.expand(x.shape[0], -1, -1), x], dim=1) + m.pos

    pieces = [Piece(_Params(bb, ("patch",), ("cls", "pos")), embed, False)]
    pieces += [Piece(b, lambda m, x: m(x), True) for b in bb.encoder.blocks]
    pieces.append(Piece(nn.ModuleList([bb.encoder.ln_f, model.head]),
                        lambda m, x: m[1](m[0](x)[:, 0]), False))
    return Workload("ViT-like", model, inputs, targets, loss_fn, pieces, tuple(inputs), loss_fn)


class _Params(nn.Module):
    """Some submodules and parameters of ``owner``, shared (not copied), by their names."""

    def __init__(self, owner: nn.Module, modules: tuple[str, ...],
                 params: tuple[str, ...]) -> None:
        super().__init__()
        for name in modules:
            self.add_module(name, getattr(owner, name))
        for name in params:
            self.register_parameter(name, getattr(owner, name))


# -- U-Net-like with long skips ---------------------------------------------------------------

def unet(batch: int, quick: bool) -> Workload:
    """U-Net-like, depth 4 (9 conv blocks), width 16, 64x64 images: skips ride the chain."""
    size = (dict(image_size=16, base_width=4, depth=2, groups=2) if quick else
            dict(image_size=64, base_width=16, depth=4, groups=4))
    model, inputs, targets, loss_fn = build("unet", batch_size=batch, seed=0, **size)

    def down(m: Any, x: torch.Tensor, *skips: torch.Tensor) -> State:
        h = m(x)
        return (F.max_pool2d(h, 2), *skips, h)

    def up(m: Any, x: torch.Tensor, *skips: torch.Tensor) -> Any:
        x = m[1](torch.cat([m[0](x), contiguous_grad(skips[-1])], dim=1))
        return (x, *skips[:-1]) if len(skips) > 1 else x

    pieces = [Piece(b, down, True) for b in model.down]
    pieces.append(Piece(model.middle, lambda m, x, *skips: (m(x), *skips), True))
    pieces += [Piece(nn.ModuleList([u, b]), up, True)
               for u, b in zip(model.upsample, model.up, strict=True)]
    pieces.append(Piece(model.out, lambda m, x: m(x), False))
    return Workload("U-Net-like", model, inputs, targets, loss_fn, pieces, tuple(inputs),
                    loss_fn)


# -- CLIP-like two towers ---------------------------------------------------------------------

def clip(batch: int, quick: bool) -> Workload:
    """CLIP-like: a text tower (4 blocks of 128, 32 tokens) and an image tower (4 blocks of
    192, 32x32 in 4x4 patches) that meet only at the logits; in the chain the text tower
    runs first with the pixels riding along, then the image tower with the text embedding."""
    size = (dict(embed_dim=16, text_d_model=16, text_layers=2, text_heads=2, text_len=8,
                 image_size=8, patch_size=4, image_d_model=16, image_layers=2, image_heads=2)
            if quick else
            dict(embed_dim=128, vocab_size=1024, text_d_model=128, text_layers=4,
                 text_heads=4, text_len=32, image_size=32, patch_size=4, image_d_model=192,
                 image_layers=4, image_heads=6))
    model, inputs, targets, loss_fn = build("clip", batch_size=batch, seed=0, **size)
    text, image = model.text_tower, model.image_tower

    def text_embed(m: Any, tokens: torch.Tensor, pixels: torch.Tensor) -> State:
        return m.tok_emb(tokens) + m.pos[:, : tokens.shape[1]], pixels

    def text_out_image_in(m: Any, x: torch.Tensor, pixels: torch.Tensor) -> State:
        t = F.normalize(m.text_proj(m.text_ln(x)[:, -1]), dim=-1)
        y = m.patch(pixels).flatten(2).transpose(1, 2)
        y = torch.cat([m.cls.expand(y.shape[0], -1, -1), y], dim=1) + m.pos
        return t, y

    def logits(m: Any, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        image_emb = F.normalize(m.proj(m.ln_f(y)[:, 0]), dim=-1)
        return m.scale.exp() * image_emb @ t.t()

    glue = nn.Module()
    glue.text_proj, glue.text_ln = text.proj, text.encoder.ln_f
    glue.patch = image.backbone.patch
    glue.register_parameter("cls", image.backbone.cls)
    glue.register_parameter("pos", image.backbone.pos)
    head = nn.Module()
    head.proj, head.ln_f = image.proj, image.backbone.encoder.ln_f
    head.register_parameter("scale", model.logit_scale)
    pieces = [Piece(_Params(text, ("tok_emb",), ("pos",)), text_embed, False)]
    pieces += [Piece(b, lambda m, x, p: (m(x), p), True) for b in text.encoder.blocks]
    pieces.append(Piece(glue, text_out_image_in, False))
    pieces += [Piece(b, lambda m, t, y: (t, m(y)), True) for b in image.backbone.encoder.blocks]
    pieces.append(Piece(head, logits, False))
    args = (inputs["tokens"], inputs["pixels"])
    return Workload("CLIP-like", model, inputs, targets, loss_fn, pieces, args, loss_fn)


WORKLOADS: dict[str, Callable[[int, bool], Workload]] = {
    "gpt": gpt, "llama": llama, "vit": vit, "unet": unet, "clip": clip}

"""A Stable-Diffusion-style UNet (diffusers, tiny config, random weights) trains exactly.

Both entry points on 2 ranks, each against one process doing the same with plain
PyTorch and AdamW: ``orgel.pipeline`` on the UNet's noise-prediction loss, and
``orgel.backend``'s closure runner as in Pfeife's Listing 1 (a frozen CLIP text
encoder and a frozen VAE encoder run in the closure, the compiled UNet is pipelined).

In float64: AdamW's first steps are about the sign of each gradient, so in float32 the
rounding of another summation order (micro-batches, or the split backward) moves a weight
whose gradient is near 0 by up to 7e-5 (steps of 1e-3); two single-process float32 runs,
whole batch against micro-batches, differ as much. In float64 the runs agree to 1e-7.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import orgel
import orgel.transparent.backend as ob

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.hf]
BATCH, M, STEPS, LR = 4, 2, 2, 1e-3


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # the UNet is compiled by both tests


def _unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")).double()


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _noise_loss(out: Any, noise: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.sample, noise)


def _batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    # channels-last, as a VAE's latents come out of its convolutions on CPU (the layout
    # under which PyTorch's GroupNorm backward crashed the profile's split backward)
    sample = torch.randn(BATCH, 4, 8, 8, generator=g, dtype=torch.float64).to(
        memory_format=torch.channels_last)
    timestep = torch.randint(0, 1000, (BATCH,), generator=g)
    text = torch.randn(BATCH, 6, 32, generator=g, dtype=torch.float64)
    noise = torch.randn(BATCH, 4, 8, 8, generator=g, dtype=torch.float64)
    return (sample, timestep, text), noise


def _assert_same_weights(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert list(state) == list(expected)
    for name, t in expected.items():
        torch.testing.assert_close(state[name], t, rtol=1e-7, atol=1e-9, msg=name)


def test_unet_trains_through_pipeline_as_one_process() -> None:
    unet = _unet()
    reference = copy.deepcopy(unet)
    inputs, noise = _batch(0)
    pipe = orgel.pipeline(unet, inputs, noise, _noise_loss, ranks=2, microbatches=M,
                          optimizer=_adamw, threads=1)
    with pipe:
        losses = [pipe.step(*_batch(s)) for s in range(STEPS)]
        state = pipe.state_dict()
    opt = _adamw(list(reference.parameters()))
    want = []
    for s in range(STEPS):
        inputs, noise = _batch(s)
        opt.zero_grad()
        loss = _noise_loss(reference(*inputs), noise)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-5)
    _assert_same_weights(state, reference)


def _encoders() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A frozen tiny CLIP text encoder (hidden 32) and a frozen tiny VAE (16x16 -> 4x8x8)."""
    torch.manual_seed(1)
    text = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=8))
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=8, sample_size=16)
    return (text.double().eval().requires_grad_(False),
            vae.double().eval().requires_grad_(False))


def _pairs(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randint(0, 64, (BATCH, 6), generator=g),
            torch.randn(BATCH, 3, 16, 16, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 4, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 1000, (BATCH,), generator=g))


def _training_closure(text_encoder: torch.nn.Module, vae: torch.nn.Module,
                      unet: Any) -> Any:
    """Pfeife's Listing 1: frozen encoders, then the (pipelined) UNet, loss and backward."""
    def closure(tokens: torch.Tensor, pixels: torch.Tensor, noise: torch.Tensor,
                timesteps: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            text = text_encoder(tokens)[0]
            latents = vae.encode(pixels).latent_dist.mode() * 0.18215
            noisy = latents + noise * (timesteps.float() / 1000).view(-1, 1, 1, 1)
        pred = unet(noisy, timesteps, text).sample
        loss = F.mse_loss(pred, noise) / M
        loss.backward()
        return loss.detach()

    return closure


def test_unet_trains_through_the_closure_runner_with_frozen_encoders() -> None:
    text_encoder, vae = _encoders()
    unet = _unet()
    reference = copy.deepcopy(unet)
    ref_opt = _adamw(list(reference.parameters()))
    # a FLOP-balanced 1F1B chain: the planner's plan is tested through orgel.pipeline above
    pipe = ob.backend(ranks=2, microbatches=M, optimizer=_adamw, threads=1, schedule="1f1b")
    closure = _training_closure(text_encoder, vae, torch.compile(unet, backend=pipe))
    ref_closure = _training_closure(text_encoder, vae, reference)
    try:
        for step in range(STEPS):
            batch = _pairs(step)
            losses = pipe.step(closure, *batch)
            ref_opt.zero_grad()
            want = [ref_closure(*(t.chunk(M)[m] for t in batch)) for m in range(M)]
            ref_opt.step()
            assert [float(x) for x in losses] == pytest.approx([float(x) for x in want],
                                                               rel=1e-5)
        _assert_same_weights(pipe.state_dict(), reference)
    finally:
        pipe.close()

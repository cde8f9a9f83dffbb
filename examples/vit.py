"""Vision Transformer on synthetic images: a workload and a tiny trainer.

Each class has a fixed random template; an image is its class template plus
noise, so the classifier has something real to learn. ``orgel run
examples/vit.py:workload`` loads :func:`workload`; ``python examples/vit.py``
trains a few steps in one process and prints the loss.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch

from orgel.models.layers import ZooWorkload, classification_loss
from orgel.models.vit import ViT, ViTConfig


def batches(
    batch_size: int, config: ViTConfig, *, seed: int = 0, noise: float = 1.0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(pixels, labels)``: class template (fixed by ``config``) plus noise."""
    shape = (config.n_classes, config.channels, config.image_size, config.image_size)
    templates = torch.randn(shape, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    while True:
        labels = torch.randint(0, config.n_classes, (batch_size,), generator=gen)
        pixels = templates[labels] + noise * torch.randn(
            (batch_size, *shape[1:]), generator=gen
        )
        yield pixels, labels


def workload(
    batch_size: int = 16,
    *,
    image_size: int = 32,
    patch_size: int = 4,
    d_model: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    n_classes: int = 10,
    seed: int = 0,
) -> ZooWorkload:
    """A ViT classifier and one batch of synthetic images."""
    config = ViTConfig(
        image_size=image_size, patch_size=patch_size, d_model=d_model, n_layers=n_layers,
        n_heads=n_heads, n_classes=n_classes,
    )
    torch.manual_seed(seed)
    model = ViT(config)
    pixels, labels = next(batches(batch_size, config, seed=seed))
    return ZooWorkload(model, (pixels,), labels, classification_loss)


def main() -> None:
    """Train for ``--steps`` steps on fresh batches and print the loss."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    model, _, _, loss_fn = workload(batch_size=args.batch_size)
    assert isinstance(model, ViT)
    data = batches(args.batch_size, model.config, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        pixels, labels = next(data)
        loss = loss_fn(model(pixels), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    print(f"{args.steps} steps in {(time.perf_counter() - start) * 1000:.0f} ms")


if __name__ == "__main__":
    main()

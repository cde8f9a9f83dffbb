"""Vision Transformer on synthetic images: a workload and a tiny trainer.

Each class has a fixed random template; an image is its class template plus
noise, so the classifier has something real to learn. ``orgel run
examples/vit.py:workload`` loads :func:`workload`; ``python examples/vit.py``
trains a few steps in one process and prints the loss.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from orgel.models.layers import ZooWorkload, classification_loss
from orgel.models.train import example_arguments, train_one_process
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
    args = example_arguments(__doc__).parse_args()
    model, _, _, loss_fn = workload(batch_size=args.batch_size)
    assert isinstance(model, ViT)
    data = batches(args.batch_size, model.config, seed=1)
    train_one_process(model, loss_fn, data, steps=args.steps, lr=args.lr)


if __name__ == "__main__":
    main()

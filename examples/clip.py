"""CLIP-like contrastive model on synthetic caption/image pairs: a workload and a trainer.

The point of this workload for orgel: the text tower and the image tower are
independent branches that meet only at the similarity logits, so a planner can
place the towers on different ranks and run them at the same time. Pass
``freeze_text=True`` to freeze the text tower (its parameters get no gradient).

A pair shares a hidden class: the caption is that class's token template with
some tokens replaced at random, the image its pixel template plus noise.
``python examples/clip.py`` trains a few steps in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from orgel.models.clip import CLIP, CLIPConfig, contrastive_loss
from orgel.models.layers import ZooWorkload
from orgel.models.train import example_arguments, train_one_process

N_CLASSES = 32


def batches(
    batch_size: int, config: CLIPConfig, *, seed: int = 0, noise: float = 1.0
) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Endless ``({"tokens", "pixels"}, weights)`` batches of matching pairs."""
    fixed = torch.Generator().manual_seed(1234)
    captions = torch.randint(0, config.vocab_size, (N_CLASSES, config.text_len), generator=fixed)
    size = config.image_size
    images = torch.randn((N_CLASSES, config.channels, size, size), generator=fixed)
    gen = torch.Generator().manual_seed(seed)
    while True:
        classes = torch.randperm(N_CLASSES, generator=gen)[:batch_size]
        tokens = captions[classes].clone()
        replace = torch.rand(tokens.shape, generator=gen) < 0.2
        random_tokens = torch.randint(0, config.vocab_size, tokens.shape, generator=gen)
        tokens[replace] = random_tokens[replace]
        pixels = images[classes] + noise * torch.randn(images[classes].shape, generator=gen)
        yield {"tokens": tokens, "pixels": pixels}, torch.ones(batch_size)


def workload(
    batch_size: int = 16,
    *,
    embed_dim: int = 64,
    text_d_model: int = 64,
    text_layers: int = 2,
    image_d_model: int = 64,
    image_layers: int = 4,
    image_size: int = 32,
    freeze_text: bool = False,
    seed: int = 0,
) -> ZooWorkload:
    """A CLIP-like model and one batch of synthetic pairs; inputs ``{"tokens", "pixels"}``."""
    if batch_size > N_CLASSES:
        raise ValueError(f"batch_size must be at most {N_CLASSES} (distinct pairs per batch)")
    config = CLIPConfig(
        embed_dim=embed_dim, text_d_model=text_d_model, text_layers=text_layers,
        image_d_model=image_d_model, image_layers=image_layers, image_size=image_size,
    )
    torch.manual_seed(seed)
    model = CLIP(config)
    if freeze_text:
        model.text_tower.requires_grad_(False)
    inputs, weights = next(batches(batch_size, config, seed=seed))
    return ZooWorkload(model, inputs, weights, contrastive_loss)


def main() -> None:
    """Train for ``--steps`` steps on fresh batches and print the loss."""
    parser = example_arguments(__doc__)
    parser.add_argument("--freeze-text", action="store_true")
    args = parser.parse_args()
    model, _, _, loss_fn = workload(batch_size=args.batch_size, freeze_text=args.freeze_text)
    assert isinstance(model, CLIP)
    data = batches(args.batch_size, model.config, seed=1)
    train_one_process(model, loss_fn, data, steps=args.steps, lr=args.lr)


if __name__ == "__main__":
    main()

"""U-Net denoiser on smooth synthetic images: a workload and a tiny trainer.

Clean images are random low-resolution patterns upsampled to full size; the
input is the clean image plus Gaussian noise and the target is the clean image.
The U-Net's long skip connections make stage edges that jump over most of the
graph. ``python examples/unet.py`` trains a few steps in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from orgel.models.layers import ZooWorkload
from orgel.models.train import example_arguments, train_one_process
from orgel.models.unet import UNet, UNetConfig, mse_loss


def batches(
    batch_size: int, config: UNetConfig, *, seed: int = 0, noise: float = 0.3
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(noisy, clean)`` image batches, both ``(B, C, H, W)``."""
    gen = torch.Generator().manual_seed(seed)
    size = config.image_size
    while True:
        coarse = torch.rand((batch_size, config.channels, 4, 4), generator=gen)
        clean = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
        yield clean + noise * torch.randn(clean.shape, generator=gen), clean


def workload(
    batch_size: int = 8,
    *,
    image_size: int = 32,
    base_width: int = 16,
    depth: int = 3,
    seed: int = 0,
) -> ZooWorkload:
    """A U-Net and one batch of (noisy, clean) images."""
    config = UNetConfig(image_size=image_size, base_width=base_width, depth=depth)
    torch.manual_seed(seed)
    model = UNet(config)
    noisy, clean = next(batches(batch_size, config, seed=seed))
    return ZooWorkload(model, (noisy,), clean, mse_loss)


def main() -> None:
    """Train for ``--steps`` steps on fresh batches and print the loss."""
    args = example_arguments(__doc__, batch_size=8, lr=2e-3).parse_args()
    model, _, _, loss_fn = workload(batch_size=args.batch_size)
    assert isinstance(model, UNet)
    data = batches(args.batch_size, model.config, seed=1)
    train_one_process(model, loss_fn, data, steps=args.steps, lr=args.lr)


if __name__ == "__main__":
    main()

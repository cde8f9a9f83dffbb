"""GPT-2-like language model on orgel's shipped demo corpus: a workload and a tiny trainer.

``orgel run examples/gpt.py:workload`` loads :func:`workload`; ``python
examples/gpt.py`` trains a few steps in one process and prints the loss.
"""

from __future__ import annotations

import argparse
import time

import torch

from orgel.data import text_batches
from orgel.models.gpt import GPT, GPTConfig, lm_loss
from orgel.models.layers import ZooWorkload


def workload(
    batch_size: int = 8,
    *,
    seq_len: int = 64,
    vocab_size: int = 256,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    tie_embeddings: bool = False,
    seed: int = 0,
) -> ZooWorkload:
    """A GPT-2-like decoder and one batch of the demo corpus (next-word targets)."""
    config = GPTConfig(
        vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        seq_len=seq_len, tie_embeddings=tie_embeddings,
    )
    torch.manual_seed(seed)
    model = GPT(config)
    tokens, targets = next(text_batches(batch_size, seq_len, vocab_size, seed=seed))
    return ZooWorkload(model, (tokens,), targets, lm_loss)


def main() -> None:
    """Train for ``--steps`` steps on fresh corpus batches and print the loss."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    model, _, _, loss_fn = workload(batch_size=args.batch_size)
    assert isinstance(model, GPT)
    config = model.config
    batches = text_batches(args.batch_size, config.seq_len, config.vocab_size, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1 or step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    print(f"{args.steps} steps in {(time.perf_counter() - start) * 1000:.0f} ms")


if __name__ == "__main__":
    main()

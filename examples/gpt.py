"""GPT-2-like language model on orgel's shipped demo corpus: a workload and a tiny trainer.

``orgel run examples/gpt.py:workload`` loads :func:`workload`; ``python
examples/gpt.py`` trains a few steps in one process and prints the loss.
"""

from __future__ import annotations

import torch

from orgel.data import text_batches
from orgel.models.gpt import GPT, GPTConfig, lm_loss
from orgel.models.layers import ZooWorkload
from orgel.models.train import example_arguments, train_one_process


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


def workload_large() -> ZooWorkload:
    """A GPT sized to keep one GPU busy: 8 layers of width 1024 over 512 tokens, batch 16
    (118 M parameters; ``benchmarks/cost_model_accuracy.py --device cuda``)."""
    return workload(batch_size=16, seq_len=512, vocab_size=8192, d_model=1024, n_layers=8,
                    n_heads=16)


def main() -> None:
    """Train for ``--steps`` steps on the shipped corpus and print the loss."""
    args = example_arguments(__doc__, batch_size=8).parse_args()
    model, _, _, loss_fn = workload(batch_size=args.batch_size)
    assert isinstance(model, GPT)
    config = model.config
    batches = text_batches(args.batch_size, config.seq_len, config.vocab_size, seed=1)
    train_one_process(model, loss_fn, batches, steps=args.steps, lr=args.lr)


if __name__ == "__main__":
    main()

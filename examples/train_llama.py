"""A real training run with orgel: a Hugging Face Llama on the shipped corpus, pipelined.

What a transformer recipe needs, written as one would for one process:

* a Llama built from a config (random weights; nothing is downloaded), a token data set
  made here from orgel's shipped corpus, batches of varying sequence length;
* AdamW with no weight decay on biases, norms and embeddings (groups by parameter name);
* linear warm-up then cosine decay of the learning rate, clipping by the global norm;
* evaluation (validation loss and perplexity) every ``--eval-every`` steps;
* checkpoints every ``--save-every`` steps, and ``--resume`` from the latest one;
* the trained weights back in the model at the end (``pipe.copy_to(model)``).

Run it on 2 local CPU ranks (the script forks them)::

    python examples/train_llama.py --steps 40

or the same script on every rank under torchrun::

    torchrun --nproc-per-node 2 examples/train_llama.py --steps 40

``--log-file FILE`` writes one JSON line per step (loss, learning rate, gradient norm) and per
evaluation (validation loss, perplexity); ``tests/test_train_llama.py`` compares them with
one process running the same loop in plain PyTorch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

import orgel
from orgel.data import WordTokenizer, load_corpus

VOCAB = 512


def build_model(seed: int = 0, layers: int = 4, width: int = 64) -> torch.nn.Module:
    """A small Llama from a config, random weights (dropout 0: exactly one process's run)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512,
                         attention_dropout=0.0, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_stream() -> torch.Tensor:
    """The shipped corpus as one stream of word ids below ``VOCAB``."""
    text = load_corpus()
    return torch.tensor(WordTokenizer.from_text(text, VOCAB).encode(text))


def batch(stream: torch.Tensor, index: int, *, size: int, lengths: tuple[int, int],
          seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Batch ``index``: ``size`` random windows of one length drawn from ``lengths``.

    The same ``(index, seed)`` gives the same batch, so a resumed run sees the data an
    uninterrupted one would. Labels are the next word.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
    starts = torch.randint(0, stream.numel() - length - 1, (size, 1), generator=gen)
    window = stream[starts + torch.arange(length + 1)]
    return {"input_ids": window[:, :-1].contiguous()}, window[:, 1:].contiguous()


def loss_fn(outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-word cross-entropy of the model's logits."""
    logits = outputs.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def param_groups(named: Iterable[tuple[str, torch.nn.Parameter]],
                 weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: weight decay on matrices, none on biases, norms and embeddings."""
    decay, plain = [], []
    for name, p in named:
        no_decay = p.dim() < 2 or "norm" in name or "embed" in name
        (plain if no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The factor on the base rate at optimizer step ``s``: linear warm-up, cosine decay."""
    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40,
                        help="optimizer steps of the run and its schedule (default 40)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop after this step (to resume later); default: --steps")
    parser.add_argument("--ranks", type=int, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=0, help="0: never")
    parser.add_argument("--checkpoint", default="llama-ckpt", help="checkpoint folder")
    parser.add_argument("--resume", action="store_true", help="go on from --checkpoint")
    parser.add_argument("--log-file", default=None, help="JSON lines of every step and evaluation")
    parser.add_argument("--export", default=None, help="torch.save the trained state_dict")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    stream = token_stream()
    cut = int(stream.numel() * 0.9)
    train, valid = stream[:cut], stream[cut:]
    lengths = (args.min_length, args.max_length)

    def train_batch(i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return batch(train, i, size=args.batch_size, lengths=lengths, seed=args.seed)

    def valid_batch(i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return batch(valid, i, size=args.batch_size, lengths=lengths, seed=args.seed + 1)

    model = build_model(args.seed)
    inputs, targets = train_batch(0)  # an example batch: orgel plans for its sizes
    options: dict[str, Any] = dict(
        ranks=args.ranks, microbatches=args.microbatches,
        optimizer=lambda params: torch.optim.AdamW(
            param_groups(params.named(), args.weight_decay), lr=args.lr),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, warmup_cosine(args.warmup, args.steps)),
        max_grad_norm=args.max_grad_norm)
    if args.resume:
        pipe = orgel.load(args.checkpoint, model, inputs, targets, loss_fn, **options)
    else:
        pipe = orgel.pipeline(model, inputs, targets, loss_fn, **options)
    leader = not pipe.spmd or int(os.environ.get("RANK", "0")) == 0
    log = open(args.log_file, "a") if args.log_file and leader else None  # noqa: SIM115

    def record(entry: dict[str, Any]) -> None:
        if leader:
            print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in entry.items()), flush=True)
        if log is not None:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    with pipe:
        while pipe.steps < (args.steps if args.stop_at is None else args.stop_at):
            step = pipe.steps
            x, y = train_batch(step)
            lr = pipe.lr[0]  # the rate this step's update uses
            loss = pipe.step(x, y)
            record({"step": step, "length": int(x["input_ids"].shape[1]), "loss": loss,
                    "lr": lr, "grad_norm": float(pipe.grad_norm)})
            if args.eval_every and pipe.steps % args.eval_every == 0:
                total = sum(pipe.evaluate(*valid_batch(i)) for i in range(args.eval_batches))
                mean = total / args.eval_batches
                record({"eval_step": pipe.steps, "eval_loss": mean,
                        "perplexity": math.exp(mean)})
            if args.save_every and pipe.steps % args.save_every == 0:
                pipe.save(args.checkpoint)
        pipe.copy_to(model)  # the trained weights, back in the caller's model
    if log is not None:
        log.close()
    if args.export and leader:
        torch.save(model.state_dict(), args.export)
    if leader:
        print(f"trained {pipe.steps} steps; the model holds the trained weights")


if __name__ == "__main__":
    main()

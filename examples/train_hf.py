"""Train a Hugging Face causal LM with orgel, written as one would for one process.

A Qwen2-style model from a small config (random weights; nothing is downloaded), a
``DataLoader`` over documents made here from orgel's shipped corpus (one sentence each),
a collator that right-pads and sets ``labels`` to -100 on the padding, the model's own
``outputs.loss``, AdamW with warm-up and cosine decay, evaluation perplexity, checkpoints
and ``--resume``, and ``save_pretrained`` at the end. Run it on 2 local CPU ranks (the
script forks them)::

    python examples/train_hf.py --steps 40 --out hf-run

or the same script on every rank under torchrun::

    torchrun --nproc-per-node 2 examples/train_hf.py --steps 40 --out hf-run

``OUT/log.jsonl`` gets one line per step (loss, learning rate) and per evaluation
(perplexity); ``OUT/checkpoints`` the checkpoints, ``OUT/model`` the trained model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import orgel
from orgel.data import WordTokenizer, load_corpus

VOCAB = 256


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def documents() -> list[torch.Tensor]:
    """The shipped corpus as documents of token ids, one sentence each (6 to 25 words)."""
    text = load_corpus()
    tokenizer = WordTokenizer.from_text(text, VOCAB)
    return [torch.tensor(tokenizer.encode(s)) for s in re.findall(r"[^.?]+[.?]", text)]


def collate(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest document of the batch; labels -100 on the padding."""
    ids = torch.zeros(len(docs), max(len(d) for d in docs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, :len(doc)] = doc
        mask[row, :len(doc)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loaders(batch_size: int, seed: int) -> tuple[DataLoader, DataLoader]:
    """Training (shuffled, seeded) and validation loaders; whole batches only."""
    docs = documents()
    cut = len(docs) - 4 * batch_size  # the last 4 batches' documents are held out
    train = DataLoader(docs[:cut], batch_size=batch_size, shuffle=True, drop_last=True,
                       collate_fn=collate, generator=torch.Generator().manual_seed(seed))
    valid = DataLoader(docs[cut:], batch_size=batch_size, drop_last=True, collate_fn=collate)
    return train, valid


def endless(loader: DataLoader, skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches epoch after epoch, the first ``skip`` left out (on resume)."""
    epochs = itertools.chain.from_iterable(itertools.repeat(loader))
    return itertools.islice(epochs, skip, None)


def tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens the model's loss counts: labels that are not -100 after the first position."""
    return int((batch["labels"][:, 1:] != -100).sum())


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop after this step (to --resume later); default: --steps")
    parser.add_argument("--out", default="hf-run", help="output folder (default hf-run)")
    parser.add_argument("--resume", action="store_true", help="go on from OUT/checkpoints")
    parser.add_argument("--save-every", type=int, default=10, help="0: never")
    parser.add_argument("--eval-every", type=int, default=10, help="0: never")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from transformers import get_cosine_schedule_with_warmup

    args = arguments(argv)
    out = Path(args.out)
    model = build_model(args.seed)
    train, valid = loaders(args.batch_size, args.seed)
    example = next(iter(valid))  # orgel plans for one batch; others may be any length
    options: dict[str, Any] = dict(
        ranks=2, microbatches=args.microbatches, max_grad_norm=1.0,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        scheduler=lambda opt: get_cosine_schedule_with_warmup(opt, args.warmup, args.steps))
    if args.resume:
        pipe = orgel.load(out / "checkpoints", model, example, **options)
    else:
        pipe = orgel.pipeline(model, example, **options)  # no loss_fn: outputs.loss
    leader = not pipe.spmd or int(os.environ.get("RANK", "0")) == 0
    if leader:
        out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.jsonl", "a") if leader else None  # noqa: SIM115

    def record(entry: dict[str, Any]) -> None:
        if log is not None:
            print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in entry.items()), flush=True)
            log.write(json.dumps(entry) + "\n")
            log.flush()

    with pipe:
        for batch in endless(train, skip=pipe.steps):
            if pipe.steps == (args.steps if args.stop_at is None else args.stop_at):
                break
            lr = pipe.lr[0]  # the rate this step's update uses
            record({"step": pipe.steps, "loss": pipe.step(batch), "lr": lr})
            if args.eval_every and pipe.steps % args.eval_every == 0:
                # evaluate gives the batch's mean over its tokens: weigh the batches by theirs
                total = sum(pipe.evaluate(b) * tokens(b) for b in valid)
                ppl = math.exp(total / sum(tokens(b) for b in valid))
                record({"eval_step": pipe.steps, "perplexity": ppl})
            if args.save_every and pipe.steps % args.save_every == 0:
                pipe.save(out / "checkpoints", keep=2)
        pipe.copy_to(model)  # the trained weights, back in the caller's model (every rank)
    if log is not None:
        log.close()
        model.save_pretrained(out / "model")
        print(f"trained {pipe.steps} steps; the model is in {out / 'model'}")


if __name__ == "__main__":
    main()

"""Variable sequence lengths: orgel at each batch's own length against padding to the longest.

For a GPT-like model (``orgel.models.build("gpt")``) and a small Hugging Face
Llama, one pipeline on 2 ranks is planned once; then the same steps (batches with
lengths drawn from ``--min-len``..``--max-len``) run twice on it, side by side:

* **as given**: every batch at its own length (the captured graph has symbolic
  sizes, :mod:`orgel.graph.sizes`: no new capture, profile or plan);
* **padded**: every batch padded to ``--max-len``, the padded targets ``-100`` so
  ``cross_entropy(ignore_index=-100)`` leaves them out: the same loss, the work of
  the longest batch every step.

Printed per model: tokens/s of each (real tokens, not padding), their ratio, and
the first step at a new length against an ordinary step at a length already seen
(each drawn length runs twice in a row; the first pays whatever a new length costs:
the ranks exchange the new message shapes once).

    python benchmarks/variable_length.py            # both models, 20 steps
    python benchmarks/variable_length.py --model gpt --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

import orgel
from orgel.models import build

IGNORE = -100


def lm_loss(logits: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy; targets ``-100`` (padding) count for nothing."""
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def gpt(vocab: int, max_len: int, width: int, layers: int) -> torch.nn.Module:
    model, *_ = build("gpt", batch_size=8, seed=0, vocab_size=vocab, d_model=width,
                      n_layers=layers, n_heads=4, seq_len=max_len)
    return model


def llama(vocab: int, max_len: int, width: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_len, use_cache=False, bos_token_id=0,
                         eos_token_id=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(rows: int, length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (rows, length + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def padded(tokens: torch.Tensor, targets: torch.Tensor,
           length: int) -> tuple[torch.Tensor, torch.Tensor]:
    extra = length - tokens.shape[1]
    return F.pad(tokens, (0, extra), value=0), F.pad(targets, (0, extra), value=IGNORE)


def timed(pipe: Any, call: Any, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    start = time.perf_counter()
    pipe.step(call(tokens), targets)
    return time.perf_counter() - start


def run(name: str, args: argparse.Namespace) -> dict[str, float]:
    model = (gpt if name == "gpt" else llama)(args.vocab, args.max_len, args.width, args.layers)
    call = (lambda t: (t,)) if name == "gpt" else (lambda t: {"input_ids": t})
    tokens, targets = batch(args.batch, args.plan_len, args.vocab, 0)
    lengths = [int(x) for x in torch.randint(args.min_len, args.max_len + 1, (args.steps,),
                                             generator=torch.Generator().manual_seed(1))]
    batches = [batch(args.batch, n, args.vocab, 100 + i) for i, n in enumerate(lengths)]
    with orgel.pipeline(model, call(tokens), targets, lm_loss, ranks=2,
                        microbatches=args.microbatches, threads=args.threads) as pipe:
        for _ in range(2):  # warm: both runs start from steps already taken
            timed(pipe, call, tokens, targets)
            timed(pipe, call, *padded(tokens, targets, args.max_len))
        new, again = [], []
        for x, y in batches:  # each length twice: first at a new length, then once more
            new.append(timed(pipe, call, x, y))
            again.append(timed(pipe, call, x, y))
        given = sum(new)  # the steps as a run meets them: each at a length new to it
        pad = 0.0
        for x, y in batches:
            pad += timed(pipe, call, *padded(x, y, args.max_len))
    real = sum(lengths) * args.batch
    extra = [a - b for a, b in zip(new, again, strict=True)]
    result = {"length": statistics.mean(lengths), "given": real / given, "padded": real / pad,
              "ratio": pad / given,
              "new_extra": statistics.median(extra), "new_extra_max": max(extra),
              "ordinary": statistics.median(again)}
    print(f"{name:6s} mean length {result['length']:.0f}: tokens/s as given "
          f"{result['given']:9.0f}  padded to {args.max_len} "
          f"{result['padded']:9.0f}  ratio {result['ratio']:.2f}x  | first step at a new "
          f"length: {result['new_extra'] * 1e3:+.0f} ms median "
          f"({result['new_extra_max'] * 1e3:+.0f} ms max) against an ordinary step of "
          f"{result['ordinary'] * 1e3:.0f} ms median",
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["gpt", "llama", "both"], default="both")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--plan-len", type=int, default=128, help="the example's length")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--width", type=int, default=256, help="d_model / hidden_size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    print(f"load: {os.getloadavg()}; {args.steps} steps, batch {args.batch}, "
          f"{args.microbatches} micro-batches, lengths {args.min_len}-{args.max_len}, "
          f"planned at {args.plan_len}; width {args.width}, {args.layers} layers, vocab "
          f"{args.vocab}", flush=True)
    for name in (["gpt", "llama"] if args.model == "both" else [args.model]):
        run(name, args)


if __name__ == "__main__":
    main()

"""What ``orgel.backend``'s closures cost per step: the same model and batch through
``orgel.pipeline`` and through ``torch.compile(backend=orgel.backend)``, side by side.

    python benchmarks/backend_overhead.py [--width 256] [--steps 20] [--rounds 3]
    python benchmarks/backend_overhead.py --vocab 32000 [--steps 8]

An MLP of ``--depth`` layers (one graph: no graph break) trains on 2 ranks, 4 micro-batches
of 64 rows, ``schedule="1f1b"`` (each entry point's planner splits it; each prints its
operations per stage), SGD. ``orgel.pipeline`` runs the loss on the last
rank; ``orgel.backend`` runs one closure per micro-batch in the calling process, which
computes the loss from the outputs the ranks send and sends their gradient back (one
runtime for every compiled model, :class:`orgel.explicit.closures.ClosurePipeline`). The two
take turns (``--rounds``; each a fresh pipeline: 2 warm-up steps, then ``--steps`` timed), so
both see the same load; the script prints each one's median step, the ratio and the load
average. Both train the same weights (the first losses are printed). Never asserted in tests.

``--vocab N``: a Hugging Face Qwen2 (2 layers of 64, vocabulary ``N``) on 8 rows of 128
tokens instead, trained on its own ``outputs.loss`` (``orgel.pipeline`` computes it on the
last rank; the closure reads only ``.loss``), and a third row, ``backend, all sent``: the
backend with every output brought to the calling process, as before outputs larger than a
message's by-value size stayed on their rank until read (:mod:`orgel.explicit.lazy`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import orgel

M = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=None,
                        help="a Hugging Face Qwen2 of this vocabulary instead of the MLP")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.vocab is None:
        model: nn.Module = nn.Sequential(
            nn.Linear(32, args.width),
            *[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
              for _ in range(args.depth)], nn.Linear(args.width, 10))
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(M * 64, 32, generator=gen)
        y = torch.randint(0, 10, (M * 64,), generator=gen)
        what = f"MLP {args.depth} x {args.width}, {M} micro-batches of 64 rows"
        entries = ["pipeline", "backend"]
    else:
        model, x = _qwen2(args.vocab)
        y = x
        what = f"Qwen2, vocabulary {args.vocab}, {M} micro-batches of 2 x 128 tokens"
        entries = ["pipeline", "backend", "backend, all sent"]
    print(f"load average before: {os.getloadavg()}")
    times: dict[str, list[float]] = {e: [] for e in entries}
    first: dict[str, float] = {}
    for _ in range(args.rounds):
        for entry in times:
            ts, loss = _run(entry, model, x, y, args.steps, hf=args.vocab is not None)
            times[entry].extend(ts)
            first.setdefault(entry, loss)
    print(f"load average after: {os.getloadavg()}")
    print(f"{what}, 2 ranks, 1F1B; median of {args.rounds} x {args.steps} steps each")
    base = statistics.median(times["pipeline"])
    for entry, ts in times.items():
        med = statistics.median(ts)
        print(f"  {entry:17s} {med * 1e3:8.1f} ms  ({med / base:4.2f}x)  first loss "
              f"{first[entry]:.6f}")
    return 0


def _qwen2(vocab: int) -> tuple[nn.Module, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, use_cache=False)
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (2 * M, 128), generator=torch.Generator().manual_seed(1))
    return Qwen2ForCausalLM(config), ids


def _run(entry: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
         hf: bool = False) -> tuple[list[float], float]:
    """``steps`` timed steps of a fresh pipeline through ``entry``; and its first loss.
    ``hf``: ``model`` is a Hugging Face causal LM, ``x`` its token ids (and labels)."""
    import copy

    from orgel.worker import closure as rank_side

    net = copy.deepcopy(model)  # every round starts from the same weights

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-4)

    # "all sent": no output stays on its rank (the forked ranks take this process's value)
    sent_whole = rank_side.BY_VALUE_BYTES
    if entry == "backend, all sent":
        rank_side.BY_VALUE_BYTES = 1 << 62
    if entry == "pipeline":
        batch: Any = {"input_ids": x, "labels": x} if hf else (x,)
        pipe: Any = orgel.pipeline(net, batch, None if hf else y,
                                   None if hf else F.cross_entropy, ranks=2, microbatches=M,
                                   schedule="1f1b", optimizer=sgd)

        def step() -> float:
            return float(pipe.step(batch) if hf else pipe.step((x,), y))
    else:
        pipe = orgel.backend(ranks=2, microbatches=M, schedule="1f1b", optimizer=sgd)
        compiled = torch.compile(net, backend=pipe)

        def closure(bx: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
            out = compiled(input_ids=bx, labels=bx).loss if hf else \
                F.cross_entropy(compiled(bx), by)
            loss = out / M
            loss.backward()
            return loss.detach()

        def step() -> float:
            return float(sum(pipe.step(closure, x, y)))
    ts = []
    try:
        with pipe:
            loss = step()
            step()
            stages = [len(st.nodes) for st in pipe.plan.stage_graph.stages]
            print(f"  {entry}: operations per stage {stages}", flush=True)
            for _ in range(steps):
                start = time.perf_counter()
                step()
                ts.append(time.perf_counter() - start)
    finally:
        rank_side.BY_VALUE_BYTES = sent_whole
    torch._dynamo.reset()  # a fresh process's Dynamo for the next round's backend
    return ts, loss


if __name__ == "__main__":
    raise SystemExit(main())

"""What ``orgel.backend``'s closures cost per step: the same model and batch through
``orgel.pipeline`` and through ``torch.compile(backend=orgel.backend)``, side by side.

    python benchmarks/backend_overhead.py [--width 256] [--steps 20] [--rounds 3]

An MLP of ``--depth`` layers (one graph: no graph break) trains on 2 ranks, 4 micro-batches
of 64 rows, ``schedule="1f1b"`` (each entry point's planner splits it; each prints its
operations per stage), SGD. ``orgel.pipeline`` runs the loss on the last
rank; ``orgel.backend`` runs one closure per micro-batch in the calling process, which
computes the loss from the outputs the ranks send and sends their gradient back (one
runtime for every compiled model, :class:`orgel.explicit.closures.ClosurePipeline`). The two
take turns (``--rounds``; each a fresh pipeline: 2 warm-up steps, then ``--steps`` timed), so
both see the same load; the script prints each one's median step, the ratio and the load
average. Both train the same weights (the first losses are printed). Never asserted in tests.
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
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.width),
                          *[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
                            for _ in range(args.depth)], nn.Linear(args.width, 10))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M * 64, 32, generator=gen)
    y = torch.randint(0, 10, (M * 64,), generator=gen)
    print(f"load average before: {os.getloadavg()}")
    times: dict[str, list[float]] = {"pipeline": [], "backend": []}
    first: dict[str, float] = {}
    for _ in range(args.rounds):
        for entry in times:
            ts, loss = _run(entry, model, x, y, args.steps)
            times[entry].extend(ts)
            first.setdefault(entry, loss)
    print(f"load average after: {os.getloadavg()}")
    print(f"MLP {args.depth} x {args.width}, 2 ranks, {M} micro-batches of 64 rows, 1F1B; "
          f"median of {args.rounds} x {args.steps} steps each")
    base = statistics.median(times["pipeline"])
    for entry, ts in times.items():
        med = statistics.median(ts)
        print(f"  {entry:9s} {med * 1e3:8.1f} ms  ({med / base:4.2f}x)  first loss "
              f"{first[entry]:.6f}")
    return 0


def _run(entry: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int
         ) -> tuple[list[float], float]:
    """``steps`` timed steps of a fresh pipeline through ``entry``; and its first loss."""
    import copy

    net = copy.deepcopy(model)  # every round starts from the same weights

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-4)

    if entry == "pipeline":
        pipe: Any = orgel.pipeline(net, (x,), y, F.cross_entropy, ranks=2, microbatches=M,
                                   schedule="1f1b", optimizer=sgd)

        def step() -> float:
            return float(pipe.step((x,), y))
    else:
        pipe = orgel.backend(ranks=2, microbatches=M, schedule="1f1b", optimizer=sgd)
        compiled = torch.compile(net, backend=pipe)

        def closure(bx: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(compiled(bx), by) / M
            loss.backward()
            return loss.detach()

        def step() -> float:
            return float(sum(pipe.step(closure, x, y)))
    ts = []
    with pipe:
        loss = step()
        step()
        stages = [len(st.nodes) for st in pipe.plan.stage_graph.stages]
        print(f"  {entry}: operations per stage {stages}", flush=True)
        for _ in range(steps):
            start = time.perf_counter()
            step()
            ts.append(time.perf_counter() - start)
    torch._dynamo.reset()  # a fresh process's Dynamo for the next round's backend
    return ts, loss


if __name__ == "__main__":
    raise SystemExit(main())

"""What a micro-batch off the captured graphs costs: step times with and without the fallback.

    python benchmarks/branching.py [--width 256] [--depth 4] [--rows 64] [--steps 7]

A forward of several graphs (``if x.mean() > 0:`` between two blocks of MLP
layers, each arm its own layer) is captured on a micro-batch that takes the
``up`` arm. One pipeline (2 ranks, 4 micro-batches, a FLOP-balanced 1F1B plan,
SGD) then trains batches of three kinds, in turn, so that all see the same load:

- ``captured``: every micro-batch takes the captured arm (the graphs run on the ranks);
- ``mixed``: micro-batches 1 and 3 take the other arm (they run whole in the
  controller, :mod:`orgel.explicit.fallback`);
- ``all off``: every micro-batch takes the other arm.

Each kind runs 2 warm-up steps (Dynamo compiles the other arm's graphs on first
sight), then ``--steps`` timed steps; the script prints each kind's median step
time, the micro-batches that ran in the controller, and the machine's load
average before and after. Never asserted in tests.

``--entry backend`` times the same through ``orgel.backend`` (a closure per
micro-batch, ``schedule="1f1b"`` over a FLOP-balanced chain): there a micro-batch
that leaves at the branch keeps its first graph's forward from the ranks, and the
rest of it (and that graph's backward, recomputed) runs in the calling process
(:class:`orgel.explicit.closures.ClosurePipeline`).
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
from orgel.graph import capture
from orgel.plan.balanced import balanced_plan


class BranchMLP(nn.Module):
    """``depth`` layers, a branch on ``h.mean()`` choosing ``up`` or ``down``, ``depth`` more."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.pre = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                   for _ in range(depth)])
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)
        self.post = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(self.inp(x))
        if x.mean() > 0:  # a graph break (on the input: the batches choose their arm)
            h = self.up(h)
        else:
            h = self.down(h)
        return self.head(self.post(h))


def rows(up: bool, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` rows whose forward takes the ``up`` arm (or the other)."""
    x = torch.randn(n, 32, generator=gen)
    return x - x.mean() + (0.5 if up else -0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--kinds", nargs="+", default=["captured", "mixed", "all off"],
                        help="which batches to time (captured only: runs on an orgel without "
                             "the fallback too, for a before/after of the captured path)")
    parser.add_argument("--entry", choices=("pipeline", "backend"), default="pipeline",
                        help="orgel.pipeline (default) or orgel.backend with a closure")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = BranchMLP(args.width, args.depth)
    gen = torch.Generator().manual_seed(1)
    m = 4
    kinds = {"captured": [True] * m, "mixed": [True, False, True, False], "all off": [False] * m}
    kinds = {k: v for k, v in kinds.items() if k in args.kinds}
    batches = {k: (torch.cat([rows(up, args.rows, gen) for up in arms]),
                   torch.randint(0, 10, (m * args.rows,), generator=gen))
               for k, arms in kinds.items()}
    x, y = batches["captured"]
    print(f"load average before: {os.getloadavg()}")
    if args.entry == "pipeline":
        plan = balanced_plan(capture(model, (x[:args.rows],)), ranks=2, microbatches=m)
        with orgel.pipeline(model, (x,), y, F.cross_entropy, ranks=2, microbatches=m,
                            plan=plan, optimizer=lambda p: torch.optim.SGD(p, lr=1e-4)) as pipe:
            times, off = _time(lambda bx, by: pipe.step((bx,), by), pipe, batches, args.steps)
    else:
        pipe = orgel.backend(ranks=2, microbatches=m, schedule="1f1b",
                             optimizer=lambda p: torch.optim.SGD(p, lr=1e-4))
        compiled = torch.compile(model, backend=pipe)

        def closure(bx: torch.Tensor, by: torch.Tensor) -> None:
            (F.cross_entropy(compiled(bx), by) / m).backward()

        with pipe:
            times, off = _time(lambda bx, by: pipe.step(closure, bx, by), pipe, batches,
                               args.steps)
    print(f"load average after: {os.getloadavg()}")
    base = statistics.median(next(iter(times.values())))
    print(f"BranchMLP width {args.width}, depth {args.depth}+{args.depth}, 2 ranks, {m} "
          f"micro-batches of {args.rows} rows, {args.entry}; median of {args.steps} steps")
    for kind, ts in times.items():
        med = statistics.median(ts)
        print(f"  {kind:9s} {med * 1e3:8.1f} ms  ({med / base:4.2f}x)  "
              f"in the controller: micro-batches {off[kind]}")


def _time(step: Any, pipe: Any, batches: dict[str, Any], steps: int
          ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Each kind's step times after 2 warm-up steps, the kinds in turn; and the
    micro-batches of each kind's last step that left the captured graphs."""
    times: dict[str, list[float]] = {k: [] for k in batches}
    off: dict[str, Any] = {}
    for i in range(2 + steps):
        for kind, (bx, by) in batches.items():
            start = time.perf_counter()
            step(bx, by)
            if i >= 2:
                times[kind].append(time.perf_counter() - start)
            off[kind] = getattr(getattr(pipe, "pipe", pipe), "off_path", "-")
    return times, off


if __name__ == "__main__":
    main()

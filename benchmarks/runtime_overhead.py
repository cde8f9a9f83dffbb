"""orgel's own cost per step: one rank holding the whole model against plain PyTorch, in one
process, side by side, on a model so small that the cost is most of the step.

    python benchmarks/runtime_overhead.py                 # CPU, one thread, a tiny GPT
    python benchmarks/runtime_overhead.py --rows 8 --repeats 9

Plain PyTorch runs forward, loss, backward, AdamW and ``zero_grad`` in this process; orgel
runs the same model on one rank (``orgel.pipeline(..., ranks=1, microbatches=1)``), whose
step also sends the batch to the rank, runs the executor and the gradient reduction and
answers the loss. The two take turns (``--steps`` steps each, ``--repeats`` times), so both
see the same load; the medians, their difference (orgel's fixed cost per step) and the
ratio are printed with the machine's load average. On an H200 (2026-12-04, docs/gpu.md) the
gap between orgel eager and plain eager was 1.4 to 2.4 ms a step of a 185 M-parameter GPT;
the larger gap between orgel's compiled stages and ``torch.compile`` was the compile path's
own host time (``benchmarks/compiled_gap.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_throughput import _model_and_batch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1, help="batch rows (default 1)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per turn")
    parser.add_argument("--repeats", type=int, default=5, help="turns of each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as a forked rank runs
    import orgel

    model, x, y, loss_fn = _model_and_batch(True, args.rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def plain() -> float:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    other, x2, y2, _ = _model_and_batch(True, args.rows)
    pipe = orgel.pipeline(other, (x2,), y2, loss_fn, ranks=1, microbatches=1, schedule="gpipe",
                          loss_rule="items", device="cpu",
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))

    def piped() -> float:
        return float(pipe.step(x2, y2))

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start; "
          f"GPT of {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
          f"batch {args.rows} x {x.shape[1]}", flush=True)
    times: dict[str, list[float]] = {"plain": [], "orgel": []}
    with pipe:
        for r in range(args.repeats):
            for name, step in (("plain", plain), ("orgel", piped)):
                for _ in range(3):
                    step()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            print(f"turn {r + 1}: plain {times['plain'][-1]:.3f} ms, "
                  f"orgel {times['orgel'][-1]:.3f} ms", flush=True)
    plain_ms, orgel_ms = (statistics.median(times[k]) for k in ("plain", "orgel"))
    print(f"median step: plain {plain_ms:.3f} ms, orgel {orgel_ms:.3f} ms; orgel's own cost "
          f"{orgel_ms - plain_ms:.3f} ms a step; plain / orgel {plain_ms / orgel_ms:.3f}x "
          f"(load average {os.getloadavg()[0]:.2f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a compiled stage loses to ``torch.compile``: one process, no ranks, the same GPT.

Three ways to train the same model, one after another in this process, each timed by the
median of ``--steps`` steps after ``--warmup``:

- ``compile``: the model compiled whole by ``torch.compile`` (what a user writes);
- ``stage-module``: orgel's :class:`~orgel.runtime.compiled.CompiledStage` over the model
  itself (orgel's compile path: AOTAutograd, min-cut partition, Inductor per graph);
- ``stage-captured``: the same over the graph orgel captures and splits (one stage), as
  a rank runs it.

The first two apart is the compile path's cost; the last two apart, the captured graph's.
With ``--kernels`` it profiles one more step of each and prints its ten most expensive
kernels and the step's total kernel time ("Self CUDA time total" on a GPU): a step much
longer than its kernels waits on the host.

    python benchmarks/compiled_gap.py --device cuda --precision bf16-mixed
    python benchmarks/compiled_gap.py --device cpu --small
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from orgel.graph.capture import capture  # noqa: E402
from orgel.graph.measure import place  # noqa: E402
from orgel.models.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from orgel.plan.balanced import balanced_plan  # noqa: E402
from orgel.runtime.compiled import CompiledStage  # noqa: E402
from orgel.split import split_plan  # noqa: E402

LARGE = {"vocab_size": 16384, "d_model": 1024, "n_layers": 12, "n_heads": 16, "seq_len": 512}
SMALL = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32}


def _time(step: Any, device: str, warmup: int, steps: int) -> float:
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step(variant: str, cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor,
          dev: torch.device, precision: str, autocast: Any) -> Any:
    """One training step of ``variant`` (see the module doc), as a function."""
    torch.manual_seed(0)
    if variant == "stage-captured":
        graph = capture(GPT(cfg), {"tokens": x}, precision=precision)
        split = split_plan(graph, balanced_plan(graph, ranks=1, microbatches=1))
        stage = split.stages[0]
        place(stage.module, dev)
        module = stage.module
        named = split.with_sizes({"tokens": x.to(dev)})
        call_args = [named[n] for n in stage.inputs]
        run: Any = CompiledStage(module)
    else:
        module = GPT(cfg).to(dev)
        call_args = [x.to(dev)]
        run = torch.compile(module) if variant == "compile" else CompiledStage(module)
    target = y.to(dev)

    def step() -> None:
        with autocast():  # the captured graph holds its autocast region itself
            out = run(*call_args)
            out = out[0] if isinstance(out, (tuple, list)) else out
            loss = lm_loss(out, target)
        loss.backward()
        for p in module.parameters():
            p.grad = None
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", default="bf16-mixed", choices=("32", "bf16-mixed"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default="compile,stage-module,stage-captured")
    parser.add_argument("--kernels", action="store_true")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    cfg = GPTConfig(**(SMALL if args.small else LARGE))
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len))
    y = torch.roll(x, -1, dims=1)
    dev = torch.device(args.device)
    bf16 = args.precision == "bf16-mixed"

    def autocast() -> Any:
        return (torch.autocast(dev.type, dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())

    results: dict[str, float] = {}
    for variant in args.variants.split(","):
        step = _step(variant, cfg, x, y, dev, args.precision, autocast)
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        results[variant] = _time(step, args.device, args.warmup, args.steps)
        print(f"{variant}: {results[variant] * 1e3:.2f} ms a step (first {first:.1f} s)",
              flush=True)
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                             if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                step()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=10, max_name_column_width=60),
                  flush=True)
        del step
    base = results.get("compile")
    for variant, t in results.items():
        if base is not None and variant != "compile":
            print(f"{variant} / torch.compile (throughput): {base / t:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

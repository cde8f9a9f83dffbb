"""Llama-3-70B and GPT-3-175B planned for 64, 256 and 1024 GPUs (data x pipeline parallel).

    python benchmarks/at_scale.py [--device h100-80gb] [--gpus 64 256 1024] \
        [--model llama3-70b] [--cache DIR] [--compare llama3-70b 1024]

Each model is built at its real depth on the meta device (transformers
configs, no weights), captured once with one sequence per micro-batch, costed
by the roofline device model and planned by the same planner and simulator
as any table, for every pipeline depth ``P`` (dividing the GPUs, at most the
blocks) with ``dp = GPUs / P`` replicas of the pipeline. A step is the
1M-token batch (Llama-3: 256 sequences of 4096 tokens; GPT-3: 512 of 2048;
their published batches are 4x and 3x that), so each replica runs
``batch / dp`` one-sequence micro-batches. Depths whose weights and optimizer
state alone cannot fit a GPU are skipped; the search is the beam planner over
1F1B, ZB-H1 and interleaved 1F1B (two stages per rank at most), 2 s of beam
per depth. Pipelines are placed on consecutive GPUs, 8 per node: the
all-reduce of a stage's gradients across replicas runs over the inter-node
link. The replicas are priced from one simulated pipeline plus the
all-reduces (:mod:`orgel.plan.replicated`), and candidates that cannot fit
memory are ruled out before they are simulated. Every row prints the
planning time and the process's peak RSS so far; ``--cache DIR`` keeps the
captured tables for later runs; ``--compare MODEL GPUS`` plans that row again
with 10x the beam time and prints both step times.

Precision: bf16 weights and activations (the model built in bfloat16, so
matmuls take the bf16 peak and values are 2 bytes), fp32 master weights and
Adam state: 16 bytes per parameter, ``optimizer_factor = 8`` times the bf16
parameter bytes, and the optimizer's passes over twice the bytes.

orgel has no tensor parallelism: a stage is at least one whole block on one
GPU, so a GPU must hold its stage's weights, gradients and Adam state
(16 bytes per parameter) plus its in-flight activations. That forces deep
pipelines (70B: 1.1 TB of state, at least 15 H100s per pipeline; 175B:
2.8 TB, at least 36) and one-sequence micro-batches.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import big  # noqa: E402

from orgel.costs.blocks import BlockCosts  # noqa: E402
from orgel.costs.devices import load_device  # noqa: E402
from orgel.plan.device import capture_meta  # noqa: E402
from orgel.plan.planner import InfeasibleError, PlanResult, plan  # noqa: E402
from orgel.profile.roofline import estimate_costs  # noqa: E402

GIB = 1 << 30
MODELS = {
    "llama3-70b": (lambda: big.llama3_70b(1, 4096), 256, 4096),
    "gpt3-175b": (lambda: big.gpt3_175b(1, 2048), 512, 2048),
}


def costs_of(name: str, device: Any, blocks: int, cache: Path | None = None
             ) -> tuple[BlockCosts, float, float]:
    """The one-sequence table of ``name`` in bf16 on ``device``: (costs, capture s, params).

    ``cache``: a folder to keep tables in (a table found there is read, not captured).
    """
    started = time.perf_counter()
    saved = None if cache is None else cache / f"{name}-{device.name}.json"
    if saved is not None and saved.exists():
        costs = BlockCosts.load(saved)
        return costs, time.perf_counter() - started, float(costs.meta["parameters"])
    w = MODELS[name][0]()
    w.model.to(torch.bfloat16)
    _, graph = capture_meta(w, 1)
    costs = estimate_costs(graph, device, blocks=blocks, rows=1)
    costs.optimizer_factor = 8.0  # bf16 weights + bf16 grads + fp32 master, m, v = 16 B/param
    costs.optimizer_ms = [2 * t for t in costs.optimizer_ms]  # fp32 state: twice the bytes
    params = sum(p.numel() for p in w.model.parameters())
    costs.meta["parameters"] = params
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        costs.save(saved)
    return costs, time.perf_counter() - started, params


def best_plan(costs: BlockCosts, gpus: int, batch: int, memory: int,
              time_limit: float | None = 2.0) -> tuple[PlanResult | None, int, float]:
    """The fastest plan over pipeline depths: (result, pipeline depth, seconds).

    ``time_limit``: seconds of beam search per depth (None: until it converges).
    """
    started = time.perf_counter()
    best: tuple[PlanResult, int] | None = None
    static = sum(costs.static_bytes(b) for b in range(costs.num_blocks))
    for depth in (4, 8, 16, 32, 64, 128):
        dp = gpus // depth
        if gpus % depth or depth > costs.num_blocks or batch % dp or static / depth > memory:
            continue
        microbatches = batch // dp
        try:
            # dp replicas each take 1/dp of a micro-batch: scale the one-row table up by dp
            result = plan(costs.scaled(dp), gpus, microbatches, dp=dp, rows=dp,
                          max_replicas=1, time_limit=time_limit, planner="beam", max_loops=2,
                          families=["1f1b", "zb-h1", "interleaved"])
        except InfeasibleError:
            continue
        if best is None or result.step_time < best[0].step_time:
            best = (result, depth)
    seconds = time.perf_counter() - started
    return (None, 0, seconds) if best is None else (best[0], best[1], seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100-80gb")
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder for the captured tables (reused by later runs)")
    parser.add_argument("--compare", nargs=2, metavar=("MODEL", "GPUS"),
                        default=["llama3-70b", "1024"],
                        help="also plan this row with 10x the beam time per depth and print "
                             "both step times (a model not planned skips it)")
    args = parser.parse_args()
    device = load_device(args.device)
    print(f"device {device.name}: {device.gpus_per_node} GPUs per node, "
          f"{device.intra_node.name} inside, {device.inter_node.name} between nodes")
    print(f"{'model':<11} {'GPUs':>5} {'P x dp':>9} {'M':>4} {'schedule':<28} {'recomp':>7} "
          f"{'step s':>7} {'tok/s/GPU':>9} {'MFU':>5} {'bubble':>6} {'GiB/GPU':>7} "
          f"{'plan s':>6} {'RSS GiB':>7}")
    for name in args.model:
        blocks = 2 * (96 if name.startswith("gpt3") else 80) + 2
        costs, captured, params = costs_of(name, device, blocks, args.cache)
        _, batch, seq = MODELS[name]
        print(f"{name}: {params / 1e9:.1f}B parameters, {costs.num_blocks} blocks, captured "
              f"and costed in {captured:.1f} s")
        for gpus in args.gpus:
            result, depth, seconds = best_plan(costs, gpus, batch, device.memory_bytes)
            if result is None:
                print(f"{name:<11} {gpus:>5} nothing fits ({seconds:.1f} s)")
                continue
            step = result.step_time / 1000
            tokens = batch * seq / step / gpus
            mfu = 6 * params * tokens / device.peak("bf16")
            label = str(result.plan.meta.get("schedule_label"))[:28]
            recompute = f"{sum(result.plan.recompute)}/{result.plan.num_stages}"
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
            print(f"{name:<11} {gpus:>5} {f'{depth}x{gpus // depth}':>9} "
                  f"{result.plan.microbatches:>4} {label:<28} {recompute:>7} {step:>7.2f} "
                  f"{tokens:>9.0f} {mfu:>5.1%} {result.sim.bubble_fraction:>6.1%} "
                  f"{max(result.sim.peak_memory) / GIB:>7.1f} {seconds:>6.1f} {rss:>7.2f}",
                  flush=True)
            if [name, str(gpus)] == args.compare:
                slow, slow_depth, slow_s = best_plan(costs, gpus, batch, device.memory_bytes,
                                                     time_limit=20.0)
                if slow is not None:
                    print(f"  same row, 20 s of beam per depth: {slow_depth}x{gpus // slow_depth} "
                          f"{slow.plan.meta.get('schedule_label')}, step "
                          f"{slow.step_time / 1000:.3f} s against {step:.3f} s "
                          f"(ratio {result.step_time / slow.step_time:.4f}), {slow_s:.1f} s "
                          f"to plan", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    print(f"peak memory (RSS) of this process: {peak:.2f} GiB")


if __name__ == "__main__":
    main()

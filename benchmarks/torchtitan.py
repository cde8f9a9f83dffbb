"""torchtitan's published runs against orgel's prediction, on the hardware they ran on.

    python benchmarks/torchtitan.py [--cache DIR] [--s S] [--h H]

torchtitan's ``docs/performance.md`` (the tables of 2025-01-30, run at torchtitan 9dec370,
torch 1963fc8 of 2024-12) reports Llama 3.1 8B, 70B and 405B on one cluster and one
software stack: Grand Teton hosts of 8 H100s with **96 GB of HBM2e at 2.4 TB/s, run at the
default 500 W power limit** (700 W is the H100 SXM's), NVLink inside a host and 400 Gb/s
RDMA per GPU between hosts; a footnote says these GPUs' peak "is between SXM and NVL, and we
don't know its exact value". orgel's ``h100-80gb`` is the 700 W SXM part with 3.35 TB/s of
HBM3, so its figures are not that hardware's.

The device here (:func:`grand_teton`) is ``h100-80gb`` with that memory (2.4 TB/s, 94 GiB
usable) and its tensor-core efficiency (matmul and attention) scaled by one factor ``s``,
the sustained rate of these power-limited GPUs under torch.compile relative to orgel's
roofline. Two factors are fitted, each to **one** published row: ``s`` to Table 1's bf16 row
(Llama 3.1 8B, FSDP on 8 GPUs with torch.compile: 6,667 tokens/s/GPU), then ``h``, the share
of what its linears could hide that AsyncTP hides (:func:`orgel.costs.mesh.tp_costs` with
``async_tp=h``), to Table 4's AsyncTP row (70B, FSDP 32 x TP 8, Float8: 876). Every other
row is predicted with them, not fitted: Float8 on the same 8 GPUs, the 8B model on 128
GPUs, 70B with blocking TP, and 405B with FSDP 8 x TP 8 x PP 8 (Float8 + AsyncTP, 1F1B and
interleaved 1F1B), each configuration expressed as torchtitan ran it
(:func:`at_scale.fixed_plan`: uniform layers, its activation checkpointing per layer or
selective per operator, TP with sequence parallelism). A pipelined row's memory adds two
facts of torchtitan's FSDP2 (:func:`pipelined_memory`: gradients accumulated unsharded in
float32, Float8 weights gathered as Float8).

What the device does not price: torchtitan's FSDP2 gathers one layer's weights at a time,
ahead of it, where orgel gathers a stage's at the step's start (without pipelining, the
whole model's, exposed and held: those rows' time and memory are orgel's FSDP's, not
torchtitan's); torch.compile's gain over eager (``s`` is fitted to a compiled run).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from at_scale import ALL_MODELS, GIB, LAYERS, costs_of, fixed_plan  # noqa: E402

from orgel.costs.devices import DEVICES, Device  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Run:
    """One published row: ``batch`` sequences a step on ``gpus`` GPUs, ``dp`` FSDP
    replicas of ``tp`` members and ``pp`` pipeline ranks (``microbatches`` a step)."""

    table: str
    model: str
    gpus: int
    batch: int
    dp: int
    tp: int
    recompute: str
    float8: bool
    tokens: float  # published tokens/s/GPU
    memory: float  # published GiB/GPU
    pp: int = 1
    microbatches: int = 1
    family: str = "1f1b"
    stages_per_rank: int = 1
    async_tp: bool = False

    @property
    def label(self) -> str:
        what = ["Float8" if self.float8 else "bf16"] + ["AsyncTP"] * self.async_tp
        sched = ("" if self.pp == 1 else f", {self.family}"
                 + (f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        return (f"{self.table}: {self.model} {self.gpus} GPUs FSDP {self.dp} x TP {self.tp}"
                f" x PP {self.pp}{sched}, {' + '.join(what)}, {self.recompute} recompute")


#: the row ``s`` is fitted to (no TP: it prices the GPU alone)
FIT_S = Run("Table 1", "llama3.1-8b", 8, 16, 8, 1, "selective", False, 6667, 77.0)
#: the row AsyncTP's hidden fraction ``h`` is fitted to (with ``s`` fitted first)
FIT_H = Run("Table 4", "llama3.1-70b", 256, 512, 32, 8, "layer", True, 876, 67.6,
            async_tp=True)
#: the rows predicted with both
PREDICTED = (
    Run("Table 1", "llama3.1-8b", 8, 16, 8, 1, "selective", True, 8532, 76.8),
    Run("Table 3", "llama3.1-8b", 128, 256, 128, 1, "selective", False, 6514, 62.0),
    Run("Table 3", "llama3.1-8b", 128, 256, 128, 1, "selective", True, 8380, 61.8),
    Run("Table 4", "llama3.1-70b", 256, 512, 32, 8, "layer", True, 829, 71.9),
    Run("Table 5", "llama3.1-405b", 512, 256, 8, 8, "layer", True, 100, 82.5, pp=8,
        microbatches=8, async_tp=True),
    Run("Table 5", "llama3.1-405b", 512, 256, 8, 8, "layer", True, 128, 72.7, pp=8,
        microbatches=8, family="interleaved", stages_per_rank=2, async_tp=True),
)


def grand_teton(s: float) -> Device:
    """The Grand Teton H100 as torchtitan ran it: ``h100-80gb`` with 2.4 TB/s of HBM2e,
    94 GiB usable, and its matmul and attention efficiency times ``s``."""
    base = DEVICES["h100-80gb"]
    eff = dict(base.efficiency)
    eff["matmul"] *= s
    eff["attention"] *= s
    return dataclasses.replace(
        base, name=f"h100-96gb-500w-s{s:.4f}", memory_gbs=2400, memory_gib=94.0,
        efficiency=eff,
        source="torchtitan docs/performance.md: Grand Teton H100, 96 GB HBM2e at 2.4 TB/s, "
               f"500 W; h100-80gb's peaks and links, tensor-core efficiency x {s:.4f}")


def predict(run: Run, device: Device, hidden: float,
            cache: Path | None) -> tuple[float, float, float]:
    """``run`` as orgel prices it on ``device``, AsyncTP hiding ``hidden`` of what its
    linears could (:func:`orgel.costs.mesh.tp_costs`): (tokens/s/GPU, GiB/GPU, bubble).
    The memory of a pipelined row is :func:`pipelined_memory`'s."""
    table = costs_of(run.model, device, 2 * LAYERS[run.model] + 2, cache, float8=run.float8,
                     per_layer=True)[0]
    result = fixed_plan(table.scaled(run.batch // run.microbatches), run.family, run.pp,
                        run.microbatches, tp=run.tp, dp=run.dp, shard="fsdp",
                        stages_per_rank=run.stages_per_rank,
                        async_tp=hidden if run.async_tp else False, recompute=run.recompute)
    seq = ALL_MODELS[run.model][2]  # the tokens of a sequence
    tokens = run.batch * seq / (result.step_time / 1000) / run.gpus
    memory = (pipelined_memory(result, run, table) if run.pp > 1
              else max(result.sim.peak_memory)) / GIB
    return tokens, memory, result.sim.bubble_fraction


def pipelined_memory(result: Any, run: Run, table: Any) -> float:
    """The largest peak of a pipelined row's ranks (bytes), with two facts of torchtitan's
    FSDP2 that the plan (orgel's FSDP: gradients in the weights' dtype, weights gathered
    in bf16) leaves out:

    * gradients accumulate unsharded over the micro-batches in float32, FSDP2's
      ``reduce_dtype`` (torchtitan's ``mixed_precision_reduce``; ``FSDPParam.
      to_accumulated_grad_if_needed``): 4 bytes a parameter where the plan holds 2;
    * with Float8, the linears' weights are gathered as Float8 (its 405B preset sets
      ``enable_fsdp_float8_all_gather``) and held so through the step (a pipelined
      stage does not reshard): 1 byte a weight where the plan holds 2. A stage's linear
      weights are its TP regions' parameters but the head's (which stays bf16).
    """
    plan = result.plan
    peaks = list(result.sim.peak_memory)
    last = table.num_blocks - 1
    for s, stage in enumerate(plan.stage_graph.stages):
        assert stage.blocks, "a plan of the table's blocks"
        params = plan.costs.stages[s].params  # bf16 bytes a member holds
        linears = (sum(table.tp_split[b].params for b in stage.blocks if b != last) // run.tp
                   if run.float8 else 0)
        for r in plan.placement[s]:
            peaks[r] += params - linears // 2
    return max(peaks)


def bisect(rate: Callable[[float], float], target: float, low: float, high: float) -> float:
    """The ``x`` in [low, high] at which ``rate(x)``, which grows with ``x``, is ``target``."""
    for _ in range(14):
        mid = (low + high) / 2
        low, high = (mid, high) if rate(mid) < target else (low, mid)
    return (low + high) / 2


def fit(cache: Path | None) -> tuple[float, float]:
    """``s`` fitted to :data:`FIT_S`, then ``h`` to :data:`FIT_H` with that ``s``."""
    s = bisect(lambda x: predict(FIT_S, grand_teton(x), 0.0, None)[0], FIT_S.tokens, 0.3, 1.0)
    device = grand_teton(s)
    h = bisect(lambda x: predict(FIT_H, device, x, cache)[0], FIT_H.tokens, 0.0, 1.0)
    return s, h


def report(cache: Path | None, s: float | None = None, h: float | None = None) -> None:
    """Fit ``s`` and ``h`` (unless given) and print every row, predicted and published."""
    started = time.perf_counter()
    if s is None or h is None:
        fitted_s, fitted_h = fit(cache)
        s = fitted_s if s is None else s
        h = fitted_h if h is None else h
    device = grand_teton(s)
    print(f"torchtitan's published runs on Grand Teton H100s (96 GB HBM2e, 500 W): s = "
          f"{s:.3f} (matmul at {device.efficiency['matmul']:.1%} and attention at "
          f"{device.efficiency['attention']:.1%} of the SXM peaks), AsyncTP hides h = "
          f"{h:.2f} of what its linears could ({time.perf_counter() - started:.0f} s to fit)",
          flush=True)
    print(f"{'row':<96} {'tok/s/GPU':>9} {'published':>9} {'error':>6} {'GiB':>6} "
          f"{'run GiB':>7} {'bubble':>6}")
    for run in (FIT_S, FIT_H, *PREDICTED):
        tokens, memory, bubble = predict(run, device, h, cache)
        fitted = {id(FIT_S): " (s fitted)", id(FIT_H): " (h fitted)"}.get(id(run), "")
        print(f"{run.label + fitted:<96} {tokens:>9.0f} {run.tokens:>9.0f} "
              f"{tokens / run.tokens - 1:>+6.0%} {memory:>6.1f} {run.memory:>7.1f} "
              f"{bubble:>6.1%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None,
                        help="folder for the captured tables (reused by later runs)")
    parser.add_argument("--s", type=float, default=None,
                        help="the tensor-core factor (default: fitted to Table 1's row)")
    parser.add_argument("--h", type=float, default=None,
                        help="AsyncTP's hidden fraction (default: fitted to Table 4's row)")
    args = parser.parse_args()
    started = time.perf_counter()
    report(args.cache, args.s, args.h)
    print(f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()

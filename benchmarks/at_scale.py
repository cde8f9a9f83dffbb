"""Llama-3-70B, GPT-3-175B and Llama-3.1-405B planned for 64-1024 GPUs: PP x TP x DP x FSDP.

    python benchmarks/at_scale.py [--device h100-80gb] [--gpus 64 256 1024] \
        [--model llama3-70b] [--cache DIR] [--compare llama3-70b 1024] [--no-torchtitan] \
        [--torchtitan-only] [--no-choice] [--layers]

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

Two rows per model and GPU count. ``pipeline``: data x pipeline parallelism
only (every GPU holds its stage's weights, gradients and Adam state, 16 bytes
per parameter: deep pipelines). ``mesh``: the joint search of
:func:`orgel.plan.planner.plan` over tensor-parallel degree ``tp`` in 1, 2,
4, 8 (inside a node), pipeline depth ``P``, ``dp = GPUs / (tp P)`` and
sharding (``none`` or ``fsdp``: optimizer state split over the replicas,
parameters gathered once per step, gradients reduce-scattered), priced by
:mod:`orgel.costs.mesh`; each (tp, P, shard) whose state cannot fit is
skipped, the others are priced by a quick plan (:mod:`orgel.plan.screen`: 1F1B, and
interleaved 1F1B with 2, 4 and 8 stages per rank for the best few) and the best few get
the full search with 1 s of beam (interleaving up to 8 stages per rank,
:data:`MESH_LOOPS`). ``x`` is the mesh row's MFU over the pipeline row's.

The torchtitan part (default on; ``--torchtitan-only`` runs nothing else, ``--no-choice``
skips orgel's own choice) runs ``benchmarks/torchtitan.py``: torchtitan's published
Llama 3.1 8B, 70B and 405B runs (its Tables 1, 3, 4 and 5: FSDP, FSDP x TP, FSDP x TP x
PP with 1F1B and interleaved 1F1B, Float8, AsyncTP) predicted on the hardware they ran on;
then orgel's own choice for Table 5's model, GPU count and batch (512 GPUs, 256 sequences
of 8192 tokens) on ``--device`` (bf16, blocking TP: the planner does not search Float8 or
AsyncTP), beside Table 5's interleaved configuration priced the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from orgel.costs.mesh import TP_DEGREES, mesh_costs  # noqa: E402
from orgel.graph.blocks import layer_blocks  # noqa: E402
from orgel.plan.device import capture_meta  # noqa: E402
from orgel.plan.planner import InfeasibleError, PlanResult, plan  # noqa: E402
from orgel.plan.predict import predicted  # noqa: E402
from orgel.plan.screen import (  # noqa: E402
    MESH_TOP,
    QUICK_TEMPLATES,
    compute_bound,
    quick_plan,
    screen,
)
from orgel.profile.roofline import estimate_costs  # noqa: E402

GIB = 1 << 30
MODELS = {
    "llama3-70b": (lambda: big.llama3_70b(1, 4096), 256, 4096),
    "gpt3-175b": (lambda: big.gpt3_175b(1, 2048), 512, 2048),
    "llama3.1-405b": (lambda: big.llama3_1_405b(1, 8192), 128, 8192),
}
#: models only ``benchmarks/torchtitan.py`` prices (built the same way, no rows here)
OTHER_MODELS = {"llama3.1-8b": (lambda: big.llama3_1_8b(1, 8192), 16, 8192),
                "llama3.1-70b": (lambda: big.llama3_70b(1, 8192), 512, 8192)}
#: every model built here: (its workload for one row, the step's sequences, their tokens)
ALL_MODELS = {**MODELS, **OTHER_MODELS}
LAYERS = {"llama3-70b": 80, "gpt3-175b": 96, "llama3.1-405b": 126, "llama3.1-8b": 32,
          "llama3.1-70b": 80}


_GRAPHS: dict[str, tuple[Any, int]] = {}  # a model captured once per process
#: stages per rank the mesh search interleaves at most (the pipeline-only search: 2)
MESH_LOOPS = 8


def costs_of(name: str, device: Any, blocks: int, cache: Path | None = None, *,
             float8: bool = False, per_layer: bool = False) -> tuple[BlockCosts, float, float]:
    """The one-sequence table of ``name`` in bf16 on ``device``: (costs, capture s, params).

    ``cache``: a folder to keep tables in (a table found there is read, not captured);
    ``float8``: its linears but the head in Float8 (:mod:`orgel.profile.roofline`);
    ``per_layer``: one block per transformer layer (:func:`layer_blocks`), not ``blocks``
    balanced by FLOPs.
    """
    started = time.perf_counter()
    suffix = ("-float8" if float8 else "") + ("-layers" if per_layer else "")
    saved = None if cache is None else cache / f"{name}-{device.name}{suffix}.json"
    if saved is not None and saved.exists():
        costs = BlockCosts.load(saved)
        # a table saved before the TP facts (and AsyncTP's linears), or before the bytes
        # each edge carries (the mask alone to the later layers), is estimated again
        if any(s.column for s in costs.tp_split) and (costs.edge_bytes or costs.is_chain()):
            return costs, time.perf_counter() - started, float(costs.meta["parameters"])
    if name not in _GRAPHS:
        w = ALL_MODELS[name][0]()
        w.model.to(torch.bfloat16)
        _GRAPHS[name] = (capture_meta(w, 1)[1], sum(p.numel() for p in w.model.parameters()))
    graph, params = _GRAPHS[name]
    costs = estimate_costs(graph, device, blocks=blocks, rows=1, float8=float8,
                           blockgraph=layer_blocks(graph) if per_layer else None)
    costs.optimizer_factor = 8.0  # bf16 weights + bf16 grads + fp32 master, m, v = 16 B/param
    costs.optimizer_ms = [2 * t for t in costs.optimizer_ms]  # fp32 state: twice the bytes
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


def best_mesh(costs: BlockCosts, gpus: int, batch: int, memory: int, per_node: int,
              time_limit: float = 1.0, top: int | None = MESH_TOP, loops: int = MESH_LOOPS
              ) -> tuple[PlanResult | None, float]:
    """The fastest plan over TP degree, pipeline depth, dp and sharding: (result, seconds).

    ``costs`` is the one-row table; each replica runs one-sequence micro-batches.
    Every mesh whose weights and optimizer state fit is priced by its quick
    plans (:func:`orgel.plan.screen.screen`: 1F1B and interleaved over
    balanced splits, no beam); the best ``top`` (and those within 5% of the
    best) are planned in full, their quick plans candidates beside. ``top=None``
    plans every mesh that fits (the exhaustive search).
    """
    started = time.perf_counter()
    meshes = []
    for tp in TP_DEGREES:
        if tp > per_node or gpus % tp:
            continue
        for depth in (1, 2, 4, 8, 16, 32, 64, 128):
            if (gpus // tp) % depth or depth > costs.num_blocks:
                continue
            dp = gpus // tp // depth
            if batch % dp:
                continue
            for shard in ("none", "fsdp") if dp > 1 else ("none",):
                table = mesh_costs(costs, tp=tp, shard=shard, replicas=dp)
                static = sum(table.static_bytes(b) for b in range(table.num_blocks))
                if static / depth <= memory:
                    meshes.append((tp, depth, dp, shard))
    quick: dict[tuple[int, int, int, str], tuple[float, Any, BlockCosts]] = {}

    def price(m: tuple[int, int, int, str], specs: Any) -> float:
        got = quick_plan(costs.scaled(m[2]), m[1], batch // m[2], tp=m[0], dp=m[2],
                         shard=m[3], memory=memory, templates=specs)
        if got[1] is not None and got[0] < quick.get(m, (float("inf"),))[0]:
            quick[m] = got
        return got[0]

    def low(m: tuple[int, int, int, str]) -> float:
        return compute_bound(costs.scaled(m[2]), m[1], batch // m[2], tp=m[0], dp=m[2],
                             shard=m[3])

    if top is not None:
        meshes = screen(meshes, price, top=top, bound=low,
                        templates=[t for t in QUICK_TEMPLATES if t.group <= loops])
    best: PlanResult | None = None
    for mesh in meshes:
        tp, _depth, dp, shard = mesh
        if best is not None and low(mesh) >= best.step_time:
            continue  # a proven bound (orgel.plan.screen.compute_bound)
        try:
            result = plan(costs.scaled(dp), gpus, batch // dp, dp=dp, rows=dp, tp=tp,
                          shard=shard, max_replicas=1, time_limit=time_limit, planner="beam",
                          max_loops=loops, families=["1f1b", "zb-h1", "interleaved"])
        except InfeasibleError:
            result = None
        if mesh in quick and (result is None or quick[mesh][0] < result.step_time):
            # the quick plan is a candidate too (orgel.plan.screen)
            step, p, table = quick[mesh]
            p, sim = predicted(p, table)
            result = PlanResult(p, "quick", sim, 0.0)
        if result is not None and (best is None or result.step_time < best.step_time):
            best = result
    return best, time.perf_counter() - started


def mesh_label(result: PlanResult) -> str:
    """``PPxTPxDP`` and ``f`` when the replicas shard."""
    m = result.plan.meta["mesh"]
    return f"{m['pp']}x{m['tp']}x{m['dp']}" + ("f" if m["shard"] == "fsdp" else "")


def fixed_plan(costs: BlockCosts, family: str, depth: int, microbatches: int, *, tp: int,
               dp: int, shard: str, stages_per_rank: int = 1,
               async_tp: bool = False, recompute: str = "layer") -> PlanResult:
    """One given configuration: ``family`` on ``depth`` pipeline ranks, uniform layers,
    every stage recomputing by ``recompute`` (``"layer"``: every layer checkpointed,
    torchtitan's full activation checkpointing; ``"selective"``: its op-level one),
    TP with sequence parallelism (``async_tp``: its collectives overlapping the linears,
    :func:`orgel.costs.mesh.tp_costs`), priced like any plan.

    ``costs`` is the whole micro-batch's table (each replica takes ``1/dp``).
    """
    from orgel.costs.blocks import chain_split
    from orgel.plan.predict import labelled, predicted, replicated
    from orgel.plan.replicated import replica_step
    from orgel.plan.scorer import Scorer
    from orgel.plan.splits import uniform_points
    from orgel.plan.templates import Template
    from orgel.schedule.families import build_schedule

    started = time.perf_counter()
    # torchtitan runs TP with sequence parallelism (its norms on a slice of the sequence)
    table = mesh_costs(costs, tp=tp, shard=shard, replicas=dp, sequence_parallel=True,
                       async_tp=async_tp)
    options: dict[str, Any] = {} if stages_per_rank == 1 else {"stages_per_rank":
                                                               stages_per_rank}
    label = family if stages_per_rank == 1 else f"{family} v={stages_per_rank}"
    base = build_schedule(family, depth, microbatches, **options)
    template = Template(label, family, options, base)
    scorer = Scorer(table.scaled(1.0 / dp), memory=None)
    points = uniform_points(costs.num_blocks, template.num_stages)
    # torchtitan's full activation checkpointing wraps each transformer block
    single = scorer.to_plan(template, chain_split(points, costs.num_blocks),
                            (recompute,) * template.num_stages)
    single = labelled(single, template)
    full = replicated(single, dp, table, None, shard)
    full = dataclasses.replace(full, tp=tp, meta={**full.meta, "mesh": {
        "pp": depth, "tp": tp, "dp": dp, "shard": shard}})
    assert replica_step(single, full) is not None
    full, sim = predicted(full, table)
    return PlanResult(full, label, sim, time.perf_counter() - started)


def torchtitan(device: Any, cache: Path | None, choice: bool = True) -> None:
    """torchtitan's published runs on the hardware they ran on (``benchmarks/torchtitan.py``),
    then, with ``choice``, orgel's own plan for Table 5's model, GPUs and batch on
    ``device`` (bf16, blocking TP: the planner does not search Float8 or AsyncTP) beside
    Table 5's interleaved configuration priced the same way."""
    import torchtitan as titan

    titan.report(cache)
    if not choice:
        return
    gpus, batch, seq = 512, 256, 8192
    costs = costs_of("llama3.1-405b", device, 2 * 126 + 2, cache)[0]
    layers = costs_of("llama3.1-405b", device, 2 * 126 + 2, cache, per_layer=True)[0]
    theirs = fixed_plan(layers.scaled(batch // 8), "interleaved", 8, 8, tp=8, dp=8,
                        shard="fsdp", stages_per_rank=2)
    best, seconds = best_mesh(costs, gpus, batch, device.memory_bytes, device.gpus_per_node)
    if best is not None:
        tokens = batch * seq / (best.step_time / 1000) / gpus
        base = batch * seq / (theirs.step_time / 1000) / gpus
        print(f"orgel's choice on {device.name} (bf16, blocking TP, sequence parallel): "
              f"{mesh_label(best)} {best.plan.meta.get('schedule_label')}, M "
              f"{best.plan.microbatches}, recompute {recomputed(best.plan)}: {tokens:.0f} "
              f"tok/s/GPU, {tokens / base:.2f}x Table 5's interleaved configuration priced the "
              f"same way ({base:.0f}; {seconds:.1f} s to plan)", flush=True)


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
    parser.add_argument("--mesh-only", action="store_true",
                        help="only the mesh rows (skip the pipeline-only search)")
    parser.add_argument("--no-torchtitan", action="store_true",
                        help="skip the prediction of torchtitan's 405B run")
    parser.add_argument("--torchtitan-only", action="store_true",
                        help="only the prediction of torchtitan's 405B run (no model rows)")
    parser.add_argument("--loops", type=int, default=MESH_LOOPS,
                        help="stages per rank the mesh search interleaves at most")
    parser.add_argument("--layers", action="store_true",
                        help="plan the model rows on a table of one block per layer (orgel "
                             "plan --blocks layers) instead of 2 x layers + 2 FLOP-balanced "
                             "blocks")
    parser.add_argument("--no-choice", action="store_true",
                        help="in the torchtitan part, skip orgel's own choice (its mesh search)")
    args = parser.parse_args()
    started = time.perf_counter()
    device = load_device(args.device)
    print(f"device {device.name}: {device.gpus_per_node} GPUs per node, "
          f"{device.intra_node.name} inside, {device.inter_node.name} between nodes")
    if not args.torchtitan_only:
        print(f"{'model':<13} {'GPUs':>5} {'search':<8} {'PPxTPxDP':>10} {'M':>4} "
              f"{'schedule':<24} {'recomp':>10} {'step s':>7} {'tok/s/GPU':>9} {'MFU':>5} "
              f"{'x':>5} {'bubble':>6} {'GiB/GPU':>7} {'plan s':>6} {'RSS GiB':>7}")
    for name in [] if args.torchtitan_only else args.model:
        blocks = 2 * LAYERS[name] + 2
        costs, captured, params = costs_of(name, device, blocks, args.cache,
                                           per_layer=args.layers)
        _, batch, seq = MODELS[name]
        print(f"{name}: {params / 1e9:.1f}B parameters, {costs.num_blocks} blocks, captured "
              f"and costed in {captured:.1f} s")
        for gpus in args.gpus:
            pipeline_mfu = None
            result: PlanResult | None = None
            if not args.mesh_only:
                result, depth, seconds = best_plan(costs, gpus, batch, device.memory_bytes)
            if result is None and not args.mesh_only:
                print(f"{name:<13} {gpus:>5} pipeline nothing fits ({seconds:.1f} s)")
            elif result is not None:
                pipeline_mfu = _row(name, gpus, "pipeline", f"{depth}x1x{gpus // depth}",
                                    result, batch, seq, params, device, seconds, None)
            if [name, str(gpus)] == args.compare and result is not None:
                slow, slow_depth, slow_s = best_plan(costs, gpus, batch, device.memory_bytes,
                                                     time_limit=20.0)
                if slow is not None:
                    print(f"  same row, 20 s of beam per depth: {slow_depth}x{gpus // slow_depth} "
                          f"{slow.plan.meta.get('schedule_label')}, step "
                          f"{slow.step_time / 1000:.3f} s against {result.step_time / 1000:.3f} s "
                          f"(ratio {result.step_time / slow.step_time:.4f}), {slow_s:.1f} s "
                          f"to plan", flush=True)
            mesh, seconds = best_mesh(costs, gpus, batch, device.memory_bytes,
                                      device.gpus_per_node, loops=args.loops)
            if mesh is None:
                print(f"{name:<13} {gpus:>5} mesh     nothing fits ({seconds:.1f} s)")
            else:
                _row(name, gpus, "mesh", mesh_label(mesh), mesh, batch, seq, params, device,
                     seconds, pipeline_mfu)
    if not args.no_torchtitan:
        torchtitan(device, args.cache, choice=not args.no_choice)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    print(f"peak memory (RSS) of this process: {peak:.2f} GiB; "
          f"{time.perf_counter() - started:.0f} s in all")


def recomputed(plan: Any) -> str:
    """How many stages recompute, and how (``l``: per layer, ``s``: selective, ``w``:
    the stage whole): ``"6/8 l4 w2"``."""
    kinds = [{"layer": "l", "selective": "s"}.get(r, "w") for r in plan.recompute if r]
    counts = " ".join(f"{k}{kinds.count(k)}" for k in "lsw" if k in kinds)
    return f"{len(kinds)}/{plan.num_stages}" + (f" {counts}" if counts else "")


def _row(name: str, gpus: int, search: str, mesh: str, result: PlanResult, batch: int,
         seq: int, params: float, device: Any, seconds: float, base: float | None) -> float:
    """Print one row; returns its MFU."""
    step = result.step_time / 1000
    tokens = batch * seq / step / gpus
    mfu = 6 * params * tokens / device.peak("bf16")
    label = str(result.plan.meta.get("schedule_label"))[:24]
    recompute = recomputed(result.plan)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    ratio = "" if base is None else f"{mfu / base:.2f}"
    print(f"{name:<13} {gpus:>5} {search:<8} {mesh:>10} {result.plan.microbatches:>4} "
          f"{label:<24} {recompute:>10} {step:>7.2f} {tokens:>9.0f} {mfu:>5.1%} {ratio:>5} "
          f"{result.sim.bubble_fraction:>6.1%} {max(result.sim.peak_memory) / GIB:>7.1f} "
          f"{seconds:>6.1f} {rss:>7.2f}", flush=True)
    return mfu


if __name__ == "__main__":
    main()

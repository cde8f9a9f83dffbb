"""Interleaved 1F1B at depth v on one Llama-3.1-405B mesh: the predicted step and peak in parts.

    python benchmarks/interleave_breakdown.py [--cache DIR] [--gpus 1024] [--tp 8] [--pp 16]
        [--batch 128] [--v 1 2 4 8] [--balanced]

The mesh (default PP 16 x TP 8 x DP 8, FSDP, one 8192-token sequence per micro-batch and
replica, the 128-sequence batch: 16 micro-batches per replica) is priced as
``benchmarks/at_scale.py``'s ``fixed_plan`` prices torchtitan's configurations (uniform
layers per stage, every stage recomputing per layer, sequence parallelism, blocking TP
collectives, bf16), with ``v`` stages per rank (``v = 1``: 1F1B), on the table of one block
per layer (``--balanced``: the 254 FLOP-balanced blocks the mesh search plans). Per ``v``
it prints:

* time, on the busiest rank: its compute (forward, backward), the forward its
  backward runs again, the TP collectives inside its actions, the FSDP all-gathers
  before each stage's first forward, the per-action overhead; its idle time (the
  bubble, which includes waiting for messages); on the critical path, the P2P transfers
  and what the reduce-scatter adds after the last backward; the end of the step
  (optimizer, loss all-reduce);
* memory, on the rank with the largest peak: weights, gradients and optimizer state,
  then what the sweep adds at its peak (activations kept, the action's temporary and
  what a recomputed backward rebuilds, receive buffers), the sends held, and the most
  micro-batch-stages alive at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from at_scale import costs_of, fixed_plan  # noqa: E402

from orgel.costs.devices import load_device  # noqa: E402
from orgel.schedule.costs import Link  # noqa: E402
from orgel.sim.allreduce import gather_time, plan_gathers  # noqa: E402
from orgel.sim.compiled import CompiledPlan  # noqa: E402

GIB = float(1 << 30)


def breakdown(table, depth: int, microbatches: int, *, tp: int, dp: int, v: int) -> dict:
    """One row of parts (ms and GiB) for ``v`` stages per rank."""
    family = "1f1b" if v == 1 else "interleaved"
    result = fixed_plan(table, family, depth, microbatches, tp=tp, dp=dp, shard="fsdp",
                        stages_per_rank=v)
    # the same plan with free TP collectives: the difference is what they cost
    free = dataclasses.replace(table, link=Link(0.0, 0.0))
    untp = fixed_plan(free, family, depth, microbatches, tp=tp, dp=dp, shard="fsdp",
                      stages_per_rank=v)
    plan, sim = result.plan, result.sim
    costs = plan.costs
    assert costs is not None
    cp = CompiledPlan(plan)
    _, arrays = cp.stage_arrays(costs)
    again = cp.recompute_effects(arrays)[0]
    share = cp.stage_share
    ranks = plan.num_ranks
    fwd = np.zeros(ranks)
    bwd = np.zeros(ranks)
    rerun = np.zeros(ranks)
    tpc = np.zeros(ranks)
    gather = np.zeros(ranks)
    overhead = np.zeros(ranks)
    ucosts = untp.plan.costs
    assert ucosts is not None
    for r, actions in enumerate(plan.schedule):
        for a in actions:
            s = a.stage
            st, us = costs.stages[s], ucosts.stages[s]
            if a.kind == "F":
                fwd[r] += us.fwd * share[s]
                tpc[r] += (st.fwd - us.fwd) * share[s]
            else:
                bwd[r] += us.bwd * share[s]
                tpc[r] += (st.bwd - us.bwd) * share[s]
                rerun[r] += again[s] * share[s]  # its TP collectives run again too
            overhead[r] += costs.action_overhead
    for s, group, firsts in plan_gathers(plan):
        for r, _ in firsts:
            gather[r] += gather_time(group, costs.stages[s].params, costs)
    busy = fwd + bwd + rerun + tpc + gather + overhead
    last = max(e.end for e in sim.timeline.events)
    end = sim.step_time - last  # the end of the step (optimizer, loss all-reduce)
    simstep = last
    r = int(np.argmax(busy))
    path = sim.critical_path
    p2p = sum(e.duration for e in path if e.track == "comm" and not e.label.startswith(
        ("allreduce", "reduce-scatter")))
    last_compute = max(e.end for e in sim.timeline.events if e.track == "compute")
    # memory: the rank with the largest peak
    m = int(np.argmax(sim.peak_memory))
    static = sum(costs.stages[s].static_bytes for s in range(plan.num_stages)
                 if m in plan.placement[s])
    params = sum(costs.stages[s].params for s in range(plan.num_stages)
                 if m in plan.placement[s])
    grads = sum(costs.stages[s].grad_bytes for s in range(plan.num_stages)
                if m in plan.placement[s])
    held = cp.held_send_bytes(grad_bytes=costs.edge_grad_bytes)
    kept = cp.recompute_effects(arrays)[1]
    mine = [s for s in range(plan.num_stages) if m in plan.placement[s]]
    return {
        "v": v, "step": sim.step_time, "simstep": simstep, "end": end, "rank": r,
        "fwd": fwd[r], "bwd": bwd[r], "rerun": rerun[r], "tp": tpc[r], "gather": gather[r],
        "overhead": overhead[r], "busy": busy[r], "idle": simstep - busy[r],
        "p2p_path": p2p, "after_last": last - last_compute,
        "bubble": sim.bubble_fraction,
        "mrank": m, "peak": sim.peak_memory[m] / GIB, "params": params / GIB,
        "grads": grads / GIB, "optim": (static - params - grads) / GIB,
        "held": held[m] / GIB, "inflight": sim.peak_inflight[m],
        "kept_per_mb": float(sum(kept[s] * share[s] for s in mine)) / len(mine) / GIB,
        "sweep": (sim.peak_memory[m] - held[m] - static) / GIB,
        "first": [x / GIB for x in sim.peak_memory[:4]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128, help="sequences per step")
    parser.add_argument("--v", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--balanced", action="store_true",
                        help="the 254 FLOP-balanced blocks the mesh search plans (cuts may "
                             "fall inside layers), not one block per layer")
    args = parser.parse_args()
    device = load_device("h100-80gb")
    costs = costs_of("llama3.1-405b", device, 2 * 126 + 2, args.cache,
                     per_layer=not args.balanced)[0]
    dp = args.gpus // args.tp // args.pp
    microbatches = args.batch // dp
    table = costs.scaled(dp)  # each replica takes one sequence of a dp-sequence micro-batch
    print(f"Llama-3.1-405B, {args.gpus} GPUs: PP {args.pp} x TP {args.tp} x DP {dp} FSDP, "
          f"{microbatches} micro-batches of one sequence per replica, per-layer recompute")
    print("time (ms; busiest rank): step = compute + idle + end of step")
    print(f"{'v':>2} {'step':>7} {'end':>5} {'fwd':>6} {'bwd':>6} {'rerun':>6} {'TP':>6} "
          f"{'gather':>6} {'ovh':>5} {'busy':>7} {'idle':>6} {'p2p@cp':>6} {'RS tail':>7} "
          f"{'bubble':>6}")
    rows = [breakdown(table, args.pp, microbatches, tp=args.tp, dp=dp, v=v) for v in args.v]
    for b in rows:
        print(f"{b['v']:>2} {b['step']:>7.0f} {b['end']:>5.0f} {b['fwd']:>6.0f} "
              f"{b['bwd']:>6.0f} {b['rerun']:>6.0f} {b['tp']:>6.0f} {b['gather']:>6.0f} "
              f"{b['overhead']:>5.1f} {b['busy']:>7.0f} {b['idle']:>6.0f} "
              f"{b['p2p_path']:>6.1f} {b['after_last']:>7.1f} {b['bubble']:>6.1%}")
    print("memory (GiB; rank with the largest peak): peak = params + grads + optimizer "
          "+ sweep (activations, temporaries, receives) + sends held")
    print(f"{'v':>2} {'rank':>4} {'peak':>6} {'params':>6} {'grads':>6} {'optim':>6} "
          f"{'sweep':>6} {'held':>5} {'alive':>5} {'kept/mb-stage':>13}  peak of ranks 0..3")
    for b in rows:
        print(f"{b['v']:>2} {b['mrank']:>4} {b['peak']:>6.1f} {b['params']:>6.1f} "
              f"{b['grads']:>6.1f} {b['optim']:>6.1f} {b['sweep']:>6.1f} {b['held']:>5.2f} "
              f"{b['inflight']:>5} {b['kept_per_mb']:>13.3f}  "
              + " ".join(f"{x:.1f}" for x in b["first"]))


if __name__ == "__main__":
    main()

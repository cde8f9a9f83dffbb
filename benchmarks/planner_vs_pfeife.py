"""Planner speed and quality on the instance Pfeife's planner was timed on.

The instance (issue 5): a chain of N blocks drawn with ``random.Random(0)``; for
block i in order: fwd = uniform(0.05, 2.0) ms, then activations =
randint(1, 32) MiB, then one randint(0, 16) draw for temporary MiB; bwd = 2 x fwd;
blocks with i % 4 == 1 hold 16 MiB of parameters (optimizer factor 4); every
edge carries 8 MiB; link 0.02 ms + 0.05 ms/MiB; 80 GiB per rank.

Pfeife's reference numbers on it: 4 ranks x 8 micro-batches: 14.07 s search,
predicted step 2840 ms (best reachable 2733 ms); 8 ranks x 16 micro-batches:
487.6 s; 1600 blocks: 26.3 s. Run: ``python benchmarks/planner_vs_pfeife.py``
(add ``--quick`` for the first row only). Timings are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import random
import time

from orgel.costs.blocks import BlockCosts
from orgel.plan import plan
from orgel.schedule.costs import Link

MiB = 1 << 20


def instance(num_blocks: int = 400) -> BlockCosts:
    """The benchmark chain (see the module docstring)."""
    rng = random.Random(0)
    fwd, acts, temps = [], [], []
    for _ in range(num_blocks):
        fwd.append(rng.uniform(0.05, 2.0))
        acts.append(rng.randint(1, 32) * MiB)
        temps.append(rng.randint(0, 16) * MiB)
    return BlockCosts(
        fwd=fwd, bwd=[2 * f for f in fwd], wgrad=list(fwd),
        params=[16 * MiB if i % 4 == 1 else 0 for i in range(num_blocks)],
        activations=acts, output=[8 * MiB] * num_blocks, temporary=temps,
        edges=[(i, i + 1) for i in range(num_blocks - 1)], link=Link(0.02, 0.05),
        memory_per_rank=80 << 30, optimizer_factor=4)


#: (label, blocks, ranks, micro-batches, Pfeife search s, Pfeife step ms)
CASES = [
    ("400 blocks, 4 ranks x 8 mb", 400, 4, 8, 14.07, 2840.0),
    ("400 blocks, 8 ranks x 16 mb", 400, 8, 16, 487.6, None),
    ("1600 blocks, 4 ranks x 8 mb", 1600, 4, 8, 26.3, None),
]
#: orgel's settings: the default (an anytime search with a budget for the problem's size,
#: ``orgel.plan.planner.search_budget``) and the thorough search (``--thorough``)
SEARCHES = [("default", {}), ("thorough", {"time_limit": None})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first case")
    args = parser.parse_args()
    rows = []
    for label, n, ranks, mbs, pf_s, pf_step in CASES[:1] if args.quick else CASES:
        costs = instance(n)
        ideal = sum(f + b for f, b in zip(costs.fwd, costs.bwd, strict=True)) * mbs / ranks
        for search, options in SEARCHES:
            t0 = time.perf_counter()
            result = plan(costs, ranks, mbs, planner="beam", max_loops=12,
                          **options)  # type: ignore[arg-type]
            wall = time.perf_counter() - t0
            rows.append((f"{label} ({search})", pf_s, wall, pf_s / wall, pf_step,
                         result.step_time, result.baselines["uniform-time"], ideal,
                         result.plan.meta["schedule_label"], result.evaluations))
    header = (f"{'case':<40} {'Pfeife s':>9} {'orgel s':>8} {'speed-up':>8} "
              f"{'Pfeife ms':>9} {'orgel ms':>9} {'1F1B bal.':>9} {'compute':>8}  schedule")
    print(header)
    print("-" * len(header))
    for label, pf_s, wall, speed, pf_step, step, base, ideal, sched, evals in rows:
        pf = f"{pf_step:9.0f}" if pf_step else f"{'-':>9}"
        print(f"{label:<40} {pf_s:9.2f} {wall:8.2f} {speed:7.0f}x {pf} {step:9.1f} "
              f"{base:9.1f} {ideal:8.1f}  {sched} ({evals} sims)")
    print("\ncompute = busiest-rank work if perfectly balanced (no bubble, no comm): a lower "
          "bound.\n1F1B bal. = the uniform-time baseline (balanced split, 1F1B).")


if __name__ == "__main__":
    main()

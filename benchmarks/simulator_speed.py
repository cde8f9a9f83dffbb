"""How many simulations per second the simulator scores (step time + peak memory).

Usage: ``python benchmarks/simulator_speed.py [--repeats 7] [--seconds 0.5]``

For each case (ranks, stages per rank, micro-batches) it builds the schedule
once (1F1B with one stage per rank, interleaved 1F1B otherwise), compiles it
(:class:`orgel.sim.CompiledPlan`) and calls ``evaluate`` with costs that change
on every call (random per-stage times and memory, as a planner would), after a
warm-up that includes the one-off straight-line compilation. It prints the
median over repeats of evaluations per second, next to the target for this
machine, and what each longest-path engine takes alone (generic loop,
straight-line code, level-synchronous numpy) plus one full ``simulate()``
(timeline, critical path). The machine's load average is printed before and
after: other processes slow every number down.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

from orgel.schedule import Costs, Link, Plan, StageCost
from orgel.schedule.families import build_schedule
from orgel.sim import CompiledPlan, simulate
from orgel.sim.compiled import STRAIGHT_LINE_AFTER
from orgel.sim.longest import LevelPath, longest_path, make_straight_line

# (ranks, stages per rank, micro-batches, target simulations per second)
CASES = [(4, 1, 8, 5000), (8, 3, 16, 300), (32, 1, 64, 100)]


def build(ranks: int, per_rank: int, microbatches: int) -> Plan:
    if per_rank == 1:
        return build_schedule("1f1b", ranks, microbatches, nbytes=4 << 20)
    return build_schedule("interleaved", ranks, microbatches, stages_per_rank=per_rank,
                          nbytes=4 << 20)


def random_costs(num_stages: int, rng: random.Random) -> Costs:
    stages = [
        StageCost(fwd=rng.uniform(0.5, 2.0), bwd=rng.uniform(1.0, 4.0),
                  params=rng.randrange(1 << 30), activations=rng.randrange(1 << 28),
                  temporary=rng.randrange(1 << 26))
        for _ in range(num_stages)
    ]
    return Costs(stages, link=Link(latency=0.02, per_mib=0.05))


def rate(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median calls per second over ``repeats`` batches of ``calls``."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return 1.0 / statistics.median(times)


def measure(ranks: int, per_rank: int, mbs: int, rng: random.Random, repeats: int,
            seconds: float) -> dict[str, float]:
    """Numbers for one case (see the module docstring)."""
    plan = build(ranks, per_rank, mbs)
    compiled = CompiledPlan(plan)
    pool = [random_costs(plan.num_stages, rng) for _ in range(64)]
    counter = iter(range(1 << 62))

    def evaluate() -> object:
        return compiled.evaluate(pool[next(counter) % len(pool)])

    for _ in range(STRAIGHT_LINE_AFTER + 2):  # warm up, compile the straight line
        evaluate()
    once = 1.0 / rate(evaluate, 3, 1)
    sims = rate(evaluate, max(3, int(seconds / once)), repeats)

    costs = pool[0]
    dur = compiled.durations(costs, compiled.stage_arrays(costs)[1])
    dl = dur.tolist()
    t = time.perf_counter()
    straight = make_straight_line(compiled.preds, compiled.order)
    compile_ms = (time.perf_counter() - t) * 1e3
    levels = LevelPath(compiled.preds, compiled.order)
    n = max(3, 20000 // compiled.num_ops)
    return {
        "ops": compiled.num_ops,
        "sims": sims,
        "compile_ms": compile_ms,
        "loop_us": 1e6 / rate(lambda: longest_path(compiled.preds, compiled.order, dl), n,
                              repeats),
        "straight_us": 1e6 / rate(lambda: straight(dl), n, repeats),
        "levels_us": 1e6 / rate(lambda: levels(dur), n, repeats),
        "simulate_ms": 1e3 / rate(lambda: simulate(plan, costs, compiled=compiled), 3, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5,
                        help="rough length of one repeat of the evaluate loop")
    args = parser.parse_args()
    rng = random.Random(0)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"({os.cpu_count()} CPUs)")
    print(f"{'ranks':>5} {'v':>2} {'mb':>3} {'schedule':>11} {'ops':>6} {'sims/s':>8} "
          f"{'target':>6} {'compile ms':>10} {'loop us':>8} {'straight us':>11} "
          f"{'levels us':>9} {'simulate ms':>11} {'load':>5}")
    for ranks, per_rank, mbs, target in CASES:
        m = measure(ranks, per_rank, mbs, rng, args.repeats, args.seconds)
        name = "1f1b" if per_rank == 1 else "interleaved"
        print(f"{ranks:>5} {per_rank:>2} {mbs:>3} {name:>11} {m['ops']:>6.0f} "
              f"{m['sims']:>8.0f} {target:>6} {m['compile_ms']:>10.1f} {m['loop_us']:>8.0f} "
              f"{m['straight_us']:>11.0f} {m['levels_us']:>9.0f} {m['simulate_ms']:>11.2f} "
              f"{os.getloadavg()[0]:>5.2f}")
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()

"""Does the planner predict a compiled pipeline's step? Eager and compiled profiles side by side.

    python benchmarks/compiled_prediction.py --ranks 2 --microbatches 4 --steps 8

With ``compile=True`` the planner's profile times each block compiled
(:mod:`orgel.profile.compiled`); before, it timed the eager blocks and the ranks then ran
compiled ones. For ``examples/gpt.py``'s workload, in one process, one after another (each
on a profile cache of its own, so each variant profiles):

* ``eager``: ``orgel.pipeline(...)``, eager stages, its plan from an eager profile;
* ``compiled, eager table``: that same plan run with ``compile=True`` (what the planner
  predicted before: the eager table's step);
* ``compiled``: ``orgel.pipeline(..., compile=True)``, its plan from a compiled profile.

For each: the plan's predicted step (``pipe.predicted().step_time``) and the median of the
measured steps after two warm-up steps, and their ratio. The load average is printed with
them (the machine is shared).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))


def _run(model: Any, inputs: Any, targets: Any, loss_fn: Any, steps: int,
         **options: Any) -> tuple[Any, float, float]:
    """The plan, its predicted step and the median measured step (ms)."""
    import orgel

    os.environ["ORGEL_CACHE"] = tempfile.mkdtemp(prefix="orgel-prediction-")
    with orgel.pipeline(model, inputs, targets, loss_fn, **options) as pipe:
        for _ in range(2):  # warm-up (compiles the stages)
            pipe.step(inputs, targets)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            pipe.step(inputs, targets)
            times.append((time.perf_counter() - start) * 1e3)
        return pipe.plan, float(pipe.predicted().step_time), statistics.median(times)


def _describe(plan: Any) -> str:
    return f"{plan.num_stages} stages on {plan.num_ranks} ranks, {plan.microbatches} mb"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default=None,
                        help="the ranks' device (default: orgel's choice; cuda: the planner "
                             "profiles on the GPU)")
    args = parser.parse_args()
    from gpt import workload

    model, inputs, targets, loss_fn = workload()
    common = dict(ranks=args.ranks, microbatches=args.microbatches, timeout_s=900,
                  device=args.device)
    rows = []
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    plan, predicted, measured = _run(copy.deepcopy(model), inputs, targets, loss_fn,
                                     args.steps, **common)
    rows.append(("eager", plan, predicted, measured))
    print(*rows[-1][:1], f"{predicted:.1f} / {measured:.1f} ms", flush=True)
    _, _, measured = _run(copy.deepcopy(model), inputs, targets, loss_fn, args.steps,
                          plan=plan, compile=True, **common)
    rows.append(("compiled, eager table", plan, predicted, measured))
    print(*rows[-1][:1], f"{predicted:.1f} / {measured:.1f} ms", flush=True)
    plan, predicted, measured = _run(copy.deepcopy(model), inputs, targets, loss_fn,
                                     args.steps, compile=True, **common)
    rows.append(("compiled", plan, predicted, measured))
    print(*rows[-1][:1], f"{predicted:.1f} / {measured:.1f} ms", flush=True)
    print(f"\nload average now {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<24}{'plan':<30}{'predicted ms':>14}{'measured ms':>13}{'pred/meas':>11}")
    for name, plan, predicted, measured in rows:
        print(f"{name:<24}{_describe(plan):<30}{predicted:>14.1f}{measured:>13.1f}"
              f"{predicted / measured:>11.2f}")


if __name__ == "__main__":
    main()

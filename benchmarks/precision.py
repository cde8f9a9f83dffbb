"""float32 against bf16-mixed for one model: plan, predicted and measured step, peak memory.

For one workload (default the GPT-like example) the planner plans it twice on 2
gloo ranks, once per precision (``orgel.plan.plan_workload`` on the workload
with ``precision`` set: capture, profiling and the loss under the autocast),
then both plans run on 2 local processes (the measurement of
``benchmarks/cost_model_accuracy.py``: median over steps 2..N of the slowest
rank's step; peak tensor bytes per rank during one step). One table, both rows
from this run, with the predicted/measured ratios and the bytes that cross
between the stages per micro-batch::

    python benchmarks/precision.py                    # GPT-like
    python benchmarks/precision.py --workload examples/vit.py:workload
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cost_model_accuracy import _rank  # noqa: E402 - the same measurement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="examples/gpt.py:workload")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                        help="where to profile and run (see cost_model_accuracy.py)")
    args = parser.parse_args()
    from orgel.launch.devices import backend_for, profiling_on, resolve_device
    from orgel.launch.spawn import spawn
    from orgel.plan import plan_workload
    from orgel.workload import load_workload, with_precision

    torch.set_num_threads(1)  # the ranks run with one thread each; profile the same way
    mib = 1 << 20
    kind = resolve_device(args.device)
    print(f"{args.workload}: 2 {backend_for(kind, 2)} ranks on {kind}, "
          f"{args.microbatches} micro-batches, "
          f"{args.steps} steps, load {os.getloadavg()[0]:.1f}")
    print(f"{'precision':<11} {'plan':<28} {'sent/mb KiB':>11} {'step ms pred':>12} "
          f"{'meas':>7} {'ratio':>6}  peak MiB pred / meas per rank")
    rows = {}
    for precision in ("32", "bf16-mixed"):
        workload = with_precision(load_workload(args.workload), precision)
        with profiling_on(kind):
            result = plan_workload(workload, ranks=2, microbatches=args.microbatches,
                                   blocks=args.blocks, planner="beam", progress=False)
        plan = result.plan
        out = spawn(_rank, 2, args.workload, plan.to_json(), args.steps, precision, kind,
                    timeout=300.0, threads=1, backend=backend_for(kind, 2))
        per_step = [max(r["times"][i] for r in out) for i in range(1, args.steps)]
        measured = statistics.median(per_step)
        sent = sum(e.nbytes for e in plan.stage_graph.edges) / 1024
        label = (f"{plan.num_stages} stages, "
                 f"{plan.meta.get('schedule_label', plan.meta.get('schedule', '?'))}")
        peaks = ", ".join(f"{p / mib:.1f}/{r['peak'] / mib:.1f}"
                          for p, r in zip(result.sim.peak_memory, out, strict=True))
        rows[precision] = (result.step_time, measured, sent)
        print(f"{precision:<11} {label[:28]:<28} {sent:>11.1f} {result.step_time:>12.1f} "
              f"{measured:>7.1f} {result.step_time / measured:>6.2f}  {peaks}")
    (p32, m32, s32), (p16, m16, s16) = rows["32"], rows["bf16-mixed"]
    print(f"bf16-mixed / float32: predicted step {p16 / p32:.2f}, measured step "
          f"{m16 / m32:.2f}, bytes sent {s16 / s32:.2f}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

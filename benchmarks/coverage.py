"""Coverage: every architecture of the test zoo through ``orgel.pipeline``, against one process.

Each model (``tests/archzoo``: Hugging Face models built from configs, CNNs with
BatchNorm and in-place activations, RNNs, models with shared layers, graph
breaks, vmap, autocast regions) runs in a process of its own, as a new user
would run it: ``orgel.pipeline(model, inputs, targets, loss_fn, ranks=2,
microbatches=2, optimizer=SGD)`` with every default (profiling, planning) and
one ``step``. The model must come back from ``orgel.pipeline`` bit-identical,
and after the step every parameter and buffer must match a copy of the model
trained in one process with gradient accumulation over the same micro-batches
(``tests/archzoo/check.py``: relative difference at most 1e-5).

One line per model (``exact`` / ``differs: ...`` / ``fails: <first line of the
error>``), then ``K/N exact`` with the transformers version:

    python benchmarks/coverage.py                     # the whole zoo, default planning
    python benchmarks/coverage.py --only hf_llama resnet
    python benchmarks/coverage.py --plan balanced     # a FLOP-balanced 1F1B chain, no profiling
    .venv4/bin/python benchmarks/coverage.py          # the same under transformers 4.x
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def run_one(name: str, ranks: int, microbatches: int, plan: str) -> dict[str, object]:
    """Check ``name`` in this process; a dict with status, detail and the worst difference."""
    sys.path.insert(0, str(TESTS))
    import torch

    from archzoo import archs
    from archzoo.check import balanced_check, orgel_check

    torch.set_num_threads(1)
    build = archs()[name]
    check = balanced_check if plan == "balanced" else orgel_check
    outcome = check(name, build, ranks=ranks, m=microbatches)
    worst = max((v for v in outcome.worst.values()), default=0.0)
    return {"name": name, "status": outcome.status, "detail": outcome.detail, "worst": worst,
            "trace": outcome.trace}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="check only these models")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--plan", choices=("auto", "balanced"), default="auto",
                        help="auto: orgel.pipeline's defaults; balanced: a FLOP-balanced chain")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model")
    parser.add_argument("--traceback", action="store_true", help="print each failure's traceback")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: check one model, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.ranks, args.microbatches, args.plan)))
        return 0

    sys.path.insert(0, str(TESTS))
    import transformers

    from archzoo import archs

    names = args.only or list(archs())
    unknown = sorted(set(names) - set(archs()))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(archs())}")
    print(f"coverage: {len(names)} models, {args.ranks} ranks, {args.microbatches} micro-batches, "
          f"plan {args.plan}, transformers {transformers.__version__}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    exact = 0
    for name in names:
        start = time.perf_counter()
        command = [sys.executable, __file__, "--one", name, "--ranks", str(args.ranks),
                   "--microbatches", str(args.microbatches), "--plan", args.plan]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            result = json.loads(lines[-1]) if lines else {
                "status": "fails", "detail": f"the process ended with {done.returncode}: "
                + (done.stderr.strip().splitlines() or [""])[-1][:160], "trace": done.stderr}
        except subprocess.TimeoutExpired:
            result = {"status": "fails", "detail": f"timed out after {args.timeout:.0f} s",
                      "trace": ""}
        took = time.perf_counter() - start
        exact += result["status"] == "exact"
        text = "exact" if result["status"] == "exact" else f"{result['status']}: {result['detail']}"
        print(f"{name:<26} {text}  ({took:.0f} s)", flush=True)
        if args.traceback and result["status"] != "exact" and result.get("trace"):
            print(result["trace"], flush=True)
    print(f"{exact}/{len(names)} exact (transformers {transformers.__version__})")
    return 0 if exact == len(names) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Differential fuzzing at length: many drawn setups through orgel against one process.

Each draw (``tests/fuzzing.py``: a zoo model, 2-4 ranks, dp, schedule family,
micro-batches, recompute, frozen parameters, precision, optimizer, learning-rate schedule,
clipping, accumulation, meta init, with ``--compile`` Inductor's stages, the entry point:
``orgel.pipeline`` or ``orgel.backend`` with a closure, and with ``--torchrun`` either in
a torchrun job) is
trained for two optimizer steps on gloo ranks and in one process; every parameter, buffer
and optimizer state copy is compared. Prints each setup, its verdict (the largest abs/rel
difference per kind of value; what differed), and a summary. CI runs a few fixed draws of
the same code (``tests/test_fuzz.py``).

    python benchmarks/fuzz.py --draws 200 --seed 0 [--hf] [--model gpt] [--torchrun] [--compile]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, action="append",
                        help="run only this draw of the seed (by its index; repeatable): "
                             "to run a finding again")
    parser.add_argument("--hf", action="store_true", help="also draw the Hugging Face models")
    parser.add_argument("--model", action="append", help="draw only these models")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no draw after this many minutes (then the summary)")
    parser.add_argument("--auto", action="store_true",
                        help="also draw the planner's own plans (schedule=auto; it profiles)")
    parser.add_argument("--torchrun", action="store_true",
                        help="also draw both entry points under torchrun (a job per draw: slower)")
    parser.add_argument("--compile", action="store_true",
                        help="also draw compile=True (Inductor compiles every stage: slower)")
    parser.add_argument("--traceback", action="store_true", help="print a crash's traceback")
    args = parser.parse_args(argv)

    import os
    import tempfile

    import torch

    torch.set_num_threads(1)
    # the planner's profiles of schedule=auto draws: kept for this run's later draws
    os.environ.setdefault("ORGEL_CACHE", tempfile.mkdtemp(prefix="orgel-fuzz-"))
    import fuzzing

    models: tuple[str, ...] = tuple(args.model or fuzzing.MODELS
                                    + (fuzzing.HF_MODELS if args.hf else ()))
    print(f"excluded (known open defects): {fuzzing.EXCLUDED}")
    outcomes: Counter[str] = Counter()
    failed: list[str] = []
    worst: dict[str, tuple[float, float]] = {}  # over the tightly judged draws, by kind
    start = time.monotonic()
    draws = 0
    for i in range(max(args.only) + 1 if args.only else args.draws):
        if args.minutes is not None and time.monotonic() - start > 60 * args.minutes:
            break
        if args.only and i not in args.only:
            continue
        draws += 1
        rng = random.Random(f"{args.seed}/{i}")

        def pick(name: str, options: Sequence[Any], rng: random.Random = rng) -> Any:
            return rng.choice(list(options))

        setup = fuzzing.draw(pick, models, auto=args.auto, compiled=args.compile,
                             entries=fuzzing.ENTRIES + (fuzzing.TORCHRUN if args.torchrun else ()))
        began = time.monotonic()
        print(f"[{i}] {setup.line()}", flush=True)
        try:
            verdict = fuzzing.check(setup)
        except fuzzing.Refused as exc:
            outcomes["refused"] += 1
            print(f"    refused: {str(exc)[:300]}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - a crash is a finding: print it, go on
            outcomes["crashed"] += 1
            failed.append(f"[{i}] {setup.line()}\n    crashed: {type(exc).__name__}: "
                          f"{str(exc)[:500]}")
            print(f"    CRASHED: {type(exc).__name__}: {str(exc)[:800]}", flush=True)
            if args.traceback:
                traceback.print_exc(limit=-6)
            continue
        outcomes["ok" if verdict.ok else "differs"] += 1
        if not verdict.used_float64:
            for kind, (a, r) in verdict.worst.items():
                w = worst.get(kind, (0.0, 0.0))
                worst[kind] = (max(w[0], a), max(w[1], r))
        if verdict.used_float64:
            outcomes["judged against float64"] += 1
        print(f"    {verdict.summary()}  ({time.monotonic() - began:.1f} s)", flush=True)
        if not verdict.ok:
            failed.append(f"[{i}] {setup.line()}\n    {verdict.summary()}")
    elapsed = time.monotonic() - start
    print(f"\n{draws} draws (seed {args.seed}) in {elapsed:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print("largest abs/rel difference by kind over the draws judged tightly: "
          + ", ".join(f"{k} {a:.1e}/{r:.1e}" for k, (a, r) in sorted(worst.items())))
    for line in failed:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

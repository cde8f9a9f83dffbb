"""``orgel demo``: train a small model on local ranks (CPU or GPU); show plan, timeline, check."""

from __future__ import annotations

import argparse
import sys

NAME = "demo"
HELP = ("train a small model on local ranks (CPU or GPU), check it against one process, draw "
        "its timeline")
EXAMPLES = (
    "orgel demo",
    "orgel demo --ranks 3 --steps 50 --model vit --out demo-vit",
    "orgel demo --device cuda",
    "orgel demo --compile",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from orgel.names import DEMO_MODELS

    parser.add_argument("--model", choices=DEMO_MODELS, default="gpt",
                        help="which model to pipeline (default: gpt on the shipped corpus)")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks to spawn (default 2)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="micro-batches per step (default 4)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step (default 16)")
    parser.add_argument("--out", default="orgel-demo", metavar="DIR",
                        help="where to write timeline.png, trace.json and plan.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--compile", action="store_true",
                        help="compile every stage with Inductor (each rank compiles at its "
                             "first step)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the ranks compute (default auto: CUDA when present; "
                             "ranks that outnumber the GPUs share them over gloo)")
    from orgel.commands.text import precision_argument

    precision_argument(parser)


def run(args: argparse.Namespace) -> int:
    from orgel.explicit.demo import run_demo

    for name in ("ranks", "steps", "microbatches", "batch_size"):
        value = getattr(args, name)
        if value < 1:
            print(f"orgel demo: --{name.replace('_', '-')} must be at least 1, got {value}",
                  file=sys.stderr)
            return 2
    if args.batch_size % args.microbatches:
        print(f"orgel demo: --batch-size {args.batch_size} must be divisible by --microbatches "
              f"{args.microbatches}", file=sys.stderr)
        return 2
    try:
        result = run_demo(model=args.model, ranks=args.ranks, steps=args.steps,
                          microbatches=args.microbatches, batch_size=args.batch_size,
                          out=args.out, progress=not args.no_progress,
                          precision=args.precision, device=args.device,
                          compile=args.compile)
    except ValueError as exc:  # options the planner or the model reject
        print(f"orgel demo: {exc}", file=sys.stderr)
        return 2
    return 0 if result.first_loss_matches else 1

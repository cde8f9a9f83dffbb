"""``orgel checkpoint``: inspect a checkpoint and export it as the original model's state_dict."""

from __future__ import annotations

import argparse
import sys

from orgel.commands.text import command_parser

NAME = "checkpoint"
HELP = "inspect a checkpoint or export it as the original model's state_dict"
EXAMPLES = (
    "orgel checkpoint info ckpt",
    "orgel checkpoint export ckpt model.pt",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = command_parser(sub, "info", "print a checkpoint's step, ranks, plan and tensors",
                          ["orgel checkpoint info ckpt"])
    info.add_argument("dir", metavar="DIR", help="checkpoint root (with LATEST) or step folder")
    export = command_parser(
        sub, "export", "write the original model's state_dict (torch.save) to OUT",
        ["orgel checkpoint export ckpt model.pt"])
    export.add_argument("dir", metavar="DIR", help="checkpoint root (with LATEST) or step folder")
    export.add_argument("out", metavar="OUT", help="output file, e.g. model.pt; load it with "
                        "model.load_state_dict(torch.load(OUT, weights_only=True))")


def run(args: argparse.Namespace) -> int:
    from orgel.runtime import checkpoint as ckpt

    try:
        meta = ckpt.read_meta(args.dir)
        if args.action == "export":
            count = ckpt.export(args.dir, args.out)
            print(f"wrote {count} tensors of step {meta['step']} to {args.out}")
            return 0
        from orgel.schedule.ir import Plan

        plan = Plan.from_json(ckpt.read_plan_json(args.dir))
        print(f"{ckpt.resolve(args.dir)}: step {meta['step']}, {meta['num_ranks']} ranks, "
              f"{len(meta['owners'])} tensors")
        print(f"plan: {plan.num_stages} stages, {plan.microbatches} micro-batches, "
              f"schedule {plan.meta.get('schedule', '?')}")
        for r in range(int(meta["num_ranks"])):
            names = sorted(n for n, owners in meta["owners"].items() if r in owners)
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            print(f"  rank {r}: {len(names)} tensors ({shown})")
        return 0
    except ckpt.CheckpointError as exc:
        print(f"orgel checkpoint: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"orgel checkpoint: {exc}", file=sys.stderr)
        return 2

"""``orgel profile``: measure a workload's blocks and links and print the cost table."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

NAME = "profile"
HELP = "measure every block's time and memory and the links between ranks (cached on disk)"
EXAMPLES = (
    "orgel profile examples/gpt.py:workload --microbatches 8 --blocks 32 --out costs.json",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="workload as FILE.py:FUNCTION")
    parser.add_argument("--microbatches", type=int, default=4, metavar="M",
                        help="micro-batches per step: blocks are measured on one (default 4)")
    parser.add_argument("--blocks", type=int, default=32, metavar="N",
                        help="target number of blocks (default 32)")
    parser.add_argument("--repeats", type=int, default=5, metavar="R",
                        help="timed runs per measurement, the median is kept (default 5)")
    parser.add_argument("--ranks", type=int, default=2, metavar="P",
                        help="measure the link of every pair among P local ranks, as many "
                        "as this host has GPUs (NCCL) or cores (gloo) for (default 2)")
    parser.add_argument("--no-link", action="store_true", help="skip the link benchmark")
    parser.add_argument("--no-cache", action="store_true", help="measure again, ignore the cache")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--out", metavar="COSTS.json", help="write the costs file here "
                        "(input for orgel plan --costs)")
    from orgel.commands.text import precision_argument

    precision_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the costs file as JSON")


def run(args: argparse.Namespace) -> int:
    from orgel.profile.workload import profile_workload
    from orgel.usercode import is_users
    from orgel.workload import in_precision

    if min(args.microbatches, args.blocks, args.repeats) < 1 or args.ranks < 2:
        print("orgel profile: --microbatches, --blocks and --repeats must be at least 1, "
              "--ranks at least 2", file=sys.stderr)
        return 2
    try:
        workload = in_precision(args.workload, args.precision)
        costs = profile_workload(workload, microbatches=args.microbatches,
                                 blocks=args.blocks, device=args.device, repeats=args.repeats,
                                 link=not args.no_link, use_cache=not args.no_cache,
                                 ranks=args.ranks,
                                 progress=not args.json)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as exc:
        if is_users(exc):  # the workload's own error: orgel.cli shows its frames
            raise
        print(f"orgel profile: {exc}", file=sys.stderr)
        return 2
    data = costs.to_dict()
    if args.out:
        costs.save(args.out)
    if args.json:
        print(json.dumps(data))
    else:
        print(format_table(data))
        if args.out:
            print(f"costs written to {args.out}")
    return 0


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.2f}"


def format_table(data: dict[str, Any]) -> str:
    """One row per block, then totals, the action overhead and the link(s)."""
    lines = [f"{'block':>5}  {'name':<24} {'fwd ms':>8} {'bwd ms':>8} {'wgrad ms':>8} "
             f"{'params MiB':>10} {'saved MiB':>9} {'out MiB':>8} {'temp MiB':>8}"]
    for i, b in enumerate(data["blocks"]):
        lines.append(f"{i:>5}  {b['name'][:24]:<24} {b['fwd']:>8.3f} {b['bwd']:>8.3f} "
                     f"{b['wgrad']:>8.3f} {_mib(b['params']):>10} {_mib(b['activations']):>9} "
                     f"{_mib(b['output']):>8} {_mib(b['temporary']):>8}")
    blocks = data["blocks"]
    lines.append(f"{'total':>5}  {'':<24} {sum(b['fwd'] for b in blocks):>8.3f} "
                 f"{sum(b['bwd'] for b in blocks):>8.3f} {sum(b['wgrad'] for b in blocks):>8.3f} "
                 f"{_mib(sum(b['params'] for b in blocks)):>10} "
                 f"{_mib(sum(b['activations'] for b in blocks)):>9}")
    link = data["link"]
    meta = data.get("meta", {})
    pairs = data.get("links") or []
    lines.append(f"action overhead {data['action_overhead']:.3f} ms; "
                 f"{'default ' if pairs else ''}link {_link(link)}; "
                 f"{len(data['edges'])} block edges; device {meta.get('device', '?')}")
    if pairs:
        # only the pairs that differ materially from the default are kept
        lines.append("rank pairs with their own link: " + "; ".join(
            f"{src}->{dst} {_link(lk)}" for src, dst, lk in pairs))
    return "\n".join(lines)


def _link(link: dict[str, float]) -> str:
    return f"{link['latency']:.3f} ms + {link['per_mib']:.3f} ms/MiB"

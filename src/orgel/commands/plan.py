"""``orgel plan``: search the fastest plan for a workload or a costs file and print it."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

NAME = "plan"
HELP = "search the fastest plan that fits memory, for a workload or a costs file"
EXAMPLES = (
    "orgel plan examples/gpt.py:workload --ranks 4 --microbatches 8 --out plan.json",
    "orgel plan --costs costs.json --ranks 8 --microbatches 16 --json",
)

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 10**6, "MIB": 1 << 20, "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30,
          "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5GB``, ``1048576`` → bytes; ValueError says the format."""
    match = _SIZE_RE.match(text)
    unit = (match.group(2) or "").upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read the size {text!r}: write a number with an optional "
                         "unit, e.g. 2GiB, 512MiB, 1.5GB or 1073741824")
    return int(float(match.group(1)) * _UNITS[unit])


def _time_limit(args: argparse.Namespace) -> float | str | None:
    """The planner's ``time_limit`` for ``--time-limit``/``--thorough`` (default "auto")."""
    if args.thorough:
        return None
    return "auto" if args.time_limit is None else args.time_limit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", nargs="?", help="workload as FILE.py:FUNCTION (or use "
                        "--costs)")
    parser.add_argument("--costs", metavar="FILE", help="plan from a costs file (JSON, see "
                        "README) instead of profiling a workload")
    parser.add_argument("--ranks", type=int, required=True, metavar="P", help="number of ranks")
    parser.add_argument("--microbatches", metavar="M", help="micro-batches per step, or "
                        "'auto' to choose for the whole batch (default: auto for a workload; "
                        "with --costs, auto when --batch is given, else 2 x ranks)")
    parser.add_argument("--device", metavar="NAME|FILE.json", help="plan a workload for a "
                        "device model instead of profiling it here: a100-40gb, a100-80gb, "
                        "h100-80gb, v100-16gb, rtx3090-24gb, or a JSON file (see README); "
                        "build big models on the meta device")
    parser.add_argument("--tf32", action="store_true", help="with --device: fp32 matmuls "
                        "run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32)")
    parser.add_argument("--batch", type=int, metavar="B", help="with --costs: rows in one "
                        "step's batch; the costs file must give the 'rows' it was measured at")
    parser.add_argument("--memory", metavar="SIZE", help="memory per rank, e.g. 2GiB "
                        "(default: the costs file's memory_per_rank, else unlimited)")
    from orgel.commands.text import precision_argument

    precision_argument(parser)
    parser.add_argument("--planner", default="auto", help="auto (default), beam, graph, "
                        "uniform-layers, uniform-params or uniform-time")
    parser.add_argument("--dp", default="1", metavar="D", help="data-parallel replicas of the "
                        "whole pipeline (divides --ranks), or 'auto' to choose (default 1)")
    parser.add_argument("--tp", default="1", metavar="T", help="tensor-parallel degree: a "
                        "number, several (2,4), or 'auto' (1, 2, 4, 8 where they divide "
                        "--ranks and the GPUs per node), each with sequence parallelism; "
                        "--ranks counts GPUs (default 1)")
    parser.add_argument("--shard", default="none", choices=("none", "fsdp", "auto"),
                        help="how data-parallel replicas hold their state: none (default), "
                        "fsdp (sharded, gathered once per step) or auto (the faster that fits)")
    parser.add_argument("--max-replicas", type=int, metavar="R",
                        help="most ranks one stage may run on as replicas (1: a pure "
                        "pipeline; default: any)")
    parser.add_argument("--rows", type=int, metavar="N", help="rows of one micro-batch: "
                        "replica counts must divide it (default: from the workload, else any)")
    parser.add_argument("--blocks", type=_blocks_arg, metavar="N|layers",
                        help="target number of blocks when profiling a workload (default 32, "
                        "or twice --ranks where that is more); with --device, 'layers' "
                        "makes one block per layer (every cut between two layers)")
    parser.add_argument("--compile", action="store_true",
                        help="time each profiled block compiled by Inductor (its forward, "
                             "backward and backward halves), as `orgel run --compile` and "
                             "orgel.pipeline(compile=True) run the stages; the first profile "
                             "compiles every block")
    parser.add_argument("--no-link", action="store_true", help="when profiling, skip the "
                        "link and runtime-overhead benchmarks (free links, bare overhead)")
    parser.add_argument("--max-loops", type=int, default=8, metavar="V",
                        help="most stages per rank in looped schedules (default 8)")
    parser.add_argument("--families", nargs="+", metavar="FAMILY",
                        help="schedule families the sequential search may use (default all: "
                        "gpipe 1f1b zb-h1 interleaved looped looped-bfs dag-1f1b dualpipev)")
    parser.add_argument("--beam-width", type=int, default=4, metavar="K",
                        help="beam width of the split search (default 4)")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--time-limit", type=float, metavar="S",
                        help="seconds for the beam phase (default: 0.3 s plus 0.1 ms per "
                             "block and rank; the search keeps the best plan found)")
    search.add_argument("--thorough", action="store_true",
                        help="let the beam phase run until it converges (no time limit)")
    parser.add_argument("--out", metavar="PLAN.json", help="write the plan here")
    parser.add_argument("--png", metavar="FILE", help="draw the simulated timeline here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _fail(message: str) -> int:
    print(f"orgel plan: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from orgel.costs.blocks import BlockCosts
    from orgel.costs.devices import DeviceError
    from orgel.costs.fields import CostsFileError
    from orgel.plan import PLANNERS, InfeasibleError, plan

    if (args.workload is None) == (args.costs is None):
        return _fail("give either a WORKLOAD (FILE.py:FUNCTION) or --costs FILE, not both")
    if args.ranks < 1:
        return _fail(f"--ranks must be at least 1, got {args.ranks}")
    if args.planner not in PLANNERS:
        return _fail(f"unknown --planner {args.planner!r}: choose one of {', '.join(PLANNERS)}")
    microbatches: int | None = None
    if args.microbatches not in (None, "auto"):
        try:
            microbatches = int(args.microbatches)
        except ValueError:
            return _fail(f"--microbatches must be a number or 'auto', got {args.microbatches!r}")
        if microbatches < 1:
            return _fail(f"--microbatches must be at least 1, got {microbatches}")
    if args.device is not None and args.workload is None:
        return _fail("--device estimates a WORKLOAD's costs: give FILE.py:FUNCTION (a costs "
                     "file already has its times)")
    if args.tf32 and args.device is None:
        return _fail("--tf32 is for --device (profiling measures what the GPU does)")
    if args.device is not None and microbatches is None:
        return _fail("--device needs --microbatches M (the micro-batch count is not searched "
                     "for a device model)")
    if args.batch is not None:
        if args.costs is None:
            return _fail("--batch is for --costs: a workload plans its own example batch")
        if args.batch < 1:
            return _fail(f"--batch must be at least 1, got {args.batch}")
        if args.rows is not None:
            return _fail("--rows follows from --batch and the micro-batch count: leave it out")
    elif args.costs is None and microbatches is None and args.rows is not None:
        return _fail("--rows follows from the micro-batch count: give --microbatches M with it")
    elif args.costs is not None and args.microbatches == "auto":
        return _fail("--microbatches auto with --costs needs --batch B (rows in one step)")
    elif args.costs is not None and microbatches is None:
        microbatches = 2 * args.ranks
    memory = None
    if args.memory is not None:
        try:
            memory = parse_size(args.memory)
        except ValueError as exc:
            return _fail(f"--memory: {exc}")
    dp: int | None = None
    if args.dp != "auto":
        try:
            dp = int(args.dp)
        except ValueError:
            return _fail(f"--dp must be a number or 'auto', got {args.dp!r}")
    tp: Any = "auto"
    if args.tp != "auto":
        try:
            degrees = tuple(int(t) for t in args.tp.split(","))
        except ValueError:
            return _fail(f"--tp must be a number, numbers like 2,4, or 'auto', got {args.tp!r}")
        tp = degrees[0] if len(degrees) == 1 else degrees
    if args.compile and (args.costs is not None or args.device is not None):
        return _fail("--compile times the blocks this machine profiles; --costs and --device "
                     "plan from a table made otherwise: leave --compile out")
    for flag, value in (("--max-replicas", args.max_replicas), ("--rows", args.rows)):
        if value is not None and value < 1:
            return _fail(f"{flag} must be at least 1, got {value}")
    options: dict[str, Any] = dict(memory=memory, planner=args.planner, dp=dp,
                                   width=args.beam_width, max_loops=args.max_loops,
                                   time_limit=_time_limit(args),
                                   max_replicas=args.max_replicas,
                                   families=args.families, tp=tp, shard=args.shard)
    if args.rows is not None:
        options["rows"] = args.rows
    try:
        if args.costs is not None and args.batch is not None:
            result = _plan_batch(BlockCosts.load(args.costs), args, microbatches, options)
        elif args.costs is not None:
            assert microbatches is not None
            result = plan(BlockCosts.load(args.costs), args.ranks, microbatches, **options)
        elif args.device is not None:
            from orgel.plan.device import plan_on_device
            from orgel.workload import in_precision

            assert microbatches is not None
            result = plan_on_device(in_precision(args.workload, args.precision), args.device,
                                    ranks=args.ranks, microbatches=microbatches,
                                    blocks=args.blocks, tf32=args.tf32, **options)
        else:
            from orgel.plan.workload import plan_workload
            from orgel.workload import in_precision

            if args.blocks == "layers":
                return _fail("--blocks layers needs --device (a profiled table is measured "
                             "block by block at a number of blocks): give --blocks N")
            workload = in_precision(args.workload, args.precision)
            result = plan_workload(workload, ranks=args.ranks, microbatches=microbatches,
                                   blocks=args.blocks, progress=not args.json,
                                   link=not args.no_link, compiled=args.compile, **options)
    except (InfeasibleError, CostsFileError, DeviceError) as exc:
        return _fail(str(exc))
    except (ValueError, FileNotFoundError, ImportError) as exc:
        return _fail(str(exc))
    if args.out:
        result.plan.save(args.out)
    if args.png:
        try:
            result.sim.timeline.save_png(args.png)
        except (OSError, ValueError) as exc:
            return _fail(f"cannot write {args.png}: {exc}")
    summary = result.summary()
    if "microbatch_search" in result.plan.meta:
        summary["batch"] = result.plan.meta["batch"]
        summary["microbatch_search"] = result.plan.meta["microbatch_search"]
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def _plan_batch(costs: Any, args: argparse.Namespace, microbatches: int | None,
                options: dict[str, Any]) -> Any:
    """Plan a --batch from a costs file: scale it per micro-batch size, search the count."""
    from orgel.plan.batch import costs_per_rows, search_microbatches

    if costs.rows is None:
        raise ValueError(f"--batch needs the rows per micro-batch that {args.costs} was measured "
                         "at: add \"rows\": N to the costs file (or plan with --microbatches "
                         "alone)")
    if microbatches is not None and args.batch % microbatches:
        raise ValueError(f"--microbatches {microbatches} does not divide --batch {args.batch}: "
                         "choose a count that does, or 'auto'")
    dp = options.pop("dp")
    return search_microbatches(costs_per_rows(costs), args.batch, args.ranks, dp=dp,
                               choices=None if microbatches is None else [microbatches],
                               **options)


def _policy(policy: bool | str) -> str:
    """A stage's recompute as the plan listing shows it: its policy, ``whole``, or nothing."""
    return policy if isinstance(policy, str) else "whole" if policy else ""


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 20):,.0f}"


def format_summary(s: dict[str, Any]) -> str:
    """The human table: stages, schedule, prediction, baselines, search time."""
    lines = [f"planner {s['planner']}: schedule {s['schedule']} on {s['num_ranks']} ranks, "
             f"{s['microbatches']} micro-batches"]
    m = s.get("mesh")
    if m:
        lines.append(f"mesh: PP {m['pp']} x TP {m['tp']} x DP {m['dp']} "
                     f"({m['pp'] * m['tp'] * m['dp']} GPUs), "
                     + ("replicas sharded (fsdp)" if m["shard"] == "fsdp" else
                        "replicas not sharded" if m["dp"] > 1 else "no replicas")
                     + (", sequence parallel" if m.get("sequence_parallel") else ""))
    lines.append(f"{'stage':>5}  {'blocks':<16} {'ranks':<10} {'fwd+bwd ms':>10} "
                 f"{'params MiB':>10} {'act MiB':>8}  recompute")
    for i, st in enumerate(s["stages"]):
        t = "-" if st["fwd"] is None else f"{st['fwd'] + st['bwd']:.2f}"
        ranks = ",".join(str(r) for r in st["ranks"])
        lines.append(f"{i:>5}  {st['blocks']:<16} {ranks:<10} {t:>10} "
                     f"{_mib(st['params']):>10} {_mib(st['activations']):>8}  "
                     f"{_policy(st['recompute'])}")
    peaks = "  ".join(f"r{r}:{_mib(m)}" for r, m in enumerate(s["peak_memory"]))
    cap = s.get("memory_per_rank")
    lines.append(f"peak memory MiB per rank: {peaks}"
                 + (f"  (cap {_mib(cap)})" if cap else ""))
    lines.append(f"predicted step {s['step_time']:.2f} ms, bubble "
                 f"{100 * s['bubble_fraction']:.1f}%")
    base = "  ".join(f"{k} {'does not fit' if v is None else f'{v:.2f} ms'}"
                     for k, v in s["baselines"].items())
    lines.append(f"baselines (1F1B): {base}")
    lines.append(f"search {s['search_seconds']:.2f} s, {s['evaluations']} simulations")
    if s.get("microbatch_search"):
        lines.append(f"micro-batch counts tried for a batch of {s['batch']} rows "
                     f"(chosen: {s['microbatches']}; step times as the search scored them):")
        lines.append(f"{'micro-batches':>13} {'rows':>6} {'step ms':>10} {'rows/s':>10}")
        for c in s["microbatch_search"]:
            step = "does not fit" if c["step_time"] is None else f"{c['step_time']:.2f}"
            rate = "-" if c["rows_per_s"] is None else f"{c['rows_per_s']:,.0f}"
            mark = "  <- chosen" if c["microbatches"] == s["microbatches"] else ""
            lines.append(f"{c['microbatches']:>13} {c['rows']:>6} {step:>10} {rate:>10}{mark}")
    return "\n".join(lines)


def _blocks_arg(text: str) -> int | str:
    """``--blocks``: a positive number, or ``layers``."""
    if text == "layers":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give a number of blocks or 'layers', not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--blocks must be at least 1, got {value}")
    return value

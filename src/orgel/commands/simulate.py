"""``orgel simulate``: predict step time, bubbles and memory of a schedule family or a plan file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from orgel.commands.text import human_bytes

if TYPE_CHECKING:  # the CLI imports its commands eagerly: keep numpy & co. out of startup
    from orgel.schedule.costs import Costs
    from orgel.schedule.ir import Plan
    from orgel.sim import SimResult

NAME = "simulate"
HELP = "predict one training step of a schedule family or a plan file: time, bubbles, memory"
EXAMPLES = (
    "orgel simulate --schedule 1f1b --ranks 4 --microbatches 8 --fwd 1 --bwd 2",
    "orgel simulate plan.json --png step.png --trace step.json",
)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "looped", "zb-h1", "dualpipev")
_LOOPED = ("interleaved", "looped-bfs")


class UsageError(ValueError):
    """A command-line mistake; the message says what to change."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", nargs="?", metavar="PLAN.json",
                        help="simulate this plan (with its costs, or the uniform costs below)")
    parser.add_argument("--schedule", choices=SCHEDULES, help="simulate a schedule family")
    parser.add_argument("--ranks", type=int, metavar="P", help="number of ranks")
    parser.add_argument("--microbatches", type=int, metavar="M",
                        help="micro-batches per step (default 2 x ranks)")
    parser.add_argument("--stages-per-rank", type=int, metavar="V",
                        help="stages per rank for interleaved and looped-bfs (default 2)")
    parser.add_argument("--loops", type=int, metavar="N_L", help="looped: loop count N_l")
    parser.add_argument("--loop-batch", type=int, metavar="B_L",
                        help="looped: micro-batches per loop group B_l (default M)")
    parser.add_argument("--prefetch", metavar="B_F,...",
                        help="looped: extra warm-up forwards per rank, e.g. 2,2,1,0")
    parser.add_argument("--fwd", type=float, metavar="F",
                        help="forward ms of one rank's share of the model per micro-batch "
                        "(default 1; each of V stages takes F/V)")
    parser.add_argument("--bwd", type=float, metavar="B",
                        help="full backward ms of one rank's share per micro-batch (default 2)")
    parser.add_argument("--wgrad", type=float, metavar="W",
                        help="weight-grad part of --bwd (split-backward schedules; the "
                        "input-grad part is B - W; default B/2)")
    parser.add_argument("--comm-latency", type=float, metavar="L",
                        help="ms per message between ranks (default 0)")
    parser.add_argument("--comm-per-mib", type=float, metavar="X",
                        help="ms per MiB sent between ranks (default 0)")
    parser.add_argument("--edge-bytes", type=int, metavar="N", default=1 << 20,
                        help="bytes sent between consecutive stages per micro-batch "
                        "(default 1 MiB)")
    parser.add_argument("--activations", type=int, metavar="BYTES", default=0,
                        help="bytes one rank's share keeps per micro-batch for backward")
    parser.add_argument("--params", type=int, metavar="BYTES", default=0,
                        help="parameter bytes of one rank's share (grads count the same again)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", metavar="FILE", help="draw the timeline (Gantt chart) here")
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome/Perfetto trace here (open in ui.perfetto.dev)")
    parser.add_argument("--out", metavar="PLAN.json",
                        help="write the simulated plan (with costs and prediction) here")
    parser.add_argument("--width", type=int, metavar="N",
                        help="columns of the text timeline (default: fit the labels, <= 160)")


def run(args: argparse.Namespace) -> int:
    from orgel.schedule.ir import PlanError
    from orgel.sim import simulate

    try:
        plan, costs = build(args)
        result = simulate(plan, costs)
        write_outputs(args, plan, costs, result)
    except (UsageError, PlanError) as exc:
        print(f"orgel simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {"schedule": plan.meta.get("schedule"), "num_ranks": plan.num_ranks,
               "microbatches": plan.microbatches, "num_stages": plan.num_stages}
        out.update(result.to_dict())
        print(json.dumps(out))
    else:
        print(report(plan, result, width=args.width))
    return 0


def build(args: argparse.Namespace) -> tuple[Plan, Costs]:
    """The plan and costs the arguments describe; raises UsageError or PlanError."""
    from orgel.schedule.ir import Plan

    if (args.plan is None) == (args.schedule is None):
        raise UsageError("give either a PLAN.json or --schedule NAME (one of "
                         f"{', '.join(SCHEDULES)})")
    for flag in ("fwd", "bwd", "wgrad", "comm_latency", "comm_per_mib"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {value:g}")
    for flag in ("edge_bytes", "activations", "params"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0")
    uniform_given = any(getattr(args, f) is not None
                        for f in ("fwd", "bwd", "wgrad", "comm_latency", "comm_per_mib"))
    if args.plan is not None:
        for flag in ("ranks", "microbatches", "stages_per_rank", "loops", "loop_batch",
                     "prefetch"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} describes a schedule family; "
                                 "a PLAN.json already fixes it: drop the option")
        try:
            plan = Plan.load(args.plan)
        except OSError as exc:
            raise UsageError(f"cannot read {args.plan}: {exc.strerror or exc}") from None
        if plan.costs is not None and not uniform_given:
            return plan, plan.costs
    else:
        plan = build_family(args)
    return plan, uniform_costs(plan, args)


def build_family(args: argparse.Namespace) -> Plan:
    """Build ``--schedule`` with its options (a chain of stages, ``--edge-bytes`` per edge)."""
    from orgel.schedule.families import build_schedule

    if args.ranks is None:
        raise UsageError("--schedule needs --ranks P")
    if args.ranks < 1:
        raise UsageError(f"--ranks must be at least 1, got {args.ranks}")
    mbs = 2 * args.ranks if args.microbatches is None else args.microbatches
    if mbs < 1:
        raise UsageError(f"--microbatches must be at least 1, got {mbs}")
    options: dict[str, Any] = {"nbytes": args.edge_bytes}
    if args.stages_per_rank is not None:
        if args.schedule not in _LOOPED:
            raise UsageError(f"--stages-per-rank applies to {' and '.join(_LOOPED)}, not "
                             f"{args.schedule} (looped takes --loops)")
        options["stages_per_rank"] = args.stages_per_rank
    looped = {"loops": args.loops, "loop_microbatches": args.loop_batch,
              "prefetch": None if args.prefetch is None else parse_prefetch(args.prefetch)}
    for key, value in looped.items():
        if value is not None:
            if args.schedule != "looped":
                flag = {"loops": "--loops", "loop_microbatches": "--loop-batch",
                        "prefetch": "--prefetch"}[key]
                raise UsageError(f"{flag} applies to --schedule looped only")
            options[key] = value
    return build_schedule(args.schedule, args.ranks, mbs, **options)


def parse_prefetch(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--prefetch takes comma-separated integers, e.g. 2,2,1,0; got "
                         f"{text!r}") from None


def uniform_costs(plan: Plan, args: argparse.Namespace) -> Costs:
    """Every stage the same: one rank's share divided over the stages per rank."""
    from orgel.schedule.costs import Costs, Link, StageCost

    per_rank = max(1, plan.num_stages // max(1, plan.num_ranks))
    fwd = 1.0 if args.fwd is None else args.fwd
    bwd = 2.0 if args.bwd is None else args.bwd
    if args.wgrad is not None and args.wgrad > bwd:
        raise UsageError(f"--wgrad ({args.wgrad:g}) is part of --bwd ({bwd:g}): make it <= bwd")
    stage = StageCost(
        fwd=fwd / per_rank, bwd=bwd / per_rank,
        bwd_weight=None if args.wgrad is None else args.wgrad / per_rank,
        params=args.params // per_rank, activations=args.activations // per_rank,
    )
    link = Link(latency=args.comm_latency or 0.0, per_mib=args.comm_per_mib or 0.0)
    return Costs(stages=[stage] * plan.num_stages, link=link)


def write_outputs(args: argparse.Namespace, plan: Plan, costs: Costs, result: SimResult) -> None:
    """--png, --trace and --out; an unwritable path is a UsageError."""
    for flag, path, write in (
        ("--png", args.png, lambda p: result.timeline.save_png(p)),
        ("--trace", args.trace, lambda p: result.timeline.save_trace(p)),
        ("--out", args.out, lambda p: _save_plan(plan, costs, result, p)),
    ):
        if path:
            try:
                write(path)
            except OSError as exc:
                raise UsageError(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None


def _save_plan(plan: Plan, costs: Costs, result: SimResult, path: str) -> None:
    """The plan with the costs it was simulated under and the prediction (no path)."""
    summary = result.to_dict()
    summary.pop("critical_path")
    dataclasses.replace(plan, costs=costs, prediction=summary).save(path)


def report(plan: Plan, result: SimResult, *, width: int | None = None) -> str:
    """The human summary: header, per-rank table, critical path, text timeline."""
    name = plan.meta.get("schedule") or "plan"
    lines = [f"{name}: {plan.num_ranks} ranks, {plan.num_stages} stages, "
             f"{plan.microbatches} micro-batches",
             f"step time {result.step_time:g} ms, bubble {100 * result.bubble_fraction:.1f}%",
             f"{'rank':>4}  {'busy':>6}  {'bubble':>6}  {'peak memory':>11}  {'in flight':>9}"]
    for r in range(plan.num_ranks):
        lines.append(f"{r:>4}  {100 * result.busy[r]:>5.1f}%  {100 * (1 - result.busy[r]):>5.1f}%"
                     f"  {human_bytes(result.peak_memory[r]):>11}  {result.peak_inflight[r]:>9}")
    cap = result.memory_per_rank
    if cap is not None:
        over = [r for r, m in enumerate(result.peak_memory) if m > cap]
        verdict = "fits" if not over else f"exceeded on ranks {over}"
        lines.append(f"memory per rank {human_bytes(cap)}: {verdict}")
    path = [e.label if e.track == "compute" else f"({e.label})" for e in result.critical_path]
    if len(path) > 16:
        path = path[:8] + [f"... {len(path) - 16} more ..."] + path[-8:]
    lines.append("critical path: " + " ".join(path))
    lines.append("")
    lines.append(result.timeline.ascii(width=width))
    return "\n".join(lines)

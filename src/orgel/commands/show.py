"""``orgel show``: print a plan's schedule text and a small simulated timeline."""

from __future__ import annotations

import argparse
import sys

NAME = "show"
HELP = "print a plan file's schedule and a text timeline of one simulated step"
EXAMPLES = (
    "orgel show plan.json",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", help="the plan to show")
    parser.add_argument("--width", type=int, metavar="N",
                        help="columns of the timeline (default: fit the labels, <= 120)")


def run(args: argparse.Namespace) -> int:
    from orgel.schedule.costs import Costs, StageCost
    from orgel.schedule.ir import Plan, PlanError
    from orgel.sim import simulate

    try:
        plan = Plan.load(args.plan)
    except OSError as exc:
        print(f"orgel show: cannot read {args.plan}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except PlanError as exc:
        print(f"orgel show: {args.plan}: {exc}", file=sys.stderr)
        return 2
    placement = ", ".join(f"s{s}@{'+'.join(str(r) for r in ranks)}"
                          for s, ranks in enumerate(plan.placement))
    name = plan.meta.get("schedule") or "plan"
    print(f"{name}: {plan.num_ranks} ranks, {plan.num_stages} stages ({placement}), "
          f"{plan.microbatches} micro-batches")
    print(plan.schedule_text())
    costs = plan.costs
    note = "plan costs"
    if costs is None:
        costs = Costs([StageCost(fwd=1.0, bwd=2.0)] * plan.num_stages)
        note = "no costs in the plan: forward 1 ms, backward 2 ms per stage"
    try:
        result = simulate(plan, costs)
    except PlanError as exc:
        print(f"orgel show: cannot simulate {args.plan}: {exc}", file=sys.stderr)
        return 2
    print()
    print(f"simulated step ({note}): {result.step_time:g} ms, "
          f"bubble {100 * result.bubble_fraction:.1f}%")
    print(result.timeline.ascii(width=args.width, max_width=120))
    return 0

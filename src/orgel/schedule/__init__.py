"""The Plan IR, its text form, schedule families and validation."""

from orgel.schedule.comm import CommPlan, Message, derive_comm
from orgel.schedule.costs import Costs, Link, StageCost
from orgel.schedule.families import FAMILIES, build_schedule
from orgel.schedule.ir import Action, Edge, Plan, PlanError, Stage, StageGraph, Value
from orgel.schedule.text import format_schedule, parse_schedule, plan_from_text
from orgel.schedule.validate import DryRun, dry_run, validate

__all__ = [
    "FAMILIES",
    "Action",
    "CommPlan",
    "Costs",
    "DryRun",
    "Edge",
    "Link",
    "Message",
    "Plan",
    "PlanError",
    "Stage",
    "StageCost",
    "StageGraph",
    "Value",
    "build_schedule",
    "derive_comm",
    "dry_run",
    "format_schedule",
    "parse_schedule",
    "plan_from_text",
    "validate",
]

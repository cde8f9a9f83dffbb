"""The Plan IR, its text form, schedule families and validation."""

from orgel.schedule.costs import Costs, Link, StageCost
from orgel.schedule.ir import Action, Edge, Plan, PlanError, Stage, StageGraph, Value

__all__ = [
    "Action",
    "Costs",
    "Edge",
    "Link",
    "Plan",
    "PlanError",
    "Stage",
    "StageCost",
    "StageGraph",
    "Value",
]

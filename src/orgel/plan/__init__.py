"""Planners: search split points, placements and schedules; baselines.

``plan(costs, ranks, microbatches)`` runs them all and returns the fastest plan
that fits memory (:mod:`orgel.plan.planner`).
"""

from orgel.plan.planner import PLANNERS, InfeasibleError, PlanResult, plan
from orgel.plan.workload import attach_split, auto_plan, plan_workload

__all__ = ["PLANNERS", "InfeasibleError", "PlanResult", "attach_split", "auto_plan", "plan",
           "plan_workload"]

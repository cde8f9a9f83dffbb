"""Planners: search split points, placements and schedules; baselines.

``plan(costs, ranks, microbatches)`` runs them all and returns the fastest plan
that fits memory (:mod:`orgel.plan.planner`).
"""

from orgel.plan.planner import PLANNERS, InfeasibleError, PlanResult, plan

__all__ = ["PLANNERS", "InfeasibleError", "PlanResult", "plan"]

"""Planners: search split points, placements and schedules; baselines.

``plan(costs, ranks, microbatches)`` runs them all and returns the fastest plan
that fits memory (:mod:`orgel.plan.planner`); ``search_microbatches`` also
chooses the micro-batch count for a global batch (:mod:`orgel.plan.batch`).
"""

from orgel.plan.batch import costs_per_rows, microbatch_choices, search_microbatches
from orgel.plan.planner import PLANNERS, InfeasibleError, PlanResult, plan
from orgel.plan.workload import attach_split, auto_plan, plan_batch, plan_workload

__all__ = ["PLANNERS", "InfeasibleError", "PlanResult", "attach_split", "auto_plan",
           "costs_per_rows", "microbatch_choices", "plan", "plan_batch", "plan_workload",
           "search_microbatches"]

"""Planners: search split points, placements and schedules; baselines."""

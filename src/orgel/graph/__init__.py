"""Capture: a model → an op graph with per-node facts; coarsening into blocks."""

"""Profiling: per-block time and memory, link benchmarks, on-disk cache."""

"""The simulator: step time, critical path and memory of a Plan under costs."""

"""The simulator: step time, critical path and memory of a Plan under costs."""

from orgel.sim.compiled import CompiledPlan
from orgel.sim.simulate import SimResult, simulate
from orgel.sim.timeline import Event, Timeline

__all__ = ["CompiledPlan", "Event", "SimResult", "Timeline", "simulate"]

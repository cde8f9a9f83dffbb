"""Planning for CUDA ranks forked from a process that must not use CUDA itself.

Local ranks are forked from the caller, and a process forked from one that has
used CUDA cannot use it. So the caller never initializes CUDA
(:func:`orgel.launch.devices.check_fork`), yet the plan for CUDA ranks must come
from blocks timed on the GPU. :func:`plan_in_child` forks one short-lived process
that captures the model, profiles it on the GPU and plans, and returns the plan;
the caller then captures and splits by it on the CPU, as every rank of a torchrun
job does with rank 0's plan (captures of one model name their ops alike).
"""

from __future__ import annotations

from typing import Any

from orgel.schedule.ir import Plan


class _Planner:
    """The engine of the planning process: one call, :meth:`plan`."""

    def __init__(self, prepare: Any, device: str) -> None:
        self.prepare, self.device = prepare, device

    def plan(self) -> str:
        from orgel.launch.devices import profiling_on

        with profiling_on(self.device):
            return str(self.prepare().to_json())


def plan_in_child(prepare: Any, *, device: str, timeout_s: float) -> Plan:
    """``prepare()``'s plan (a function returning a :class:`Plan`), made in a forked process
    that profiles on ``device``; this process runs none of it."""
    from orgel.launch.processes import LocalGroup

    group = LocalGroup(1, lambda rank: _Planner(prepare, device), timeout_s=timeout_s,
                       daemon=False)  # it measures links: processes of its own
    try:
        (text,) = group.call("plan")
    finally:
        group.close()
    return Plan.from_json(text)

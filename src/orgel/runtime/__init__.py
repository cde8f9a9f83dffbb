"""The runtime: execute a Plan on torch.distributed, one action list per rank.

* :class:`Executor` runs one rank's actions of a Plan over a SplitModel
  (``step(inputs, targets) -> loss``; ``events``: the step's measured timeline);
* :class:`LocalGroup` starts local ranks and drives them, :func:`spawn` runs one
  function on fresh ones (the same launcher); :func:`init_from_env` joins torchrun
  (all three from :mod:`orgel.launch.processes`);
* :func:`gather_events`, :func:`summary`, :func:`save_views`: measured timelines.
"""

from orgel.launch.errors import CommFailure, StepFailure, WorkerError
from orgel.launch.processes import LocalGroup, init_from_env
from orgel.launch.spawn import spawn
from orgel.runtime.executor import Executor
from orgel.runtime.trace import Event, gather_events, save_views, summary

__all__ = [
    "CommFailure",
    "Event",
    "Executor",
    "LocalGroup",
    "StepFailure",
    "WorkerError",
    "gather_events",
    "init_from_env",
    "save_views",
    "spawn",
    "summary",
]

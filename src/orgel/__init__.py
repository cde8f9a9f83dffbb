"""orgel: automatic pipeline parallelism for PyTorch training.

The entry points a user needs are exported here: :func:`pipeline` (explicit
API), :func:`backend` (``torch.compile`` backend with a closure runner),
:func:`load` (resume a checkpoint), :func:`build_on_meta` (a meta model whose
constructor's buffers each rank makes again), :func:`capture` and
:func:`simulate`, the Plan IR types, and the errors a training loop may
catch (:class:`WorkloadError`: a batch refused in the caller; :class:`StepError`:
a step every rank dropped, the pipeline trains on; :class:`WorkerError`: the
pipeline ended). Everything else lives in the
sub-packages named by the flow: graph, profile, schedule, sim, plan, split,
runtime. Each name is imported on first use, so ``import orgel`` itself imports no
torch (``orgel --help`` answers at once).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orgel.explicit.api import Pipeline, load, pipeline
    from orgel.graph import capture
    from orgel.launch.errors import StepError, WorkerError
    from orgel.schedule import Action, Costs, Plan, PlanError, StageGraph
    from orgel.schedule.families import build_schedule
    from orgel.schedule.validate import validate
    from orgel.sim import simulate
    from orgel.split.deferred import build_on_meta
    from orgel.transparent.backend import Backend, backend
    from orgel.workload import Workload, WorkloadError, load_workload

#: where each exported name lives: imported on first use (PEP 562), so that what needs no
#: torch (``orgel --help``, a command's parser) starts without importing it
_HOMES = {
    "Pipeline": "orgel.explicit.api", "load": "orgel.explicit.api",
    "pipeline": "orgel.explicit.api", "capture": "orgel.graph",
    "StepError": "orgel.launch.errors", "WorkerError": "orgel.launch.errors",
    "Action": "orgel.schedule", "Costs": "orgel.schedule", "Plan": "orgel.schedule",
    "PlanError": "orgel.schedule", "StageGraph": "orgel.schedule",
    "build_schedule": "orgel.schedule.families", "validate": "orgel.schedule.validate",
    "simulate": "orgel.sim", "build_on_meta": "orgel.split.deferred",
    "Backend": "orgel.transparent.backend", "backend": "orgel.transparent.backend",
    "Workload": "orgel.workload", "WorkloadError": "orgel.workload",
    "load_workload": "orgel.workload",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"orgel.{name}") is not None:
        value = importlib.import_module(f"orgel.{name}")  # a part (orgel.graph), as a package
    else:
        raise AttributeError(f"module 'orgel' has no attribute {name!r}")
    globals()[name] = value  # once: later reads find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__version__ = "0.1.0"

__all__ = [
    "Action",
    "Backend",
    "Costs",
    "Pipeline",
    "Plan",
    "PlanError",
    "StageGraph",
    "StepError",
    "WorkerError",
    "Workload",
    "WorkloadError",
    "__version__",
    "backend",
    "build_on_meta",
    "build_schedule",
    "capture",
    "load",
    "load_workload",
    "pipeline",
    "simulate",
    "validate",
]

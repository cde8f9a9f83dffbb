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
runtime.
"""

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

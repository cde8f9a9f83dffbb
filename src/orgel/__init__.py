"""orgel: automatic pipeline parallelism for PyTorch training."""

from orgel.schedule import Action, Costs, Plan, PlanError, StageGraph

__version__ = "0.1.0"

__all__ = ["Action", "Costs", "Plan", "PlanError", "StageGraph", "__version__"]

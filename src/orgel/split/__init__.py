"""Plan + captured graph → one module per stage."""

from orgel.split.split import SplitError, split_model, split_plan
from orgel.split.types import SplitModel, StageModule

__all__ = ["SplitError", "SplitModel", "StageModule", "split_model", "split_plan"]

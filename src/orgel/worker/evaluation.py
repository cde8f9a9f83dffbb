"""The eval-mode split, made when ``evaluate`` is first called rather than at start-up.

Evaluation needs a second capture of the model, in eval mode (:mod:`orgel.split.evaluation`).
A pipeline that never evaluates should not pay for it when it starts, so the front end
hands the pipeline and each rank a :class:`LazyEvaluation`; the first ``evaluate`` makes
the split in each process that needs it (each rank for its stages, the controller for the
outputs' structure at the first ``evaluate(..., outputs=True)``: a loss alone waits for
no capture there), and every later call reuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LazyEvaluation:
    """``make()``'s result (the eval-mode SplitModel, or why there is none), made once."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._made: Any = None

    def get(self) -> Any:
        if self._made is None:
            self._made = self._make()
        return self._made

"""The eval-mode split, made when ``evaluate`` is first called rather than at start-up.

Evaluation needs a second capture of the model, in eval mode (:mod:`orgel.split.evaluation`).
A pipeline that never evaluates should not pay for it when it starts, so the front end
hands the pipeline and each rank a :class:`LazyEvaluation`; the first ``evaluate`` makes
the split in each process that needs it (each rank for its stages, the controller for the
outputs' structure at the first ``evaluate(..., outputs=True)``: a loss alone waits for
no capture there), and every later call reuses it. A batch that leaves out some of the
example's inputs (``labels``, to get a Hugging Face model's logits) gets a capture of its
own, made the same way at its first ``evaluate``: the key is the inputs' names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any


class LazyEvaluation:
    """``make(names)``'s result (the eval-mode SplitModel of a batch of the inputs
    ``names``, or why there is none), made once per ``names``."""

    def __init__(self, make: Callable[[tuple[str, ...]], Any]) -> None:
        self._make = make
        self._made: dict[tuple[str, ...], Any] = {}

    def get(self, names: Collection[str]) -> Any:
        key = tuple(sorted(names))
        if key not in self._made:
            self._made[key] = self._make(key)
        return self._made[key]

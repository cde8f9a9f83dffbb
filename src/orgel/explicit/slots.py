"""One micro-batch's state in the controller's step (:mod:`orgel.explicit.glued`)."""

from __future__ import annotations

from typing import Any

import torch


class Slot:
    """One micro-batch of a step in the controller: its graph calls, loss, outputs, error."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.calls = 0
        self.sent = 0  # captured graph calls whose arguments went to the ranks
        self.off_path = False  # the forward left the captured graphs: it ran here
        self.anchor: torch.Tensor | None = None
        self.result: float = 0.0
        self.outputs: Any = None  # the model's outputs, detached on the CPU, when asked for
        self.error: BaseException | None = None
        self.grads: dict[str, torch.Tensor] = {}  # this micro-batch's, of those trained here
        self.backed: set[int] = set()  # graph calls whose backward ran
        self.scaled = False  # orgel.backend: the closure's loss went through pipe.scale


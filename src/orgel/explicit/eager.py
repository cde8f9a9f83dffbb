"""The parameters a forward of several graphs trains in its controller (``Glue.eager``).

Code outside every graph (a module Dynamo ran as Python) trains them: the controller
computes their gradient (on its own copy for ``orgel.pipeline``, on the caller's module
for ``orgel.backend``'s closures), sums it over the micro-batches in order and sends it
to each parameter's home rank (:func:`orgel.split.exchanges.home_rank`), which steps it with
the rest and sends the new value back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from orgel.explicit.fallback import summed
from orgel.explicit.mailbox import Stopped
from orgel.split.exchanges import exchange_stages, grad_ranks


class EagerParameters:
    """The controller's side of those parameters, mixed into
    :class:`~orgel.explicit.glued.GluedPipeline` (which sets what it reads)."""

    plan: Any
    calls: int
    _eager: dict[str, torch.nn.Parameter]
    _homes: dict[str, int]
    _home_ranks: list[int]
    _split: Any
    _mail: Any

    # annotations only (no attribute here, so the pipeline's own methods are the ones used)
    _send: Callable[[int, tuple[str, Any, Any]], None]
    call_ranks: Callable[..., list[Any]]

    def _send_grads(self, slots: list[Any], threads: list[threading.Thread]) -> None:
        """Sum the micro-batches' gradients in micro-batch order; send each to its home rank.

        Every rank gets one message a step (empty where none is homed there): it waits
        for it before its gradient sums (a micro-batch off the captured graphs may train
        any parameter). Where every micro-batch
        ran in the controller, or (``orgel.backend``) no closure's backward reached the
        ranks, the ranks' own backward ran on stand-ins and zeros only: the message says
        so, and the rank drops those zero gradients first (torch leaves a parameter no
        micro-batch reached without one).
        """
        for t in threads:
            t.join()
        if any(s.error is not None for s in slots):
            return
        by_rank: dict[int, dict[str, torch.Tensor | None]] = {
            r: {} for r in range(self.plan.num_ranks)}
        for name in self._eager:  # a parameter the glue trains: its home, even without a gradient
            by_rank[self._homes[name]][name] = None
        for name, total in summed(slots).items():
            home = self._homes.get(name)
            for r in grad_ranks(name, self.plan, self._split) if home is None else [home]:
                by_rank[r][name] = total
        # the ranks' gradients are stand-ins' (zero) where no micro-batch's backward reached
        # them there: torch leaves them None then, and the optimizer skips them
        reset = all(s.off_path or not s.backward for s in slots)
        for r, grads in by_rank.items():
            try:
                self._send(r, ("p_grad", self.calls, (grads, reset)))
            except Stopped:  # a rank failed: the step reports that rank's error
                return

    def _receive_values(self) -> None:
        """The new values of the parameters the controller trains, from their home ranks."""
        if not self._eager:
            return
        with torch.no_grad():
            for r in self._home_ranks:
                values = self._mail.get("p_value", (self.calls, r), r,
                                        "the parameters the controller trains, after the step")
                for name, value in values.items():
                    self._eager[name].copy_(value)

    def _pull_values(self) -> None:
        """Refresh the controller's copies from the ranks (after a load)."""
        if not self._eager:
            return
        state: dict[str, torch.Tensor] = {}
        for part in self.call_ranks("state_dict"):
            state.update(part)
        with torch.no_grad():
            for name, p in self._eager.items():
                p.copy_(state[name])


def controller_copy(model: torch.nn.Module, eager: list[str]) -> torch.nn.Module:
    """``model`` with its own copies of the ``eager`` parameters and of every buffer.

    Every other parameter stays the caller's object (no memory, and graph
    calls are recognised by them); the controller's eager code trains and
    updates only its copies (a buffer the Python between graphs writes
    included), so the caller's model is never changed.
    """
    import copy

    eager_ids = {id(model.get_parameter(n)) for n in eager}
    memo: dict[int, Any] = {id(p): p for p in model.parameters() if id(p) not in eager_ids}
    return copy.deepcopy(model, memo)


def exchange_ranks(plan: Any, split: Any) -> dict[int, tuple[int, ...]]:
    """For each exchange (by graph call), the ranks whose stage holds it, by replica."""
    return {c: tuple(plan.placement[s]) for c, s in exchange_stages(split).items()}

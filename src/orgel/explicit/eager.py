"""The parameters a forward of several graphs trains in its controller (``Glue.eager``).

Code outside every graph (a module Dynamo ran as Python) trains them: the controller
computes their gradient (on its own copy for ``orgel.pipeline``, on the caller's module
for ``orgel.backend``'s closures), sums it over the micro-batches in order and sends it
to the ranks that step it (:func:`orgel.split.exchanges.eager_homes`: its home rank, or
every replica of an FSDP home stage), which step it with the rest and send the new value
back (each process its own part).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from orgel.explicit.fallback import summed
from orgel.explicit.mailbox import Stopped
from orgel.runtime.pieces import whole_values
from orgel.split.exchanges import exchange_stages, grad_ranks


class EagerParameters:
    """The controller's side of those parameters, mixed into
    :class:`~orgel.explicit.glued.GluedPipeline` (which sets what it reads)."""

    plan: Any
    calls: int
    _eager: dict[str, torch.nn.Parameter]
    _homes: dict[str, list[int]]
    _split: Any
    _mail: Any
    #: the ranks' values may differ from the caller's now (an optimizer step or a load
    #: changed them; the caller's copies of the parameters the ranks train stay as they were)
    _moved = False

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
        self._promote()
        by_rank: dict[int, dict[str, torch.Tensor | None]] = {
            r: {} for r in range(self.plan.num_ranks)}
        for name, ranks in self._homes.items():  # a parameter the glue trains, even
            for r in ranks:                        # without a gradient: its ranks step it
                by_rank[r][name] = None
        for name, total in summed(slots).items():
            for r in self._homes.get(name) or grad_ranks(name, self.plan, self._split):
                by_rank[r][name] = total
        # the ranks' gradients are stand-ins' (zero) where no micro-batch's backward reached
        # them there: torch leaves them None then, and the optimizer skips them
        reset = all(s.off_path or not s.backward for s in slots)
        for r, grads in by_rank.items():
            try:
                self._send(r, ("p_grad", self.calls, (grads, reset, sorted(self._homes))))
            except Stopped:  # a rank failed: the step reports that rank's error
                return

    @property
    def _home_ranks(self) -> list[int]:
        """The ranks that step a parameter the controller trains (:attr:`_homes`)."""
        return sorted({r for ranks in self._homes.values() for r in ranks})

    def _promote(self) -> None:
        """Add to the parameters the controller trains (``orgel.backend``'s closures find
        more as they run: :meth:`orgel.explicit.closures.ClosurePipeline._promote`)."""

    def _receive_values(self) -> None:
        """The new values of the parameters the controller trains, from the ranks that step
        them: each process its own part (a tensor-parallel member's or an FSDP replica's
        shard, :mod:`orgel.runtime.pieces`), laid together here."""
        self._moved = True
        if not self._eager:
            return
        values = whole_values([
            self._mail.get("p_value", (self.calls, r, member), r,
                           "the parameters the controller trains, after the step")
            for r in self._home_ranks for member in range(self.plan.tp)])
        with torch.no_grad():
            for name, value in values.items():
                self._eager[name].copy_(value)

    def _pull_values(self) -> None:
        """Refresh the controller's copies from the ranks (after a load)."""
        self._moved = True
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

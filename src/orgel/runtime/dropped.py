"""A step every rank drops: the executor's part of ``abandon_on_error``.

When an action's own work raises on a rank (a loss on a target out of range, a
stage on a bad input), the rank records its error in the rendezvous store
(:meth:`DroppedStep._fail_action`) and runs the rest of its action list with the
messages only: its sends become placeholders (:meth:`DroppedStep._send`), so
every posted receive meets its send. The step's closing all-reduce carries a
"failed" flag; every rank then drops the step (:meth:`DroppedStep._drop_step`:
no optimizer step, gradients and the buffers the forwards updated put back) and
raises :class:`~orgel.launch.errors.StepAbandoned` with the first error.

:class:`DroppedStep` is a base of :class:`orgel.runtime.executor.Executor`; the
attributes it reads are the executor's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from orgel.launch.errors import PeerStepFailed, StepAbandoned, StepFailure, describe
from orgel.runtime.comm import Transport
from orgel.runtime.optim import GradSync
from orgel.runtime.optimizer import OptimizerLoop
from orgel.runtime.sharding import Sharding
from orgel.runtime.stage import Run, StageInfo


class DroppedStep:
    """Dropping a failed step on every rank (a base of the executor)."""

    # the executor's attributes this part reads and resets
    rank: int
    stages: dict[int, StageInfo]
    transport: Transport
    sync: GradSync
    sharding: Sharding
    loop: OptimizerLoop
    abandon_on_error: bool
    _failed: tuple[BaseException, str] | None
    _signature: Any
    _runs: dict[tuple[int, int], Run]
    _inbox: dict[int, list[torch.Tensor]]
    _local_grads: dict[tuple[int, int], dict[str, torch.Tensor]]
    _in_grads: dict[str, torch.Tensor]
    _outgoing: Callable[[int], list[torch.Tensor]]
    on_drop: Callable[[], None] | None

    @property
    def dropping(self) -> bool:
        """Whether this step is being dropped (some work of this rank's raised)."""
        return self._failed is not None

    def _keep_written(self) -> None:
        """Copy what the step's forwards update in place (BatchNorm statistics), so that a
        dropped step puts it back; nothing when steps are not dropped."""
        self._written = ({(s, n): info.stage.module.get_buffer(n).clone()
                          for s, info in self.stages.items() for n in info.stage.written}
                         if self.abandon_on_error else {})

    def _send(self, i: int) -> None:
        """Send message ``i``; a placeholder while the step is being dropped (its receiver
        still gets the message)."""
        if self._failed is None:
            self.transport.send(i, self._outgoing(i))
        else:
            self.transport.send_placeholder(i)

    def _fail_action(self, exc: Exception, where: str) -> None:
        """This rank's work raised: report it once, then go on with the step's messages only.

        The rest of the action list runs its receives and sends (placeholders,
        :meth:`Transport.send_placeholder`) and no compute, so every rank reaches
        the step's closing all-reduce, which tells all of them to drop the step.
        """
        self._failed = (exc, where)
        line, tb = describe(StepFailure(f"rank {self.rank}: {exc} [while running {where}]",
                                        rank=self.rank, action=where, cause=exc))
        self.transport.announce_step_failure(json.dumps([self.rank, line, tb]))
        if self.on_drop is not None:
            self.on_drop()

    def _drop_step(self) -> StepAbandoned:
        """Drop this step on this rank (some rank's work raised): its error to raise.

        No optimizer step, no gradients kept (with ``accumulate`` > 1, those of the
        calls since the last optimizer step too: the accumulation starts again), the
        buffers the forwards updated (BatchNorm statistics) as they were, nothing of
        the step's computation kept; the next step exchanges shapes again (a dropped
        step's messages may have had none).
        """
        for p in self.sync.all_params:
            p.grad = None
        self.sharding.drop()
        self.loop.pending = 0
        with torch.no_grad():
            for (s, name), saved in self._written.items():
                self.stages[s].stage.module.get_buffer(name).copy_(saved)
        self._runs, self._inbox, self._local_grads, self._in_grads = {}, {}, {}, {}
        return self._abandoned()

    def _abandoned(self) -> StepAbandoned:
        """The error every rank raises for the pass being dropped: the first rank's own."""
        self._signature = None  # the next pass exchanges shapes (placeholders may have none)
        root, line, tb = json.loads(self.transport.step_failure())
        if self._failed is not None and root == self.rank:
            cause: BaseException = self._failed[0]
            where = self._failed[1]
        else:
            cause, where = PeerStepFailed(f"rank {root} failed in this step"), "the step"
        return StepAbandoned(f"rank {self.rank}: {cause} [while running {where}]", rank=root,
                             action=where, cause=cause, report=(line, tb))

"""The closure runner's side of the messages with ``orgel.backend``'s ranks.

Each closure's model inputs go to the input stages' processes (``"in"``, by the ranks'
micro-batch); the loss stage's processes send the outputs (``"out"``) and take their
gradient (``"grad"``). With ``dp`` replicas the ranks' micro-batch ``j`` is closures
``j*dp ... j*dp+dp-1`` side by side, each replica taking one closure's rows.

A step's failure (:mod:`orgel.worker.closure`): a closure that raises sends every process
``"fail"`` and releases the closures waiting on outputs; a loss-stage process whose work
failed sends ``"failed"``, which releases them too; every step ends with ``"end"`` to every
process once the closures returned, and ``"done"`` from each loss-stage process.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from orgel.batching import batch_placeholders, side_by_side
from orgel.explicit.mailbox import RankPipes
from orgel.worker.closure import Slot

#: :attr:`RankLink._failed_first` when a rank's own work stopped the step
RANK_FAILED = "a rank"


class RankLink:
    """Mixed into :class:`~orgel.transparent.backend.Backend`, which sets what it reads."""

    dp: int
    microbatches: int
    batch_dim: int
    _slots: list[Slot]
    _whole: tuple[str, ...]
    _rows: int | None
    _pipes: RankPipes
    _fed: set[int]
    _feed_lock: threading.Lock
    _input_ranks: list[int]
    _loss_processes: list[list[int]]
    _scale: float | None  # float16: the loss scale the closures multiply by (else None)
    timeout_s: float
    _ranks_up: threading.Event
    pipe: Any
    #: what stopped this step first: a closure's slot, RANK_FAILED, or None (nothing)
    _failed_first: Slot | str | None

    def _await_call(self, slot: Slot) -> None:
        """Wait until the closure of ``slot`` called the compiled model (or ended)."""
        if not slot.called.wait(self.timeout_s):
            raise TimeoutError(f"the closure for micro-batch {slot.index} neither called the "
                               f"compiled model nor returned within {self.timeout_s:g} s; call "
                               "the model once per closure")

    def _abort_step(self, first: Slot | str) -> None:
        """Stop this step (``first``: the closure that raised, or :data:`RANK_FAILED`): the
        closures waiting on outputs are released; for a closure, every rank is told, and the
        ranks drop the step."""
        with self._feed_lock:
            if self._failed_first is not None:
                return
            self._failed_first = first
        for slot in self._slots:
            slot.delivered.set()  # (outputs None: "the pipelined step was aborted")
        if isinstance(first, Slot) and self.pipe is not None:
            words = (f"{type(first.error).__name__}: {first.error}" if first.error is not None
                     else "it returned without calling the compiled model")
            self._pipes.fail(f"the closure for micro-batch {first.index} raised ({words})")

    def _check_closures(self) -> None:
        """Raise the closures' error: the one that stopped the step first (the others'
        then only say the step was aborted), none where a rank's own work stopped it."""
        if self._failed_first == RANK_FAILED:
            return
        first = self._failed_first
        for slot in ([first] if isinstance(first, Slot) else []) + self._slots:
            if slot.error is not None:
                # dynamo wraps what the backend raised; the user wants orgel's own message
                inner = getattr(slot.error, "inner_exception", None)
                if isinstance(inner, ValueError | RuntimeError):
                    raise inner from None
                raise slot.error
        missing = [s.index for s in self._slots if s.done and s.inputs is None]
        if missing:
            raise RuntimeError(f"the closure for micro-batches {missing} returned without "
                               "calling the compiled model; call it once per closure")

    def _end_step(self, threads: list[threading.Thread]) -> None:
        """Tell every process that this step's closures returned (``"end"``): the ranks
        then sum the gradients or drop the step. A closure still running after the timeout
        drops it."""
        self._ranks_up.wait()  # (the first step: its closures wait for the start too)
        deadline = time.monotonic() + self.timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.pipe is None:  # the first step failed before the ranks started
            return
        hung = [t for t in threads if t.is_alive()]
        if hung:
            self._abort_step(self._slots[threads.index(hung[0])])
        self._pipes.end()

    def _feed(self, slot: Slot) -> None:
        """Send the input ranks the ranks' micro-batch of ``slot`` once all its closures
        called the model: with dp replicas, closures ``j*dp ... j*dp+dp-1`` side by side
        (replica r takes closure ``j*dp+r``'s rows)."""
        dp = self.dp
        j = slot.index // dp
        with self._feed_lock:
            group = self._slots[j * dp:(j + 1) * dp]
            if j in self._fed or any(s.inputs is None for s in group):
                return
            self._fed.add(j)
        inputs = side_by_side([s.inputs for s in group], self._whole,  # type: ignore[misc]
                              self.batch_dim)
        for r in self._input_ranks:
            self._pipes.send(r, ("in", j, inputs))

    def _send_grad(self, slot: Slot, grads: list[Any] | None) -> None:
        if slot.grad_sent:
            raise RuntimeError("backward ran twice through the pipelined model in one closure")
        slot.grad_sent = True
        if grads is not None and getattr(self, "_scale", None) is not None and not slot.scaled:
            from orgel.precision import UNSCALED_BACKWARD

            raise RuntimeError(UNSCALED_BACKWARD)
        for process in self._loss_processes[slot.index % self.dp]:
            self._pipes.send(process, ("grad", slot.index // self.dp, grads))

    def _shapes(self, first: dict[str, torch.Tensor] | None
                ) -> tuple[dict[str, torch.Tensor], int]:
        """The whole batch's placeholders (shapes only) and rows, from micro-batch 0's
        inputs: every micro-batch of a step has its shapes."""
        if first is None:
            raise RuntimeError("the closure for micro-batch 0 did not call the compiled model")
        dim, m = self.batch_dim, self.microbatches
        stand_ins = batch_placeholders(first, m, dim, self._whole)
        batched = [t.shape[dim] for n, t in stand_ins.items() if n not in self._whole]
        rows = int(batched[0]) if batched else int(self._rows or m)
        return stand_ins, rows

    def _read_outputs(self) -> None:
        """Hand each closure its outputs as the loss stage's ranks send them (replica r's
        micro-batch j is closure ``j*dp+r``'s)."""
        readers = [threading.Thread(target=self._read_from, args=(r, process, member == 0),
                                    daemon=True)
                   for r, processes in enumerate(self._loss_processes)
                   for member, process in enumerate(processes)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()

    def _read_from(self, replica: int, process: int, answers: bool) -> None:
        """Read one loss-stage process's outputs until its ``"done"``; only member 0's go to
        the closures (the other tensor-parallel members hold the same)."""
        while True:
            try:
                kind, j, outputs = self._pipes.conns[process].recv()
            except (EOFError, OSError):
                self._abort_step(RANK_FAILED)
                return
            if kind == "done":
                return
            if kind == "failed":
                self._abort_step(RANK_FAILED)
            if kind != "out" or not answers:
                continue
            slot = self._slots[j * self.dp + replica]
            slot.outputs = outputs
            slot.delivered.set()

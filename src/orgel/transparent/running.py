"""The Pipeline API of ``orgel.backend`` once its ranks run (they start on the first step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from orgel.precision import ambient_autocast, device_type
from orgel.schedule.ir import Plan

#: why orgel.backend's pipeline does not evaluate (``Pipeline.evaluate`` raises with it)
NO_EVALUATION = ("orgel.backend runs your closure as a training step; to evaluate, call the "
                 "compiled model outside pipe.step under torch.no_grad() (after model.eval() "
                 "for eval mode): it runs in this process on the values the ranks trained")

STOPPED = ("this orgel.backend's ranks are stopped (by close(), by a rank that died or hung, "
           "or by a closure that hung past timeout_s): "
           "create a new orgel.backend and compile the model with it (pipe.load(directory) "
           "resumes from a checkpoint)")


class RunningPipeline:
    """``plan``, ``steps``, ``state_dict``, ``save``, ``load``, ... of the ranks' pipeline.

    The subclass sets :attr:`pipe` when its ranks start; before that, each of these
    raises saying the pipeline starts on the first step (``load`` waits for it).
    """

    pipe: Any = None  # an orgel.worker.pipe.Pipeline once the ranks run
    given_plan: Plan | str | Path | None = None
    schedule: str | None = None  # a family over a FLOP-balanced chain instead of a plan
    ranks: int
    microbatches: int  # closures per step (dp replicas share them)
    dp: int
    _pending_load: str | Path | None = None
    _loads = 0  # loads made while running (the ranks' values changed outside a step)
    _precision: torch.dtype | None  # bf16-mixed's autocast dtype, or None
    #: the ranks' values for an evaluation outside step (see _values), and when asked
    _fetched: tuple[tuple[int, int, int], dict[int, torch.Tensor]] | None = None

    @property
    def plan(self) -> Plan:
        return self._running().plan

    @property
    def steps(self) -> int:
        """Optimizer steps taken (one per ``accumulate`` step calls)."""
        return int(self._running().steps)

    @property
    def pending(self) -> int:
        """Step calls made since the last optimizer step (``accumulate`` > 1; a dropped
        step sets it back to 0: the accumulation starts again)."""
        return int(self._running().pending)

    @property
    def lr(self) -> list[float]:
        """The learning rates in force for the next optimizer step, one per param group."""
        return list(self._running().lr)

    @property
    def grad_norm(self) -> float | None:
        """The last optimizer step's global gradient norm before clipping (see Pipeline)."""
        norm = self._running().grad_norm
        return None if norm is None else float(norm)

    @property
    def loss_scale(self) -> dict[str, Any] | None:
        """Under ``precision="16-mixed"``: the ranks' ``{"scale", "growth_tracker",
        "skipped"}`` after the last step (see :attr:`orgel.Pipeline.loss_scale`); else None."""
        state = self._running().loss_scale
        return None if state is None else dict(state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The compiled model's parameters and buffers by their original names."""
        return dict(self._running().state_dict())

    def save(self, directory: str | Path, *, keep: int | None = None) -> Path:
        """Checkpoint every rank atomically (see :meth:`orgel.worker.pipe.Pipeline.save`).

        ``keep``: None (the default) removes no older checkpoint; ``keep=k`` all but the
        newest ``k``.
        """
        return Path(self._running().save(directory, keep=keep))

    def load(self, directory: str | Path) -> int | None:
        """Resume from a checkpoint (its plan too, if none was given and the ranks match).

        Before the first step the load happens when the ranks start; returns None then.
        """
        if self.pipe is None:
            from orgel.runtime import checkpoint as ckpt

            meta = ckpt.read_meta(directory)  # fail now on a missing or foreign checkpoint
            saved = Plan.from_json(ckpt.read_plan_json(directory))
            if (self.given_plan is None and self.schedule is None
                    and int(meta["num_ranks"]) == self.ranks
                    and saved.microbatches * self.dp == self.microbatches):
                self.given_plan = saved  # same layout: resume exactly where it stopped
            self._pending_load = directory
            return None
        self._loads += 1
        return int(self.pipe.load(directory))

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: raises RuntimeError saying what to do instead (:data:`NO_EVALUATION`)."""
        raise RuntimeError(f"evaluation is not available: {NO_EVALUATION}")

    def timeline(self) -> list[Any]:
        """Measured events of the last step, all ranks (orgel.runtime.trace.Event)."""
        return list(self._running().timeline())

    def kill(self) -> None:
        """Stop the ranks at once (a second Ctrl-C in a step: orgel.launch.interrupts)."""
        if self.pipe is not None:
            self.pipe.kill()

    def close(self) -> None:
        """Stop the ranks, and drop the code Dynamo compiled with this backend (only that:
        it would keep its graphs alive and count against the recompile limit of the model's
        frames, which another backend of the same model class compiles again)."""
        from orgel.graph.dynamo import forget_compiled

        if self.pipe is not None:
            self.pipe.close()
        forget_compiled(self)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        """``with pipe:`` closes the ranks at the end, as ``orgel.pipeline``'s does."""
        self.close()

    def _running(self) -> Any:
        if self.pipe is None:
            raise RuntimeError("the pipeline starts on the first pipe.step(closure, ...)")
        return self.pipe

    # -- a graph called outside step: an evaluation, here ---------------------------------

    def _evaluate_here(self, gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> Any:
        """A graph called outside ``step`` (an evaluation): run it here, on the ranks' values.

        With gradients off, the caller's parameters and buffers among ``args`` are replaced
        by the values the ranks hold now (fetched once per step); before the first step
        they are the caller's own. ``precision="bf16-mixed"`` opens its autocast around
        the graph where the caller opened none.
        """
        if torch.is_grad_enabled():
            raise RuntimeError(
                "outside pipe.step(...) the compiled model only evaluates: call it under "
                "torch.no_grad() (it runs in this process, on the values the ranks trained), "
                "or train it inside a closure run by pipe.step(closure, ...)")
        if self.pipe is not None:
            values = self._values()
            args = tuple(values.get(id(a), a) if isinstance(a, torch.Tensor) else a
                         for a in args)
        if self._precision is None or ambient_autocast() is not None:
            return gm(*args)
        with torch.autocast(device_type(args), dtype=self._precision):
            return gm(*args)

    def _values(self) -> dict[int, torch.Tensor]:
        """The ranks' value of each of the caller's parameters and buffers, by the id of the
        caller's tensor; asked once per step call (and again after a load)."""
        now = (self.pipe.steps, self.pipe.pending, self._loads)
        if self._fetched is None or self._fetched[0] != now:
            owner = self.pipe._model
            state = self.pipe.state_dict()
            by_id = {id(t): state[name] for name, t in
                     [*owner.named_parameters(remove_duplicate=False),
                      *owner.named_buffers(remove_duplicate=False)] if name in state}
            self._fetched = (now, by_id)
        return self._fetched[1]

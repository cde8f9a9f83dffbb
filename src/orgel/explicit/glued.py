"""Training a forward of several graphs: the controller runs the Python between them.

A model whose forward Dynamo captures as several graphs (see
:mod:`orgel.graph.glue`) is planned and split as one joined graph; its
exchange points sit in stages on the ranks. In training, the controller runs
the model's forward once per micro-batch, each in its own thread, through
``torch.compile`` with a backend whose graphs are remote: calling graph ``c``
sends its arguments to the rank holding exchange ``c`` (graph 0's model inputs
to the input stages, as the closure runner does) and returns graph ``c``'s
outputs when the rank of the next exchange (or the loss stage) sends them. The
Python between graphs - branches, ``.item()``, NumPy, and the graphs that
read no parameter or buffer - runs here, on the real values of that
micro-batch; ``loss_fn`` runs here too, and its backward sends each graph's
output gradients back and receives its argument gradients.

Parameters that code outside every graph trains (a module Dynamo ran eagerly, a custom
Function's backward; :attr:`orgel.graph.glue.Glue.eager`) get their gradient here, on the
controller's copy, summed over the micro-batches in order; the rank that holds them (or
rank 0) adds it before its gradient sums, steps them, checkpoints them, sends them back.

A micro-batch whose forward runs other graphs than the capture ran (another
branch, graphs specialised on a Python value that changed, other argument
shapes) runs whole in the controller instead, on the ranks' values of the step
(:mod:`orgel.explicit.fallback`; with ``tp`` or FSDP each process sends its own shard of
the values, :mod:`orgel.runtime.pieces`); :attr:`GluedPipeline.off_path` lists them.
``orgel.backend``'s closures go on from the graph call where it left
(:class:`~orgel.explicit.closures.ClosurePipeline`).

A micro-batch's error here (its forward, ``loss_fn``, its backward) is the step's error,
and every rank drops that step (:mod:`orgel.runtime.dropped`): the controller's ``"fail"``
ends the ranks' waits for this process, and the step's ``"end"`` tells the ranks already
past their last action. A rank's own error drops it the same way (its ``"failed"`` ends
the controller's waits) and raises :class:`~orgel.launch.errors.StepError`. The pipeline
trains on after either, as :class:`~orgel.worker.pipe.Pipeline` does.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from orgel import guard
from orgel.batching import batch_rows, placeholders, split_microbatches
from orgel.explicit.eager import EagerParameters, controller_copy, exchange_ranks
from orgel.explicit.evaluation import evaluate_here, merged_outputs
from orgel.explicit.fallback import (
    Deviated,
    Fallback,
    check_outside,
    deviation,
)
from orgel.explicit.lazy import LazyOutputs
from orgel.explicit.mailbox import Mailbox, RankPipes, Stopped, members
from orgel.explicit.routes import Routes
from orgel.explicit.slots import GraphCall, Slot, Turns
from orgel.flow.start import loss_processes
from orgel.graph.dynamo import dynamo_settings, forget_compiled
from orgel.graph.glue_capture import kept_compiler
from orgel.graph.glue_sizes import expected_shape
from orgel.launch.errors import StepError, WorkerError
from orgel.launch.interrupts import finishes_first
from orgel.lossweights import batch_weights, checked_weigh
from orgel.nesting import call
from orgel.split.exchanges import eager_homes
from orgel.worker.engine import Dropped, kept_results
from orgel.worker.pipe import Pipeline
from orgel.workload import named_inputs


class GluedPipeline(Routes, EagerParameters, Pipeline):
    """:class:`orgel.worker.pipe.Pipeline` for a forward of several graphs (its controller).

    ``step(inputs, targets)`` runs the forward, ``loss_fn`` and backward of
    each micro-batch here in its own thread, the graphs on the ranks; ``evaluate``
    runs here, on the ranks' values (see :meth:`evaluate`); the rest of the API is
    :class:`~orgel.worker.pipe.Pipeline`'s.
    """

    #: fail the step at the first loss that is not finite (the loss is computed here)
    check_finite = False

    def __init__(self, plan: Any, group: Any, conns: list[Connection], *, glue: Any,
                 split: Any, model: torch.nn.Module,
                 loss_fn: Callable[[Any, Any], torch.Tensor], replicated: tuple[str, ...],
                 timeout_s: float, state_keys: list[str], aliases: dict[str, str],
                 batch_dim: int = 0, accumulate: int = 1,
                 loss_scaling: bool | dict[str, Any] = False) -> None:
        super().__init__(plan, group, model=model,
                         loss_ranks=loss_processes(plan, split.loss_stage),
                         state_keys=state_keys, aliases=aliases, spmd=False,
                         accumulate=accumulate)
        #: data-parallel replicas: the controller runs ``dp`` micro-batches per micro-batch
        #: of the ranks (:attr:`pieces` in all), replica ``r`` of the ranks' micro-batch
        #: ``j`` being the controller's ``j * dp + r`` (that replica's rows of it)
        self.dp = len(plan.placement[split.loss_stage])
        self.pieces = plan.microbatches * self.dp
        #: step calls made: the exchanges with the ranks are keyed by it (each rank counts
        #: its calls too), not by optimizer steps, which ``accumulate`` > 1 makes fewer
        self.calls = 0
        #: float16's loss scale this step (None: no scaling); the ranks' scalers own it
        #: (unscale, skip, update), and this process reads it back after every call
        self.scale: float | None = None
        if loss_scaling:
            self.scale = float(dict(loss_scaling if isinstance(loss_scaling, dict) else {})
                               .get("init_scale", 2.0 ** 16))
        self.glue = glue
        self.loss_fn = loss_fn
        self._keep_outputs = False  # whether this step keeps the model's outputs
        self.replicated = replicated
        self.batch_dim = batch_dim
        # by process; messages go to every tensor-parallel member of a rank, member 0 answers
        self._pipes = RankPipes(conns, members(plan))
        self._mail = Mailbox(conns, timeout_s, members(plan))
        self._lazy = LazyOutputs(self._pipes.send, self._mail.get)
        self._timeout_s = timeout_s
        self._turns = Turns(0, timeout_s)  # this step's (see _run_threads)
        self._ranks_of = exchange_ranks(plan, split)  # by replica
        self._loss_ranks = list(plan.placement[split.loss_stage])
        self._input_ranks = sorted({r for s, st in enumerate(split.stages) if st.model_inputs
                                    for r in plan.placement[s]})
        self._fed: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # group -> piece inputs
        self._stopped = False  # a micro-batch of this step failed (the ranks were told)
        self._feed_lock = threading.Lock()
        # the ranks' stand-ins: the inputs stages read, and those whose sizes they read
        self._input_names = list(dict.fromkeys([*split.model_input_names,
                                                *(i for i, _ in split.sizes.values())]))
        # the parameters code outside every graph trains: their gradients are computed
        # here, on a copy of them (the caller's model stays as it was), and a rank steps them
        self._homes = eager_homes(glue, plan, split)
        self._split = split
        self._fallback = Fallback(model, glue, split)
        #: the micro-batches of the last step whose forward left the captured graphs
        self.off_path: list[int] = []
        runner = self._runner = controller_copy(model, glue.eager)
        self._eager = {name: runner.get_parameter(name) for name in glue.eager}
        self._params = dict(runner.named_parameters())
        self._state_ids = {id(t) for t in [*runner.parameters(), *runner.buffers()]}
        # the caller's parameters (the ranks train them): a forward that reaches one outside
        # every graph (Dynamo ran a frame as Python past its recompile limit) left the path
        eager_ids = {id(p) for p in self._eager.values()}
        self._remote_ids = {id(p) for p in runner.parameters() if id(p) not in eager_ids}
        self._local = threading.local()
        # dynamic=None: a float read off a tensor after a break (.item()) turns symbolic at
        # its first change, not a recompile per value (eager past 8); sizes are symbolic
        # where the capture's were (Glue.settings, entered wherever this compiles)
        # the backend the capture compiled with: its code serves this copy (no second trace)
        self._compiler = kept_compiler(glue)
        self._compiled = torch.compile(runner, backend=self._compiler, dynamic=None)
        self._warm = False

    # -- the graphs, as torch.compile hands them over -------------------------------------

    def _route(self, gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> Any:
        """A graph call of a micro-batch's forward (its thread's route: :meth:`_guarded`)."""
        if not any(id(a) in self._state_ids for a in args):
            return gm(*args)  # no parameter or buffer: glue, it runs here
        return self._call(gm.code, args)

    def _call(self, code: str, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        slot: Slot | None = getattr(self._local, "slot", None)
        if slot is None:
            raise RuntimeError("this compiled model runs only inside pipe.step(...)")
        c = slot.calls
        self._turns.reached(slot.index, c)  # past Dynamo's lookups up to this graph
        slot.calls += 1
        calls = self.glue.calls
        if c >= len(calls) or calls[c].code != code:
            expected = (f"graph {c} of {len(calls)} ({calls[c].where})" if c < len(calls)
                        else f"no graph after the last of {len(calls)}")
            what = (f"micro-batch {slot.index}'s forward ran another graph than the captured "
                    f"forward at graph call {c} (expected {expected})")
            raise Deviated(
                f"{what}: it took another branch, or "
                "Dynamo specialised a graph on a Python value that changed (a float from "
                ".item(), a shape); to keep it on the captured graphs, make the branch a "
                "tensor op (torch.where) or keep such values as tensors", what)
        call = calls[c]
        inputs: dict[str, torch.Tensor] = {}
        for i, (kind, name) in enumerate(call.roles):
            if kind == "param" and args[i] is not self._params.get(name):
                raise Deviated(f"graph call {c} of micro-batch {slot.index} reads another "
                               f"parameter than {name!r}, which the captured forward read")
            if kind == "input":
                if args[i].requires_grad:
                    raise RuntimeError(f"model input {name!r} requires grad; pass inputs that "
                                       "do not")
                inputs[name] = args[i].detach()
            if kind in ("size", "number"):  # the ranks read a size off the micro-batch
                want = name if kind == "number" else slot.sizes[name[0]][name[1]]
                if args[i] != want:
                    of = "" if kind == "number" else f" ({name[0]!r} dim {name[1]})"
                    raise Deviated(f"graph call {c} of micro-batch {slot.index} takes the int "
                                   f"{args[i]} where the captured forward took {want}{of}")
        values = [args[i] for i in call.glue]
        shapes = [tuple(v.shape) for v in values]
        wanted = [expected_shape(dims, slot.sizes) for dims in call.shapes]
        j = next((j for j, (got, want) in enumerate(zip(shapes, wanted, strict=True))
                  if len(got) != len(want) or any(w is not None and g != w
                                                  for g, w in zip(got, want, strict=True))),
                 None)
        if j is not None:
            what = (f"micro-batch {slot.index}'s graph call {c} ({call.where}) gets an argument "
                    f"of shape {list(shapes[j])} where the captured forward had "
                    f"{['any' if w is None else w for w in wanted[j]]}")
            raise Deviated(
                f"{what}: the Python between graphs makes shapes that depend on the data "
                "(torch.where, nonzero, a loop over what the tokens chose); to keep it on the "
                "captured graphs, compute such a part with fixed shapes (a dense mask instead "
                "of an index list)", what)
        assert slot.anchor is not None
        # a graph run with gradients off (a rotary table under torch.no_grad) still takes its
        # place in the anchors' chain: its backward sends the ranks their zero gradients
        grad = torch.is_grad_enabled()
        with torch.enable_grad():
            out = GraphCall.apply(self, slot, c, inputs, grad, slot.anchor, *values)
        slot.anchor = out[0]
        # the frames before the next graph, or after the last one: after the micro-batch
        # before (its last graph's frames are behind it once its backward began)
        self._turns.wait(slot.index, c + 1 if c + 1 < len(calls) else sys.maxsize)
        return tuple(out[1:])

    # -- a step ---------------------------------------------------------------------------

    @finishes_first
    def step(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        """One training step on a whole batch; returns its loss (each micro-batch's loss
        weighted by :mod:`orgel.lossweights`, as the ranks' executors weigh theirs).

        ``outputs=True``: ``(loss, outputs)``, the model's outputs as
        :meth:`orgel.worker.pipe.Pipeline.step` returns them (computed here, in this process).
        """
        self._keep_outputs = outputs
        named = named_inputs(self._model, inputs)
        self._check_batch(named, targets, "pipe.step")  # sizes the graphs cannot take
        parts = split_microbatches(named, targets, self.pieces, self.batch_dim,
                                   self.replicated)
        self._weights = batch_weights(self.loss_rule, [p for p, _ in parts],
                                      [t for _, t in parts], 1, self.batch_dim, self.replicated)
        if not self._warm:
            self._warm_up(parts[0][0])
        stand_ins = placeholders({n: t for n, t in named.items() if n in self._input_names})
        # the ranks count rows from the placeholders, or from here when no stage reads an input
        rows = batch_rows(named, targets, self.batch_dim, self.replicated)
        slots = self._run_threads(lambda slot: self._run_microbatch(slot, *parts[slot.index]),
                                  stand_ins, rows)
        loss = sum(s.result for s in slots)
        if not outputs:
            return loss
        return loss, merged_outputs([s.outputs for s in slots], rows)

    @finishes_first
    def evaluate(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        """Forward only over a whole batch in eval mode, as
        :meth:`orgel.worker.pipe.Pipeline.evaluate` (same arguments and results), run here.

        The forward's Python between graphs lives in this process, so the controller
        evaluates: its own copy of the model takes the ranks' values (fetched once per
        optimizer step) and runs each micro-batch eagerly under ``torch.no_grad()`` in
        eval mode, its loss weighed as ``step`` weighs it. The ranks do nothing, the
        caller's model is not changed, and the next ``step`` trains as if this had not run.
        """
        return evaluate_here(self, self._fallback.current(self), inputs, targets, outputs)

    def _run_threads(self, work: Callable[[Slot], None], stand_ins: dict[str, torch.Tensor],
                     rows: int) -> list[Slot]:
        """``work(slot)`` for every micro-batch, each in its own thread, beside the ranks' step."""
        slots = [Slot(i) for i in range(self.pieces)]
        self._fed.clear()
        self._mail.begin()
        self._stopped = False
        self._turns = Turns(len(slots), self._timeout_s)
        threads = [threading.Thread(target=self._guarded, args=(work, slot),
                                    name=f"orgel-forward{slot.index}", daemon=True)
                   for slot in slots]
        for t in threads:
            t.start()
        # once every micro-batch is done, every rank gets its gradients (EagerParameters)
        threads.append(threading.Thread(target=self._send_grads, args=(slots, threads[:]),
                                        name="orgel-eager-grads", daemon=True))
        threads[-1].start()
        ender = threading.Thread(target=self._end_step, args=(threads[:],),
                                 name="orgel-end-step", daemon=True)
        ender.start()
        try:
            results = self.call_ranks("closure_step", stand_ins, rows)
        except Exception as exc:  # a rank is gone (a dropped step comes back as a result)
            self._mail.abort("a rank failed")
            self._join(slots, threads[:len(slots)])
            for t in threads:
                t.join()
            if isinstance(exc, WorkerError) and not isinstance(exc, StepError):
                # the ranks are gone: so is the code Dynamo compiled for this pipeline, which
                # would otherwise serve a later capture of the same model class
                forget_compiled(self._compiler)
            self._raise_first(slots)
            if isinstance(exc, StepError):
                raise _on_stand_ins(exc, slots) from None
            raise
        self._join(slots, threads[:len(slots)])
        for t in [*threads, ender]:
            t.join()
        self._mail.finish(self.plan.num_ranks)  # nothing of this step is still on the way
        if any(isinstance(r, Dropped) for r in results):  # every rank dropped the step
            self.pending = 0  # and the gradients accumulated since the last optimizer step
        self._raise_first(slots)  # a micro-batch's own error is the cause, or
        try:
            kept_results(results)  # StepError, a rank's
        except StepError as exc:
            raise _on_stand_ins(exc, slots) from None
        if self.stepping:  # the optimizer stepped: its new values
            self._receive_values()
        self.off_path = [s.index for s in slots if s.off_path]
        state = self.ranks_loss_scale() if self.scale is not None else None  # (in the step)
        if state is not None:  # the ranks' scale after this call (backed off, grown)
            self.scale = float(state["scale"])
        self.calls += 1
        self.called()
        return slots

    def _join(self, slots: list[Slot], threads: list[threading.Thread]) -> None:
        """Wait for each micro-batch's thread; where one still runs ``timeout_s`` later (a
        closure of ``orgel.backend`` that hangs), stop the ranks, which may wait on it, and
        raise :meth:`_hung`'s error."""
        deadline = time.monotonic() + self._timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [s for s, t in zip(slots, threads, strict=True) if t.is_alive()]
        if hung:
            self.kill()
            raise self._hung(hung)

    def _hung(self, slots: list[Slot]) -> Exception:
        """The error for micro-batches whose thread has not ended within the timeout."""
        return TimeoutError(f"the forward of micro-batches {[s.index for s in slots]} has not "
                            f"ended within {self._timeout_s:g} s")

    def _guarded(self, work: Callable[[Slot], None], slot: Slot) -> None:
        self._local.slot = slot
        self._turns.wait(slot.index)  # Dynamo's first lookup: one thread at a time
        try:
            with guard.no_autocast_cache(), self._compiler.routed(self._route):
                work(slot)
        except BaseException as exc:  # noqa: BLE001 - re-raised by step()
            slot.error = getattr(exc, "inner_exception", None) or exc
            self._stop_step(slot)
        finally:
            self._turns.passed(slot.index)

    def _stop_step(self, slot: Slot) -> None:
        """Micro-batch ``slot`` failed: the other micro-batches stop waiting, and every rank
        is told (``"fail"``: its waits for this process raise, and it drops the step)."""
        with self._feed_lock:
            if self._stopped:
                return
            self._stopped = True
        error = slot.error
        self._mail.abort(f"micro-batch {slot.index} failed: {type(error).__name__}")
        self._pipes.fail(f"micro-batch {slot.index} failed in the calling process "
                         f"({type(error).__name__}: {error})")

    def _end_step(self, threads: list[threading.Thread]) -> None:
        """Once every micro-batch (and the gradients' sender) is done, tell every process
        (``"end"``): the ranks then sum the gradients, or drop the step if one failed."""
        for t in threads:
            t.join()
        self._lazy.settle(self._stopped)  # (the ranks wait for the "end": they answer)
        self._pipes.end()

    def _warm_up(self, inputs: dict[str, Any]) -> None:
        """Run micro-batch 0's forward here once, every graph locally, before the first step.

        Dynamo compiles each frame the first time a thread runs it; two
        micro-batch threads compiling the same frames at once can each get a
        differently specialised graph (then that micro-batch runs in the controller).
        Compiling them here, in one thread, leaves the threads only cache hits.
        The controller's copy, grad mode and RNG are put back afterwards.
        """
        with (guard.untouched(self._runner), dynamo_settings(nested=True), self.glue.settings(),
              torch.enable_grad(), guard.no_autocast_cache(), self.glue.autocast()):
            call(self._compiled, inputs)  # no route: every graph runs here
        self._warm = True

    def close(self) -> None:
        """Stop the ranks, and drop the code Dynamo compiled here for the controller's copy."""
        try:
            super().close()
        finally:
            forget_compiled(self._compiler)

    def load_state_dict(self, state: Any, strict: bool = True) -> Any:
        result = super().load_state_dict(state, strict)
        self._fallback.forget()
        self._pull_values()
        return result

    @finishes_first  # (its bookkeeping after the ranks' load runs before a held Ctrl-C)
    def load(self, directory: Any) -> int:
        step = super().load(directory)
        self.calls = step  # each rank's call count restarts from the checkpoint's step too
        self._fallback.forget()
        self._pull_values()
        return step

    @staticmethod
    def _raise_first(slots: list[Slot]) -> None:
        """The first micro-batch's own error (not one that only saw the step stop)."""
        for slot in slots:
            if slot.error is not None and not isinstance(slot.error, Stopped):
                raise slot.error

    def _run_microbatch(self, slot: Slot, inputs: dict[str, Any], targets: Any) -> None:
        first = slot.anchor = torch.zeros((), requires_grad=True)
        slot.sizes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        try:
            with dynamo_settings(nested=True), self.glue.settings(), torch.enable_grad(), \
                    self.glue.autocast():  # Dynamo's settings are per thread
                out = call(self._compiled, inputs)
                self._check_calls(slot)
                check_outside(slot.index, out, self._remote_ids)
        except Exception as exc:
            found = deviation(exc)
            if found is None:
                raise
            self._turns.passed(slot.index)  # off the graphs: the next may look up past here
            self._fallback.leave(self, slot, inputs, found.what)
            self._fallback.run(self, slot, inputs, targets)
            return
        with dynamo_settings(nested=True), torch.enable_grad():
            if self._keep_outputs:
                slot.outputs = out
            loss = self.weighed_loss(slot.index, out, targets)
            # the anchors chain every graph call: backward reaches each, last one first;
            # the gradients of the parameters trained here are kept per micro-batch. Each
            # call counts 1/accumulate (the ranks' loss stage does not scale it again)
            names = list(self._eager)
            grads = torch.autograd.grad(self.backward_root(loss) + slot.anchor * 0,
                                        [first, *self._eager.values()], allow_unused=True)
            slot.grads = {n: g for n, g in zip(names, grads[1:], strict=True) if g is not None}
        slot.result = float(loss.detach())

    def backward_root(self, loss: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's backward starts from: its loss times the loss scale (float16:
        the ranks unscale every gradient, this process's included), over ``accumulate``
        (each call counts ``1/accumulate``; the ranks' loss stage scales neither again)."""
        return (loss if self.scale is None else loss * self.scale) / self.accumulate

    def weighed_loss(self, m: int, outputs: Any, targets: Any) -> torch.Tensor:
        """Micro-batch ``m``'s loss, weighed as the ranks' executors weigh theirs; with
        :attr:`check_finite`, :class:`NonFiniteLoss` where it is NaN or infinite."""
        return checked_weigh(self.loss_fn(outputs, targets), self._weights[(m, 0)], outputs,
                             check_finite=self.check_finite, m=m,
                             where="computed in this process")

    def _check_calls(self, slot: Slot) -> None:
        if slot.calls != len(self.glue.calls):
            raise Deviated(f"micro-batch {slot.index}'s forward ran {slot.calls} graphs; "
                           f"the captured forward ran {len(self.glue.calls)}")


def _on_stand_ins(exc: StepError, slots: list[Slot]) -> StepError:
    """A rank's :class:`StepError` of a step where micro-batches left the captured graphs:
    the ranks finished their part of those on stand-ins of their sizes, a run that fails
    where the capture took an int of the model for a size (``exc`` as it is otherwise)."""
    left = [s.index for s in slots if s.leaving]
    if not left:
        return exc
    return StepError(
        f"{exc}\n(micro-batches {left} left the captured graphs and ran in the calling "
        "process while the ranks finished their part on stand-ins of their sizes; where that "
        "run fails, an int the Python between graphs hands on that equals a size of the first "
        "batch (a head count in a local variable, equal to its micro-batch rows) may have "
        "been taken for that size: give the first batch sizes that differ from the model's "
        "own numbers)", exc.rank, exc.report)

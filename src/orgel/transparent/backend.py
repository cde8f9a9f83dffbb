"""The transparent API: a ``torch.compile`` backend plus a closure runner (Pfeife Listing 1).

::

    pipe = orgel.backend(ranks=2, microbatches=4, optimizer=lambda p: torch.optim.AdamW(p))
    model = torch.compile(model, backend=pipe)

    def closure(tokens, pixels):
        with torch.no_grad():
            text = frozen_text_tower(tokens)        # runs here, in the calling process
        out = model(text, pixels)                   # pipelined across the ranks
        loss = criterion(out) / pipe.microbatches   # the closure owns the loss
        loss.backward()                             # gradients flow into the pipeline
        return loss.detach()

    losses = pipe.step(closure, tokens, pixels)     # one value per micro-batch

``step`` slices every batched argument into micro-batches (all but those named in
``orgel.backend(..., replicated=[positions])``) and runs one closure per
micro-batch, each in its own thread. A closure's model call hands its inputs
straight to the ranks that host input stages, which start on them while other
closures are still pre-processing; a closure's loss and backward
(post-processing) run while the ranks work on other micro-batches. Outputs and
gradients cross through :mod:`orgel.worker.closure`; the optimizer steps once every
closure is done. The first step is the exception: it first runs micro-batch
0's closure up to its backward to find the graphs (:mod:`orgel.transparent.finding`),
then captures, plans and starts the ranks once every closure has reached its
model call. A compiled model with graph breaks (several graphs that read
parameters, or one called more than once) is joined and pipelined as
:mod:`orgel.explicit.glued` does for ``orgel.pipeline``; the closures run the Python
between its graphs (:class:`orgel.explicit.closures.ClosurePipeline`). Gradients
accumulate over micro-batches as in gradient accumulation: divide the loss by
``microbatches`` for a batch-mean loss. A closure that never calls
``backward`` contributes no gradient; a step whose closures all skip it (an
evaluation batch) leaves every parameter and the optimizer's state as they were.

Modes: local spawn (the calling process drives forked ranks), or under torchrun, where
process 0 runs the closures beside its own rank and the other processes follow its steps
(:mod:`orgel.transparent.job`).
The model's inputs must not require grad (run pre-processing under ``no_grad``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from orgel import guard
from orgel.explicit.closures import UntrainedWarning as UntrainedWarning  # its public name
from orgel.explicit.mailbox import RankPipes
from orgel.explicit.slots import Turns
from orgel.graph.dynamo import dynamo_settings
from orgel.launch.errors import StepError, WorkerError
from orgel.runtime.optimizer import LearningRate, SchedulerFactory, check_loop_options
from orgel.schedule.ir import Plan
from orgel.transparent.exchange import RankLink
from orgel.transparent.finding import FindsGraphs
from orgel.transparent.graph_model import (
    GraphModel,
    roles_of,
)
from orgel.transparent.job import check_world, first_inputs, follows
from orgel.transparent.running import STOPPED, RunningPipeline
from orgel.transparent.slicing import check_cutting, shared_inputs, slice_batch
from orgel.worker.closure import OutputsFunction, Slot
from orgel.worker.engine import OptimizerFactory
from orgel.worker.pipe import kept_results


class Backend(RunningPipeline, RankLink, FindsGraphs):
    """A torch.compile backend and the runner of closures over it; see :func:`backend`."""

    def __init__(self, *, ranks: int, microbatches: int, optimizer: OptimizerFactory | None,
                 memory: int | None, dp: int, plan: Plan | str | Path | None,
                 timeout_s: float, threads: int | None, precision: str = "32",
                 scheduler: SchedulerFactory | None = None, lr: LearningRate | None = None,
                 max_grad_norm: float | None = None, accumulate: int = 1,
                 batch_dim: int = 0, replicated: tuple[int, ...] = (),
                 shard: str = "none", tp: int = 1, recompute: bool | str = False,
                 schedule: str | None = None, compile: bool = False,
                 sequence_parallel: bool = False,
                 loss_scaling: bool | dict[str, Any] = False) -> None:
        from orgel.flow.capture import default_optimizer
        from orgel.flow.options import check_options

        check_options(ranks, microbatches, optimizer, memory, dp, plan, schedule)
        self.ranks, self.microbatches = ranks, microbatches
        self.optimizer = optimizer or default_optimizer
        check_loop_options(optimizer=self.optimizer, scheduler=scheduler, lr=lr,
                           max_grad_norm=max_grad_norm, accumulate=accumulate)
        #: the ranks' executor options: the training loop (see orgel.runtime.optimizer), and
        #: their stages through Inductor or not (orgel.runtime.compiled)
        self.loop: dict[str, Any] = {"scheduler": scheduler, "lr": lr,
                                     "max_grad_norm": max_grad_norm, "accumulate": accumulate,
                                     "compile": compile}
        self.memory, self.dp, self.given_plan, self.schedule = memory, dp, plan, schedule
        self.shard = shard  # how the dp replicas hold their state ("none" or "fsdp")
        self.tp = tp  # processes per pipeline rank (tensor parallelism); ranks counts all
        self.sequence_parallel = sequence_parallel  # what tp leaves whole, cut by sequence
        self.recompute = recompute  # every stage's (orgel.runtime.checkpointing)
        self.timeout_s, self.threads = timeout_s, threads
        self.batch_dim = batch_dim
        #: positions of ``step``'s arguments that go whole to every closure
        self.replicated = tuple(replicated)
        self.model: GraphModel | None = None
        self.pipe: Any = None  # an orgel.worker.pipe.Pipeline once the ranks run
        self._pipes = RankPipes([])  # the caller's end of each rank's pipe, once started
        self._input_ranks: list[int] = []
        #: the loss stage's processes in each replica (its tp members; member 0 answers)
        self._loss_processes: list[list[int]] = []
        self._fed: set[int] = set()  # the ranks' micro-batches whose inputs went out
        self._feed_lock = threading.Lock()
        #: set once the first step's ranks run (or that step ended): the closures that
        #: called the model before wait for it before their outputs' timeout counts
        self._ranks_up = threading.Event()
        self._placeholders: dict[str, torch.Tensor] = {}
        self._rows: int | None = None  # the batch size of the model's inputs (placeholders)
        self._whole: tuple[str, ...] = ()  # model inputs every micro-batch gets whole
        self._local = threading.local()
        self._slots: list[Slot] = []
        self._turns = Turns(0, timeout_s)  # this step's (see _run_closures)
        self._failed_first: Slot | str | None = None  # what stopped this step first
        self._pending_load: str | Path | None = None
        # the graph calls micro-batch 0's forward made on the first step (see _discover)
        self._found: list[tuple[Any, ...]] | None = None
        self._discovering = False
        self._stepping = False  # inside step: graph calls are training (else evaluation)
        self._names: dict[int, str] | None = None  # id -> name in the compiled model
        self._module: torch.nn.Module | None = None  # the compiled module, when one is
        self._autocast: tuple[str, torch.dtype] | None = None  # around the model (1st step)
        from orgel.precision import autocast_dtype

        self._precision = autocast_dtype(precision)  # ValueError for unknown names
        #: float16's loss scale, the ranks' (they unscale, skip and update it): what
        #: :meth:`scale` multiplies a closure's loss by this step (None: no scaling)
        self._scale: float | None = None
        if loss_scaling:  # float16 (orgel.precision.loss_scaling)
            options = loss_scaling if isinstance(loss_scaling, dict) else {}
            self._scale = float(options.get("init_scale", 2.0 ** 16))
            # the closures scale their own losses: the ranks' loss stage does not again
            self.loop["loss_scaling"] = loss_scaling

    # -- torch.compile side -------------------------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # sizes left symbolic included (a graph after a break: bound when they are joined)
        roles = roles_of(placeholders, example_inputs, strict=False)
        stateful = any(kind in ("param", "buffer") for kind, _ in roles)

        def run(*args: Any) -> Any:
            m = getattr(self._local, "microbatch", None)
            if m is not None:  # past Dynamo's lookup: the next closure may call the model
                self._turns.passed(m)
            if stateful and not self._stepping:
                return self._evaluate_here(gm, args)
            if stateful:
                self._check_autocast()
            if self._discovering:
                return self._record(gm, example_inputs, roles, args)
            if not stateful:  # reads no parameter or buffer: runs here, as the closure does
                return gm(*args)
            from orgel.explicit.closures import ClosurePipeline

            if isinstance(self.pipe, ClosurePipeline):
                return self.pipe.graph_call(gm, args)
            if self.model is None:
                raise RuntimeError("call the compiled model inside a closure run by "
                                   "pipe.step(...)")
            if gm.code == self.model.graph_module.code:
                return self._forward(*args)
            from orgel.graph.capture import GraphBreakError

            raise GraphBreakError(
                "torch.compile handed orgel.backend another graph after the first step found "
                "one: the compiled model's forward took another path, or an input's shape "
                "changed in a dimension Dynamo had fixed (the first step's graph keeps "
                "symbolic only the sizes of tensors the closure passes on as it got them, "
                "and none under torch.compile(dynamic=False)). Keep those shapes fixed")

        return run

    # -- the first step: find the graphs ----------------------------------------------------

    def _start_glued(self) -> None:
        """Plan and start the joined graphs of a compiled model with graph breaks."""
        from orgel.transparent.start import start_glued

        self.pipe = start_glued(self)
        if self._pending_load is not None:
            self.pipe.load(self._pending_load)

    def _forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        m = getattr(self._local, "microbatch", None)
        if m is None:
            raise RuntimeError("call the compiled model inside a closure run by pipe.step(...)")
        slot = self._slots[m]
        if slot.inputs is not None:
            raise RuntimeError("a closure called the compiled model twice; call it once per "
                               "micro-batch")
        assert self.model is not None
        inputs = {}
        for (kind, name), value in zip(self.model.roles, args, strict=True):
            if kind == "input":
                if value.requires_grad:
                    raise RuntimeError(f"input {name!r} of the compiled model requires grad; "
                                       "run the pre-processing under torch.no_grad()")
                inputs[name] = value.detach()
        slot.inputs = inputs
        running = self.pipe is not None
        if running:  # the input stages take it now (see closure.py)
            self._feed(slot)
        slot.called.set()
        if not running:  # the first step: capture, plan and fork first (not the ranks' time)
            self._ranks_up.wait()
            if self.pipe is not None:  # a send blocks until its rank reads: not in the runner
                self._feed(slot)
        if not slot.delivered.wait(self.timeout_s):
            raise TimeoutError(f"micro-batch {slot.index}'s outputs did not arrive from the loss "
                               f"stage's processes {self._loss_processes} within "
                               f"{self.timeout_s:g} s")
        if slot.outputs is None:
            raise RuntimeError("the pipelined step was aborted")
        anchor = torch.zeros((), requires_grad=True)

        def send(grads: list[Any]) -> None:
            self._send_grad(slot, grads)

        return tuple(OutputsFunction.apply(anchor, send, *slot.outputs))

    # -- the runner ----------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the pipeline's float16 loss scale (``precision="16-mixed"``); else
        ``loss`` itself. In a closure, ``backend.scale(loss).backward()`` is GradScaler's
        ``scaler.scale(loss).backward()``: the ranks unscale every gradient before the
        optimizer, skip a step whose gradients overflowed and back the scale off, as
        ``scaler.step``/``scaler.update`` do (:mod:`orgel.runtime.scaler`). Under 16-mixed a
        closure's backward must start from it."""
        if self._scale is None:
            return loss
        from orgel.explicit.closures import ClosurePipeline

        if isinstance(self.pipe, ClosurePipeline):  # graph breaks: the closures' own threads
            slot = getattr(self.pipe._local, "slot", None)
            if slot is None:
                raise RuntimeError("call backend.scale(loss) inside a closure run by step(...)")
            slot.scaled = True
            assert self.pipe.scale is not None  # the ranks' scale, read after every call
            return loss * self.pipe.scale
        m = getattr(self._local, "microbatch", None)
        if m is None and not self._discovering:  # (the first step's search runs one here)
            raise RuntimeError("call backend.scale(loss) inside a closure run by step(...)")
        if m is not None and m < len(self._slots):
            self._slots[m].scaled = True
        return loss * self._scale

    def _refresh_scale(self) -> None:
        """The ranks' loss scale now (after a step backed it off or grew it, or a load)."""
        if self._scale is not None and self.pipe is not None:
            state = self.pipe.ranks_loss_scale()  # inside step: not a call of its own
            if state is not None:
                self._scale = float(state["scale"])

    def step(self, closure: Callable[..., Any], *batch: Any) -> list[Any]:
        """Run ``closure`` once per micro-batch of ``batch``; the optimizer steps once after.

        Returns the closure's return values, one per micro-batch in order. Outside
        ``step``, the compiled model evaluates: called under ``torch.no_grad()`` (after
        ``model.eval()`` for eval mode) it runs in this process on the ranks' values.
        """
        if not callable(closure):
            raise TypeError("step(closure, *batch): closure must be callable")
        if self.pipe is not None and self.pipe.closed:
            raise WorkerError(STOPPED, -1)
        self._stepping = True
        try:
            if follows():  # under torchrun, process 0's step (orgel.transparent.job)
                return self._follow(closure, batch)
            results = self._step(closure, batch)
        except BaseException as exc:
            if hasattr(self.pipe, "told"):  # process 0 of a torchrun job: the followers raise
                self.pipe.told("step", exc)
            raise
        finally:
            self._stepping = False
        if hasattr(self.pipe, "told"):
            self.pipe.told("step", results)
        return results

    def _follow(self, closure: Callable[..., Any], batch: tuple[Any, ...]) -> Any:
        if self.pipe is None:  # the graph found here too; the batch it is measured on is 0's
            pieces, _ = slice_batch(batch, self.microbatches, self.batch_dim, self.replicated)
            if self.model is None:
                self._find_graphs(closure, pieces)
        if self.pipe is None:  # one graph: process 0's closures' inputs give its batch
            self._slots = [Slot(m) for m in range(self.microbatches)]
            given, shared = first_inputs(None, self.timeout_s)
            for slot, inputs in zip(self._slots, given, strict=True):
                # an input every closure passed as one tensor is one here too (not batched)
                slot.inputs = {**inputs, **{n: given[0][n] for n in shared}}
            self._start()
        return self.pipe._follow("step")

    def _step(self, closure: Callable[..., Any], batch: tuple[Any, ...]) -> list[Any]:
        from orgel.explicit.closures import ClosurePipeline

        pieces, rows = slice_batch(batch, self.microbatches, self.batch_dim, self.replicated)
        if self.pipe is None and self.model is None:  # the first step: find the graphs
            self._find_graphs(closure, pieces)
        if isinstance(self.pipe, ClosurePipeline):
            return self.pipe.step_closures(closure, pieces, rows)
        self._refresh_scale()
        return self._run_closures(closure, pieces)

    def _run_closures(self, closure: Callable[..., Any], pieces: list[list[Any]]) -> list[Any]:
        """A step of the one pipelined graph, each closure in a thread of its own. A closure
        that raises (or a rank's work) drops the step on every rank, which train on."""
        self._slots = [Slot(m) for m in range(self.microbatches)]
        self._turns = Turns(self.microbatches, self.timeout_s)
        self._fed, self._failed_first = set(), None
        if self.pipe is None:  # (again after a first step that failed)
            self._ranks_up.clear()
        threads = [threading.Thread(target=self._run_closure, args=(closure, m, pieces[m]),
                                    name=f"orgel-closure{m}", daemon=True)
                   for m in range(self.microbatches)]
        for t in threads:
            t.start()
        ender = threading.Thread(target=self._end_step, args=(threads,), daemon=True)
        ender.start()
        try:
            if self.pipe is None:  # first step: every closure's inputs give the graph's batch
                try:
                    for slot in self._slots:
                        self._await_call(slot)
                    self._check_closures()
                except BaseException as exc:
                    first_inputs(exc, self.timeout_s)  # torchrun's other processes stop too
                    raise
                given = [s.inputs for s in self._slots]
                first_inputs((given, shared_inputs(given)), self.timeout_s)
                self._start()
                self._ranks_up.set()  # the closures send their inputs (see _forward)
            else:  # this step's shapes (a size the graph left symbolic may change)
                try:
                    self._await_call(self._slots[0])
                except TimeoutError:
                    self.pipe.kill()  # a closure that hangs: the ranks wait on it
                    raise
                if self._slots[0].inputs is not None:  # (else the ranks drop this step)
                    self._placeholders, self._rows = self._shapes(self._slots[0].inputs)
            reader = threading.Thread(target=self._read_outputs, daemon=True)
            reader.start()
            try:
                results = self.pipe.call_ranks("closure_step", self._placeholders, self._rows)
            except Exception:
                for slot in self._slots:
                    slot.called.wait(self.timeout_s)
                self._check_closures()  # a closure that failed first is the cause to report
                raise
            reader.join(self.timeout_s)
        finally:
            self._ranks_up.set()
            for slot in self._slots:  # release closures still waiting (after an error)
                slot.delivered.set()
            for t in threads:
                t.join(self.timeout_s)
        ender.join(self.timeout_s)
        running = [m for m, t in enumerate(threads) if t.is_alive()]
        if running:  # they may still send to the ranks: stop them
            self.pipe.kill()
            raise TimeoutError(f"the closures of micro-batches {running} have not returned "
                               f"{self.timeout_s:g} s after the pipelined step ended; a closure "
                               "must not wait on anything after its backward")
        try:
            kept_results(results)  # StepError where every rank dropped the step
        except StepError:
            self.pipe.pending = 0  # and the gradients accumulated so far
            self._check_closures()  # a closure's error is the cause to report
            raise
        self._check_closures()
        self.pipe.called()
        return [s.result for s in self._slots]

    def _run_closure(self, closure: Callable[..., Any], m: int, args: list[Any]) -> None:
        self._local.microbatch = m
        slot = self._slots[m]
        self._turns.wait(m)  # Dynamo's lookup of the compiled model: one closure at a time
        try:
            # thread-local: the closure compiles the model here, without the autocast cache
            with dynamo_settings(), guard.no_autocast_cache():
                slot.result = closure(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by step()
            slot.error = exc
        finally:
            self._turns.passed(m)
            slot.done = True
            slot.called.set()
            if slot.error is None and slot.inputs is not None and not slot.grad_sent:
                self._send_grad(slot, None)  # no backward: no gradient from this micro-batch
            elif slot.error is not None or slot.inputs is None:
                self._abort_step(slot)  # every rank drops the step

    def _start(self) -> None:
        """Capture, plan and split the one graph; fork the ranks (closure engines)."""
        from orgel.transparent.start import start_ranks

        started = start_ranks(self)
        self._rows, self._loss_processes = started.rows, started.loss_processes
        self._input_ranks, self._placeholders = started.input_ranks, started.placeholders
        self._whole = started.whole
        self._pipes, self.pipe = RankPipes(started.conns), started.pipe
        if self._pending_load is not None:
            self.pipe.load(self._pending_load)
            self._refresh_scale()  # the checkpoint's, before any closure scales its loss


def backend(*, ranks: int = 2, microbatches: int = 4, optimizer: OptimizerFactory | None = None,
            memory: int | None = None, dp: int = 1, plan: Plan | str | Path | None = None,
            timeout_s: float = 300.0, threads: int | None = None,
            precision: str = "32", scheduler: SchedulerFactory | None = None,
            lr: LearningRate | None = None, max_grad_norm: float | None = None,
            accumulate: int = 1, batch_dim: int = 0,
            replicated: Sequence[int] = (), **others: Any) -> Backend:
    """A torch.compile backend that pipelines the compiled model; also its closure runner.

    Use the returned object as ``torch.compile(model, backend=pipe)`` and train
    with ``pipe.step(closure, *batch)``. The ranks start on the first step (the
    graph is captured on that step's first micro-batch). Options as in
    :func:`orgel.pipeline`; ``precision="bf16-mixed"`` runs the compiled model
    under ``torch.autocast`` with bfloat16, as an autocast the closure opens
    around it would (the closure's own loss is the closure's); ``"16-mixed"`` with
    float16, and the closure starts its backward from ``pipe.scale(loss)`` (GradScaler's
    ``scaler.scale(loss)``; ``loss_scale``: GradScaler's options). ``scheduler``, ``lr``,
    ``max_grad_norm`` and ``accumulate`` as in :func:`orgel.pipeline`; with
    ``accumulate=k`` the closures' gradients count ``1/k`` (as ``(loss / k).backward()``)
    and the optimizer steps on every k-th ``step``. ``batch_dim``: the
    dimension ``step``'s tensor arguments are cut into micro-batches along (one int:
    ``step`` takes positional arguments; 1 for sequence-first ``[T, B]`` data).
    ``dp=d`` runs ``d`` replicas of the pipeline (``ranks`` counts all of them) that share
    each step's closures: the ranks' micro-batch ``j`` is closures ``j*d`` to ``j*d+d-1``
    side by side, each replica taking one closure's rows, so ``microbatches`` must be a
    multiple of ``d``; ``shard="fsdp"`` shards the replicas' state and ``tp=t`` splits
    each pipeline rank over ``t`` processes (``sequence_parallel=True``: what the split
    layers leave whole cut along the sequence); ``recompute``, ``schedule`` and ``compile``
    (the ranks' stages through Inductor, with graph breaks too) as in :func:`orgel.pipeline`
    (``ranks`` counts every process). Its other options (``device``, ``init``, ...) are
    refused with the reason (:data:`orgel.flow.options.REFUSED`).
    ``replicated``: positions of ``step``'s batch arguments (0 is the first after the
    closure) that every closure gets whole, such as class weights ``[C]`` whose size
    happens to be the batch size; arguments without the batch dimension (a 0-dim
    tensor, a Python number) go whole anyway. Every other tensor argument is cut along
    ``batch_dim``, and all of them must have the same size there (the batch size).

    Under torchrun, ``ranks`` is the job's process count: process 0 runs the closures on
    its batch and every other process's ``step`` follows it (:mod:`orgel.transparent.job`);
    call ``step`` and the other methods on every process, in the same order.
    """
    from orgel.flow.options import options, refuse
    from orgel.guard import autograd_first
    from orgel.plan.transforms import pipeline_ranks
    from orgel.precision import loss_scaling
    from orgel.runtime.checkpointing import check_policy
    from orgel.runtime.sharding import check_shard_option

    autograd_first()  # before the caller's torch.compile runs Dynamo (orgel.guard says why)
    options(**others)  # a misspelt name: TypeError with the names that exist
    refuse("backend", {**others, "dp": dp, "precision": precision})
    scaling = loss_scaling(precision, others.get("loss_scale"))
    check_world(ranks)  # under torchrun: one process per rank

    tp, shard = int(others.get("tp", 1)), str(others.get("shard", "none"))
    pipeline_ranks(ranks, tp, dp)  # tp divides ranks, dp the pipeline ranks
    check_shard_option(shard, dp)
    positions = check_cutting(microbatches, dp, batch_dim, replicated)
    return Backend(ranks=ranks, microbatches=microbatches, optimizer=optimizer, memory=memory,
                   dp=dp, plan=plan, timeout_s=timeout_s, threads=threads, precision=precision,
                   scheduler=scheduler, lr=lr, max_grad_norm=max_grad_norm,
                   accumulate=accumulate, batch_dim=batch_dim, replicated=tuple(positions),
                   shard=shard, tp=tp, schedule=others.get("schedule"),
                   sequence_parallel=bool(others.get("sequence_parallel", False)),
                   recompute=check_policy(others.get("recompute", False)),
                   compile=bool(others.get("compile", False)),
                   loss_scaling=scaling)


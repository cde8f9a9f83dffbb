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
closure is done. The first step first runs micro-batch 0's closure up to its backward
to find the graphs (:mod:`orgel.transparent.finding`), then joins, plans and starts
them. One runtime runs every compiled model, as :mod:`orgel.explicit.glued` runs
``orgel.pipeline``'s forward of several graphs: a model of one graph is a joined forward
of one call, and with graph breaks (several graphs that read parameters, or one called
more than once) the closures run the Python between its graphs
(:class:`orgel.explicit.closures.ClosurePipeline`). A closure whose forward leaves
the graphs found (another arm of a branch, a second call of the model) goes on in this
process from there, on the ranks' values of the step. Gradients
accumulate over micro-batches as in gradient accumulation: divide the loss by
``microbatches`` for a batch-mean loss. A closure that never calls
``backward`` contributes no gradient; a step whose closures all skip it (an
evaluation batch) leaves every parameter and the optimizer's state as they were.

Modes: local spawn (the calling process drives forked ranks), or under torchrun, where
process 0 runs the closures beside its own rank and the other processes follow its steps
(:mod:`orgel.transparent.job`).
A model input that requires grad (a trainable pre-processing layer of the closure) gets
its gradient back in the closure's backward, as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from orgel.batching import fingerprint
from orgel.graph.glue_sizes import mark_fixed_ints
from orgel.launch.errors import WorkerError
from orgel.launch.interrupts import finishes_first
from orgel.parameters import Trains, check_trainable, trainable
from orgel.runtime.optimizer import LearningRate, SchedulerFactory, check_loop_options
from orgel.schedule.ir import Plan
from orgel.transparent.finding import FindsGraphs
from orgel.transparent.graph_model import roles_of
from orgel.transparent.job import check_world, follows
from orgel.transparent.running import STOPPED, RunningPipeline
from orgel.transparent.slicing import argument_name, check_cutting, slice_batch
from orgel.worker.engine import OptimizerFactory


class Backend(RunningPipeline, FindsGraphs):
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
        self.pipe: Any = None  # an orgel.explicit.closures.ClosurePipeline once the ranks run
        self._pending_load: str | Path | None = None
        # the graph calls micro-batch 0's forward made on the first step (see _discover)
        self._found: list[tuple[Any, ...]] | None = None
        self._discovering = False
        self._stepping = False  # inside step: graph calls are training (else evaluation)
        self._names: dict[int, str] | None = None  # id -> name in the compiled model
        self._module: torch.nn.Module | None = None  # the compiled module, when one is
        self._built: Trains | None = None  # its trained set and modes, as the graphs were found
        self._autocast: tuple[str, torch.dtype] | None = None  # around the model (1st step)
        from orgel.precision import autocast_dtype

        self._precision = autocast_dtype(precision)  # ValueError for unknown names
        #: float16's initial loss scale (None: no scaling); the first step's search for the
        #: graphs scales by it, every step after by the ranks' (the pipeline's ``scale``)
        self._scale: float | None = None
        if loss_scaling:  # float16 (orgel.precision.loss_scaling)
            options = loss_scaling if isinstance(loss_scaling, dict) else {}
            self._scale = float(options.get("init_scale", 2.0 ** 16))
            # the closures scale their own losses: the ranks' loss stage does not again
            self.loop["loss_scaling"] = loss_scaling

    # -- torch.compile side -------------------------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        mark_fixed_ints(gm)  # a head count equal to a size stays a number
        # sizes left symbolic included (bound when the graphs are joined)
        roles = roles_of(placeholders, example_inputs)
        stateful = any(kind in ("param", "buffer") for kind, _ in roles)

        def run(*args: Any) -> Any:
            if stateful and not self._stepping:
                return self._evaluate_here(gm, args)
            if stateful:
                self._check_autocast()
            if self._discovering:
                return self._record(gm, example_inputs, roles, args)
            if not stateful:  # reads no parameter or buffer: runs here, as the closure does
                return gm(*args)
            if self.pipe is None:
                raise RuntimeError("call the compiled model inside a closure run by "
                                   "pipe.step(...)")
            return self.pipe.graph_call(gm, args)

        return run

    # -- the first step: find the graphs ----------------------------------------------------

    def _start_glued(self) -> None:
        """Plan and start the joined graphs of a compiled model with graph breaks."""
        from orgel.transparent.start import start_glued

        self.pipe = start_glued(self)
        if self._pending_load is not None:
            self.pipe.load(self._pending_load)

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
        if self._discovering:  # the first step's search for the graphs (it stops here)
            return loss * self._scale
        slot = None if self.pipe is None else getattr(self.pipe._local, "slot", None)
        if slot is None:
            raise RuntimeError("call backend.scale(loss) inside a closure run by step(...)")
        slot.scaled = True
        assert self.pipe.scale is not None  # the ranks' scale, read after every call
        return loss * self.pipe.scale

    @finishes_first
    def step(self, closure: Callable[..., Any], *batch: Any) -> list[Any]:
        """Run ``closure`` once per micro-batch of ``batch``; the optimizer steps once after.

        Returns the closure's return values, one per micro-batch in order. Outside
        ``step``, the compiled model evaluates: called under ``torch.no_grad()`` (after
        ``model.eval()`` for eval mode) it runs in this process on the ranks' values.
        """
        if not callable(closure):
            raise TypeError("step(closure, *batch): closure must be callable")
        from orgel.precision import check_around

        check_around("pipe.step", None, trains=True, closures=True)
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
        if self.pipe is None:  # the graphs found here too; the batch trained is process 0's
            pieces, _ = slice_batch(batch, self.microbatches, self.batch_dim, self.replicated,
                                    self.dp)
            self._find_graphs(closure, pieces)
        return self.pipe._follow("step", fingerprint(_arguments(batch), None))

    def _step(self, closure: Callable[..., Any], batch: tuple[Any, ...]) -> list[Any]:
        pieces, rows = slice_batch(batch, self.microbatches, self.batch_dim, self.replicated,
                                   self.dp)
        if self.pipe is None:  # the first step: find the graphs, start the ranks
            self._find_graphs(closure, pieces)
            self._built = None if self._module is None else trainable(self._module)
        elif self._built is not None and self._module is not None:  # as one process would:
            check_trainable(self._module, self._built, "backend")  # the first step's set, mode
        if hasattr(self.pipe, "same_batch"):  # process 0 of a torchrun job: every process's
            self.pipe.same_batch(_arguments(batch), None, "pipe.step")  # batch is this one
        return self.pipe.step_closures(closure, pieces, rows)


def _arguments(batch: tuple[Any, ...]) -> dict[str, Any]:
    """``step``'s batch arguments by name (:func:`argument_name`), as a torchrun job
    compares them."""
    return {argument_name(i): value for i, value in enumerate(batch)}


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
    tensor, a Python number) go whole anyway. Every other tensor argument, and every tensor
    inside an argument that is a dict, list or ``BatchEncoding`` (a Hugging Face batch,
    passed whole: ``pipe.step(closure, batch)`` and ``compiled(**batch)`` in the closure),
    is cut along ``batch_dim``, and all of them must have the same size there (the batch
    size).

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


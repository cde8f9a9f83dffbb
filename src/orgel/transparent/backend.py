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
0's closure up to its backward to find the graphs (:meth:`Backend._discover`),
then captures, plans and starts the ranks once every closure has reached its
model call. A compiled model with graph breaks (several graphs that read
parameters, or one called more than once) is joined and pipelined as
:mod:`orgel.explicit.glued` does for ``orgel.pipeline``; the closures run the Python
between its graphs (:class:`orgel.explicit.glued.ClosurePipeline`). Gradients
accumulate over micro-batches as in gradient accumulation: divide the loss by
``microbatches`` for a batch-mean loss. A closure that never calls
``backward`` contributes no gradient; a step whose closures all skip it (an
evaluation batch) leaves every parameter and the optimizer's state as they were.

Mode: local spawn (the calling process drives forked ranks), see :mod:`orgel.explicit.api`.
The model's inputs must not require grad (run pre-processing under ``no_grad``).
"""

from __future__ import annotations

import keyword
import re
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from orgel import guard
from orgel.graph.dynamo import dynamo_settings
from orgel.guard import untouched
from orgel.launch.processes import under_torchrun
from orgel.precision import device_type
from orgel.runtime.optimizer import LearningRate, SchedulerFactory, check_loop_options
from orgel.schedule.ir import Plan
from orgel.worker.closure import ClosureEngine, OutputsFunction, Slot, profiling_loss
from orgel.worker.engine import OptimizerFactory, RankEngine
from orgel.worker.pipe import canonical_names

_TOKEN = re.compile(r"\.([A-Za-z_]\w*)|\[\'([^\']+)\'\]|\[(\d+)\]")


#: why orgel.backend's pipeline does not evaluate (``Pipeline.evaluate`` raises with it)
NO_EVALUATION = ("orgel.backend runs your closure as a training step; it has no forward-only "
                 "evaluation: evaluate a copy of the model in one process with the values of "
                 "its state_dict(), or use orgel.pipeline, whose pipe.evaluate runs on the ranks")


class GraphModel(torch.nn.Module):
    """The graph TorchDynamo captured, as a module holding the original parameters.

    Parameters and buffers are registered under their names in the user's
    model (taken from dynamo's sources), so orgel's capture, split and
    checkpoints see the original names; ``forward(**inputs)`` calls the graph.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                 roles: list[tuple[str, str]] | None = None,
                 autocast: tuple[str, torch.dtype] | None = None) -> None:
        super().__init__()
        # the autocast the caller ran the graph under: forward re-opens it, so a capture of
        # this module holds the region and every stage re-enters it
        self.autocast = autocast
        # dynamo hands over a lazily compiled GraphModule whose first forward generates
        # its code; dynamo refuses to trace that step, and orgel's capture traces this
        # module again, so generate the code now
        real_recompile = getattr(gm, "real_recompile", None)
        if callable(real_recompile):
            real_recompile()
        self.graph_module = gm
        self.roles: list[tuple[str, str]] = []  # (kind, name) per placeholder, in order
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # dynamo drops the placeholders' sources once the backend returns: pass the roles
        # read while it was compiling (``roles``) to build one later
        if roles is None:
            roles = [_role(node, value) for node, value in zip(placeholders, example_inputs,
                                                               strict=True)]
        for (kind, name), value in zip(roles, example_inputs, strict=True):
            if kind in ("param", "buffer"):
                register_state(self, kind, name, value)
            elif kind == "const":
                self.register_buffer(name, value, persistent=False)
            self.roles.append((kind, name))
        self.input_names = [n for k, n in self.roles if k == "input"]

    def forward(self, **inputs: torch.Tensor) -> Any:
        args = []
        for kind, name in self.roles:
            if kind == "input":
                args.append(inputs[name])
            elif kind == "const":
                args.append(getattr(self, name))
            elif kind == "param":
                args.append(self.get_parameter(name))
            else:
                args.append(self.get_buffer(name))
        if self.autocast is None:
            return self.graph_module(*args)
        with torch.autocast(self.autocast[0], dtype=self.autocast[1]):
            return self.graph_module(*args)


def ambient_autocast() -> tuple[str, torch.dtype] | None:
    """``(device type, dtype)`` of the autocast enabled around this call (None: none)."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def _describe(state: tuple[str, torch.dtype] | None) -> str:
    return "no autocast" if state is None else f"torch.autocast({state[0]!r}, dtype={state[1]})"


def register_state(module: torch.nn.Module, kind: str, name: str, value: torch.Tensor) -> None:
    """Register ``value`` as parameter or buffer ``name`` (dotted) of ``module``."""
    *path, leaf = name.split(".")
    owner: torch.nn.Module = module
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, torch.nn.Module())
        owner = owner._modules[part]  # type: ignore[assignment]
    if kind == "param":
        assert isinstance(value, torch.nn.Parameter)
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value)


def _role(node: torch.fx.Node, value: Any) -> tuple[str, str]:
    """(kind, name) of a dynamo placeholder: param/buffer by original name, input, const."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    text = ""
    if source is not None:
        text = source.name() if callable(source.name) else str(source.name)
    tokens = [a or b or c for a, b, c in _TOKEN.findall(text)]
    if "_parameters" in tokens or isinstance(value, torch.nn.Parameter):
        return "param", ".".join(t for t in tokens[1:] if t not in ("_modules", "_parameters"))
    if "_buffers" in tokens:
        return "buffer", ".".join(t for t in tokens[1:] if t not in ("_modules", "_buffers"))
    if text.startswith("L[") and tokens and isinstance(value, torch.Tensor):
        name = tokens[-1]  # an argument taken as L["args"][0] is named by its position
        plain = name.isidentifier() and not keyword.iskeyword(name)
        return "input", name if plain else f"arg{name}"
    return "const", f"_orgel_const_{node.name}"


class UntrainedWarning(UserWarning):
    """Parameters of a compiled model with graph breaks that no rank trains (see
    :func:`backend`): the Python between its graphs uses them."""


class Backend:
    """A torch.compile backend and the runner of closures over it; see :func:`backend`."""

    def __init__(self, *, ranks: int, microbatches: int, optimizer: OptimizerFactory | None,
                 memory: int | None, dp: int, plan: Plan | str | Path | None,
                 timeout_s: float, threads: int | None, precision: str = "32",
                 scheduler: SchedulerFactory | None = None, lr: LearningRate | None = None,
                 max_grad_norm: float | None = None, accumulate: int = 1,
                 batch_dim: int = 0, replicated: tuple[int, ...] = ()) -> None:
        from orgel.flow.capture import default_optimizer
        from orgel.flow.options import check_options

        check_options(ranks, microbatches, optimizer, memory, dp, plan)
        self.ranks, self.microbatches = ranks, microbatches
        self.optimizer = optimizer or default_optimizer
        check_loop_options(optimizer=self.optimizer, scheduler=scheduler, lr=lr,
                           max_grad_norm=max_grad_norm, accumulate=accumulate)
        #: the ranks' training-loop options (see orgel.runtime.optimizer)
        self.loop: dict[str, Any] = {"scheduler": scheduler, "lr": lr,
                                     "max_grad_norm": max_grad_norm, "accumulate": accumulate}
        self.memory, self.dp, self.given_plan = memory, dp, plan
        self.timeout_s, self.threads = timeout_s, threads
        self.batch_dim = batch_dim
        #: positions of ``step``'s arguments that go whole to every closure
        self.replicated = tuple(replicated)
        self.model: GraphModel | None = None
        self.pipe: Any = None  # an orgel.worker.pipe.Pipeline once the ranks run
        self._conns: list[Any] = []  # controller's end of each rank's pipe
        self._locks = [threading.Lock() for _ in range(ranks)]
        self._input_ranks: list[int] = []
        self._loss_rank = -1
        self._placeholders: dict[str, torch.Tensor] = {}
        self._rows: int | None = None  # the batch size of the model's inputs (placeholders)
        self._local = threading.local()
        self._slots: list[Slot] = []
        self._pending_load: str | Path | None = None
        # the graph calls micro-batch 0's forward made on the first step (see _discover)
        self._found: list[tuple[Any, ...]] | None = None
        self._discovering = False
        self._names: dict[int, str] | None = None  # id -> name in the compiled model
        self._module: torch.nn.Module | None = None  # the compiled module, when one is
        self._autocast: tuple[str, torch.dtype] | None = None  # around the model (1st step)
        from orgel.precision import autocast_dtype, scales_loss

        self._precision = autocast_dtype(precision)  # ValueError for unknown names
        if scales_loss(precision):
            from orgel.flow.options import REFUSED

            raise ValueError(REFUSED[("backend", "precision=16-mixed")])

    # -- torch.compile side -------------------------------------------------------------

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if any(isinstance(v, torch.SymInt) for v in example_inputs):
            raise ValueError("torch.compile traced the model with dynamic shapes; orgel "
                             "pipelines fixed shapes: use torch.compile(model, backend=pipe, "
                             "dynamic=False) and micro-batches of one size")
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        roles = [_role(n, v) for n, v in zip(placeholders, example_inputs, strict=True)]
        stateful = any(kind in ("param", "buffer") for kind, _ in roles)

        def run(*args: Any) -> Any:
            if stateful:
                self._check_autocast()
            if self._discovering:
                return self._record(gm, example_inputs, roles, args)
            if not stateful:  # reads no parameter or buffer: runs here, as the closure does
                return gm(*args)
            from orgel.explicit.glued import ClosurePipeline

            if isinstance(self.pipe, ClosurePipeline):
                return self.pipe._call(gm.code, args)
            if self.model is None:
                raise RuntimeError("call the compiled model inside a closure run by "
                                   "pipe.step(...)")
            if gm.code == self.model.graph_module.code:
                return self._forward(*args)
            from orgel.graph.capture import GraphBreakError

            raise GraphBreakError(
                "torch.compile handed orgel.backend another graph after the first step found "
                "one: the compiled model's input shapes changed, or its forward took another "
                "path. Keep micro-batch shapes fixed")

        return run

    def _check_autocast(self) -> None:
        """The closure's autocast around the model must be the one the first step found.

        Autocast applies around a Dynamo graph (the graph holds no casts): the
        ranks re-create the one the first step ran under (:attr:`GraphModel.autocast`).
        """
        now = ambient_autocast()
        if self._discovering:
            if self._autocast is not None and now != self._autocast:
                raise RuntimeError("the compiled model ran under two different autocasts in "
                                   "one forward; orgel.backend takes one")
            self._autocast = now
        elif now != self._autocast:
            raise RuntimeError(
                f"the compiled model now runs under {_describe(now)} but the first step ran it "
                f"under {_describe(self._autocast)}: the ranks run it as the first step did. "
                "Keep the autocast around the compiled model the same in every closure")

    # -- the first step: find the graphs ----------------------------------------------------

    def _discover(self, closure: Callable[..., Any], args: list[Any]) -> None:
        """Run micro-batch 0's closure up to its backward; record the graphs it calls.

        The graphs run here on detached copies of the parameters and buffers
        (nothing of the caller's changes), and the closure stops where its
        ``backward`` (or ``torch.autograd.grad``) begins, before a gradient reaches a
        parameter (:func:`_stopped_at_backward`).
        One graph that reads parameters is pipelined as is; several are joined
        (:mod:`orgel.graph.glue`) and the closures run the Python between them.
        """
        self._found = []
        self._discovering = True
        try:
            with untouched(), dynamo_settings(), _stopped_at_backward(), \
                    guard.no_autocast_cache():
                closure(*args)
        except _ForwardDone:
            pass
        except BaseException as exc:
            self._found = None
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, ValueError | RuntimeError):
                raise inner from None
            raise
        finally:
            self._discovering = False

    def _record(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                roles: list[tuple[str, str]], args: tuple[Any, ...]) -> Any:
        from orgel.graph.glue import check_grad_mode

        if self._names is None:
            self._module = _compiled_module()
            self._names = {} if self._module is None else canonical_names(self._module)
        # a graph of a resumed frame names the parameters from one of its locals (a
        # submodule on the stack): name them as the compiled model does
        roles = [(kind, self._names.get(id(a), name)) if kind in ("param", "buffer")
                 else (kind, name) for (kind, name), a in zip(roles, args, strict=True)]
        kinds = [kind for kind, _ in roles]
        shadow = [a.detach().requires_grad_(a.requires_grad) if k == "param"
                  else a.detach().clone() if k == "buffer" else a
                  for a, k in zip(args, kinds, strict=True)]
        if "param" in kinds or "buffer" in kinds:
            check_grad_mode(gm, [isinstance(a, torch.Tensor) and a.requires_grad for a in args],
                            "The compiled model has graph breaks.")
        out = gm(*shadow)
        _stop_outputs(out)
        assert self._found is not None
        if "param" in kinds or "buffer" in kinds:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            self._found.append((gm, example_inputs, roles, list(args), outs))
        return out

    def _start_glued(self, rows: int) -> None:
        """Plan and start the joined graphs of a compiled model with graph breaks."""
        from orgel.explicit import glued
        from orgel.flow.capture import resolve_plan, split_for
        from orgel.graph.glue import join_calls
        from orgel.graph.measure import measure
        from orgel.worker.state import model_aliases
        from orgel.workload import Workload

        if under_torchrun():
            raise RuntimeError("orgel.backend runs in local-spawn mode (one process drives "
                               "the ranks); under torchrun use orgel.pipeline")
        assert self._found is not None
        # the caller's parameters and buffers by original name: the compiled module, or
        # (a compiled function) a module holding what its graphs read
        holder = self._module or torch.nn.Module()
        prepared = []
        named: dict[str, int] = {}  # name -> id of the tensor it stands for
        for gm, _, roles, args, outs in self._found:
            given: list[tuple[str, Any] | None] = []
            for (kind, name), a in zip(roles, args, strict=True):
                if kind in ("param", "buffer"):
                    if name not in named:
                        named[name] = id(a)
                        if self._module is None:
                            register_state(holder, kind, name, a)
                    elif named[name] != id(a):
                        # a compiled function: Dynamo names a resumed frame's tensors
                        # after its locals, which can give two tensors one name
                        raise RuntimeError(
                            f"two tensors of the compiled function's graphs are both named "
                            f"{name!r}: compile the module (torch.compile(model, backend=pipe)) "
                            "so that orgel names them as the model does")
                    given.append((kind, name))
                else:  # model inputs and what the Python between graphs made: exchanged
                    given.append(None)
            prepared.append((gm, list(args), outs, given))
        if self._module is not None:
            read = set(named.values())
            outside = [n for n, p in self._module.named_parameters()
                       if p.requires_grad and id(p) not in read]
            if outside:
                warnings.warn(UntrainedWarning(
                    f"orgel.backend does not train {outside[:4]}"
                    f"{' and more' if len(outside) > 4 else ''}: no graph of the compiled "
                    "model reads them (Dynamo ran the code that uses them between its graphs), "
                    "so their .grad accumulates in this process and no rank steps them. Step "
                    "them with an optimizer of your own, or use orgel.pipeline, which trains "
                    "them on a rank"), stacklevel=2)
        reason = (f"torch.compile captured the compiled model as {len(prepared)} graphs that "
                  "read parameters.")
        raw, glue = join_calls(prepared, reason, eager=[])
        workload = Workload(holder, {}, _rows_at(rows, self.batch_dim), profiling_loss,
                            batch_dim=self.batch_dim)
        with untouched(holder):
            graph = measure(holder, {}, raw, [reason], "dynamo")
            graph.glue = glue
            plan = resolve_plan(self.given_plan, workload, graph, self.ranks,
                                     self.microbatches, self.memory, self.dp, planner="beam",
                                     optimizer=self.optimizer)
            split = split_for(workload, graph, plan)
        keys, aliases = model_aliases(holder)
        self.pipe = glued.start(workload, plan, split, glue, optimizer=self.optimizer,
                                timeout_s=self.timeout_s, threads=self.threads, keys=keys,
                                aliases=aliases, closures=True, options=self.loop)
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
        if self.pipe is not None:  # running: the input stages take it now (see closure.py)
            self._feed(slot)
        slot.called.set()
        if not slot.delivered.wait(self._wait_s):
            raise TimeoutError(f"micro-batch {slot.index}'s outputs did not arrive from the loss "
                               f"rank {self._loss_rank} within {self._wait_s:g} s")
        if slot.outputs is None:
            raise RuntimeError("the pipelined step was aborted")
        anchor = torch.zeros((), requires_grad=True)

        def send(grads: list[Any]) -> None:
            self._send_grad(slot, grads)

        return tuple(OutputsFunction.apply(anchor, send, *slot.outputs))

    def _send(self, rank: int, message: tuple[str, int, Any]) -> None:
        with self._locks[rank]:
            self._conns[rank].send(message)

    def _feed(self, slot: Slot) -> None:
        for r in self._input_ranks:
            self._send(r, ("in", slot.index, slot.inputs))

    def _send_grad(self, slot: Slot, grads: list[Any] | None) -> None:
        if slot.grad_sent:
            raise RuntimeError("backward ran twice through the pipelined model in one closure")
        slot.grad_sent = True
        self._send(self._loss_rank, ("grad", slot.index, grads))

    # -- the runner ----------------------------------------------------------------------

    def step(self, closure: Callable[..., Any], *batch: Any) -> list[Any]:
        """Run ``closure`` once per micro-batch of ``batch``; the optimizer steps once after.

        Returns the closure's return values, one per micro-batch in order.
        """
        if not callable(closure):
            raise TypeError("step(closure, *batch): closure must be callable")
        from orgel.explicit.glued import ClosurePipeline

        pieces, rows = _slice(batch, self.microbatches, self.batch_dim, self.replicated)
        if self.pipe is None and self.model is None:  # the first step: find the graphs
            self._discover(closure, pieces[0])
            assert self._found is not None
            if not self._found:
                raise RuntimeError("the closure for micro-batch 0 returned without calling "
                                   "the compiled model (or it reads no parameter); call it "
                                   "once per closure")
            if len(self._found) == 1:
                gm, example_inputs, roles, args, _ = self._found[0]
                around = self._autocast
                if around is None and self._precision is not None:
                    around = (device_type(args), self._precision)
                self.model = GraphModel(gm, example_inputs, roles, around)
            elif self._autocast is not None or self._precision is not None:
                under = (_describe(self._autocast) if self._autocast is not None
                         else "precision='bf16-mixed'")
                raise RuntimeError(
                    f"the compiled model has graph breaks and runs under {under}: "
                    "orgel.backend re-creates such an autocast for one "
                    "graph only. Remove the graph break, or use orgel.pipeline(..., "
                    "precision='bf16-mixed')")
            else:
                self._start_glued(rows)
        if isinstance(self.pipe, ClosurePipeline):
            return self.pipe.step_closures(closure, pieces, rows)
        self._slots = [Slot(m) for m in range(self.microbatches)]
        threads = [threading.Thread(target=self._run_closure, args=(closure, m, pieces[m]),
                                    name=f"orgel-closure{m}", daemon=True)
                   for m in range(self.microbatches)]
        for t in threads:
            t.start()
        try:
            if self.pipe is None:  # first step: every closure's inputs give the graph's batch
                for slot in self._slots:
                    self._await_call(slot)
                self._check_closures()
                self._start()
                for slot in self._slots:
                    self._feed(slot)
            reader = threading.Thread(target=self._read_outputs, daemon=True)
            reader.start()
            try:
                self.pipe.call_ranks("closure_step", self._placeholders, self._rows)
            except Exception:
                for slot in self._slots:
                    slot.called.wait(self._wait_s)
                self._check_closures()  # a closure that failed first is the cause to report
                raise
            reader.join(self._wait_s)
        finally:
            for slot in self._slots:  # release closures still waiting (after an error)
                slot.delivered.set()
            for t in threads:
                t.join(self._wait_s)
        running = [m for m, t in enumerate(threads) if t.is_alive()]
        if running:
            raise TimeoutError(f"the closures of micro-batches {running} have not returned "
                               f"{self._wait_s:g} s after the pipelined step ended; a closure "
                               "must not wait on anything after its backward")
        self._check_closures()
        self.pipe.called()
        return [s.result for s in self._slots]

    @property
    def _wait_s(self) -> float:
        """How long the runner waits for a closure, or for outputs from the ranks."""
        return self.timeout_s

    def _await_call(self, slot: Slot) -> None:
        """Wait until the closure of ``slot`` called the compiled model (or ended)."""
        if not slot.called.wait(self._wait_s):
            raise TimeoutError(f"the closure for micro-batch {slot.index} neither called the "
                               f"compiled model nor returned within {self._wait_s:g} s; call "
                               "the model once per closure")

    def _check_closures(self) -> None:
        for slot in self._slots:
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

    def _run_closure(self, closure: Callable[..., Any], m: int, args: list[Any]) -> None:
        self._local.microbatch = m
        slot = self._slots[m]
        try:
            # thread-local: the closure compiles the model here, without the autocast cache
            with dynamo_settings(), guard.no_autocast_cache():
                slot.result = closure(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by step()
            slot.error = exc
        finally:
            slot.done = True
            slot.called.set()
            if slot.error is None and slot.inputs is not None and not slot.grad_sent:
                self._send_grad(slot, None)  # no backward: no gradient from this micro-batch
            elif self.pipe is not None and (slot.error is not None or slot.inputs is None):
                self.pipe.kill()  # the ranks wait on this closure: stop them

    def _read_outputs(self) -> None:
        for _ in range(self.microbatches):
            try:
                kind, m, outputs = self._conns[self._loss_rank].recv()
            except (EOFError, OSError):
                return
            slot = self._slots[m]
            slot.outputs = outputs
            slot.delivered.set()

    def _start(self) -> None:
        import multiprocessing as mp

        from orgel.batching import batch_rows
        from orgel.flow.capture import capture_microbatch, resolve_plan, split_for
        from orgel.flow.start import check_param_groups
        from orgel.launch.processes import LocalGroup
        from orgel.worker.pipe import Pipeline
        from orgel.worker.state import model_aliases
        from orgel.workload import Workload

        if self.model is None:
            raise RuntimeError("the compiled model was never called")
        if under_torchrun():
            raise RuntimeError("orgel.backend runs in local-spawn mode (one process drives "
                               "the ranks); under torchrun use orgel.pipeline")
        first = self._slots[0].inputs
        assert first is not None
        dim = self.batch_dim
        given = [s.inputs for s in self._slots]
        shared = _shared_inputs(given)  # e.g. a replicated argument the closure passes on
        whole = tuple(n for n, t in first.items() if n in shared or t.dim() <= dim)
        batch = {n: first[n] if n in whole
                 else torch.cat([g[n] for g in given], dim)  # type: ignore[index]
                 for n in first}
        rows = batch_rows(batch, None, dim, whole)
        self._rows = rows
        workload = Workload(self.model, batch, _rows_at(rows, dim), profiling_loss,
                            batch_dim=dim, replicated=whole)
        with untouched(self.model):
            graph = capture_microbatch(workload, self.microbatches)
            # dynamo's graph has the micro-batch's shapes baked in and the user's model is
            # not ours to re-trace per replica: plan chains of one rank per stage (beam)
            plan = resolve_plan(self.given_plan, workload, graph, self.ranks,
                                     self.microbatches, self.memory, self.dp, planner="beam",
                                     optimizer=self.optimizer)
            if any(len(r) > 1 for r in plan.placement):
                raise ValueError("orgel.backend runs stages on one rank each; give a plan "
                                 "without data-parallel stages")
            split = split_for(workload, graph, plan)
        self._loss_rank = plan.placement[split.loss_stage][0]
        self._input_ranks = sorted({plan.placement[s][0] for s, st in enumerate(split.stages)
                                    if st.model_inputs})
        # shapes only: a 1-element storage expanded, cheap to send every step
        self._placeholders = {n: torch.zeros((), dtype=t.dtype).expand(t.shape)
                              for n, t in batch.items()}
        ctx = mp.get_context("fork")
        pipes = [ctx.Pipe() for _ in range(self.ranks)]
        self._conns = [here for here, _ in pipes]

        def make_engine(rank: int) -> RankEngine:
            return ClosureEngine(rank, plan, split, optimizer=self.optimizer,
                                 conn=pipes[rank][1], timeout_s=self.timeout_s,
                                 options={**self.loop, "replicated": whole},
                                 batch_dim=self.batch_dim)

        group = LocalGroup(self.ranks, make_engine, timeout_s=self.timeout_s,
                           threads=self.threads)
        # names and tensors no graph reads (tied aliases, an unused pooler) come from the
        # compiled module, when there is one
        owner = self._module or self.model
        keys, aliases = model_aliases(owner)
        self.pipe = Pipeline(plan, group, model=owner,
                                 loss_ranks=[self._loss_rank], state_keys=keys, aliases=aliases,
                                 spmd=False, accumulate=self.loop["accumulate"],
                                 evaluation=NO_EVALUATION)
        check_param_groups(self.pipe)
        if self._pending_load is not None:
            self.pipe.load(self._pending_load)

    # -- the rest of the Pipeline API, once running ------------------------------------------

    @property
    def plan(self) -> Plan:
        return self._running().plan

    @property
    def steps(self) -> int:
        """Optimizer steps taken (one per ``accumulate`` step calls)."""
        return int(self._running().steps)

    @property
    def lr(self) -> list[float]:
        """The learning rates in force for the next optimizer step, one per param group."""
        return list(self._running().lr)

    @property
    def grad_norm(self) -> float | None:
        """The last optimizer step's global gradient norm before clipping (see Pipeline)."""
        norm = self._running().grad_norm
        return None if norm is None else float(norm)

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
            if (self.given_plan is None and int(meta["num_ranks"]) == self.ranks
                    and saved.microbatches == self.microbatches):
                self.given_plan = saved  # same layout: resume exactly where it stopped
            self._pending_load = directory
            return None
        return int(self.pipe.load(directory))

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: raises RuntimeError saying what to do instead (:data:`NO_EVALUATION`)."""
        raise RuntimeError(f"evaluation is not available: {NO_EVALUATION}")

    def timeline(self) -> list[Any]:
        """Measured events of the last step, all ranks (orgel.runtime.trace.Event)."""
        return list(self._running().timeline())

    def close(self) -> None:
        """Stop the ranks."""
        if self.pipe is not None:
            self.pipe.close()

    def _running(self) -> Any:
        if self.pipe is None:
            raise RuntimeError("the pipeline starts on the first pipe.step(closure, ...)")
        return self.pipe


class _ForwardDone(BaseException):
    """Raised where the closure run by :meth:`Backend._discover` calls backward."""


def _stopped_at_backward() -> torch.autograd.graph.saved_tensors_hooks:
    """A backward of what the body computes raises :class:`_ForwardDone` when it begins.

    Autograd's saved-tensor hooks, on this thread only while the body runs (nothing of
    torch is replaced: the closure calls the real ``backward`` and
    ``torch.autograd.grad``): every tensor an operation saves for its backward comes
    back only through :func:`_stop`, so the backward stops at the first node that
    reads one, the loss's own in practice, before a gradient reaches a leaf. The
    graphs' outputs stop it as well (:func:`_stop_outputs`), so a backward whose
    first nodes save nothing stops at the model at the latest; a leaf of the
    closure's own that such a chain reaches first (``(out.sum() + w.sum()).backward()``)
    would get its ``.grad``.
    """
    return torch.autograd.graph.saved_tensors_hooks(_pack, _stop)


def _pack(t: torch.Tensor) -> torch.Tensor:
    # detached: a packed output holding its own grad_fn would never be freed
    return t.detach()


def _stop(_packed: Any) -> torch.Tensor:
    raise _ForwardDone


def _stop_outputs(out: Any) -> None:
    """Make a backward that reaches the graph's outputs ``out`` raise :class:`_ForwardDone`."""
    for t in out if isinstance(out, (tuple, list)) else [out]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(_stop)


def _compiled_module() -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped, found on the calling frames (None: a function).

    The compiled model's call runs through ``torch.compile``'s module wrapper
    (``OptimizedModule``), which holds the caller's module.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, OptimizedModule):
                return value._orig_mod  # type: ignore[no-any-return]
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _slice(batch: tuple[Any, ...], m: int, dim: int = 0, replicated: tuple[int, ...] = ()
           ) -> tuple[list[list[Any]], int]:
    """``step``'s arguments cut into ``m`` micro-batches, and the batch size.

    The workload's one rule (:func:`orgel.batching.split_microbatches`): along ``dim``,
    what has the batch size is cut; the arguments at the positions ``replicated`` and
    those without the dimension go whole to every micro-batch. With nothing to cut,
    every closure gets the arguments whole and the batch size is ``m``.
    """
    from orgel.batching import batch_rows, split_microbatches
    from orgel.workload import WorkloadError

    beyond = [i for i in replicated if i >= len(batch)]
    if beyond:
        raise ValueError(f"orgel.backend(replicated={list(replicated)}) names argument "
                         f"positions {beyond} but step got {len(batch)} batch arguments "
                         "(positions count from 0 after the closure)")
    named = {_argument(i): arg for i, arg in enumerate(batch)}
    whole = tuple(_argument(i) for i in replicated)
    if not any(isinstance(a, torch.Tensor) and a.dim() > dim
               for i, a in enumerate(batch) if i not in replicated):
        return [list(batch) for _ in range(m)], m
    try:
        rows = batch_rows(named, None, dim, whole)
        parts = split_microbatches(named, None, m, dim, whole)
    except WorkloadError as exc:
        raise WorkloadError(
            f"{exc}. For orgel.backend the inputs are step's arguments by position "
            "('argument i' counts from 0 after the closure): name the ones that go whole "
            "to every closure in orgel.backend(..., replicated=[i, ...])") from None
    return [list(part.values()) for part, _ in parts], rows


def _shared_inputs(given: list[dict[str, torch.Tensor] | None]) -> tuple[str, ...]:
    """The model inputs every micro-batch's closure passed as the same tensor (same memory,
    shape and strides): not batched, such as a ``replicated`` argument passed on whole."""
    first = given[0]
    if first is None or len(given) < 2:
        return ()

    def where(t: torch.Tensor) -> tuple[Any, ...]:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())

    return tuple(n for n, t in first.items()
                 if all(g is not None and where(g[n]) == where(t) for g in given[1:]))


def _argument(i: int) -> str:
    """How :func:`_slice` names ``step``'s argument at position ``i`` (0 after the closure)."""
    return f"argument {i}"


def _rows_at(rows: int, dim: int) -> torch.Tensor:
    """Placeholder targets with ``rows`` along the batch dimension ``dim``."""
    return torch.zeros((1,) * dim + (rows,))


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
    around it would (the closure's own loss is the closure's). ``scheduler``, ``lr``,
    ``max_grad_norm`` and ``accumulate`` as in :func:`orgel.pipeline`; with
    ``accumulate=k`` the closures' gradients count ``1/k`` (as ``(loss / k).backward()``)
    and the optimizer steps on every k-th ``step``.
    around it would (the closure's own loss is the closure's). ``batch_dim``: the
    dimension ``step``'s tensor arguments are cut into micro-batches along (one int:
    ``step`` takes positional arguments; 1 for sequence-first ``[T, B]`` data).
    ``orgel.pipeline``'s other options (``tp``, ``shard``, ``device``, ``init``,
    ``weights``, ``compile``, ...) are refused with the reason
    (:data:`orgel.flow.options.REFUSED`), as is ``dp`` above 1.
    ``replicated``: positions of ``step``'s batch arguments (0 is the first after the
    closure) that every closure gets whole, such as class weights ``[C]`` whose size
    happens to be the batch size; arguments without the batch dimension (a 0-dim
    tensor, a Python number) go whole anyway. Every other tensor argument is cut along
    ``batch_dim``, and all of them must have the same size there (the batch size).
    """
    from orgel.flow.options import options, refuse

    options(**others)  # a misspelt name: TypeError with the names that exist
    refuse("backend", {**others, "dp": dp, "precision": precision})
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ValueError(f"batch_dim must be a non-negative int for orgel.backend (step takes "
                         f"positional arguments), got {batch_dim!r}")
    positions = list(replicated) if isinstance(replicated, (list, tuple)) else None
    if positions is None or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                for i in positions):
        raise ValueError(f"replicated must be a list of step's argument positions (ints >= 0, "
                         f"0 is the first argument after the closure), got {replicated!r}")
    return Backend(ranks=ranks, microbatches=microbatches, optimizer=optimizer, memory=memory,
                   dp=dp, plan=plan, timeout_s=timeout_s, threads=threads, precision=precision,
                   scheduler=scheduler, lr=lr, max_grad_norm=max_grad_norm,
                   accumulate=accumulate, batch_dim=batch_dim, replicated=tuple(positions))

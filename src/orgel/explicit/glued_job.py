"""A forward of several graphs (graph breaks) under torchrun: the controller in process 0.

In local-spawn mode the calling process is the controller (:mod:`orgel.explicit.glued`)
and the ranks are processes it forks. Under torchrun every process runs the script, so
process 0 takes both parts: its main thread is the controller (the Python between the
graphs, ``loss_fn``, the backward's glue), and its rank's engine runs in a thread of its
own beside it. Every other process is a *follower*: its pipeline's methods serve the
controller's commands on its rank's engine until process 0's call of the same method
returns, and then return what it returned.

The controller reaches the ranks as it does local ones, over connection objects: a pipe
inside process 0 to its own rank, and two TCP connections (:mod:`multiprocessing.connection`,
authenticated with a key process 0 broadcasts over the job's process group) to every other
process, one for the commands (:class:`JobGroup`) and one for the exchanges' messages.
The ranks' own messages (activations, gradient sums) go over the job's process group as
in every other plan.

Call the pipeline's methods on every process, in the same order (as every torchrun
pipeline asks); a follower that calls another method than process 0 is told so.
Process 0's batch is the one trained: pass the same batch on every process (process 0
compares every follower's with its own before a step or an evaluation begins, and refuses a
difference on every process: :meth:`Leads.same_batch`).
"""

from __future__ import annotations

import pickle
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orgel.batching import Targets, check_same_everywhere, fingerprint
from orgel.explicit.closures import ClosurePipeline
from orgel.explicit.glued import GluedPipeline
from orgel.explicit.mailbox import connect, pipe_here
from orgel.launch.errors import StepError, WorkerError
from orgel.launch.processes import LocalGroup, serve
from orgel.worker.pipe import Pipeline

#: what a follower's pipeline takes over from process 0's after each call
SHARED = ("steps", "pending", "calls", "off_path")


def start_job(workload: Any, plan: Any, split: Any, glue: Any, *, optimizer: Any,
              timeout_s: float, keys: list[str], aliases: dict[str, str],
              options: dict[str, Any] | None, closures: bool = False) -> Pipeline:
    """This process's part of a torchrun job training a forward of several graphs: the
    controller's pipeline on process 0, a :class:`Follower` on every other process.

    ``closures``: ``orgel.backend``'s closures are the controller (:class:`LeadingClosures`).
    """
    import torch.distributed as dist

    from orgel.explicit.glued_start import controller, engine_maker
    from orgel.worker.state import own_stage_copies

    process, world = dist.get_rank(), dist.get_world_size()
    if world != plan.world_size:
        raise ValueError(f"the plan has {plan.world_size} processes ({plan.num_ranks} ranks of "
                         f"tp={plan.tp}) but torchrun started {world}")
    make = engine_maker(workload, plan, split, glue, optimizer=optimizer, timeout_s=timeout_s,
                        options=options, closures=closures)
    # the stages train copies: the caller's model changes only through pipe.copy_to
    own_stage_copies(split.stages[s].module
                     for s in plan.stages_on(plan.pipeline_rank_of(process)))
    group, mine = job_group(make, timeout_s)
    if group is None:
        return Follower(*mine, plan=plan, model=workload.model, keys=keys, aliases=aliases,
                        timeout_s=timeout_s)
    pipe = controller(LeadingClosures if closures else Leading, workload, plan, split, glue,
                      group, group.exchanges,
                      timeout_s=timeout_s, keys=keys, aliases=aliases, options=options)
    from orgel.flow.start import check_param_groups

    check_param_groups(pipe)
    return pipe


def job_group(make: Callable[[int, Any], Any], timeout_s: float
              ) -> tuple[JobGroup | None, tuple[Any, Any]]:
    """This process's rank of the torchrun job, its engine ``make(process, exchanges)``.

    On process 0: the :class:`JobGroup` that drives every rank (its own engine answering
    in a thread of this process) and ``(None, None)``; on any other: ``None`` and
    ``(engine, commands)``, the engine and its connection for process 0's commands (for a
    :class:`Follower`).
    """
    import torch.distributed as dist

    commands, exchanges = connect(timeout_s)
    if dist.get_rank() != 0:
        return None, (make(dist.get_rank(), exchanges[0]), commands[0])
    own_commands, own_exchanges = pipe_here(), pipe_here()
    engine = make(0, own_exchanges[1])  # in the main thread: groups are made in one order
    thread = threading.Thread(target=_serve_here, args=(engine, own_commands[1]),
                              name="orgel-rank0", daemon=True)
    thread.start()
    group = JobGroup([own_commands[0], *commands[1:]], [own_exchanges[0], *exchanges[1:]],
                     thread, timeout_s=timeout_s)
    return group, (None, None)


def _serve_here(engine: Any, conn: Any) -> None:
    """Process 0's rank: its engine answers the controller's commands in this thread."""
    from orgel.graph import glue

    try:
        serve(engine, conn)
    finally:
        glue.set_runtime(None)  # the exchanges of a later capture here record, as before


# -- process 0: the ranks' commands, and the calls the followers wait for --------------------

class JobGroup(LocalGroup):
    """The torchrun job's ranks as the controller drives them: :class:`LocalGroup`'s
    commands and failure reports, over the connections of :func:`connect` (rank 0 a
    thread of this process)."""

    def __init__(self, commands: list[Any], exchanges: list[Any], thread: threading.Thread, *,
                 timeout_s: float) -> None:
        self.num_ranks = len(commands)
        self.timeout_s = timeout_s
        self._conns = commands
        self.exchanges = exchanges
        self._procs: list[Any] = []
        self.closed = False
        self._thread = thread
        closing = (commands, exchanges, timeout_s)  # LocalGroup's finalizer, of other arguments
        self._finalizer = weakref.finalize(self, _close_all, *closing)  # type: ignore[arg-type,call-arg]

    def _watched(self, ranks: Any) -> dict[Any, int]:
        return {}  # a connection closes when its process ends: the pipes say it all

    def _death(self, rank: int, what: str) -> str:
        return (f"closed its connection to process 0 during {what} (its process ended; "
                "torchrun's log holds its error)")

    def kill(self, why: str = "process 0's own output holds its error") -> None:
        """Stop every rank: tell the followers why, then close every connection."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        for conn in self._conns[1:]:
            try:
                conn.send(("__stop__", why))
            except OSError:
                pass
        for conn in [*self._conns, *self.exchanges]:
            conn.close()
        # this process's rank (a thread) now finds its connections closed and ends its step
        # with the others; meet it, so that no exit of this process finds it inside a
        # collective (gloo's threads then abort the process: "terminate called without an
        # active exception")
        if threading.current_thread() is not self._thread:
            self._thread.join(self.timeout_s)

    def close(self) -> None:
        """Ask every rank to end (the followers' ``close`` returns), then meet them."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        _close_all(self._conns, self.exchanges, self.timeout_s)
        self._thread.join(self.timeout_s)
        import gc

        import torch.distributed as dist

        dist.barrier()  # the next pipeline in these processes starts together
        gc.collect()  # what this rank's engine held (its thread has ended) is freed now

    def batches(self, call: str, mine: Any) -> list[Any]:
        """Every process's fingerprint of the batch it passed to ``call`` (``mine``: process
        0's), asked of the followers (:meth:`Follower._follow` answers). A follower inside
        another call, or gone, counts as equal here: the call's end tells it."""
        self.tell(("__batch__",))
        found = [mine]
        for conn in self._conns[1:]:
            try:
                kind, theirs, value = conn.recv() if conn.poll(self.timeout_s) else ("", "", 0)
            except (EOFError, OSError):
                kind, theirs, value = "", "", 0
            found.append(value if (kind, theirs) == ("batch", call) else mine)
        return found

    def tell(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` to every follower (one that is gone hears nothing)."""
        for conn in self._conns[1:]:
            try:
                conn.send(message)
            except OSError:
                pass


def _close_all(commands: list[Any], exchanges: list[Any], timeout_s: float) -> None:
    for conn in commands:
        try:
            conn.send(("__close__", (), {}))
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    for conn in commands:
        try:
            if conn.poll(max(0.0, deadline - time.monotonic())):
                conn.recv()
        except (EOFError, OSError):
            pass
    for conn in [*commands, *exchanges]:
        conn.close()


def _portable(exc: BaseException) -> tuple[str, Any]:
    """``exc`` in a form a follower can raise again."""
    if isinstance(exc, WorkerError):
        return ("step" if isinstance(exc, StepError) else "worker", (str(exc), exc.rank))
    try:
        return ("pickled", pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its words
        return ("words", f"{type(exc).__name__}: {exc}")


def _again(form: tuple[str, Any]) -> BaseException:
    kind, value = form
    if kind == "step":
        return StepError(*value)
    if kind == "worker":
        return WorkerError(*value)
    if kind == "pickled":
        return pickle.loads(value)  # noqa: S301 - process 0 of this job made it
    return RuntimeError(value)


class Leads(Pipeline):
    """Process 0's pipeline (a base placed before another Pipeline class): every method
    that the followers call too ends by sending them its result (or its error), and the
    counters in :attr:`shared`."""

    _ranks: JobGroup
    _depth = 0  # the calls in progress: one made inside another is not told
    shared: tuple[str, ...] = ("steps", "pending")

    def _lead(self, name: str, call: Callable[[], Any],
              payload: Callable[[Any], Any] | None = None) -> Any:
        if self._depth:
            return call()
        self._depth += 1
        try:
            value = call()
        except BaseException as exc:
            self.told(name, exc)
            raise
        finally:
            self._depth -= 1
        self.told(name, value if payload is None else payload(value))
        return value

    def told(self, name: str, outcome: Any) -> None:
        """Tell the followers that process 0's ``name`` returned ``outcome`` (or raised it,
        an exception)."""
        if isinstance(outcome, BaseException):
            if not self._ranks.closed:
                self._ranks.tell(("__raise__", name, _portable(outcome), self._shared()))
            return
        self._ranks.tell(("__return__", name, outcome, self._shared()))

    def _shared(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.shared}

    def same_batch(self, inputs: dict[str, Any], targets: Targets, call: str) -> None:
        """Refuse (ValueError, raised by every follower too) a batch some follower passed to
        ``call`` that is not this process's: process 0's batch is the one trained, and a
        batch per process (a DistributedSampler's shard) would train on one process's."""
        check_same_everywhere(lambda mine: self._ranks.batches(call, mine), inputs, targets,
                              call)

    def _check_batch(self, named: dict[str, Any], targets: Any, call: str) -> None:
        super()._check_batch(named, targets, call)
        self.same_batch(named, targets, call)

    def step(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        return self._lead("step", lambda: super(Leads, self).step(inputs, targets,
                                                                     outputs=outputs))

    def evaluate(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        return self._lead("evaluate", lambda: super(Leads, self).evaluate(
            inputs, targets, outputs=outputs))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._lead("state_dict", lambda: super(Leads, self).state_dict())

    def load_state_dict(self, state: Any, strict: bool = True) -> Any:
        return self._lead("load_state_dict",
                          lambda: super(Leads, self).load_state_dict(state, strict))

    def copy_to(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        return self._lead("copy_to", lambda: super(Leads, self).copy_to(model),
                          lambda done: done.state_dict())

    def save(self, directory: str | Path, *, keep: int | None = None) -> Path:
        return self._lead("save", lambda: super(Leads, self).save(directory, keep=keep))

    def load(self, directory: str | Path) -> int:
        return self._lead("load", lambda: super(Leads, self).load(directory))

    def timeline(self) -> list[Any]:
        return self._lead("timeline", lambda: super(Leads, self).timeline())

    @property
    def lr(self) -> list[float]:
        return self._lead("lr", lambda: super(Leads, self).lr)

    @property
    def grad_norm(self) -> float | None:
        return self._lead("grad_norm", lambda: super(Leads, self).grad_norm)

    @property
    def loss_scale(self) -> dict[str, Any] | None:
        return self._lead("loss_scale", lambda: super(Leads, self).loss_scale)

    @property
    def compile_s(self) -> list[float]:
        return self._lead("compile_s", lambda: super(Leads, self).compile_s)


class Leading(Leads, GluedPipeline):
    """Process 0's controller of a forward of several graphs (graph breaks) under torchrun."""

    shared = SHARED


class LeadingClosures(Leads, ClosurePipeline):
    """Process 0's ``orgel.backend`` closures for a compiled model with graph breaks."""

    shared = SHARED


# -- every other process ----------------------------------------------------------------------

class Follower(Pipeline):
    """The pipeline on a process other than 0 of a torchrun job with graph breaks.

    Each method serves process 0's commands on this process's rank until process 0's
    same call ends, and returns what it returned (the step's loss, the gathered state,
    the checkpoint's folder) or raises its error; ``copy_to`` writes the values into this
    process's model. ``steps`` and the other counters follow process 0's.
    """

    def __init__(self, engine: Any, conn: Any, *, plan: Any, model: torch.nn.Module,
                 keys: list[str], aliases: dict[str, str], timeout_s: float) -> None:
        super().__init__(plan, None, model=model, loss_ranks=[0], state_keys=keys,
                         aliases=aliases, spmd=False)
        self._engine = engine  # None once closed
        self._conn = conn
        self._timeout_s = timeout_s
        self.calls = 0
        self.off_path: list[int] = []

    @property
    def closed(self) -> bool:
        return self._engine is None

    def _follow(self, name: str, batch: Any = None) -> Any:
        """Serve until process 0's ``name`` ends; what it returned. ``batch``: the
        fingerprint of the batch this process passed (process 0 asks for it)."""
        from orgel.graph import glue

        if self.closed:
            raise WorkerError("the pipeline is closed; create a new pipeline", -1)
        while True:
            try:
                message = serve(self._engine, self._conn, idle_s=self._timeout_s)
            except TimeoutError as exc:
                raise WorkerError(f"process 0 gave this process no work within "
                                  f"{self._timeout_s:g} s of pipe.{name}: call the pipeline's "
                                  "methods on every process, in the same order", 0) from exc
            if message[0] != "__batch__":
                break
            self._conn.send(("batch", f"pipe.{name}", batch))
        kind = message[0]
        if kind in ("__return__", "__raise__"):
            got, value, shared = message[1:]
            for k, v in shared.items():
                setattr(self, k, v)
            if got != name:
                raise RuntimeError(f"this process called pipe.{name} where process 0 called "
                                   f"pipe.{got}: call the pipeline's methods on every process, "
                                   "in the same order")
            if kind == "__raise__":
                raise _again(value)
            return value
        self._engine = None  # closed: its stages, optimizer and messages go (gloo's too)
        glue.set_runtime(None)
        if kind == "__close__":
            if name == "close":
                return None
            raise WorkerError(f"process 0 closed the pipeline while this process called "
                              f"pipe.{name}", 0)
        why = message[1] if kind == "__stop__" else "its connection to this process closed"
        raise WorkerError(f"process 0 stopped the pipeline during pipe.{name} ({why})", 0)

    def step(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        """Process 0's step (its batch is the one trained, and must be this one); its loss."""
        return self._follow("step", self._fingerprint(inputs, targets))

    def evaluate(self, inputs: Any, targets: Any = None, *, outputs: bool = False) -> Any:
        return self._follow("evaluate", self._fingerprint(inputs, targets))

    def _fingerprint(self, inputs: Any, targets: Any) -> Any:
        """This batch as process 0 fingerprints its own (:meth:`Leads.same_batch`)."""
        from orgel.workload import named_inputs

        try:
            return fingerprint(named_inputs(self._model, inputs), targets)
        except Exception as exc:  # noqa: BLE001 - a batch process 0's differs from anyway
            return [(f"a batch that cannot be read ({type(exc).__name__})", (), "", 0.0)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._follow("state_dict"))

    def load_state_dict(self, state: Any, strict: bool = True) -> Any:
        return self._follow("load_state_dict")

    def copy_to(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        return self._write_into(model, self._follow("copy_to"))

    def save(self, directory: str | Path, *, keep: int | None = None) -> Path:
        from orgel.runtime.checkpoint import CheckpointError

        folder = Path(self._follow("save"))
        if folder.parent.resolve() != Path(directory).resolve():
            raise CheckpointError(f"this process saved into {directory} but process 0 into "
                                  f"{folder.parent}, where the checkpoint was written: name "
                                  "the same folder on every process")
        return folder

    def load(self, directory: str | Path) -> int:
        return int(self._follow("load"))

    def timeline(self) -> list[Any]:
        return list(self._follow("timeline"))

    @property
    def lr(self) -> list[float]:
        return list(self._follow("lr"))

    @property
    def grad_norm(self) -> float | None:
        return self._follow("grad_norm")  # type: ignore[no-any-return]

    @property
    def loss_scale(self) -> dict[str, Any] | None:
        return self._follow("loss_scale")  # type: ignore[no-any-return]

    @property
    def compile_s(self) -> list[float]:
        return list(self._follow("compile_s"))

    def call_ranks(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        raise RuntimeError("only process 0 drives the ranks of a forward of several graphs")

    def kill(self) -> None:
        self._engine = None
        self._conn.close()

    def close(self) -> None:
        """Serve until process 0 closes the pipeline; then meet every process."""
        import gc

        import torch.distributed as dist

        if self.closed:
            return
        self._follow("close")
        self._conn.close()
        dist.barrier()
        gc.collect()  # the engine's objects refer to each other: freed now

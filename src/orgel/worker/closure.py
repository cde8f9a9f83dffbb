"""The two ends of the bridge between a user's closure and the pipelined model.

The closure runs in the controller; the pipelined model runs on the ranks.
For micro-batch ``m`` the rank that computes the model's outputs (the *loss
stage*) hands them to the closure, and the closure hands back their gradient:

```
controller, closure m            input-stage rank(s)       loss-stage rank
  model(x) ──"in", m, inputs──▶  F ... ─────────────────▶  loss stage ──"out", m, outputs──┐
  ◀── outputs (autograd leaf) ─────────────────────────────────────────┘
  loss = criterion(outputs, y)
  loss.backward() ── "grad", m, d loss/d outputs ──▶ surrogate loss ──▶ B ...
```

An input stage's first forward of ``m`` waits for ``"in", m`` (the executor's
``fetch_inputs`` hook), so the ranks start on early micro-batches while
later closures are still pre-processing. On the loss-stage rank the
executor's ``loss_fn`` is a :class:`SurrogateLoss`: it ships
the outputs, waits for their gradient ``g`` and returns ``sum(outputs * g)``
times the executor's loss divisor, whose gradient with respect to the outputs
is exactly ``g``. The pipeline's backward then runs as if the closure's loss
had been computed on the rank. A closure that never calls ``backward`` sends
no gradient: its surrogate loss does not require one, and a step in which no
micro-batch's loss had a gradient leaves every ``.grad`` None, so the optimizer
changes nothing (as ``opt.step()`` after no backward in one process). In the
controller, :class:`orgel.explicit.slots.GraphCall` makes the received outputs part of the
closure's autograd graph and sends their gradient when the closure calls ``backward``
(:mod:`orgel.explicit.routes`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.batching import batch_size
from orgel.graph import glue
from orgel.launch.messages import BY_VALUE_BYTES, Held, fingerprint, send
from orgel.runtime.pieces import piece_of
from orgel.runtime.sharding import shard_like
from orgel.split.exchanges import exchange_stages, home_rank, homed_on
from orgel.worker.engine import RankEngine


class ClosureFailed(RuntimeError):
    """The controller's closure raised in this step; every rank drops the step."""


class RankInbox:
    """A rank's end of its pipe to the controller: messages ``(kind, m, payload)``.

    A rank that hosts both an input stage and the loss stage receives model
    inputs (``"in"``) and output gradients (``"grad"``) on one pipe, in
    whatever order the closures produce them; :meth:`get` keeps the others.
    A ``"v_fetch"`` it answers at once, from whichever :meth:`get` reads it: the
    controller asks mid-step, and every rank reads its pipe at least once more
    before the step ends (the controller's gradients, ``"p_grad"``).
    """

    def __init__(self, conn: Connection, timeout_s: float | None = None) -> None:
        self.conn = conn
        #: how long :meth:`get` waits for the controller (a closure that hangs there)
        self.timeout_s = timeout_s
        #: answers the controller's ``"v_fetch"`` (the values of this rank's parameters and
        #: buffers, by name) while :meth:`get` waits for anything; None: no such question
        self.serve: Callable[[], dict[str, Any]] | None = None
        #: this process's tensor-parallel member of its rank: every member answers
        #: ``"v_fetch"`` with its own part, under a key that names it
        self.member = 0
        #: the controller's ``"fail"`` of this step: a closure raised (its words)
        self.failed: str | None = None
        self._kept: dict[tuple[str, Any], Any] = {}
        #: outputs kept here until the controller reads them (:meth:`offer`), by token
        self._held: dict[int, torch.Tensor] = {}
        self._tokens = itertools.count()
        #: whether a held output goes with its fingerprint: ``orgel.backend``'s controller
        #: may compute the graph again and check it (a float32 pass over the output)
        self.fingerprints = False

    def begin(self) -> None:
        """A new step: nothing of the last one is kept (it was read up to its ``"end"``)."""
        self.failed = None
        self._kept.clear()
        self._held.clear()

    def offer(self, value: torch.Tensor) -> torch.Tensor | Held:
        """``value`` as an output goes to the controller: itself, or where it is larger than
        what a message carries by value, a :class:`Held` in its place, the value kept here
        until the controller reads it (``"o_fetch"``) or drops it (``"o_free"``), at
        the latest until the next step (:mod:`orgel.explicit.lazy`)."""
        value = value.detach()
        if value.nbytes <= BY_VALUE_BYTES:
            return value.cpu()
        token = next(self._tokens)
        self._held[token] = value
        return Held(token, tuple(value.shape), value.dtype,
                    fingerprint(value) if self.fingerprints else None)

    def send(self, message: tuple[str, Any, Any]) -> None:
        send(self.conn, message)  # small tensors by value (orgel.launch.messages)

    def get(self, kind: str, m: Any) -> Any:
        """The payload of message ``(kind, m)``, waiting for it (at most ``timeout_s``).

        :class:`ClosureFailed` once the controller said a closure of this step raised
        (the step's ``"end"`` is still read)."""
        while (kind, m) not in self._kept:
            if self.failed is not None and kind != "end":
                raise ClosureFailed(self.failed)
            if self.timeout_s is not None and not self.conn.poll(self.timeout_s):
                what = "inputs" if kind == "in" else "output gradients" if kind == "grad" else kind
                raise TimeoutError(f"waited {self.timeout_s:g} s for the {what} of micro-batch "
                                   f"{m} from the controller's closure, which neither sent "
                                   "them nor failed")
            got_kind, got_m, payload = self.conn.recv()
            if got_kind == "o_fetch":  # (None: a value of a step that ended)
                held = self._held.pop(got_m, None)
                self.send(("o_value", got_m, None if held is None else held.cpu()))
                continue
            if got_kind == "o_free":
                self._held.pop(got_m, None)
                continue
            if got_kind == "v_fetch" and self.serve is not None:
                self.send(("v_values", (*got_m, self.member), self.serve()))
                continue
            if got_kind == "fail":
                self.failed = self.failed or str(payload)
                continue
            self._kept[(got_kind, got_m)] = payload
        return self._kept.pop((kind, m))


class SurrogateLoss:
    """The executor's ``loss_fn`` on the loss-stage rank, for micro-batch :attr:`microbatch`.

    The executor's ``on_microbatch`` hook sets :attr:`microbatch` before the loss
    stage computes; the targets the executor passes are placeholders.
    """

    def __init__(self, inbox: RankInbox) -> None:
        self.inbox = inbox
        self.divisor = 1.0  # (accumulate: the controller's 1/k, undone here)
        self.microbatch = 0
        self._grads: dict[int, list[torch.Tensor | None] | None] = {}

    def reset(self) -> None:
        self._grads.clear()

    def __call__(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        m = self.microbatch
        flat = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        if m not in self._grads:  # a recomputed forward reuses the gradient it already has
            self.inbox.send(("out", m, [self.inbox.offer(t) for t in flat]))
            self._grads[m] = self.inbox.get("grad", m)
        grads = self._grads[m]
        if grads is None:
            # the closure never called backward: a loss without a gradient, so this
            # micro-batch gives none (a step of such closures steps no parameter)
            return torch.zeros((), device=flat[0].device if flat else None)
        reached = [(t, g) for t, g in zip(flat, grads, strict=True)
                   if g is not None and t.requires_grad]
        # an output the loss did not reach gives nothing (what only it reads keeps no
        # gradient, as in one process); none reached: zeros, so the backward still runs
        if reached:
            total = sum((t * g.to(t.device, t.dtype)).sum() for t, g in reached)
        else:
            total = sum((t * 0.0).sum() for t in flat if t.requires_grad)
        if not isinstance(total, torch.Tensor) and not torch.is_grad_enabled():
            return torch.zeros(())  # a recomputed stage's first forward: no graph is kept
        if not isinstance(total, torch.Tensor):
            raise RuntimeError("the compiled model's outputs do not require grad: nothing to train")
        return total * self.divisor


class ClosureEngine(RankEngine):
    """Worker side of the closure runner: lazy model inputs and the surrogate loss.

    For a forward of several graphs (``glue``) it also keeps the parameters the
    controller trains that are homed on this rank (:func:`orgel.split.exchanges.eager_homes`):
    before the gradient sums it adds the controller's gradients (``"p_grad"``),
    after the optimizer it sends their new values back (``"p_value"``).

    ``closures`` (``orgel.backend``'s): this rank waits for a
    ``"p_grad"`` every step too, which may tell it that no closure's backward reached it
    (its gradients are then dropped: stand-ins' zeros, not gradients).

    A micro-batch whose forward leaves the captured graphs runs in the controller
    (:mod:`orgel.explicit.fallback`), which may then train any parameter. Every step this
    rank waits for a ``"p_grad"`` (possibly empty) and adds what it names to the copy
    it holds; rank 0 keeps a copy of every parameter no stage reads; and it answers
    ``"v_fetch"`` with its own part of the values of its parameters and buffers.
    """

    serves_exchanges = True

    def __init__(self, rank: int, plan: Any, split: Any, *, optimizer: Any, conn: Connection,
                 timeout_s: float, glue_info: Any = None,
                 model: torch.nn.Module | None = None,
                 options: dict[str, Any] | None = None,
                 batch_dim: int = 0, closures: bool = False) -> None:
        self.inbox = RankInbox(conn, timeout_s)
        self.inbox.fingerprints = closures
        self.surrogate = SurrogateLoss(self.inbox)
        #: every parameter the controller trains (Glue.eager), and those this rank steps
        self._eager_names = sorted(glue_info.eager) if glue_info is not None else []
        self.homed = homed_on(rank, self._eager_names, plan, split)
        kept = list(self.homed)
        if model is not None:  # the controller may train any parameter (off the path)
            kept += [n for n, _ in model.named_parameters()
                     if n not in self._eager_names and home_rank(n, plan, split) == rank]
        held = {n for st in (split.stages[s] for s in plan.stages_on(rank))
                for n in st.param_names.values()}
        extra = {}
        if model is not None:
            for name in kept:
                if name not in held:  # no stage reads it: this rank keeps its own copy
                    p = model.get_parameter(name)
                    extra[name] = torch.nn.Parameter(p.detach().clone(),
                                                     requires_grad=p.requires_grad)
        super().__init__(rank, plan, split, optimizer=optimizer, loss_fn=self.surrogate,
                         timeout_s=timeout_s,
                         executor_options={**(options or {}), "extra_params": extra,
                                           "batch_dim": batch_dim})
        # the step's inputs give shapes; each micro-batch's real ones come from the
        # controller when a stage first needs them, so closures still pre-processing later
        # micro-batches overlap the pipeline's work on earlier ones
        self.executor.fetch_inputs = lambda m: self.inbox.get("in", m)
        # the loss is the controller's: which values a gradient reaches shows only as it runs
        self.executor.reach_flags = True
        self.executor.on_microbatch = self._at_microbatch
        # the controller weighed each micro-batch's loss (its share of the batch's rows or
        # labels): the loss stage weighs its surrogate 1 ("sum"), whatever the pieces' sizes
        self.executor.loss_rule = "sum"
        # under loss scaling the controller scaled the gradients it sends: not again here
        self.executor.scale_seed = False
        self.exchange: glue.RankExchange | None = None
        if exchange_stages(split):
            self.exchange = glue.RankExchange(self.inbox, self.executor.device)
            glue.set_runtime(self.exchange)  # this process is a rank: exchanges ask the controller
            self.executor.side_leaves = self.exchange.leaves
        self.executor.before_reduce = self._add_controller_grads
        # (the homed parameters may grow: the controller's "p_grad" names them all)
        self.executor.after_optimizer = self._send_values
        self.inbox.serve = self._values_now
        self.inbox.member = self.executor.member
        # a closure's (or the controller's) error drops the step and the ranks go on: its
        # "fail" stops this rank's waits, and the step's "end" says whether one came
        self.executor.abandon_on_error = True
        self.executor.verdict = self._verdict
        # the controller reads every process until its "done" (any may be asked for its
        # values mid-step), and is told "failed" when its work fails
        self.executor.on_drop = lambda: self.inbox.send(("failed", None, None))

    def _verdict(self) -> Exception | None:
        """Read the step's ``"end"``: whether a closure of this step raised."""
        self.inbox.get("end", None)
        return None if self.inbox.failed is None else ClosureFailed(self.inbox.failed)

    def _at_microbatch(self, m: int) -> None:
        """A stage is about to compute micro-batch ``m``: the loss and the exchanges serve it."""
        self.surrogate.microbatch = m
        if self.exchange is not None:
            self.exchange.microbatch = m

    def _first_copies(self) -> dict[str, torch.nn.Parameter]:
        """Each parameter's first copy on this rank, by name."""
        found: dict[str, torch.nn.Parameter] = {}
        for name, p in self.executor.named_parameters():
            found.setdefault(name, p)
        return found

    def _homed_params(self) -> dict[str, torch.nn.Parameter]:
        """Each homed parameter's first copy on this rank, by name."""
        return {n: p for n, p in self._first_copies().items() if n in self.homed}

    def _values_now(self) -> dict[str, Any]:
        """This process's parameters and buffers by name, copied to the CPU (``"v_fetch"``):
        a tensor-parallel or FSDP-sharded one as this process's :class:`~orgel.runtime.pieces.Piece`
        (asked mid-step, it gathers nothing: the controller lays the pieces together)."""
        values = {n: piece_of(p) for n, p in self._first_copies().items()}
        for n, b in self.named_buffers():
            if n not in values:
                values[n] = piece_of(b)
        return values

    def _add_controller_grads(self) -> None:
        """Add the controller's gradients (``"p_grad"``: by name, homed here) to the copies.

        With them comes ``reset``: every micro-batch ran in the controller (or no
        closure's backward reached the ranks), so this rank's backward ran on stand-ins
        only: its zeros are dropped first, and a parameter without a gradient before this
        call has none after it (with ``accumulate``, the earlier calls' gradients stay).
        """
        if self.executor.dropping:  # the controller sends none for a step it stopped
            return
        grads, reset, eager = self.inbox.get("p_grad", self.step_count)
        if len(eager) != len(self._eager_names):  # orgel.backend found more (ClosurePipeline)
            self._eager_names = list(eager)
            self.homed = homed_on(self.rank, self._eager_names, self.plan, self.split)
        params = self._first_copies()
        if reset:  # this call's stand-in zeros go; earlier calls' gradients (accumulate) stay
            first = self.executor.loop.pending == 0  # (the last step's are dropped after this)
            for param in self.executor.parameters():
                if first or id(param) in self._gradless:
                    param.grad = None
            # and so do those a sharded stage keeps on its whole weights until it reduces
            self.executor.sharding.drop(None if first else self._gradless)
        # an FSDP shard (its stage reduced) takes its part on every replica of the stage
        # (orgel.split.exchanges.grad_ranks); anything else on the home rank alone, whose
        # gradient the replicas' sum or the reduce-scatter then counts once
        shards = self.executor.sharding.shard_ids()
        for name, g in grads.items():
            p = params.get(name)
            if g is None or p is None:
                continue
            if id(p) not in shards and home_rank(name, self.plan, self.split) != self.rank:
                continue
            g = shard_like(p, g.to(p.device, p.dtype))  # this member's or replica's part
            p.grad = g if p.grad is None else p.grad + g

    def _send_values(self) -> None:
        if not self.homed:
            return
        # each process its own part: a tensor-parallel member's or FSDP replica's shard
        values = {n: piece_of(p) for n, p in self._homed_params().items()}
        self.inbox.send(("p_value", (self.step_count, self.rank, self.executor.member), values))

    def closure_step(self, placeholders: dict[str, torch.Tensor],
                     rows: int | None = None) -> Any:
        """One step; ``placeholders`` only give shapes, the inputs arrive per micro-batch.

        ``rows`` is the batch size where no placeholder has it (no stage reads a
        model input: the forward's first graph takes what code before it made). A step
        every rank dropped comes back as :class:`~orgel.worker.engine.Dropped`.
        """
        from orgel.launch.errors import StepAbandoned
        from orgel.worker.engine import Dropped

        self.surrogate.reset()
        self.inbox.begin()
        #: the parameters without a gradient before this call, where it is not an
        #: accumulation's first: a call no closure's backward reached leaves them so
        #: (_add_controller_grads)
        self._gradless = ({id(p) for p in self.executor.parameters() if p.grad is None}
                          - self.executor.sharding.accumulating())
        if self.exchange is not None:
            self.exchange.begin(self.step_count)
        dim = int(self.executor.batch_dim)
        rows = batch_size(placeholders, dim) if rows is None else rows
        try:
            # targets: a placeholder too, with the batch along the batch dimension
            self.executor.step(placeholders, torch.zeros((1,) * dim + (rows,)))
        except StepAbandoned as exc:  # every rank dropped it (a closure or a rank raised)
            return Dropped(exc.rank, exc.report)
        finally:
            self.inbox.send(("done", None, None))  # nothing more of this step from here
        self.step_count += 1
        return None


def profiling_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """A stand-in loss, used only to time the loss stage's backward while profiling.

    Training never calls it: the closure computes the real loss, and the loss
    stage back-propagates the closure's gradient of the outputs through the
    surrogate ``sum(outputs * grad)`` (see :mod:`orgel.worker.closure`), which costs the
    same as this sum.
    """
    leaves = [t for t in torch.utils._pytree.tree_leaves(outputs)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise RuntimeError("the compiled model returns no floating-point tensor to train")
    return sum((t.sum() for t in leaves), torch.zeros(()))

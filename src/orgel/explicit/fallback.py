"""A micro-batch whose forward leaves the captured graphs: it runs whole in the controller.

A forward of several graphs (:mod:`orgel.explicit.glued`) is captured on one
micro-batch. Another micro-batch may run other graphs: an ``if h.mean() > 0:``
that takes the other arm, a loop over the experts a router picked (transformers
4.57's Mixtral), a graph whose arguments have other shapes. The ranks hold only
the captured graphs, so such a micro-batch (the controller finds it at its first
graph call that differs from the captured one, or at the end of a forward that
ran fewer) is computed here instead, exactly as one process computes it:

1. the ranks finish their part of it on stand-ins: each captured graph it has
   not reached gets the arguments capture recorded, and every captured graph
   gets zero output gradients, so the ranks' parameters get nothing from it;
2. the controller asks every rank for the values of its parameters and buffers
   (``"v_fetch"``, answered mid-step: none has stepped yet), once per step, and
   loads them into its own copy of the model (made on the first such
   micro-batch; the caller's model is never changed); a tensor-parallel member or an
   FSDP replica sends its own shard, and the controller lays them together
   (:mod:`orgel.runtime.pieces`: a gather mid-step would wait for partners that are
   elsewhere in the step);
3. it runs the model's forward eagerly on that copy, then ``loss_fn`` and the
   backward, and keeps this micro-batch's gradient of every parameter;
4. with the gradients of the parameters the Python between graphs trains, they
   are summed over the micro-batches in order and sent to each parameter's home
   rank (:func:`orgel.split.exchanges.home_rank`; rank 0 keeps a copy of every
   parameter no stage reads), which adds them before its gradient sums; a
   tensor-parallel member adds its part, and every replica of an FSDP stage its shard
   after the reduce-scatter (:func:`orgel.split.exchanges.grad_ranks`).

Why the whole micro-batch, in the controller: the ranks hold only the captured
graphs and run a fixed schedule, so a graph they do not hold has no place
there, and its parameters may sit on several ranks; the controller can run any
Python the forward takes, and one rule (everything of that micro-batch, here)
needs no alignment of the graphs before and after the branch.

What it costs: such a micro-batch's forward and backward run in the controller,
one thread per micro-batch, beside the ranks' stand-in work; the step fetches
every parameter once from the ranks; Dynamo compiles each new graph it meets on
the way there once. ``python benchmarks/branching.py`` (2 ranks, 4 micro-batches
of 64 rows, a 4+4-layer MLP with an ``if x.mean() > 0:`` between, SGD; median
of 7 steps; the 2-core CPU machine shared with other work, load average 4.4-5.3)
measured, for every micro-batch on the captured path / micro-batches 1 and 3
off it / all 4 off it: 72.7 / 107.2 / 104.9 ms at width 256 (1.47x and 1.44x),
119.1 / 182.7 / 198.5 ms at width 512 (1.53x and 1.67x). The captured path costs
what it did before the fallback existed (68-82 ms either way, within the noise
of that load).

What it does not do: a pipeline whose stages update buffers in place
(BatchNorm statistics) refuses such a micro-batch, since the stand-ins would
update them; a buffer the controller's forward writes is refused too.
Randomness in the forward (dropout) draws from the controller's generator.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.batching import plain
from orgel.graph import glue as glue_mod
from orgel.graph.glue_sizes import stretched
from orgel.graph.opgraph import CaptureError
from orgel.nesting import call
from orgel.runtime.pieces import whole_values


class GlueError(CaptureError):
    """A micro-batch's forward ran other graphs than the captured forward."""


class Deviated(GlueError):
    """A micro-batch's forward left the captured graphs: ``orgel.pipeline`` runs it here.

    ``what`` says where it left (the message may add advice for ``orgel.backend``).
    """

    def __init__(self, message: str, what: str | None = None) -> None:
        super().__init__(message)
        self.what = message if what is None else what


def deviation(exc: BaseException) -> Deviated | None:
    """The :class:`Deviated` that ``exc`` is or carries (Dynamo may wrap it), else None."""
    inner = getattr(exc, "inner_exception", None)
    for e in (exc, inner, exc.__cause__):
        if isinstance(e, Deviated):
            return e
    return None


class Fallback:
    """The controller's copy of the model and the step's values, for micro-batches off the path.

    ``model``: the caller's model (copied on first use); ``dummies[c]``: the
    arguments capture recorded for graph call ``c`` (what the ranks get for a
    graph such a micro-batch did not reach).
    """

    def __init__(self, model: torch.nn.Module, glue: Any, split: Any) -> None:
        self.model = model
        self.glue = glue
        recorded = glue_mod._EXAMPLES.get(glue.key)
        self.dummies: dict[int, list[torch.Tensor]] | None = (
            None if recorded is None else
            {c: [t.detach().clone() for t in values] for c, values in recorded.items()})
        #: buffers the stages update in place (the stand-ins would update them too)
        self.written = sorted({b for st in split.stages for b in st.written})
        self._copy: torch.nn.Module | None = None
        self._fetched = -1  # the step whose values the copy holds
        self._lock = threading.Lock()

    @property
    def model_copy(self) -> torch.nn.Module | None:
        """The calling process's copy of the model, once a micro-batch ran whole on it."""
        return self._copy

    def check(self, index: int, why: str) -> None:
        """Raise where micro-batch ``index`` cannot run in the controller (``why``: it left)."""
        if self.written:
            raise GlueError(f"{why}. orgel would run it in the calling process, but the "
                            "pipeline's stages update buffers in place "
                            f"({', '.join(self.written)}: BatchNorm statistics?), which the "
                            "ranks' stand-in run would change; make every micro-batch take "
                            "the captured path")
        if self.dummies is None:
            raise GlueError(f"{why}. orgel would run it in the calling process, but the values "
                            "capture recorded are gone (more than 32 captures since); make the "
                            "pipeline again")

    def values(self, pipe: Any) -> torch.nn.Module:
        """The controller's copy of the model with the ranks' values of this step.

        Asks every rank once per step (the first micro-batch that needs it waits;
        the ranks answer from any wait on the controller, at the latest the one
        for the step's gradients).
        """
        with self._lock:
            if self._fetched == pipe.calls:
                assert self._copy is not None
                return self._copy
            if self._copy is None:
                self._copy = copy.deepcopy(self.model)
            ranks = range(pipe.plan.num_ranks)
            for r in ranks:
                pipe._send(r, ("v_fetch", (pipe.calls, r), None))
            # every process its own part (orgel.runtime.pieces): a tensor-parallel member's
            # or an FSDP replica's shard, laid together here
            values = whole_values([
                pipe._mail.get("v_values", (pipe.calls, r, member), r,
                               "its parameters' values (a micro-batch off the captured path)")
                for r in ranks for member in range(pipe.plan.tp)])
            values.update(pipe._unread(set(values)))
            state = self._copy.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, t in values.items():
                    if name in state:
                        state[name].copy_(t)
            self._fetched = pipe.calls
            return self._copy

    def current(self, pipe: Any) -> torch.nn.Module:
        """The controller's copy of the model with the ranks' values now, between steps
        (:meth:`orgel.worker.pipe.Pipeline.state_dict`; asked once per step call)."""
        with self._lock:
            if self._fetched != pipe.calls:
                if self._copy is None:
                    self._copy = copy.deepcopy(self.model)
                state = self._copy.state_dict(keep_vars=True)
                with torch.no_grad():
                    for name, t in pipe.state_dict().items():
                        if name in state:
                            state[name].copy_(t)
                self._fetched = pipe.calls
            assert self._copy is not None
            return self._copy

    def forget(self) -> None:
        """The ranks' values changed outside a step (a load): fetch them again."""
        self._fetched = -1

    def leave(self, pipe: Any, slot: Any, inputs: dict[str, Any], why: str) -> None:
        """Micro-batch ``slot`` of ``pipe`` left the captured graphs: the ranks finish it
        on stand-ins.

        Each captured graph call it has not sent gets the arguments capture
        recorded (graph 0 this micro-batch's model inputs), its outputs are
        dropped, and every call gets zero output gradients: the ranks' part of
        this micro-batch changes no gradient. :meth:`run` then computes it here.
        """
        self.check(slot.index, why)
        assert self.dummies is not None
        slot.leaving = True
        glue, m = pipe.glue, slot.index
        calls = glue.calls
        first = {name: inputs[name].detach() for kind, name in calls[0].roles if kind == "input"}
        start = slot.sent
        for c in range(start, len(calls)):
            if glue.has_exchange(c):
                pipe._send(pipe.exchange_rank(c, m), ("x_in", pipe.key(c, m), [
                    stretched(t, dims, slot.sizes)  # this micro-batch's sizes
                    for t, dims in zip(self.dummies[c], calls[c].shapes, strict=True)]))
            if c == 0:
                pipe.feed(m, first)
        for c in range(start, len(calls)):
            if c + 1 < len(calls):
                pipe._mail.get("x_out", pipe.key(c + 1, m), pipe.exchange_rank(c + 1, m),
                               f"graph {c}'s outputs of micro-batch {m}")
            else:
                pipe._mail.get("out", m // pipe.dp, pipe.loss_rank(m),
                               f"the outputs of micro-batch {m}")
        slot.sent = slot.calls = len(calls)
        slot.backed.clear()
        pipe._back_unreached(slot, after=-1)
        slot.off_path = True

    def run(self, pipe: Any, slot: Any, inputs: dict[str, Any], targets: Any) -> None:
        """Micro-batch ``slot`` in the controller: its loss, outputs and every gradient."""
        model = self.values(pipe)
        buffers = {n: b._version for n, b in model.named_buffers()}
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with torch.enable_grad():
            with self.glue.autocast():
                out = call(model, inputs)
            written = [n for n, b in model.named_buffers() if b._version != buffers[n]]
            if written:
                raise GlueError(f"micro-batch {slot.index} left the captured graphs and ran in "
                                f"the calling process, where its forward wrote buffers "
                                f"{written[:3]} in place: orgel cannot hand that to the ranks")
            loss = pipe.weighed_loss(slot.index, out, targets)
            grads = (torch.autograd.grad(pipe.backward_root(loss), [p for _, p in params],
                                         allow_unused=True)
                     if loss.requires_grad and params else [None] * len(params))
        slot.grads = {n: g for (n, _), g in zip(params, grads, strict=True) if g is not None}
        slot.result = float(loss.detach())
        if pipe._keep_outputs:
            slot.outputs = out


def check_outside(index: int, out: Any, remote: set[int]) -> None:
    """Raise :class:`Deviated` where ``out`` depends on a parameter in ``remote`` (by id: the
    ones the ranks train) through no graph call: code Dynamo ran as Python that the
    capture did not (a frame past its recompile limit).

    The walk covers the controller's own autograd graph of micro-batch ``index``: the
    Python between graphs and one node per graph call.
    """
    seen: set[Any] = set()
    todo: list[Any] = [t.grad_fn for t in pytree.tree_leaves(plain(out))
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None and id(variable) in remote:
            raise Deviated(f"micro-batch {index}'s forward used a parameter outside every "
                           "graph call (Dynamo ran a frame as Python, past its recompile limit?)")
        todo.extend(f for f, _ in fn.next_functions)


def summed(slots: list[Any]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient over the micro-batches (``slot.grads``), summed in order."""
    names = sorted({n for s in slots for n in s.grads})
    total: dict[str, torch.Tensor] = {}
    for name in names:
        for slot in slots:
            g = slot.grads.get(name)
            if g is not None:
                total[name] = g.clone() if name not in total else total[name].add_(g)
    return total


__all__ = ["Deviated", "Fallback", "GlueError", "check_outside", "deviation",
           "summed"]

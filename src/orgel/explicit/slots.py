"""One micro-batch's state in the controller's step, and its graph calls
(:mod:`orgel.explicit.glued`)."""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

from orgel.explicit.lazy import LazyOutput


class Slot:
    """One micro-batch of a step in the controller: its graph calls, loss, outputs, error."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.calls = 0
        self.sent = 0  # captured graph calls whose arguments went to the ranks
        self.off_path = False  # the forward left the captured graphs: it ran here
        self.leaving = False  # it began to leave them (the ranks finish it on stand-ins)
        #: ``orgel.backend``'s closures: each graph call's graph, arguments, outputs and
        #: autocast, should the micro-batch leave the captured graphs later (see
        #: :meth:`orgel.explicit.closures.ClosurePipeline.graph_call`)
        self.ran: list[tuple[Any, ...]] = []
        self.anchor: torch.Tensor | None = None
        self.result: float = 0.0
        self.outputs: Any = None  # the model's outputs, detached on the CPU, when asked for
        self.error: BaseException | None = None
        self.grads: dict[str, torch.Tensor] = {}  # this micro-batch's, of those trained here
        self.backed: set[int] = set()  # graph calls whose backward ran
        #: whether the loss's backward reached a graph call (``orgel.backend``: a closure may
        #: call none; then the ranks' zero gradients of it are no gradient at all)
        self.backward = False
        self.sizes: dict[str, tuple[int, ...]] = {}  # the model inputs' shapes
        self.scaled = False  # orgel.backend: the closure's loss went through pipe.scale


class GraphCall(torch.autograd.Function):
    """Graph ``c`` of one micro-batch, run by the ranks: ``(anchor, *outputs)``."""

    @staticmethod
    def forward(ctx: Any, pipe: Any, slot: Slot, c: int, inputs: dict[str, Any],
                grad: bool, anchor: torch.Tensor,
                *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # weakly: a tensor of this graph the slot or the caller keeps (the anchor, a loss,
        # an error's frames) made a cycle through autograd that Python cannot collect
        ctx.pipe, ctx.slot, ctx.c, ctx.count = weakref.ref(pipe), weakref.ref(slot), c, len(values)
        call = pipe.glue.calls[c]
        outs = tuple(t if isinstance(t, LazyOutput)  # (read when used)
                     else t.clone() if layout is None else layout.copy(t)
                     for t, layout in zip(pipe._run(slot, c, inputs, values), call.layouts,
                                          strict=True))
        # differentiable as at capture: a frame after this call meets what Dynamo compiled
        # it for (an output that needed no gradient there, a mask or a rotary table, needs
        # none here; it would compile the frame again, in the middle of a step)
        ctx.floating = [grad and t.is_floating_point() and d
                        for t, d in zip(outs, call.differentiable, strict=True)]
        # an output the loss does not reach gets None, not zeros: the last graph's go to the
        # loss rank as they are, so what only they read keeps no gradient, as in one process
        ctx.set_materialize_grads(False)
        ctx.like = [(t.shape, t.dtype) for t in outs]
        ctx.mark_non_differentiable(*[t for t, f in zip(outs, ctx.floating, strict=True)
                                      if not f])
        return (anchor.detach().clone(), *outs)

    @staticmethod
    def backward(ctx: Any, anchor_grad: Any, *grads: Any) -> tuple[Any, ...]:
        # a later call the loss does not reach has not run its backward: the ranks take the
        # backwards in reverse order, so it goes first, with zero gradients
        pipe, slot = ctx.pipe(), ctx.slot()
        if pipe is None or slot is None:
            raise RuntimeError("the step that ran this forward is over: its backward runs "
                               "within the step")
        last = ctx.c + 1 >= len(pipe.glue.calls)  # (an exchange's backward takes zeros)
        sent = [None if not floating else g if g is not None or last
                else torch.zeros(shape, dtype=dtype)
                for g, floating, (shape, dtype) in zip(grads, ctx.floating, ctx.like,
                                                       strict=True)]
        pipe._turns.passed(slot.index)  # its forward is over: it looks nothing up any more
        slot.backward = True
        pipe._back_unreached(slot, after=ctx.c)
        slot.backed.add(ctx.c)
        # the arguments' gradients are waited for only where one of them takes one, here and
        # on the ranks (an argument the frozen layers before it made carries none there, and
        # the ranks' backward does not reach its exchange)
        carries = pipe.glue.calls[ctx.c].carries or (True,) * ctx.count
        answer = any(n and k for n, k in zip(ctx.needs_input_grad[6:], carries, strict=True))
        got = pipe._back(slot, ctx.c, sent, ctx.count, answer)
        return (None, None, None, None, None, None, *got)


class Turns:
    """Micro-batch threads reach each frame of the compiled model one after another.

    Dynamo keeps a frame's compiled entries in most-recently-used order: a lookup that
    matches an entry behind the first moves it to the front. Two threads looking up the
    same frame at once while that happens (a guard that runs Python lets the other
    thread in) can miss the entry that matches, and Dynamo compiles the frame again in
    the middle of a step (torch 2.13 logs "Unexpected recompilation"; seen after an
    evaluation outside ``step`` put its own entries in front). So thread ``m`` looks up a
    frame only after thread ``m - 1`` has: before the model's first frame it waits
    (:meth:`wait`) until thread ``m - 1`` has called graph 0; with graph breaks, before
    the frames after graph call ``c`` (on its way out of that call) until thread ``m - 1``
    has called graph ``c + 1`` (:meth:`reached`), or ended or left the captured graphs
    (:meth:`passed`); after its last graph, until thread ``m - 1``'s backward began. The
    rest of the micro-batches' work still runs side by side. A
    thread that does not move on within ``timeout_s`` lets the next one go (its own wait
    reports the hang).
    """

    def __init__(self, count: int, timeout_s: float) -> None:
        self._reached = [-1] * count  # the graph call each thread has made
        self._moved = threading.Condition()
        self._timeout_s = timeout_s

    def wait(self, m: int, call: int = 0) -> None:
        """Until thread ``m - 1`` has made graph call ``call`` (or ended)."""
        if m <= 0:
            return
        with self._moved:
            if not self._moved.wait_for(lambda: self._reached[m - 1] >= call,
                                        self._timeout_s):
                self._reached[m - 1] = sys.maxsize  # not waited on again
                self._moved.notify_all()

    def reached(self, m: int, call: int) -> None:
        """Thread ``m`` makes graph call ``call``: its lookups up to that graph are done."""
        with self._moved:
            if call > self._reached[m]:
                self._reached[m] = call
                self._moved.notify_all()

    def passed(self, m: int) -> None:
        """Thread ``m`` looks nothing up any more in this step (it ended, or its forward
        left the captured graphs, or the model is one graph and it called it)."""
        self.reached(m, sys.maxsize)

"""``orgel.backend``'s compiled model, one graph or several (graph breaks): the closures run
the Python around and between its graphs (:class:`ClosurePipeline`), as the controller of
:mod:`orgel.explicit.glued` does for ``orgel.pipeline``."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.batching import batch_placeholders, plain
from orgel.explicit.fallback import Deviated, GlueError, check_outside
from orgel.explicit.glued import GluedPipeline
from orgel.explicit.lazy import LazyOutput
from orgel.explicit.slots import Slot
from orgel.graph.dynamo import dynamo_settings
from orgel.launch.errors import WorkerError
from orgel.launch.messages import Held, same_fingerprint
from orgel.precision import ambient_autocast


def closure_tensors(args: list[Any]) -> dict[str, torch.Tensor]:
    """A closure's tensor arguments by the names the joined graphs of a forward with graph
    breaks give them (``arg<i>``, ``i`` the position), whose sizes those graphs read
    (:func:`orgel.graph.glue_sizes.size_roles`); a tensor inside an argument (a Hugging
    Face batch, a dict or ``BatchEncoding``; a list) is named by its path,
    ``arg0__input_ids__``."""
    return {f"arg{i}{re.sub(r'[^0-9A-Za-z_]', '_', pytree.keystr(path))}": leaf
            for i, a in enumerate(args)
            for path, leaf in pytree.tree_flatten_with_path(plain(a))[0]
            if isinstance(leaf, torch.Tensor)}


class ClosurePipeline(GluedPipeline):
    """The graphs of ``orgel.backend``'s compiled model (one, or several where it has graph
    breaks), joined.

    The closures of :meth:`orgel.transparent.backend.Backend.step` replace ``model`` and
    ``loss_fn``: each runs in its own thread, calls the compiled model (whose
    graphs reach :meth:`_call` through the backend) and runs its own backward.
    A graph call the closure's loss does not reach gets zero gradients.

    A micro-batch whose forward leaves the captured graphs (another arm of a branch, a
    second call of the model) cannot start again in the controller as
    ``orgel.pipeline``'s does: the closure is the user's, and its forward is under way.
    So from the graph call where it leaves (:meth:`graph_call`), the ranks finish their
    part of it on stand-ins with zero gradients
    (:meth:`~orgel.explicit.fallback.Fallback.leave`), and the rest runs here, on a copy
    holding the ranks' values of the step: every later graph call, and the backward of
    the calls the ranks ran before, recomputed from their arguments (checked against the
    outputs the ranks gave). The gradients this gives the copy's parameters are kept per
    micro-batch, summed in micro-batch order and added by each parameter's home rank, as
    those of the parameters the Python between graphs trains are (with ``tp`` or FSDP each
    process sends its own shard of the values). Not where the stages update buffers in
    place: there the step stops, saying so.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._warm = True  # orgel.backend ran micro-batch 0's forward to find the graphs
        # the closures run the caller's module: the parameters its Python between graphs
        # uses (Glue.eager) are the caller's own. Each micro-batch's gradient of them is
        # kept as its backward reaches them (a hook, in the closure's thread), summed in
        # micro-batch order and stepped by their home rank, whose new values come back here
        self._eager = {name: self._model.get_parameter(name) for name in self.glue.eager}
        # the rest get their gradient on the ranks, which run the graphs; where one reaches
        # the caller's copy of one here, the Python between graphs used it too (a tied
        # embedding looked up outside the graphs): it is kept as the eager ones' are, and
        # the parameter joins them for good (_promote)
        named = {id(p): name for name, p in self._eager.items()}  # (the eager ones' names)
        self._hooks = [p.register_hook(self._keeper(named.get(id(p), name), here=True))
                       for name, p in self._model.named_parameters() if p.requires_grad]
        #: parameters a graph reads whose caller's copy got a gradient in a step
        self._used_here: set[str] = set()
        # the caller's tensors a graph call off the captured path reads in their stead: the
        # copy's (Fallback.values), by the id of the caller's; the eager ones stay the caller's
        self._stand_for = {id(t): name for name, t in
                           [*self._model.named_parameters(remove_duplicate=False),
                            *self._model.named_buffers(remove_duplicate=False)]
                           if name not in self._eager}
        self._copy_hooks: list[Any] = []
        self._copy_lock = threading.Lock()

    def graph_call(self, gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> Any:
        """Graph ``gm`` of a closure's forward, called with ``args``: on the ranks while its
        micro-batch runs the captured graphs; from the call where it leaves them, here."""
        slot = getattr(self._local, "slot", None)
        if slot is not None and slot.off_path:
            return self._in_region(gm, args)
        try:
            out = self._call(gm.code, args)
        except Deviated as exc:
            assert slot is not None
            try:  # Python that read the caller's parameters (not the ranks' values) got here
                # (until the ranks' values move, the caller's are theirs)
                check_outside(slot.index, args, self._remote_ids if self._moved else set())
            except Deviated as outside:
                raise GlueError(f"{exc.what}, and {outside}: orgel cannot run the rest of it "
                                "here on the ranks' values") from exc
            self._turns.passed(slot.index)  # off the graphs: the next may look up past here
            # the ranks finish it on stand-ins (every call's gradients zero), so they wait
            # for nothing of it while the values come (Fallback.values)
            self._fallback.leave(self, slot, {}, exc.what)
            return self._in_region(gm, args)
        if slot is not None:  # should it leave later: its backward here
            # (an output still on its rank by its fingerprint: keeping it would fetch it)
            kept = tuple(t.held if isinstance(t, LazyOutput) else t for t in out)
            slot.ran.append((gm, args, kept, ambient_autocast() or self.glue.region))
        return out

    def _in_region(self, gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """:meth:`_here` under the autocast the ranks run the graphs in, where the closure
        opened none (``orgel.backend(precision=...)`` around a model of one graph)."""
        if ambient_autocast() is not None or self.glue.region is None:
            return self._here(gm, args)
        with torch.autocast(*self.glue.region):
            return self._here(gm, args)

    def _here(self, gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Graph ``gm`` run here on the ranks' values of the step (their copy's tensors in
        place of the caller's parameters and buffers)."""
        copy = self._fallback.values(self)
        with self._copy_lock:
            if not self._copy_hooks:  # each micro-batch's gradient, kept as _keeper keeps it
                self._copy_hooks = [p.register_hook(self._keeper(name))
                                    for name, p in copy.named_parameters()
                                    if p.requires_grad and name not in self._eager]
        state = dict([*copy.named_parameters(remove_duplicate=False),  # and the buffers
                      *copy.named_buffers(remove_duplicate=False)])  # state_dict leaves out
        local = [state[self._stand_for[id(a)]] if isinstance(a, torch.Tensor)
                 and id(a) in self._stand_for else a for a in args]
        buffers = {id(b): b._version for b in copy.buffers()}
        out = gm(*local)
        if any(id(a) in buffers and a._version != buffers[id(a)] for a in local):
            raise GlueError("a micro-batch left the captured graphs and ran here, where a graph "
                            "wrote a buffer in place: orgel cannot hand that to the ranks; "
                            "make every micro-batch take the captured path")
        return tuple(out)

    def _back(self, slot: Any, c: int, grads: list[Any], count: int,
              answer: bool = True) -> list[Any]:
        """Graph ``c``'s backward: on the ranks, or, once its micro-batch left the captured
        graphs (the ranks had zero gradients for it), here (:meth:`_back_here`). A backward
        that begins before the forward made every captured graph call (the forward returned
        early) leaves them there: the ranks wait for calls that will not come."""
        self._leave_if_short(slot)
        if slot.off_path:
            return self._back_here(slot, c, grads)
        if self.scale is not None and not slot.scaled and any(g is not None for g in grads):
            from orgel.precision import UNSCALED_BACKWARD

            raise RuntimeError(UNSCALED_BACKWARD)
        k = self.accumulate
        if k == 1:
            return super()._back(slot, c, grads, count, answer)
        got = super()._back(slot, c, [None if g is None else g / k for g in grads], count,
                            answer)
        return [None if g is None else g * k for g in got]

    def _leave_if_short(self, slot: Any) -> None:
        """Leave the captured graphs where ``slot``'s forward made fewer graph calls than
        they hold (it returned early): the ranks would wait for the calls that did not
        come. Called as its backward begins, or as its closure ends without one."""
        captured = len(self.glue.calls)
        if slot.off_path or not 0 < slot.calls < captured:
            return
        what = (f"micro-batch {slot.index}'s forward ran {slot.calls} graphs; the captured "
                f"forward ran {captured}")
        self._fallback.leave(self, slot, {}, what)

    def _back_here(self, slot: Any, c: int, grads: list[Any]) -> list[Any]:
        """The backward of graph call ``c``, which the ranks ran before the micro-batch left
        the captured graphs: the graph again here on its arguments, checked against the
        outputs the ranks gave (a graph that draws random numbers would not give them),
        then its gradients: the copy's parameters' kept by their hooks, the arguments'
        returned."""
        gm, args, outs, autocast = slot.ran[c]
        call = self.glue.calls[c]
        values = {i: args[i].detach().requires_grad_(args[i].requires_grad) for i in call.glue}
        given = tuple(values.get(i, a) for i, a in enumerate(args))
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            if autocast is not None:
                stack.enter_context(torch.autocast(*autocast))
            again = self._here(gm, given)
        rtol = _tolerance(autocast)
        for got, want in zip(again, outs, strict=True):
            if not _same(got, want, rtol):
                raise GlueError(
                    f"micro-batch {slot.index} left the captured graphs, and graph call {c}, "
                    "which the ranks ran before it left, gives other outputs here (it draws "
                    "random numbers: dropout?): orgel cannot compute its backward; make every "
                    "micro-batch take the captured path, or the graph deterministic")
        pairs = [(t, g) for t, g in zip(again, grads, strict=True)
                 if g is not None and isinstance(t, torch.Tensor) and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return [values[i].grad for i in call.glue]

    def _keeper(self, name: str, here: bool = False) -> Callable[[torch.Tensor], None]:
        """A hook that keeps the gradient of parameter ``name`` in its micro-batch's slot;
        ``here``: it is on the caller's copy (else on :mod:`orgel.explicit.fallback`'s)."""
        def keep(grad: torch.Tensor) -> None:
            slot = getattr(self._local, "slot", None)
            if slot is not None:  # a backward of the user's own, outside a step: not ours
                if here and name not in self._eager:
                    self._used_here.add(name)
                    if self._moved:  # its forward read the caller's copy, not the ranks' value
                        raise GlueError(
                            f"the Python between the compiled model's graphs read {name!r}, "
                            "which a graph reads too, for the first time after the ranks had "
                            "trained it: this process's copy still held its earlier value, so "
                            "this step is dropped. orgel keeps that copy current from now on: "
                            "run the step again")
                grad = grad.detach() / self.accumulate  # each call counts 1/accumulate
                got = slot.grads.get(name)
                slot.grads[name] = grad.clone() if got is None else got + grad
        return keep

    def step_closures(self, closure: Callable[..., Any], pieces: list[list[Any]],
                      rows: int) -> list[Any]:
        """Run ``closure(*pieces[m])`` for every micro-batch ``m``; their return values."""
        def work(slot: Slot) -> None:
            slot.anchor = torch.zeros((), requires_grad=True)
            slot.sizes = sizes[slot.index]
            # where the graphs were found with symbolic sizes, Dynamo compiles any frame the
            # closure recompiles as it did then (Glue.settings; Dynamo's settings are per thread)
            # past Dynamo's recompile limit a frame would run as Python on the caller's
            # values of parameters the ranks train: stop there instead (_past_limit)
            with dynamo_settings(), self.glue.settings(), _past_limit():
                slot.result = closure(*pieces[slot.index])
            # its forward is over (a closure without a backward has not said so yet): the
            # next micro-batch may look up past its last graph, as the ranks' schedule may
            # need that micro-batch's forward before this one's backward below
            self._turns.passed(slot.index)
            if slot.calls == 0 and not slot.off_path:
                raise RuntimeError(f"micro-batch {slot.index}'s closure returned without "
                                   "calling the compiled model; call it in every closure")
            self._leave_if_short(slot)  # (no backward)
            self._check_calls(slot)
            self._back_unreached(slot, after=-1)  # no backward, or one that missed some

        # the closures' arguments, which the sizes the graphs took symbolic are read off
        # (orgel.transparent.start.closure_inputs): their shapes, and the ranks' stand-ins
        # (all of them: a step of other shapes exchanges its messages' shapes anew)
        named = [closure_tensors(args) for args in pieces]
        sizes = [{n: tuple(t.shape) for n, t in one.items()} for one in named]
        stand_ins = batch_placeholders(named, self.batch_dim, self.replicated)
        try:
            results = [s.result for s in self._run_threads(work, stand_ins, rows)]
        finally:  # (a dropped step too)
            if self._used_here - set(self._eager):  # found in a dropped step: made current
                self._promote_now()
            copy = self._fallback.model_copy  # (micro-batches off the captured graphs ran on it)
            for p in [*self._eager.values(), *([] if copy is None else copy.parameters())]:
                p.grad = None  # summed from the hooks and stepped on a rank
        return results

    def _promote_now(self) -> None:
        """:meth:`_promote` after a dropped step, and the caller's copies of those
        parameters made the ranks' values (read once from the ranks)."""
        self._promote()
        try:
            self._pull_values()
        except WorkerError:  # the ranks are gone: the step's own error says so
            pass

    def _hung(self, slots: list[Slot]) -> Exception:
        first = slots[0]
        if first.calls == 0:  # the ranks wait for its inputs
            return TimeoutError(f"the closure for micro-batch {first.index} neither called the "
                                f"compiled model nor returned within {self._timeout_s:g} s")
        return TimeoutError(f"the closures of micro-batches {[s.index for s in slots]} have "
                            f"not returned {self._timeout_s:g} s after the pipelined step "
                            "ended; a closure must not wait on anything after its backward")

    def _promote(self) -> None:
        """Make the parameters a graph reads whose caller's copy got a gradient this step
        (:attr:`_used_here`) eager ones from now on: their gradient from here joins the
        ranks' on their home rank (every replica of an FSDP stage) this step, their new
        values come back into the caller's module after each optimizer step (the next
        step's Python between graphs reads them), and a graph run here off the captured
        path reads the caller's copy too (it holds the ranks' values)."""
        from orgel.split.exchanges import grad_ranks

        for name in sorted(self._used_here - set(self._eager)):
            p = self._model.get_parameter(name)
            self._eager[name] = p
            self._homes[name] = grad_ranks(name, self.plan, self._split)
            self._stand_for.pop(id(p), None)
            self._remote_ids.discard(id(p))

    def close(self) -> None:
        for hook in [*self._hooks, *self._copy_hooks]:
            hook.remove()
        self._hooks = self._copy_hooks = []
        super().close()


@contextlib.contextmanager
def _past_limit() -> Any:
    """Make Dynamo raise, in this thread, where a closure recompiles a frame past its
    recompile limit: it would run that frame as Python, on the calling process's values of
    parameters the ranks train (not theirs), and its gradients would reach no rank. The
    closure's error stops the step on every rank, saying what to change."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    except FailOnRecompileLimitHit as exc:
        limit = torch._dynamo.config.recompile_limit
        raise GlueError(
            f"Dynamo compiled a frame of the compiled model again past its recompile limit "
            f"({limit}): it would run as Python on this process's stale values of parameters "
            "the ranks train. A frame compiles again for every new value a graph break hands "
            "it under torch.compile(..., dynamic=False) (a float from .item()): compile with "
            "the default dynamic=None, or keep such values tensors") from exc


def _tolerance(autocast: tuple[str, torch.dtype] | None) -> float:
    """How far (relative to the output's largest value) an output computed again here may be
    from the ranks': float32's sums in another order, or under an autocast to a 16-bit type
    eight of its roundings (tensor parallelism rounds each half of a split matmul before the
    sum). Dropout is far outside either: it zeroes values."""
    return 1e-4 if autocast is None else max(1e-4, 8 * torch.finfo(autocast[1]).eps)


def _same(got: Any, want: Any, rtol: float = 1e-4) -> bool:
    """Whether ``got``, an output computed again here, is the ``want`` the ranks gave (a
    tensor, or the fingerprint of one they kept: :class:`orgel.launch.messages.Held`), within
    ``rtol`` of the largest value (:func:`_tolerance`)."""
    if isinstance(want, Held):
        assert want.fingerprint is not None, "orgel.backend's ranks fingerprint held outputs"
        return same_fingerprint(got.detach(), want.fingerprint, rtol)
    if not isinstance(want, torch.Tensor):
        return True
    if want.is_floating_point():
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
        return torch.allclose(got.detach(), want.detach(), rtol=rtol,
                              atol=1e-6 + rtol * scale, equal_nan=True)
    return torch.equal(got, want)

"""``orgel.backend``'s first step: the graphs micro-batch 0's closure calls.

:class:`FindsGraphs`, mixed into :class:`orgel.transparent.backend.Backend`, runs micro-batch
0's closure up to its backward (:mod:`orgel.transparent.discover`), records the graphs
Dynamo hands the backend on the way, and makes one graph the pipelined
:class:`~orgel.transparent.graph_model.GraphModel` or starts several joined (graph breaks).
It also holds the rule that the autocast around the compiled model stays as found.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from orgel import guard
from orgel.graph.dynamo import dynamo_settings, forget_compiled
from orgel.graph.glue import RETURNS_SIZE, returns_size
from orgel.graph.glue_sizes import glue_settings, size_values
from orgel.graph.opgraph import CaptureError
from orgel.guard import untouched
from orgel.precision import ambient_autocast, device_type
from orgel.transparent.discover import (
    ForwardDone,
    compiled_module,
    stop_outputs,
    stopped_at_backward,
)
from orgel.transparent.graph_model import GraphModel, describe_autocast, unbound
from orgel.transparent.slicing import marked
from orgel.worker.pipe import canonical_names


class Breaks(Exception):  # noqa: N818 - a signal, not an error the caller sees
    """The symbolic discovery met a graph break (it stops there)."""


class FindsGraphs:
    """The first step's discovery; :class:`~orgel.transparent.backend.Backend` sets what
    it reads and provides :meth:`_start_glued`."""

    model: GraphModel | None
    pipe: Any
    _found: list[tuple[Any, ...]] | None
    _discovering: bool
    _names: dict[int, str] | None
    _module: torch.nn.Module | None
    _autocast: tuple[str, torch.dtype] | None
    _precision: torch.dtype | None
    _pending_load: str | Path | None
    #: the sizes of micro-batch 0's closure arguments that the graphs of a forward with graph
    #: breaks take symbolic (empty: found static), and every closure's arguments
    _glue_values: tuple[int, ...] = ()
    _pieces: list[list[Any]] = []

    def _start_glued(self) -> None:
        raise NotImplementedError

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
                f"the compiled model now runs under {describe_autocast(now)} but the first step "
                f"ran it under {describe_autocast(self._autocast)}: the ranks run it as the first "
                "step did. Keep the autocast around the compiled model the same in every closure")


    def _discover(self, closure: Callable[..., Any], args: list[Any], dynamic: bool,
                  sizes: tuple[int, ...] = ()) -> None:
        """Run micro-batch 0's closure up to its backward; record the graphs it calls.

        The graphs run here on detached copies of the parameters and buffers
        (nothing of the caller's changes), and the closure stops where its
        ``backward`` (or ``torch.autograd.grad``) begins, before a gradient reaches a
        parameter (:func:`stopped_at_backward`).
        One graph that reads parameters is pipelined as is; several are joined
        (:mod:`orgel.graph.glue`) and the closures run the Python between them.
        ``dynamic``: every dimension of the closure's tensor arguments is marked as
        possibly dynamic (:func:`torch._dynamo.maybe_mark_dynamic`, on views of them), so
        Dynamo leaves the sizes it can symbolic and a later batch of another sequence
        length runs the same graph. A graph break then stops the discovery at once
        (:class:`Breaks`): several graphs are found again (:meth:`_find_graphs`), with
        ``sizes``, so the trace of the rest this way would be for nothing.
        ``sizes``: the sizes of the closure's arguments, which Dynamo then leaves symbolic in
        every frame it compiles, the resumed ones after a break included
        (:func:`orgel.graph.glue_sizes.glue_settings`): how several graphs are found to be
        joined with symbolic sizes.
        """
        if dynamic:
            args = [marked(a) for a in args]
        self._found = []
        self._discovering = True
        try:
            with untouched(), dynamo_settings(), glue_settings(sizes), stopped_at_backward(), \
                    guard.no_autocast_cache(), \
                    torch._dynamo.error_on_graph_break(True) if dynamic else nullcontext():
                closure(*args)
        except ForwardDone:
            pass
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
            self._found = None
            if not dynamic:
                raise
            raise Breaks from exc
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
        from orgel.graph.glue_capture import check_grad_mode

        if self._names is None:
            self._module = compiled_module()
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
        if self._glue_values and returns_size(gm):  # joined symbolic it cannot be: say so
            # before Dynamo traces the rest of the forward with symbolic sizes
            raise CaptureError(RETURNS_SIZE.format(len(self._found or ())))
        out = gm(*shadow)
        if torch.is_grad_enabled():  # as the ranks' outputs come back (GraphCall): every
            # floating one takes a gradient, so the frames after it compile as in training
            out = _differentiable(out)
        stop_outputs(out)
        assert self._found is not None
        if "param" in kinds or "buffer" in kinds:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            self._found.append((gm, example_inputs, roles, list(args), outs))
        return out

    def _find_graphs(self, closure: Callable[..., Any], pieces: list[list[Any]]) -> None:
        """The first step: micro-batch 0's graphs; one is pipelined as :attr:`model`,
        several are joined and started (:meth:`_start_glued`)."""
        try:
            self._discover(closure, pieces[0], dynamic=True)
            assert self._found is not None
            again = len(self._found) > 1 and any(kind == "size" for _, _, roles, _, _ in
                                                 self._found for kind, _ in roles)
        except Breaks:
            again = True
        self._pieces = pieces
        self._glue_values = ()
        if again:
            # graph breaks: find the graphs again, every size of the closure's arguments
            # symbolic wherever Dynamo meets it, so that they join with symbolic sizes; where
            # they cannot (a graph returns a size), found static
            self._glue_values = size_values({str(i): a for i, a in enumerate(pieces[0])})
            try:
                self._find_again(closure, pieces[0])
                self._use_found()
                return
            except CaptureError:
                self._glue_values = ()
            self._find_again(closure, pieces[0])
        self._use_found()

    def _find_again(self, closure: Callable[..., Any], args: list[Any]) -> None:
        """Find the graphs again (graph breaks), with :attr:`_glue_values` symbolic."""
        forget_compiled(self)
        self._names = None
        self._discover(closure, args, dynamic=False, sizes=self._glue_values)
        assert self._found is not None

    def _use_found(self) -> None:
        """Pipeline the one graph found as :attr:`model`, or join and start several."""
        if not self._found:
            raise RuntimeError("the closure for micro-batch 0 returned without calling "
                               "the compiled model (or it reads no parameter); call it "
                               "once per closure")
        if len(self._found) == 1:
            gm, example_inputs, roles, args, _ = self._found[0]
            if self._glue_values and unbound(roles):
                raise CaptureError("a size of the one graph is no size of its inputs")
            around = self._autocast
            if around is None and self._precision is not None:
                around = (device_type(args), self._precision)
            self.model = GraphModel(gm, example_inputs, roles, around)
            return
        # the Python between the graphs runs in the closures, under their autocast
        around = self._autocast
        if self._precision is not None and around is None:
            from orgel.flow.options import REFUSED

            raise RuntimeError(REFUSED[("backend graph breaks", "precision")])
        if around is not None and self._precision not in (None, around[1]):
            raise RuntimeError(
                f"orgel.backend's precision names {self._precision} but the closure runs "
                f"the compiled model under {describe_autocast(around)}; with graph "
                "breaks the closure's autocast is the one that runs (precision= only "
                "turns float16's loss scaling on): make the two agree")
        self._start_glued()


def _differentiable(out: Any) -> Any:
    """``out`` (a graph's outputs) with every floating tensor taking a gradient."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
            return t.detach().requires_grad_()
        return t

    return type(out)(one(t) for t in out) if isinstance(out, (tuple, list)) else one(out)

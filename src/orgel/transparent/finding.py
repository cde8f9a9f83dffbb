"""``orgel.backend``'s first step: the graphs micro-batch 0's closure calls.

:class:`FindsGraphs`, mixed into :class:`orgel.transparent.backend.Backend`, runs micro-batch
0's closure up to its backward (:mod:`orgel.transparent.discover`), records the graphs
Dynamo hands the backend on the way, joins them (one graph too) and starts them.
It also holds the rule that the autocast around the compiled model stays as found.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orgel import guard
from orgel.explicit.closures import closure_tensors
from orgel.graph.dynamo import dynamo_settings, forget_compiled
from orgel.graph.glue import RETURNS_SIZE, returns_size
from orgel.graph.glue_sizes import capture_settings, size_values
from orgel.graph.opgraph import CaptureError
from orgel.guard import untouched
from orgel.precision import ambient_autocast, device_type
from orgel.transparent.discover import (
    ForwardDone,
    compiled_module,
    leaf_grads_kept,
    stop_outputs,
    stopped_at_backward,
)
from orgel.transparent.graph_model import describe_autocast
from orgel.worker.pipe import canonical_names


class FindsGraphs:
    """The first step's discovery; :class:`~orgel.transparent.backend.Backend` sets what
    it reads and provides :meth:`_start_glued`."""

    pipe: Any
    _found: list[tuple[Any, ...]] | None
    _discovering: bool
    _names: dict[int, str] | None
    _module: torch.nn.Module | None
    _autocast: tuple[str, torch.dtype] | None
    #: the autocast the joined graphs run under: the closure's, or precision='s (one graph)
    _region: tuple[str, torch.dtype] | None = None
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
        ranks re-create the one the first step ran under (the joined graph's region).
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


    def _discover(self, closure: Callable[..., Any], args: list[Any],
                  sizes: tuple[int, ...] = ()) -> None:
        """Run micro-batch 0's closure up to its backward; record the graphs it calls.

        The graphs run here on detached copies of the parameters and buffers
        (nothing of the caller's changes), and the closure stops where its
        ``backward`` (or ``torch.autograd.grad``) begins, before a gradient reaches a
        parameter (:func:`stopped_at_backward`); a leaf of the closure's own that it
        reached before stopping gets its gradient back (:func:`leaf_grads_kept`). The
        graphs are joined (:mod:`orgel.graph.glue`; one graph too) and the closures run
        the Python around and between them.
        ``sizes``: the sizes of the closure's arguments, which Dynamo then leaves symbolic in
        every frame it compiles, the resumed ones after a break included
        (:func:`orgel.graph.glue_sizes.glue_settings`): how the graphs are found to be
        joined with symbolic sizes.
        """
        self._found = []
        self._discovering = True
        try:
            with untouched(), leaf_grads_kept(), dynamo_settings(), capture_settings(sizes), \
                    stopped_at_backward(), guard.no_autocast_cache():
                closure(*args)
        except ForwardDone:
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
        from orgel.graph.glue_capture import check_grad_mode

        if self._names is None:
            self._module = compiled_module()
            self._names = {} if self._module is None else canonical_names(self._module)
        # a graph of a resumed frame names the parameters from one of its locals (a
        # submodule on the stack): name them as the compiled model does
        roles = [(kind, self._names.get(id(a), name)) if kind in ("param", "buffer")
                 else (kind, name) for (kind, name), a in zip(roles, args, strict=True)]
        kinds = [kind for kind, _ in roles]
        stateful = "param" in kinds or "buffer" in kinds  # the model's, not the closure's
        shadow = [a.detach().requires_grad_(a.requires_grad) if k == "param"
                  else a.detach().clone() if k == "buffer" else a
                  for a, k in zip(args, kinds, strict=True)]
        if stateful:
            # (a graph of buffers alone may run under the model's own no_grad: transformers
            # 4.57's rotary embedding; the closure's no_grad leaves every graph without one)
            trains = any(k == "param" and a.requires_grad for k, a in zip(kinds, args,
                                                                          strict=True))
            if trains and not torch.is_grad_enabled():
                raise RuntimeError(
                    "the first step's closure called the compiled model under "
                    "torch.no_grad(): that step finds the graphs the ranks train, so call "
                    "the model with gradients on there (a closure that runs no backward "
                    "still changes nothing); later steps' closures may call it under "
                    "torch.no_grad()")
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
        if stateful:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            self._found.append((gm, example_inputs, roles, list(args), outs))
        return out

    def _find_graphs(self, closure: Callable[..., Any], pieces: list[list[Any]]) -> None:
        """The first step: micro-batch 0's graphs, joined and started (:meth:`_start_glued`).

        They are found with every size of the closure's arguments symbolic wherever Dynamo
        meets it, so that a later batch of another length or batch size runs the same
        graphs; where they cannot be so (a graph returns a size), found static.
        """
        from torch._dynamo.exc import TorchDynamoException

        self._pieces = pieces
        self._glue_values = size_values(closure_tensors(pieces[0]))
        try:
            self._find(closure, pieces[0])
            self._use_found()
            return
        except (CaptureError, TorchDynamoException):
            # Dynamo fails on some code with those sizes symbolic: an int of the model's
            # equal to one of them (a layer count of 2 beside 2 rows) slices a list
            if not self._glue_values:
                raise
            self._glue_values = ()
        self._find(closure, pieces[0])
        self._use_found()

    def _find(self, closure: Callable[..., Any], args: list[Any]) -> None:
        """Find the graphs, with :attr:`_glue_values` symbolic."""
        forget_compiled(self)
        self._names = None
        self._discover(closure, args, sizes=self._glue_values)
        assert self._found is not None

    def _use_found(self) -> None:
        """Join the graphs found and start them; the closures run the Python around them."""
        if not self._found:
            raise RuntimeError("the closure for micro-batch 0 returned without calling "
                               "the compiled model (or it reads no parameter); call it "
                               "in every closure")
        around = self._autocast
        if self._precision is not None and around is None:
            if len(self._found) > 1:
                from orgel.flow.options import REFUSED

                raise RuntimeError(REFUSED[("backend graph breaks", "precision")])
            # one graph: precision= opens the autocast around it, as the closure's would
            self._region = (device_type(self._found[0][3]), self._precision)
        else:
            self._region = around
        if around is not None and self._precision not in (None, around[1]):
            raise RuntimeError(
                f"orgel.backend's precision names {self._precision} but the closure runs "
                f"the compiled model under {describe_autocast(around)}; the closure's "
                "autocast is the one that runs (precision= only turns float16's loss "
                "scaling on): make the two agree")
        self._start_glued()


def _differentiable(out: Any) -> Any:
    """``out`` (a graph's outputs) with every floating tensor taking a gradient."""
    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
            return t.detach().requires_grad_()
        return t

    return type(out)(one(t) for t in out) if isinstance(out, (tuple, list)) else one(out)

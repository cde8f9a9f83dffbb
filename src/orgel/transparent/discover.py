"""The first step of ``orgel.backend``: run a closure's forward and stop at its backward.

:func:`stopped_at_backward` lets micro-batch 0's closure run up to the first backward
(without replacing anything of torch), :func:`leaf_grads_kept` puts back the gradients
that backward gave before it stopped; :func:`compiled_module` finds the module
``torch.compile`` wrapped.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from orgel.guard import GradSnapshot, grad_snapshot, put_grad_back


class ForwardDone(BaseException):
    """Raised where the closure run by :meth:`Backend._discover` calls backward."""


def stopped_at_backward() -> torch.autograd.graph.saved_tensors_hooks:
    """A backward of what the body computes raises :class:`ForwardDone` when it begins.

    Autograd's saved-tensor hooks, on this thread only while the body runs (nothing of
    torch is replaced: the closure calls the real ``backward`` and
    ``torch.autograd.grad``): every tensor an operation saves for its backward comes
    back only through :func:`_stop`, so the backward stops at the first node that
    reads one, the loss's own in practice, before a gradient reaches a leaf. The
    graphs' outputs stop it as well (:func:`stop_outputs`), so a backward whose
    first nodes save nothing stops at the model at the latest; a leaf of the
    closure's own that such a chain reaches first (``(out.sum() + w.sum()).backward()``)
    gets its ``.grad``, which :func:`leaf_grads_kept` puts back.
    """
    return torch.autograd.graph.saved_tensors_hooks(_pack, _stop)


def _pack(t: torch.Tensor) -> torch.Tensor:
    # detached: a packed output holding its own grad_fn would never be freed
    return t.detach()


def _stop(_packed: Any) -> torch.Tensor:
    raise ForwardDone


def stop_outputs(out: Any) -> None:
    """Make a backward that reaches the graph's outputs ``out`` raise :class:`ForwardDone`."""
    for t in out if isinstance(out, (tuple, list)) else [out]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(_stop)


@contextlib.contextmanager
def leaf_grads_kept() -> Iterator[None]:
    """Every leaf tensor of this process that requires grad has the ``.grad`` it had before
    the block once the block ends (:func:`orgel.guard.put_grad_back`, as ``untouched`` puts
    a model's back).

    The leaves are found among the objects the garbage collector tracks (tensors are),
    as nothing records which tensors a closure reads: a backward stopped by
    :func:`stopped_at_backward` may have reached a leaf of the closure's own through
    nodes that save nothing, and that gradient belongs to no step.
    """
    before: list[tuple[torch.Tensor, GradSnapshot]] = []
    for obj in gc.get_objects():
        # by type(), not isinstance(): that reads __class__, which a dead weak proxy
        # raises at and a deprecated name of torch warns at
        if issubclass(type(obj), torch.Tensor) and _is_leaf(obj):
            before.append((obj, grad_snapshot(obj)))
    try:
        yield
    finally:
        for leaf, snapshot in before:
            put_grad_back(leaf, snapshot)


def _is_leaf(t: torch.Tensor) -> bool:
    if isinstance(t, FakeTensor):  # (a trace's stand-in, left over by a compile)
        return False
    try:  # (an otherwise unusual tensor that cannot say counts as none)
        return bool(t.requires_grad and t.grad_fn is None)
    except Exception:  # noqa: BLE001
        return False


def compiled_module() -> torch.nn.Module | None:
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

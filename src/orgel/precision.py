"""Training precision, named as the ecosystem names it: ``"32"``, ``"bf16-mixed"``, ``"16-mixed"``.

``"bf16-mixed"`` is ``torch.autocast(dtype=torch.bfloat16)`` around the
forward and the loss, as one process writes it::

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(x), y)
    loss.backward()

``"16-mixed"`` is the same with float16 and ``torch.amp.GradScaler``'s loss
scaling, done for the whole pipeline at once (:mod:`orgel.runtime.scaler`).

Parameters, gradients and optimizer state stay float32. orgel captures the
forward inside that autocast region, so the graph holds the region and every
stage re-enters it (:mod:`orgel.split`): each op runs in the dtype it has in
one process, profiling measures it so, and values cross between ranks in the
dtype they have (bfloat16 activations: half the bytes). The loss runs under the
same autocast on the loss rank.

A model whose parameters are already bfloat16 (``model.to(torch.bfloat16)``)
trains with the default ``"32"``: orgel keeps the dtypes it finds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.names import PRECISION_DTYPES

#: precision name -> the autocast dtype (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {
    name: None if dtype is None else getattr(torch, dtype)
    for name, dtype in PRECISION_DTYPES.items()
}
_LATER = {
    "bf16-true": "orgel does not convert your model; call model.to(torch.bfloat16) yourself "
                 "and keep precision='32' (orgel keeps the dtypes it finds)",
}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision``; ValueError naming the values for anything else."""
    if precision in PRECISIONS:
        return PRECISIONS[precision]
    why = _LATER.get(str(precision))
    if why is not None:
        raise ValueError(f"precision={precision!r} is not supported: {why}")
    raise ValueError(f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)}, "
                     f"got {precision!r}")


def scales_loss(precision: str) -> bool:
    """Whether ``precision`` trains with loss scaling (float16)."""
    return autocast_dtype(precision) == torch.float16


#: what a closure that starts its backward from the loss itself under float16 is told
UNSCALED_BACKWARD = ("precision='16-mixed': start the closure's backward from pipe.scale(loss) "
                     "(as GradScaler's scaler.scale(loss).backward()), not from loss itself: "
                     "the ranks unscale every gradient by the loss scale")


def loss_scaling(precision: str, loss_scale: dict[str, Any] | None) -> bool | dict[str, Any]:
    """What the ranks' loss scaler takes (:mod:`orgel.runtime.scaler`): False without
    float16, else GradScaler's options given (``True`` for its defaults). ValueError for
    ``loss_scale`` under a precision that does not scale the loss."""
    if loss_scale is not None and not scales_loss(precision):
        raise ValueError("loss_scale is for precision='16-mixed' (float16 needs it); "
                         f"precision={precision!r} does not scale the loss")
    return scales_loss(precision) and (dict(loss_scale or {}) or True)


def device_type(values: Any) -> str:
    """The device type autocast should use for these tensors (the first one's; else cpu).

    A meta tensor (a meta model's shapes-only trace) runs nowhere and autocast takes no
    "meta": cpu's region, which leaves meta tensors as they are.
    """
    for t in pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor):
            return "cpu" if t.device.type == "meta" else t.device.type
    return "cpu"


class AutocastLoss:
    """``loss_fn`` run under the precision's autocast, on the outputs' device type."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], dtype: torch.dtype) -> None:
        self.loss_fn = loss_fn
        self.dtype = dtype

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        with torch.autocast(device_type(outputs), dtype=self.dtype):
            return self.loss_fn(outputs, targets)


def autocast_loss(loss_fn: Callable[[Any, Any], torch.Tensor],
                   precision: str) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` under ``precision``'s autocast (``loss_fn`` itself for ``"32"``)."""
    dtype = autocast_dtype(precision)
    return loss_fn if dtype is None else AutocastLoss(loss_fn, dtype)


def autocast(precision: str, device: str = "cpu") -> Any:
    """The context one process runs its forward and loss in under ``precision``."""
    dtype = autocast_dtype(precision)
    return torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def ambient_autocast() -> tuple[str, torch.dtype] | None:
    """``(device type, dtype)`` of the autocast enabled around this call (None: none)."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def check_around(call: str, precision: str | None, *, trains: bool,
                 closures: bool = False) -> None:
    """Refuse a pipeline call made under a grad mode or an autocast it would not honour.

    The ranks run the precision the pipeline was built with, and ``orgel.backend``'s
    closures run in threads of their own: a ``torch.no_grad()`` or ``torch.autocast``
    around the call reaches neither, so one process and the pipeline would compute
    different things (a validation batch trained, float32 where bfloat16 was meant).
    ``call``: what was called (``"pipe.step"``); ``precision``: the pipeline's (None:
    unknown here, left unchecked); ``trains``: the call trains (gradients must be on);
    ``closures``: the call runs ``orgel.backend``'s closures.
    """
    if trains and not torch.is_grad_enabled():
        advice = ("to evaluate, call the compiled model under torch.no_grad() outside "
                  "pipe.step, or call pipe.step without the no_grad around it and with a "
                  "closure that calls no backward" if closures else
                  "to compute a loss without training, call pipe.evaluate(inputs, targets)")
        raise RuntimeError(f"{call} trains (a backward and an optimizer step on the ranks) "
                           f"but was called under torch.no_grad(): {advice}")
    around = ambient_autocast()
    if around is None or (not closures and precision is None):
        return
    if not closures and PRECISIONS.get(precision or "32") == around[1]:
        return  # the pipeline's own precision: the ranks run it anyway
    device, dtype = around
    named = {v: k for k, v in PRECISIONS.items() if v is not None}.get(dtype)
    given = f"torch.autocast({device!r}, dtype={dtype})"
    if closures:
        raise RuntimeError(
            f"{call} was called under {given}, which the closures do not see (each runs in "
            "a thread of its own): open the autocast inside the closure, around the compiled "
            "model's call" + (f", or pass precision={named!r} to orgel.backend" if named else ""))
    raise RuntimeError(
        f"{call} was called under {given}, which the ranks do not see: they run the "
        f"pipeline's precision={precision!r}. "
        + (f"Build the pipeline with precision={named!r} and call {call} without the "
           "autocast" if named else "Call it without the autocast"))

"""How a call and its answer travel on the pipe between the controller and a local rank.

A pipe pickles with :class:`multiprocessing.reduction.ForkingPickler`, for which PyTorch
registers tensors to travel by shared memory: each tensor's memory is copied into a
shared segment whose file descriptor is handed over on a socket of its own, with an
authentication challenge. For a batch of a few kilobytes that is most of the way: on one
rank training a tiny GPT it was about a tenth of the rank's step, and the controller's
thread that hands the descriptors over was busy in a third of its samples
(docs/gpu.md, 2026-12-04). :func:`send` pickles a message whose tensors hold at most
:data:`BY_VALUE_BYTES` in all with their bytes inside (plain CPU tensors; anything else as
before), and a larger one as before. The receiving end needs nothing: a pipe's ``recv``
unpickles either.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

#: a message whose tensors hold at most this many bytes carries them by value
BY_VALUE_BYTES = 1 << 20


class Held(NamedTuple):
    """An output a rank keeps until the controller asks for it (``"o_fetch"``, by
    ``token``), sent in its place: what the controller needs of it before that
    (:class:`orgel.explicit.lazy.LazyOutput`), and its :func:`fingerprint` where the
    controller may check a graph computed again against it (``orgel.backend``'s)."""

    token: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    fingerprint: tuple[float, float] | None


def fingerprint(value: torch.Tensor) -> tuple[float, float]:
    """The sum and the 2-norm of ``value``'s elements (accumulated in float32 at least, in float64
    for integers): what tells a tensor computed again from the one the ranks computed (a graph
    that draws random numbers) without its values (:func:`same_fingerprint`)."""
    if value.is_floating_point():
        wide = torch.promote_types(value.dtype, torch.float32)
        return (float(value.sum(dtype=wide)),
                float(torch.linalg.vector_norm(value, dtype=wide)))
    exact = value.to(torch.float64)  # (integers and booleans, rarely large)
    return float(exact.sum()), float(exact.abs().sum())


def same_fingerprint(value: torch.Tensor, want: tuple[float, float],
                     rtol: float = 1e-4) -> bool:
    """Whether ``value``'s :func:`fingerprint` is ``want`` up to float32's sums (``rtol``, a
    relative 1e-4 of the norm by default; the sum within that times the square root of the
    element count)."""
    total, norm = fingerprint(value)
    slack = rtol * want[1] + 1e-6
    return abs(norm - want[1]) <= slack and \
        abs(total - want[0]) <= slack * max(1.0, value.numel()) ** 0.5


def send(conn: Connection, message: Any) -> None:
    """Send ``message`` on ``conn``: small tensors inside it, large ones by shared memory.
    A connection of orgel's own (under torchrun, :class:`orgel.explicit.mailbox.ByValue`)
    pickles as it does."""
    if not isinstance(conn, Connection):
        conn.send(message)
        return
    tensors = [t for t in pytree.tree_leaves(message) if isinstance(t, torch.Tensor)]
    if sum(t.nbytes for t in tensors) <= BY_VALUE_BYTES:
        try:
            data = dumps(message)
        except Exception:  # noqa: BLE001 - what plain pickling cannot carry goes as before
            pass
        else:
            conn.send_bytes(data)
            return
    conn.send(message)


def dumps(message: Any) -> bytes | memoryview:
    """``message`` pickled with its plain CPU tensors' bytes inside (``pickle.loads``
    reads it). Tensors pickled by torch's own reduction go through ``torch.save`` one by
    one; this is what a pipe carries by value here and torchrun's connections always
    (:class:`orgel.explicit.mailbox.ByValue`). Raises what pickling raises."""
    buffer = io.BytesIO()
    _ByValue(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getbuffer()


class _ByValue(pickle.Pickler):
    """Pickles a plain, dense CPU tensor as its bytes, its dtype and its shape."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" \
                or obj.layout != torch.strided or obj.is_quantized or obj.is_conj() \
                or obj.is_neg():
            return NotImplemented
        if obj.requires_grad and not obj.is_leaf:  # torch's own way refuses it: so does send
            raise pickle.PicklingError("a non-leaf tensor that requires grad")
        value = obj.detach().contiguous()
        flat = value.reshape(-1)
        if flat.numel() and flat.stride(0) != 1:  # one value expanded: its strides are 0,
            flat = torch.empty(1, dtype=flat.dtype).copy_(flat)  # "contiguous" at size 1
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        return _rebuild, (data, value.dtype, tuple(value.shape), obj.requires_grad)


def _rebuild(data: bytes, dtype: torch.dtype, shape: tuple[int, ...],
             requires_grad: bool) -> torch.Tensor:
    """The tensor :class:`_ByValue` pickled (a copy of its own, writable)."""
    if not data:
        value = torch.empty(shape, dtype=dtype)
    else:
        value = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    return value.requires_grad_(requires_grad) if requires_grad else value

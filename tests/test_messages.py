"""The pipe between the controller and a local rank: small tensors travel inside the message
(torch's shared-memory way cost about a tenth of a small rank's step), large ones by shared
memory as before; every pipeline test sends its batches this way."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from orgel.launch.messages import BY_VALUE_BYTES, send


def _through(message: object) -> object:
    a, b = mp.Pipe()
    send(a, message)
    return b.recv()


def test_small_tensors_arrive_equal_and_as_they_were() -> None:
    tokens = torch.randint(0, 9, (8, 512))
    half = torch.randn(3, 4, dtype=torch.bfloat16).t()  # not contiguous, no numpy dtype
    empty = torch.empty(0, 5)
    leaf = torch.ones(2, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(2, 2))
    got = _through(("step", (tokens, half, empty, leaf, weight, 3), {"k": torch.tensor(2.5)}))
    method, (t, h, e, lf, w, n), kw = got  # type: ignore[misc]
    assert method == "step" and n == 3 and kw["k"].item() == 2.5
    assert torch.equal(t, tokens) and not t.is_shared()
    assert h.dtype == torch.bfloat16 and torch.equal(h, half)
    assert e.shape == (0, 5)
    assert lf.requires_grad and torch.equal(lf, leaf)
    assert isinstance(w, torch.nn.Parameter) and torch.equal(w, weight)
    t.add_(1)  # a copy of its own, writable
    assert not torch.equal(t, tokens)


def test_one_value_expanded_arrives_as_its_shape() -> None:
    """A scalar expanded to a shape of ones (strides 0, which torch calls contiguous at size
    1): its bytes are the one value (it crashed the torchrun pipe of ``orgel.backend``, a
    batch of one row and one micro-batch, found by ``benchmarks/fuzz.py --seed 115``)."""
    from orgel.explicit.mailbox import pipe_here

    ones = torch.tensor(7).expand(1, 1)
    half = torch.tensor(2.5, dtype=torch.bfloat16).expand(1)
    here, there = pipe_here()  # torchrun's connection: it pickles every tensor by value
    try:
        for got, want in zip([_through((ones, half)), _send_recv(here, there, (ones, half))],
                             [(ones, half)] * 2, strict=True):
            for g, w in zip(got, want, strict=True):  # type: ignore[call-overload]
                assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
    finally:
        here.close()
        there.close()


def _send_recv(here: object, there: object, message: object) -> object:
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(there.recv()))  # type: ignore[attr-defined]
    reader.start()
    here.send(message)  # type: ignore[attr-defined]
    reader.join(timeout=30)
    return got[0]


def test_large_tensors_travel_by_shared_memory() -> None:
    big = torch.zeros(BY_VALUE_BYTES // 4 + 1)
    (got,) = _through((big,))  # type: ignore[misc]
    assert got.is_shared() and torch.equal(got, big)


def test_a_non_leaf_that_requires_grad_is_refused_as_torch_refuses_it() -> None:
    a, _ = mp.Pipe()
    with pytest.raises(RuntimeError, match="non-leaf tensor which requires_grad"):
        send(a, (torch.ones(2, requires_grad=True) * 2,))


def test_torchruns_connections_carry_tensors_by_value_too() -> None:
    """torchrun's processes are not one family (no shared memory between them): their
    connection (:class:`orgel.explicit.mailbox.ByValue`) pickles every message by value,
    the plain CPU tensors as their bytes, large ones too; a non-leaf that requires grad is
    refused there as well."""
    from orgel.explicit.mailbox import pipe_here

    here, there = pipe_here()
    big = torch.arange(BY_VALUE_BYTES // 4 + 1, dtype=torch.float32)
    half = torch.randn(3, 4, dtype=torch.bfloat16).t()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(there.recv()))
    reader.start()  # a message larger than the socket's buffer: read while it is sent
    here.send(("step", (big, half, torch.nn.Parameter(torch.ones(2)))))
    reader.join(timeout=30)
    method, (b, h, w) = got[0]  # type: ignore[misc]
    assert method == "step" and torch.equal(b, big) and not b.is_shared()
    assert torch.equal(h, half) and isinstance(w, torch.nn.Parameter)
    with pytest.raises(Exception, match="non-leaf"):
        here.send((torch.ones(2, requires_grad=True) * 2,))
    here.close()
    there.close()

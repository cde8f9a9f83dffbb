"""Model outputs that stay on their rank until the calling process reads them.

The loss-stage rank hands the controller each micro-batch's outputs
(:mod:`orgel.worker.closure`). A causal language model's logits are
``rows × tokens × vocabulary`` numbers of which a closure that trains on the model's own
``outputs.loss`` reads none: a Qwen2 of vocabulary 32000 through ``orgel.backend`` spent
about 60 ms of every micro-batch of 2 x 128 tokens bringing its 16 MiB of logits over
(``benchmarks/backend_overhead.py --vocab 32000``). So an output larger than what a
message carries by value (:data:`orgel.launch.messages.BY_VALUE_BYTES`) stays on the rank
(:class:`orgel.launch.messages.Held`), and the controller gets a :class:`LazyOutput`: a
tensor of the same shape and dtype whose values are fetched the first time any operation
reads them (``"o_fetch"``, answered while the rank waits for the controller). One that
nothing read is freed on the rank soon after it is dropped here (``"o_free"``); one still
held at the end of the step is fetched then (:meth:`LazyOutputs.settle`), since the rank
forgets its outputs when its next step begins.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.launch.messages import Held


class LazyOutput(torch.Tensor):
    """A tensor whose values are fetched from a rank when first read.

    Shape, dtype, device and ``requires_grad`` are known without the values; every
    operation (``__torch_dispatch__``) works on the fetched tensor and returns plain
    tensors; the fetch happens once.
    """

    held: Held
    _lock: threading.Lock
    _fetch: Callable[[], torch.Tensor]
    _value: torch.Tensor | None

    @staticmethod
    def __new__(cls, held: Held, fetch: Callable[[], torch.Tensor]) -> LazyOutput:
        t = torch.Tensor._make_wrapper_subclass(cls, held.shape, dtype=held.dtype,
                                                device=torch.device("cpu"))
        t.held = held
        t._fetch = fetch
        t._value = None
        t._lock = threading.Lock()
        return t  # type: ignore[no-any-return]

    def __init__(self, *_: Any) -> None:  # (the arguments are __new__'s)
        super().__init__()

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def materialized(self) -> torch.Tensor:
        """The values, fetched on the first call."""
        with self._lock:
            if self._value is None:
                self._value = self._fetch()
            return self._value

    @property
    def fetched(self) -> bool:
        return self._value is not None

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        def real(x: Any) -> Any:
            return x.materialized() if isinstance(x, LazyOutput) else x

        return func(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs or {}))

    # what does not go through the dispatcher
    def __repr__(self, **_: Any) -> str:  # type: ignore[override]
        return repr(self.materialized())

    def tolist(self) -> Any:  # type: ignore[override]
        return self.materialized().tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                               "tensor.detach().numpy() instead.")
        return self.materialized().numpy()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.materialized().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Any) -> torch.Tensor:
        return self.materialized().clone()


class LazyOutputs:
    """The controller's side of held outputs: wraps them (:meth:`wrap`), fetches and frees
    them on the rank, and fetches at the end of a step what is still held (:meth:`settle`).

    ``send(rank, message)`` and ``get(kind, key, rank, what)`` are the controller's pipes
    and mailbox.
    """

    def __init__(self, send: Callable[[int, tuple[str, Any, Any]], None],
                 get: Callable[..., Any]) -> None:
        self._send = send
        self._get = get
        self._lock = threading.Lock()
        self._step: list[weakref.ref[LazyOutput]] = []
        #: (rank, token) of outputs dropped unread: sent by :meth:`_flush`, not by the
        #: finalizer (it may run inside a send on the same pipe, which holds its lock)
        self._freed: list[tuple[int, int]] = []

    def wrap(self, values: list[Any], rank: int) -> list[Any]:
        """``values`` as the rank sent them, each :class:`Held` one as a :class:`LazyOutput`."""
        self._flush()
        return [self._lazy(v, rank) if isinstance(v, Held) else v for v in values]

    def _lazy(self, held: Held, rank: int) -> LazyOutput:
        finalizers: list[weakref.finalize] = []

        def fetch() -> torch.Tensor:
            self._send(rank, ("o_fetch", held.token, None))
            value = self._get("o_value", held.token, rank, "an output the closure read")
            for finalizer in finalizers:  # the rank let it go as it sent it
                finalizer.detach()
            return value  # type: ignore[no-any-return]

        lazy = LazyOutput(held, fetch)
        finalizer = weakref.finalize(lazy, self._freed.append, (rank, held.token))
        finalizer.atexit = False
        finalizers.append(finalizer)
        with self._lock:
            self._step.append(weakref.ref(lazy))
        return lazy

    def _flush(self) -> None:
        """Tell the ranks which held outputs were dropped unread (they free them)."""
        while self._freed:
            try:
                rank, token = self._freed.pop()
            except IndexError:  # another thread took the last one
                return
            try:
                self._send(rank, ("o_free", token, None))
            except Exception:  # noqa: BLE001, S110 - a closed pipe: nothing is held any more
                pass

    def settle(self, stopped: bool) -> None:
        """The step's closures are done: fetch what is still held and still referenced
        here (the rank forgets it when its next step begins); a stopped step's are gone."""
        with self._lock:
            step, self._step = self._step, []
        self._flush()
        for ref in step:
            lazy = ref()
            if lazy is None or lazy.fetched:
                continue
            if not stopped:
                try:
                    lazy.materialized()
                    continue
                except Exception:  # noqa: BLE001 - the step stopped meanwhile: its own error
                    pass
            lazy._fetch = _gone


def _gone() -> torch.Tensor:
    raise RuntimeError("this output of the compiled model was never read in the step that "
                       "made it, and that step stopped (its values are gone): read what "
                       "you need of the outputs within the step")

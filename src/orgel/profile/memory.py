"""Live tensor bytes by watching every op's outputs (for CPUs without allocator stats).

:class:`LiveBytes` is a dispatch mode: each tensor an op returns is counted
once per storage (views share their base's storage) and subtracted when the
last tensor on that storage is garbage collected; ``peak`` is the most bytes
alive at once since the mode was entered, ``now`` the bytes alive right now.
Only storages created under the mode count, so inputs and parameters made
before it are left out.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Track bytes of storages allocated under this mode that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensors]
        self.now = 0
        self.peak = 0

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0:
                continue
            entry = self.live.get(ptr)
            if entry is None:
                # A storage that existed before the mode shows up as a view: skip it.
                if any(ptr == a.untyped_storage().data_ptr()
                       for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)):
                    continue
                entry = self.live[ptr] = [storage.nbytes(), 0]
                self.now += entry[0]
                self.peak = max(self.peak, self.now)
            entry[1] += 1
            weakref.finalize(t, self._drop, ptr)
        return out


#: the optimizers profiling can measure, by the name orgel's options give them
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def optimizer_class(kind: str) -> Callable[..., torch.optim.Optimizer]:
    """The optimizer named ``kind``; a clear error for a name profiling cannot measure."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    return OPTIMIZERS[kind]


def optimizer_temporary(params: list[torch.Tensor], kind: str = "adamw", *,
                        timed: bool = False) -> Any:
    """Extra bytes of one optimizer step as a multiple of the parameters' bytes.

    Runs ``kind`` (``adamw``, ``adam`` or ``sgd``) on copies of ``params`` with
    random gradients: one step to create its state, then one step under
    :class:`LiveBytes` (multi-tensor implementations allocate whole lists of
    temporaries at once). ``timed=True`` returns ``(multiple, ms per MiB of
    parameters)``, the step's time being the median of five more steps.
    """
    make = optimizer_class(kind)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    total = sum(p.numel() * p.element_size() for p in copies)
    if total == 0:
        return (0.0, 0.0) if timed else 0.0
    opt = make(copies, lr=1e-3)
    for _ in range(2):
        for p in copies:
            p.grad = torch.randn_like(p)
        if not opt.state:
            opt.step()
            continue
        with LiveBytes() as mode:
            opt.step()
        if not timed:
            return mode.peak / total
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1000.0)
        return mode.peak / total, statistics.median(times) / (total / (1 << 20))
    return (0.0, 0.0) if timed else 0.0


def optimizer_factor(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
                     ) -> float:
    """Weights + gradients + ``make``'s state, as a multiple of the weights' bytes.

    ``make(params)`` is a user's optimizer factory (``orgel.pipeline``'s
    ``optimizer``). It runs one step on two small float32 parameters (a matrix
    ``weight`` and a vector ``bias``, as :class:`orgel.parameters.NamedParameters`)
    with random gradients; its state tensors are counted (a
    per-parameter step count, a 0-dim tensor, is left out). Plain SGD gives
    2, SGD with momentum 3, Adam and AdamW 4: the factor the planner multiplies
    parameters by for a rank's static memory (:attr:`BlockCosts.optimizer_factor`).
    """
    from orgel.parameters import probe_parameters

    params = probe_parameters()  # named "weight" and "bias", for a factory that groups by name
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make(params)
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    weights = sum(p.numel() * p.element_size() for p in params)
    return 2.0 + state / weights


def optimizer_jobs(groups: list[list[torch.Tensor]], kind: str = "adamw"
                   ) -> list[dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]]:
    """Jobs timing one ``kind`` step over copies of each group of parameters (one per block).

    Each group gets its own optimizer over copies with random gradients,
    stepped once to create its state, so a timed step is a training step's
    (the runtime steps one optimizer per rank over its stages' parameters:
    the blocks' steps add up to it). A group without parameters gets no job.
    """
    make = optimizer_class(kind)
    jobs: list[dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]] = []
    for params in groups:
        if not params:
            jobs.append({})
            continue
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p in copies:
            p.grad = torch.randn_like(p)
        opt = make(copies, lr=1e-3)
        opt.step()
        def step(_: object, opt: torch.optim.Optimizer = opt) -> None:
            opt.step()

        jobs.append({"optimizer": (lambda: None, step)})
    return jobs

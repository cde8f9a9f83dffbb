"""Which call, in the process that forks orgel's CUDA ranks, initializes the CUDA driver?

A process whose CUDA driver is initialized cannot fork ranks that use CUDA ("CUDA error:
initialization error" in every rank), even while ``torch.cuda.is_initialized()`` is False:
``cudaGetDeviceCount`` (what ``torch.cuda.is_available()`` asks by default) initializes the
driver without initializing torch's CUDA state. This script records the stack of every
such call in this process while ``orgel.pipeline(..., device="cuda")`` builds a small
GPT's pipeline and trains two steps, then prints them. Run it on a GPU machine:

    python benchmarks/cuda_fork_check.py

Calls in C++ that initialize the driver (``cudaGetDeviceCount`` behind ``at::hasCUDA``)
pass no Python function to record, so a profile hook also reads after every call and
return whether the driver is initialized (:func:`orgel.launch.devices.driver_initialized`,
which does not initialize it) and prints the stack where it first is.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import torch

CALLS: list[tuple[str, str]] = []


def _recording(name: str, fn: object) -> object:
    def call(*args: object, **kwargs: object) -> object:
        if os.getpid() == PARENT:
            CALLS.append((name, "".join(traceback.format_stack(limit=14)[:-1])))
        return fn(*args, **kwargs)  # type: ignore[operator]
    return call


PARENT = os.getpid()
FIRST: list[str] = []  # where the driver was first found initialized
PROBE: list[Any] = []  # orgel.launch.devices.driver_initialized, once imported


def _watch(frame: object, event: str, arg: object) -> None:
    if FIRST or os.getpid() != PARENT or event not in ("return", "c_return"):
        return
    if PROBE[0]():
        name = getattr(arg, "__qualname__", "") if event == "c_return" else ""
        FIRST.append(f"after {event} {name}\n" + "".join(traceback.format_stack(
            frame, limit=30)))  # type: ignore[arg-type]
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def main() -> int:
    if not torch.backends.cuda.is_built():
        print("this PyTorch has no CUDA: nothing to check")
        return 0
    for name in ("_cuda_getDeviceCount", "_cuda_init"):
        setattr(torch._C, name, _recording(name, getattr(torch._C, name)))
    import orgel
    from orgel.models.gpt import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16))
    x = torch.randint(0, 64, (8, 16))
    y = torch.roll(x, -1, dims=1)
    error = None
    from orgel.launch.devices import driver_initialized

    PROBE.append(driver_initialized)
    sys.setprofile(_watch)
    threading.setprofile(_watch)
    try:
        with orgel.pipeline(model, (x,), y, lm_loss, ranks=2, microbatches=2,
                            device="cuda") as pipe:
            print("losses", [pipe.step((x,), y) for _ in range(2)])
    except Exception as exc:  # noqa: BLE001 - reported below, with the calls
        error = exc
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    print("the driver first found initialized in the caller:",
          FIRST[0] if FIRST else "never")
    print(f"{len(CALLS)} call(s) in the caller that initialize the CUDA driver:")
    for name, stack in CALLS:
        print(f"--- {name}\n{stack}")
    if error is not None:
        print(f"the pipeline failed: {type(error).__name__}: {str(error)[:600]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the ranks compute and how their messages travel: the one rule every launcher uses.

* :func:`resolve_device` turns the user's ``device`` (``"cpu"``, ``"cuda"``,
  ``"auto"`` or ``None``) into a device type, never initializing CUDA in this
  process (the GPU count is read through NVML, which does not poison a fork).
* :func:`rank_device`: local rank ``r`` of a CUDA run computes on GPU
  ``r mod (GPUs)``; several ranks share a GPU when they outnumber the GPUs.
* :func:`host`: what a rank answers its controller, with CUDA tensors copied to
  the host (the controller of forked ranks must not use CUDA).
* :func:`backend_for`: NCCL when every rank has a GPU of its own, otherwise gloo,
  whose point-to-point messages the transport stages through pinned host memory
  (:class:`orgel.runtime.comm.Transport`: gloo sends and receives host tensors
  only; NCCL refuses two ranks on one GPU).
* :func:`profiling_device`: where profiling measures by default (CUDA when present);
  :func:`profiling_on` changes it for a block (the caller of ``orgel.pipeline``, whose
  ranks are forked, never profiles on CUDA itself: a forked process of its own does,
  :mod:`orgel.explicit.device_plan`).
* :func:`check_fork` refuses a CUDA run whose ranks would be forked from a process
  that has initialized CUDA (a forked child cannot use it), saying what to do;
  :func:`driver_initialized` reads whether the driver is, without initializing it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils._pytree as pytree

DEVICES = ("auto", "cpu", "cuda")


_GPUS: list[int] = []  # gpu_count's answer, once known

#: one entry once :func:`orgel.guard.cuda_unused` hid the GPUs in this process. PyTorch's
#: C++ side counts the GPUs once and keeps the count: where code asked it while they were
#: hidden (a capture did, on an H200 with torch 2.11), a process forked from this one finds
#: no GPU, and nothing tells whether it was asked (:func:`check_fork`)
HID_GPUS: list[bool] = []


def gpu_count() -> int:
    """The GPUs this process sees, read without initializing CUDA here.

    ``torch.cuda.device_count()`` asks NVML, and where NVML does not answer it asks the
    CUDA runtime, which makes this process one that forked ranks cannot use CUDA from.
    So unless this process already uses CUDA, a forked child of its own counts them."""
    if not _GPUS:
        _GPUS.append(_count_gpus())
    return _GPUS[0]


def _count_gpus() -> int:
    if not torch.backends.cuda.is_built():
        return 0
    if torch.cuda.is_initialized():
        return int(torch.cuda.device_count())
    nvml = torch.cuda._device_count_nvml() if hasattr(torch.cuda, "_device_count_nvml") else -1
    if nvml >= 0:
        return int(nvml)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child asks the runtime and leaves at once
        try:
            os.write(write, str(torch._C._cuda_getDeviceCount()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return int(text) if text.strip().isdigit() else 0


def resolve_device(device: str | torch.device | None, *,
                   model: torch.nn.Module | None = None) -> str:
    """``"cpu"`` or ``"cuda"`` for the user's ``device``.

    ``None``: the device of ``model``'s parameters (a model on the meta device, or
    without parameters, goes where ``"auto"`` says); ``"auto"``: CUDA when this
    process sees a GPU, else the CPU.
    """
    if device is None and model is not None:
        found = {p.device.type for p in model.parameters()}
        found |= {b.device.type for b in model.buffers()}
        found.discard("meta")
        if len(found) > 1:
            raise ValueError(f"the model's tensors are on several devices ({sorted(found)}): "
                             "put the whole model on one device, or pass device='cpu' or "
                             "device='cuda'")
        if found:
            device = found.pop()
    if device is None or (isinstance(device, str) and device in DEVICES):
        kind = device or "auto"
    else:
        try:
            kind = torch.device(device).type  # "cuda:1": the ranks choose their GPUs
        except RuntimeError:
            kind = str(device)
    if kind == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if kind == "cuda" and gpu_count() == 0:
        raise ValueError("device='cuda' but this process sees no GPU (torch "
                         f"{torch.__version__}, CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): use device='cpu'")
    return kind


def rank_device(kind: str, rank: int) -> torch.device:
    """The device local rank ``rank`` computes on (torchrun's LOCAL_RANK when set), made
    this process's current CUDA device. Called in the rank's own process."""
    if kind != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local % gpu_count())
    torch.cuda.set_device(device)
    return device


def backend_for(kind: str, ranks: int) -> str:
    """The process group backend for ``ranks`` local ranks computing on ``kind``."""
    if kind == "cuda" and ranks <= gpu_count() and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo"


def driver_initialized() -> bool | None:
    """Whether this process has initialized the CUDA driver, read without initializing it
    (None where no driver library loads).

    ``torch.cuda.is_initialized()`` tells only of PyTorch's own CUDA state: C++ code that
    asks whether CUDA is there (``cudaGetDeviceCount``) initializes the driver without it,
    and a child forked after that cannot use CUDA. Every driver call returns
    ``CUDA_ERROR_NOT_INITIALIZED`` (3) before ``cuInit``; ``cuCtxGetCurrent`` is one.
    """
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    context = ctypes.c_void_p()
    return int(lib.cuCtxGetCurrent(ctypes.byref(context))) != 3


def check_fork(kind: str) -> None:
    """Raise ValueError if ranks forked from this process could not use CUDA."""
    if kind != "cuda":
        return
    if torch.cuda.is_initialized():
        raise ValueError(
            "this process has already used CUDA (a model or tensor on the GPU, or an "
            "earlier CUDA pipeline's capture), and the "
            "local ranks are forked from it, which CUDA does not allow: build the model on "
            "the CPU (or the meta device) and pass device='cuda' (each rank moves its own "
            "stages to its GPU), or start the ranks with torchrun")
    if HID_GPUS:
        raise ValueError(
            "this process has captured a model with its GPUs hidden (an earlier pipeline, "
            "or orgel.guard.cuda_unused), after which CUDA ranks forked from it may find no "
            "GPU: start each CUDA pipeline in a process of its own (the first orgel.pipeline "
            "of a script works), or start the ranks with torchrun or `orgel run --device "
            "cuda`")
    if driver_initialized():
        raise ValueError(
            "this process has initialized the CUDA driver (code that asked whether CUDA is "
            "there, or an earlier pipeline's capture), and the local ranks are forked from "
            "it, which CUDA does not allow: start orgel.pipeline(device='cuda') before "
            "anything in this process asks CUDA, or start the ranks with torchrun or "
            "`orgel run --device cuda`")


def host(value: Any) -> Any:
    """``value`` with every CUDA tensor in it copied to the host (a CUDA tensor sent
    through a pipe would travel as a CUDA IPC handle, which only a process using CUDA
    can open)."""
    return pytree.tree_map(
        lambda t: t.cpu() if isinstance(t, torch.Tensor) and t.is_cuda else t, value)


def move(value: Any, device: torch.device) -> Any:
    """``value`` (tensors in tuples, lists and dicts) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move(v, device) for k, v in value.items()}
    return value


_PROFILING: ContextVar[str | None] = ContextVar("orgel_profiling_device", default=None)


def profiling_device() -> torch.device:
    """Where profiling measures when not told: :func:`profiling_on`'s device, or CUDA when
    this process sees a GPU, else the CPU."""
    return torch.device(_PROFILING.get() or ("cuda" if gpu_count() > 0 else "cpu"))


@contextmanager
def profiling_on(device: str) -> Iterator[None]:
    """Profile on ``device`` inside."""
    token = _PROFILING.set(device)
    try:
        yield
    finally:
        _PROFILING.reset(token)

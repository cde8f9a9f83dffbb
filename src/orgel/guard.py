"""Leave the caller's model and torch's global state exactly as orgel found them.

Everything orgel does before the first training step (validating the
workload, capturing the graph, measuring and profiling it, planning,
splitting) runs the user's model or pieces of it in train mode. A forward in
train mode moves BatchNorm statistics, counts ``num_batches_tracked`` and
draws from the RNG; a backward fills ``.grad``; a failure half-way through can
leave grad mode switched off or a ``torch.vmap`` level open. :func:`untouched`
wraps all of that once, at the entry points, so that no step of the
preparation has to remember to put anything back:

* buffers are copied and written back in place (the stage modules share the
  model's tensors, so they start from the caller's values too);
* parameters are never written by the preparation; their version counters
  prove it, and a change is reported as an error rather than silently kept;
* ``.grad``, ``requires_grad`` and every module's train/eval flag are restored;
* the torch (CPU and CUDA), Python and NumPy RNG states, grad mode and the
  functorch (vmap/grad) nesting depth are restored, also after an exception.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA if this process uses it, Python, NumPy) as
    plain data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py_version, list(py_state), py_gauss],
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if torch.cuda.is_initialized():  # else unused; reading it would initialize CUDA here
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    npst = state["numpy"]
    np.random.set_state(
        (npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
         npst["has_gauss"], npst["cached"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _global_state() -> dict[str, Any]:
    return {
        "rng": rng_state(),
        "grad": torch.is_grad_enabled(),
        "functorch": torch._C._functorch.get_dynamic_layer_stack_depth(),
    }


def _restore_global(saved: dict[str, Any]) -> None:
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    if depth > saved["functorch"]:  # a transform (vmap, grad) left open by an exception
        torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(saved["functorch"])
    torch.set_grad_enabled(saved["grad"])
    set_rng_state(saved["rng"])


GradSnapshot = tuple[torch.Tensor | None, int, torch.Tensor | None]


def grad_snapshot(t: torch.Tensor) -> GradSnapshot:
    """``t.grad`` now: the tensor itself, its version counter and a copy of its values,
    for :func:`put_grad_back`."""
    grad = t.grad
    if grad is None:
        return None, 0, None
    return grad, grad._version, grad.detach().clone()


def put_grad_back(t: torch.Tensor, snapshot: GradSnapshot) -> None:
    """``t.grad`` as :func:`grad_snapshot` saw it: the same tensor (None: none), holding
    the values it held then where it was changed in place since (its version counter
    tells; comparing values would read tensors that hold none, such as fake ones), so
    whoever holds that tensor sees its values again."""
    grad, version, value = snapshot
    if t.grad is not grad:
        t.grad = grad
    if grad is not None and value is not None and grad._version != version:
        with torch.no_grad():
            grad.copy_(value)


@contextmanager
def untouched(model: torch.nn.Module | None = None) -> Iterator[None]:
    """Run the body, then put ``model`` and torch's global state back as they were.

    Raises RuntimeError after the body if the body changed a parameter in place (orgel's
    preparation never does; a model's forward that writes its own parameters, such as
    ``nn.Embedding(max_norm=...)``, does: the message names the parameter and says so).
    """
    saved = _global_state()
    modules = [] if model is None else list(model.modules())
    training = [m.training for m in modules]
    params = [] if model is None else list(model.named_parameters())
    flags = [(p.requires_grad, p._version) for _, p in params]
    grads = [grad_snapshot(p) for _, p in params]
    buffers = [] if model is None else [b for b in model.buffers() if b is not None]
    copies = [b.detach().clone() for b in buffers]
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        _restore_global(saved)  # first: no tensor may be touched inside an open vmap
        with torch.no_grad():
            for b, copy in zip(buffers, copies, strict=True):
                if b.is_meta or not torch.equal(b, copy):
                    b.copy_(copy)
        for m, flag in zip(modules, training, strict=True):
            m.training = flag
        changed = []
        for (name, p), (requires_grad, version), grad in zip(params, flags, grads,
                                                             strict=True):
            p.requires_grad_(requires_grad)
            put_grad_back(p, grad)
            if p._version != version:
                changed.append(name)
        if changed and not failed and sys.exc_info()[0] is None:
            raise RuntimeError(
                f"parameter(s) {', '.join(changed[:5])} changed in place while orgel ran the "
                "model's forward to prepare the pipeline (its capture, the loss rule's trial, "
                "profiling). A forward that writes its own parameters (nn.Embedding(max_norm=...) "
                "renormalizes the rows it looks up; a weight clamped inside forward) would "
                "start training from weights one process never had, written once per such "
                "run: leave the parameters as they are in forward (F.embedding without "
                "max_norm; renormalize or clamp the weights outside the model). If the forward "
                "does not write them, this is a bug in orgel: please report it with the model"
            )


@contextmanager
def quiet(logger: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """Inside: ``logger`` drops records below ``level`` (a message torch logs about work
    orgel tries and handles itself: the user has nothing to change); its level is put
    back after."""
    log = logging.getLogger(logger)
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


@contextmanager
def no_autocast_cache() -> Iterator[None]:
    """Run a user's closure (and the compile that finds its graphs) without autocast's
    weight cache, restoring this thread's setting afterwards.

    torch's autocast cache has one mutex for all threads: a Dynamo trace in one closure
    thread takes it while holding the GIL (fake tensors through ``cached_cast``), and
    another thread's ``autocast.__exit__`` clears the cache holding the mutex while it
    waits for the GIL, and both wait forever (seen in the suite). The cache only saves
    casting a weight again within one autocast region, so the values are the same; a
    ``torch.autocast`` the closure opens without ``cache_enabled`` reads this thread's
    setting, which is thread-local. Dynamo guards on it, so the pass that first compiles
    the closure's graphs runs under it too: the closure threads then run those graphs.
    """
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


#: the environment :func:`cuda_unused` sets: ``torch.cuda.is_available()`` reads the
#: GPU count from NVML (never the CUDA runtime) and counts the visible GPUs: none
_NO_CUDA = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "CUDA_VISIBLE_DEVICES": ""}


@contextmanager
def cuda_unused() -> Iterator[None]:
    """Inside, ``torch.cuda.is_available()`` answers False unless this process uses CUDA
    already, so that PyTorch's own code leaves CUDA uninitialized.

    Dynamo saves and restores the CUDA RNG state around every frame it converts
    when CUDA is available, which initializes CUDA; ranks forked afterwards could
    then not use it. The controller of forked ranks captures the model inside this
    (on the CPU) and never uses CUDA itself (:mod:`orgel.launch.devices`).

    Nothing of torch is replaced: the environment says so (:data:`_NO_CUDA`), and
    ``torch.cuda.is_available`` reads it on every call, also where code bound the
    function before (Dynamo's device interface does). The variables are put back on
    the way out; while inside, code of the caller's that initializes CUDA from
    another thread would find no GPU. orgel's GPU count
    (:func:`orgel.launch.devices.gpu_count`) is read before they are hidden.
    """
    if torch.cuda.is_initialized():
        yield
        return
    import os

    from orgel.launch.devices import HID_GPUS, gpu_count

    gpu_count()  # kept once read: read it with every GPU in sight
    saved = {name: os.environ.get(name) for name in _NO_CUDA}
    os.environ.update(_NO_CUDA)
    if torch.backends.cuda.is_built() and not HID_GPUS:
        HID_GPUS.append(True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_ENGINE: list[bool] = []  # one entry once autograd_first ran in this process


def autograd_first() -> None:
    """Start autograd's engine in this process before TorchDynamo runs in it, where there
    is no GPU, so that the ranks orgel forks from it can run a backward.

    The engine starts at a process's first backward and asks every device type how many
    devices it has; where one says any, it starts a thread for each and marks every
    process forked afterwards as one whose backward fails ("Unable to handle autograd's
    threading in combination with fork-based multiprocessing"). With PyTorch's CUDA
    builds (the usual pip wheels; 2.11 and 2.13 seen) that happens on a machine without a
    GPU too, once Dynamo has compiled anything (orgel's capture is Dynamo's): `orgel demo`
    failed in every rank. Started first, the engine does not ask again. Where a GPU is
    seen nothing is done: orgel's CUDA ranks fork before the controller captures
    (:mod:`orgel.launch.devices`).
    """
    if _ENGINE or not torch.backends.cuda.is_built():
        return
    _ENGINE.append(True)
    from orgel.launch.devices import gpu_count

    if torch.cuda.is_initialized() or gpu_count() > 0:
        return
    try:
        with torch.enable_grad():
            torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:  # a forked child of a process whose engine had started
        pass

"""The workload convention: ``(model, inputs, targets, loss_fn)``, loading, checking, micro-batches.

A training workload is a model, its example inputs (a tuple of positional
tensors or a dict of keyword tensors), the targets (a tensor or a tuple of
tensors) and ``loss_fn(outputs, targets)`` returning a scalar averaged over the
batch. Every tensor with a batch dimension (``batch_dim``, 0 unless told
otherwise; one int, or a dict by input name and ``"targets"``:
:func:`orgel.batching.dim_of`) is split into micro-batches; tensors without one are
passed whole to every micro-batch (the rules: :mod:`orgel.batching`).
CLI commands name a workload as ``path/to/file.py:function``.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.batching import (
    TARGETS,
    BatchDim,
    Targets,
    WorkloadError,
    batch_rows,
    check_batch_dim,
    close,
    dim_of,
    single_dim,
    split_microbatches,
    tensors_in,
)
from orgel.nesting import call, flatten
from orgel.usercode import user_code


@dataclass
class Workload:
    """A model, one batch of inputs and targets, and the loss that joins them."""

    model: torch.nn.Module
    inputs: tuple[Any, ...] | dict[str, Any]
    targets: Targets
    #: None (or left out of a workload file's tuple as None): the model's own loss,
    #: :func:`model_loss`, on every front end
    loss_fn: Callable[[Any, Any], torch.Tensor]
    #: the batch dimension (:func:`orgel.batching.dim_of`): an int for everything, or a dict
    #: by input name and ``"targets"``
    batch_dim: BatchDim = 0
    #: names of inputs that are not batched: each micro-batch gets them whole
    replicated: tuple[str, ...] = ()
    #: ``"32"`` or ``"bf16-mixed"`` (:mod:`orgel.precision`): the autocast the forward is
    #: captured in; ``loss_fn`` is expected to apply it already (see ``with_precision``)
    precision: str = "32"

    def __post_init__(self) -> None:
        self.model = plain_module(self.model)
        if self.loss_fn is None:  # the model computes its own loss (labels in the batch)
            self.loss_fn = model_loss


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile``'d model wraps (``OptimizedModule._orig_mod``), else
    ``model``: orgel captures the model itself (``compile=True`` compiles each stage), and
    names its state as the module's own (no ``_orig_mod.`` prefix), as
    ``model.state_dict()`` of the model before compiling does."""
    frames = sys.modules.get("torch._dynamo.eval_frame")  # (no compiled model without it)
    if frames is not None and isinstance(model, frames.OptimizedModule):
        return plain_module(model._orig_mod)
    return model


def model_loss(outputs: Any, targets: Any = None) -> torch.Tensor:
    """The model's own loss: ``outputs.loss`` (or ``outputs["loss"]``), the ``loss_fn``
    of a pipeline given none. A Hugging Face model computes it from the ``labels`` of the
    batch (``targets`` is not read)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None:
        raise WorkloadError(
            f"no loss_fn was given, so the model's own loss is the loss, but its outputs "
            f"({type(outputs).__name__}) hold no 'loss': put the labels in the batch "
            "(a Hugging Face model computes its loss from batch['labels']) or pass "
            "loss_fn(outputs, targets)")
    return loss


def with_precision(w: Workload, precision: str) -> Workload:
    """``w`` trained under ``precision`` (:mod:`orgel.precision`): its loss under the autocast."""
    from orgel.precision import autocast_loss

    return Workload(w.model, w.inputs, w.targets, autocast_loss(w.loss_fn, precision), w.batch_dim,
                    w.replicated, precision)


def in_precision(spec: str, precision: str) -> str | Workload:
    """``spec`` as it is for ``"32"``; else the loaded workload trained in ``precision``."""
    if precision in ("32", "32-true"):
        return spec
    return with_precision(load_workload(spec), precision)


def load_workload(spec: str) -> Workload:
    """Load ``"path/to/file.py:function"``; the function returns the 4-tuple (or a Workload).

    What the file or the function raises is the user's error: a
    :class:`~orgel.usercode.UserCodeError` naming the workload, with the user's frames.
    """
    path_text, sep, func_name = spec.rpartition(":")
    if not sep or not path_text or not func_name:
        raise WorkloadError(
            f"workload {spec!r} must look like 'path/to/file.py:function' "
            "(a Python file and the function in it that returns (model, inputs, targets, loss_fn))"
        )
    path = Path(path_text)
    if not path.is_file():
        raise WorkloadError(f"workload file {path} does not exist")
    module_name = f"_orgel_workload_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise WorkloadError(f"cannot import {path}: is it a Python file?")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    with user_code(spec, diagnoses=(WorkloadError,)):  # the file's errors are the user's
        loader_spec.loader.exec_module(module)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise WorkloadError(f"{path} has no function {func_name!r}")
    with user_code(spec, diagnoses=(WorkloadError,)):
        result = func()
    if isinstance(result, Workload):
        return result
    if hasattr(result, "_fields") and len(result) in (4, 5):  # a NamedTuple like the zoo's
        return Workload(*tuple(result))
    if not isinstance(result, tuple) or len(result) != 4:
        raise WorkloadError(
            f"{spec} returned {type(result).__name__}; it must return the 4-tuple "
            "(model, inputs, targets, loss_fn)"
        )
    return Workload(*result)


def named_inputs(model: torch.nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    """The model's inputs by keyword: positional ones are named by ``forward``'s signature.

    What orgel calls the forward with, everywhere (capture, the steps, the
    references): the workload's inputs (:func:`given_inputs`), plus
    ``use_cache=False`` for a model that would build a generation cache
    (:func:`cache_off`).
    """
    return cache_off(model, given_inputs(model, inputs))


def given_inputs(model: torch.nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    """The workload's own inputs by keyword: positional ones named by ``forward``'s signature.

    Any mapping is a batch by keyword: a dict, or the ``BatchEncoding`` that a Hugging Face
    tokenizer or data collator (``DataCollatorWithPadding``) returns. An input that is a
    dict, list or tuple of tensors is named by the path of each (``batch.pixels``:
    :mod:`orgel.nesting`)."""
    if isinstance(inputs, Mapping):
        return flatten(inputs)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise WorkloadError(
            f"inputs must be a tuple of tensors or a dict of tensors, got {type(inputs).__name__}"
        )
    params = list(inspect.signature(model.forward).parameters.values())
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(inputs) > len(positional):
        raise WorkloadError(
            f"{type(model).__name__}.forward takes {len(positional)} positional inputs but "
            f"the workload gives {len(inputs)}; pass a dict of keyword inputs instead"
        )
    return flatten({p.name: value for p, value in zip(positional, inputs, strict=False)})


def cache_off(model: torch.nn.Module, named: dict[str, Any]) -> dict[str, Any]:
    """``named`` with ``use_cache=False`` where ``model`` would otherwise build a KV cache.

    A Hugging Face model (a ``config`` with ``use_cache``, a forward that takes
    ``use_cache``) builds a generation cache by default (``use_cache=True``) and
    returns it beside the logits. No training loss reads it; it costs a copy of
    every layer's keys and values, and neither Dynamo on a meta model nor
    torch.export can capture it. orgel trains the forward without it, as
    Hugging Face's own training does: the outputs then hold no cache
    (``past_key_values`` is None). A workload that passes ``use_cache`` keeps its
    own value.
    """
    if "use_cache" in named or getattr(getattr(model, "config", None), "use_cache",
                                       None) is None:
        return named
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return named
    if "use_cache" not in params:
        return named
    return {**named, "use_cache": False}


def on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (any parameter or buffer there).

    Such a model has shapes and dtypes but no values: capture measures it on
    meta inputs (shapes, FLOPs, bytes per node, nothing allocated), and each rank
    materializes only its own stages (:mod:`orgel.split.materialize`).
    """
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def meta_autocast_advice(exc: BaseException, model: torch.nn.Module) -> str:
    """What to change where a meta model's forward failed for opening ``torch.autocast``
    on the meta device (transformers 4.x's rotary embeddings do: ``torch.autocast("meta",
    enabled=False)`` raises "unsupported scalarType" even outside orgel); else ""."""
    if "unsupported scalarType" not in str(exc):
        return ""
    if not on_meta(model):
        return ""
    return (" (the model opens torch.autocast on the meta device, which torch refuses even "
            "outside orgel: transformers 4.x's rotary embeddings do. Build the model on "
            "the CPU and pass that, or use transformers 5)")


def validate_workload(w: Workload, microbatches: int = 1) -> None:
    """Raise :class:`WorkloadError` unless ``w`` can be split into ``microbatches``.

    Checks: the model is a module; inputs are tensors (tuple or dict); something
    has a batch dimension; every batched tensor's batch size is the same and
    divisible by ``microbatches`` (the example the pipeline is planned on; a later batch
    may cut unevenly, :func:`orgel.batching.micro_sizes`; inputs named in ``replicated``
    are not batched);
    some parameter is trainable; the loss on the whole batch is a scalar.
    """
    if not isinstance(w.model, torch.nn.Module):
        raise WorkloadError(f"model must be a torch.nn.Module, got {type(w.model).__name__}")
    if not w.model.training:
        warnings.warn(
            "the model is in eval mode (Hugging Face's from_pretrained leaves it so), and the "
            "pipeline trains it as it is, as one process would: dropout off, BatchNorm on its "
            "running statistics; call model.train() before building the pipeline to train in "
            "training mode (switching it after the build is refused at the next step)",
            UserWarning, stacklevel=3)
    if not isinstance(microbatches, int) or microbatches < 1:
        raise WorkloadError(f"microbatches must be a positive integer, got {microbatches!r}")
    named = named_inputs(w.model, w.inputs)
    unknown = sorted(set(w.replicated) - set(named))
    if unknown:
        raise WorkloadError(f"replicated names {unknown} are not inputs of the model; "
                            f"its inputs are {list(named)}")
    for name, value in given_inputs(w.model, w.inputs).items():  # orgel's use_cache aside
        if not isinstance(value, torch.Tensor) and value is not None:
            raise WorkloadError(
                f"input {name!r} is a {type(value).__name__}; inputs must be tensors "
                "(put constant options in the model or a closure)"
            )
    if not callable(w.loss_fn):
        raise WorkloadError("loss_fn must be callable as loss_fn(outputs, targets)")
    if not any(p.requires_grad for p in w.model.parameters()):
        raise WorkloadError(
            "the model has no trainable parameters (none requires grad), so training would "
            "change nothing: unfreeze some (p.requires_grad_(True)) or run it without orgel"
        )
    check_batch_dim(w.batch_dim, named, w.targets)
    batch = _batch_size(w)
    if batch % microbatches:
        raise WorkloadError(
            f"batch size {batch} is not divisible into {microbatches} micro-batches; "
            f"choose a micro-batch count that divides {batch}"
        )
    # A trial forward must not change the model (BatchNorm statistics, the RNG).
    from orgel.guard import untouched

    targets = w.targets
    if on_meta(w.model):  # shapes only: the batch goes to the meta device with the model
        loss = _meta_loss(w, named)
        if loss is None:  # the forward reads values no meta or fake tensor holds
            return
    else:  # shapes and dtypes are enough: fake tensors, no arithmetic on the whole batch
        loss = _fake_loss(w, (named, targets))
        if loss is None:  # the forward reads values (or raises): the real one says which
            with untouched(w.model), torch.no_grad():
                loss = w.loss_fn(call(w.model, named), targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WorkloadError(
            f"loss_fn must return a scalar tensor averaged over the batch, got {shape}"
        )
    if not loss.dtype.is_floating_point:
        raise WorkloadError(f"loss_fn returned a {loss.dtype} tensor; it must be floating point")
    if microbatches > 1 and not on_meta(w.model):
        with untouched(w.model), torch.no_grad():
            _check_rows(w, named, microbatches)


def _meta_loss(w: Workload, named: dict[str, Any]) -> Any:
    """The loss of a trial forward of a meta model on meta copies of the batch.

    Python in the forward that reads a value (transformers' check for packed
    sequences, ``(ids[:, -1] == 0).all()``) cannot run on meta tensors; such a
    forward is tried again on fake tensors, which transformers treats as
    tracing (as Dynamo's capture sees the forward: the check is skipped). None
    where both fail for want of values (the capture traces past the read, and the
    ranks compute the loss on real ones).
    """
    from orgel.guard import untouched

    batch = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (named, w.targets))
    try:
        with untouched(w.model), torch.no_grad():
            return w.loss_fn(call(w.model, batch[0]), batch[1])
    except Exception as exc:  # noqa: BLE001 - the fake run decides; its error is this one
        loss = _fake_loss(w, batch)
        if loss is None:
            advice = meta_autocast_advice(exc, w.model)
            if advice:
                raise WorkloadError(f"the model's forward failed on the meta device: "
                                    f"{exc}{advice}") from exc
            if "meta" in str(exc).lower():  # left to the capture, which traces it
                return None
            raise exc from None
        return loss


def _fake_loss(w: Workload, batch: tuple[dict[str, Any], Any]) -> Any:
    """The loss of a forward on fake copies of ``batch`` (shapes and dtypes, no values:
    a trial of a large model's whole batch costs no arithmetic), or None where that
    forward raises (it reads a value: the caller runs a real one, whose error is the
    user's own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from orgel.guard import quiet, untouched

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:  # (a kernel that raises on fake tensors is logged as an error by torch: quiet)
        with quiet("torch._subclasses.fake_tensor"), untouched(w.model), torch.no_grad(), mode:
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, batch)
            return w.loss_fn(call(w.model, fake[0]), fake[1])
    except Exception:  # noqa: BLE001 - any failure: the real forward decides
        return None


def _check_rows(w: Workload, named: dict[str, Any], m: int) -> None:
    """Raise when ``batch_dim`` is not the batch but another dimension is.

    In eval mode, the last micro-batch's outputs should be the same rows of the whole
    batch's outputs. Where they are not (``[T, B]`` data cut along time, or a model that
    uses batch statistics, which orgel leaves alone) and they are when the batch is cut
    along another dimension, the error names that dimension.
    """
    import dataclasses

    w.model.eval()
    if _rows_agree(w, named, m) is not False:
        return
    ndim = max((t.dim() for t in tensors_in(named)), default=0)
    for d in range(ndim):
        if d == single_dim(w.batch_dim):
            continue
        other = dataclasses.replace(w, batch_dim=d)
        try:
            agree = _rows_agree(other, named, m)
        except WorkloadError:  # no batch along d
            continue
        if agree:
            raise WorkloadError(
                f"the model's outputs for the last of {m} micro-batches are not the same rows "
                f"of its outputs for the whole batch when cut along batch_dim={w.batch_dim!r}, "
                f"and they are when cut along dim {d}: the batch is dim {d} (sequence-first "
                f"[T, B] data, say); pass batch_dim={d} (or a dict {{input name: dim, "
                "'targets': dim}})")


def _rows_agree(w: Workload, named: dict[str, Any], m: int) -> bool | None:
    """Whether the last micro-batch's outputs are those rows of the whole batch's outputs
    (None: nothing to compare)."""
    inputs, _ = split_microbatches(named, w.targets, m, w.batch_dim, w.replicated)[-1]
    try:
        whole = pytree.tree_leaves(call(w.model, named))
        part = pytree.tree_leaves(call(w.model, inputs))
    except Exception:  # noqa: BLE001 - a model that cannot run so: nothing to compare
        return None
    batch = batch_rows(named, w.targets, w.batch_dim, w.replicated)
    d = dim_of(w.batch_dim, TARGETS)
    compared = None
    for full, piece in zip(whole, part, strict=False):
        if not (isinstance(full, torch.Tensor) and isinstance(piece, torch.Tensor)
                and full.dtype.is_floating_point and full.dim() > d
                and full.shape[d] == batch and piece.shape[d] * m == batch):
            continue
        rows = full.narrow(d, batch - piece.shape[d], piece.shape[d])
        if rows.shape != piece.shape:
            continue
        compared = True
        if not close(piece, rows):
            return False
    return compared


def _batch_size(w: Workload) -> int:
    named = named_inputs(w.model, w.inputs)
    return batch_rows(named, w.targets, w.batch_dim, w.replicated)


def microbatches(w: Workload, m: int) -> list[tuple[dict[str, torch.Tensor], Targets]]:
    """Split inputs (by name) and targets into ``m`` equal micro-batches along ``batch_dim``."""
    return split_microbatches(named_inputs(w.model, w.inputs), w.targets, m, w.batch_dim,
                              w.replicated)


def microbatch_rows(w: Workload, m: int) -> int | None:
    """Rows of one of ``m`` micro-batches along the workload's batch dimension (None: no
    tensor input)."""
    first, targets = microbatches(w, m)[0]
    inputs = {k: v for k, v in first.items() if k not in w.replicated}
    if not any(isinstance(t, torch.Tensor) for t in inputs.values()):
        return None
    return batch_rows(inputs, targets, w.batch_dim)

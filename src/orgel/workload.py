"""The workload convention: ``(model, inputs, targets, loss_fn)``, loading, checking, micro-batches.

A training workload is a model, its example inputs (a tuple of positional
tensors or a dict of keyword tensors), the targets (a tensor or a tuple of
tensors) and ``loss_fn(outputs, targets)`` returning a scalar averaged over the
batch. Every tensor with a batch dimension (``batch_dim``, 0 unless told
otherwise; one int, or a dict by input name and ``"targets"``: :func:`dim_of`) is
split into micro-batches; tensors without one are passed whole to every micro-batch.
CLI commands name a workload as ``path/to/file.py:function``.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from orgel.usercode import user_code

Targets = Any  # a tensor, a tuple/list of tensors, or None
#: The batch dimension: one int for every input and the targets, or a dict from input
#: name (and ``"targets"``) to its dimension; a name it leaves out is batched along 0.
BatchDim = Any  # int | Mapping[str, int]

TARGETS = "targets"


class WorkloadError(ValueError):
    """A workload is malformed; the message says what to change."""


@dataclass
class Workload:
    """A model, one batch of inputs and targets, and the loss that joins them."""

    model: torch.nn.Module
    inputs: tuple[Any, ...] | dict[str, Any]
    targets: Targets
    loss_fn: Callable[[Any, Any], torch.Tensor]
    #: the batch dimension (:func:`dim_of`): an int for everything, or a dict by input name
    #: and ``"targets"``
    batch_dim: BatchDim = 0
    #: names of inputs that are not batched: each micro-batch gets them whole
    replicated: tuple[str, ...] = ()
    #: ``"32"`` or ``"bf16-mixed"`` (:mod:`orgel.precision`): the autocast the forward is
    #: captured in; ``loss_fn`` is expected to apply it already (see ``with_precision``)
    precision: str = "32"


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
    """The workload's own inputs by keyword: positional ones named by ``forward``'s signature."""
    if isinstance(inputs, dict):
        return dict(inputs)
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
    return {p.name: value for p, value in zip(positional, inputs, strict=False)}


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


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (any parameter or buffer there).

    Such a model has shapes and dtypes but no values: capture measures it on
    meta inputs (shapes, FLOPs, bytes per node, nothing allocated), and each rank
    materializes only its own stages (:mod:`orgel.split.materialize`).
    """
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def validate_workload(w: Workload, microbatches: int = 1) -> None:
    """Raise :class:`WorkloadError` unless ``w`` can be split into ``microbatches``.

    Checks: the model is a module; inputs are tensors (tuple or dict); something
    has a batch dimension; every batched tensor's batch size is the same and
    divisible by ``microbatches`` (inputs named in ``replicated`` are not batched);
    some parameter is trainable; the loss on the whole batch is a scalar.
    """
    if not isinstance(w.model, torch.nn.Module):
        raise WorkloadError(f"model must be a torch.nn.Module, got {type(w.model).__name__}")
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
    else:
        with untouched(w.model), torch.no_grad():
            loss = w.loss_fn(w.model(**named), targets)
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
    from torch._subclasses.fake_tensor import FakeTensorMode

    from orgel.guard import untouched

    batch = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (named, w.targets))
    try:
        with untouched(w.model), torch.no_grad():
            return w.loss_fn(w.model(**batch[0]), batch[1])
    except Exception as exc:  # noqa: BLE001 - the fake run decides; its error is this one
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with untouched(w.model), torch.no_grad(), mode:
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, batch)
            try:
                return w.loss_fn(w.model(**fake[0]), fake[1])
            except Exception:  # noqa: BLE001
                if "meta" in str(exc).lower():  # left to the capture, which traces it
                    return None
                raise exc from None


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
    ndim = max((t.dim() for t in _tensors(named)), default=0)
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
        whole = pytree.tree_leaves(w.model(**named))
        part = pytree.tree_leaves(w.model(**inputs))
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
        scale = float(rows.abs().max()) if rows.numel() else 0.0
        compared = True
        if not torch.allclose(rows.float(), piece.float(), rtol=1e-3, atol=1e-4 * (1 + scale)):
            return False
    return compared


def _batch_size(w: Workload) -> int:
    named = named_inputs(w.model, w.inputs)
    return batch_rows(named, w.targets, w.batch_dim, w.replicated)


def dim_of(batch_dim: BatchDim, name: str) -> int:
    """The batch dimension of input ``name`` (or of the targets, ``name="targets"``).

    The one rule every part reads (the micro-batch split, each replica's share,
    the planner's row count, ``orgel.backend``'s slicing): ``batch_dim`` is an int
    for every input and the targets alike, or a dict by input name whose
    ``"targets"`` entry is the targets' dimension; names it leaves out use 0.
    """
    if isinstance(batch_dim, Mapping):
        return int(batch_dim.get(name, 0))
    return int(batch_dim)


def single_dim(batch_dim: BatchDim) -> int | None:
    """The one dimension every value is batched along, or None when a dict gives several."""
    if not isinstance(batch_dim, Mapping):
        return int(batch_dim)
    dims = {int(d) for d in batch_dim.values()}
    if len(dims) > 1:
        return None
    return dims.pop() if dims else 0


def check_batch_dim(batch_dim: BatchDim, inputs: dict[str, Any], targets: Targets) -> None:
    """Raise :class:`WorkloadError` for a ``batch_dim`` that names no input or lies outside one."""
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, (int, Mapping)):
        raise WorkloadError(f"batch_dim must be an int or a dict {{input name: dim}}, got "
                            f"{batch_dim!r}")
    if isinstance(batch_dim, Mapping):
        unknown = sorted(set(batch_dim) - set(inputs) - {TARGETS})
        if unknown:
            raise WorkloadError(f"batch_dim names {unknown}, which are not inputs of the model; "
                                f"its inputs are {list(inputs)} (and 'targets' for the targets)")
        if TARGETS in inputs and TARGETS in batch_dim:
            raise WorkloadError("the model has an input named 'targets', so batch_dim's "
                                "'targets' entry is ambiguous: give one int for everything")
        bad = [(k, d) for k, d in batch_dim.items() if not isinstance(d, int) or d < 0]
    else:
        bad = [("every input", batch_dim)] if batch_dim < 0 else []
    if bad:
        raise WorkloadError(f"batch_dim must be non-negative ints (count from the front); got "
                            f"{bad}")
    for name, value in [*inputs.items(), (TARGETS, targets)]:
        d = dim_of(batch_dim, name)
        tensors = _tensors(value)
        if isinstance(batch_dim, Mapping) and name in batch_dim and tensors and all(
                t.dim() <= d for t in tensors):
            raise WorkloadError(f"batch_dim gives {name!r} batch dimension {d}, but it has "
                                f"shape {tuple(tensors[0].shape)}")


def batch_rows(inputs: dict[str, Any], targets: Targets, batch_dim: BatchDim = 0,
               replicated: tuple[str, ...] | Any = ()) -> int:
    """The batch size: every batched input's and the targets' size along its batch dimension.

    Tensors without that dimension (scalars) are not batched, nor inputs named in
    ``replicated``. Raises :class:`WorkloadError` when the sizes disagree or none has one.
    """
    sizes: dict[int, list[str]] = {}
    for name, value in [*inputs.items(), (TARGETS, targets)]:
        if name in replicated and name != TARGETS:
            continue
        d = dim_of(batch_dim, name)
        for t in _tensors(value):
            if t.dim() > d:
                sizes.setdefault(int(t.shape[d]), []).append(f"{name}[dim {d}]")
    if not sizes:
        raise WorkloadError(
            f"no input or target has a batch dimension (batch_dim={batch_dim!r}); give at "
            "least one tensor with a batch dimension (or set batch_dim)")
    if len(sizes) > 1:
        seen = "; ".join(f"{n}: {', '.join(w[:3])}" for n, w in sorted(sizes.items()))
        raise WorkloadError(
            f"tensors disagree on the batch size ({seen}); give every batched input and "
            "target the same batch size, set batch_dim to the dimension that is the batch "
            "(an int, or a dict {input name: dim, 'targets': dim} for sequence-first "
            "[T, B] inputs), and name the inputs that are not batched in "
            "orgel.pipeline(..., replicated=[...])")
    return next(iter(sizes))


def batch_size(values: Any, dim: int = 0) -> int:
    """The batch size of ``values`` (nested tuples/lists/dicts of tensors) along one ``dim``."""
    return batch_rows({"values": values}, None, {"values": dim})


def split_batch(value: Any, m: int, dim: int, batch: int) -> list[Any]:
    """``m`` micro-batches of ``value``: the one rule for what is batched.

    A tensor whose size along ``dim`` is the batch size ``batch`` is chunked into
    ``m`` equal parts; every other value (a scalar, a table of another size, a
    non-tensor) goes whole to every micro-batch. Tuples, lists, named tuples and
    dicts are split element by element.
    """
    if isinstance(value, torch.Tensor):
        if value.dim() > dim and value.shape[dim] == batch:
            return list(value.chunk(m, dim=dim))
        return [value] * m
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        parts = [split_batch(v, m, dim, batch) for v in value]
        return [type(value)(*(p[i] for p in parts)) for i in range(m)]
    if isinstance(value, (tuple, list)):
        parts = [split_batch(v, m, dim, batch) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(m)]
    if isinstance(value, dict):
        parts_d = {k: split_batch(v, m, dim, batch) for k, v in value.items()}
        return [{k: p[i] for k, p in parts_d.items()} for i in range(m)]
    return [value] * m


def replica_rows(rows: int, replica: int, replicas: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a micro-batch of ``rows`` rows that replica ``replica`` runs.

    The one rule for data-parallel replicas. A stage placed on ``replicas`` ranks
    runs *every* micro-batch on every replica, each on its own contiguous, equal
    share of the micro-batch's rows along the batch dimension: replica ``k`` runs
    rows ``[k*rows/replicas, (k+1)*rows/replicas)``. With a batch of ``B`` rows cut
    into ``M`` micro-batches (:func:`split_batch`: micro-batch ``m`` is rows
    ``[m*B/M, (m+1)*B/M)``), replica ``k`` thus runs batch rows
    ``m*B/M + [k*B/(M*replicas), (k+1)*B/(M*replicas))`` for each ``m``, in
    micro-batch order, through its own copy of the stage: BatchNorm normalises
    over those rows, and updates that copy's running statistics, which the end
    of each training step averages over the replicas (:mod:`orgel.runtime.buffers`).
    Raises ValueError when ``rows`` does not divide by ``replicas``.
    """
    if rows % replicas:
        raise ValueError(
            f"a micro-batch of {rows} rows cannot be shared by {replicas} replicas: "
            "choose a batch size divisible by microbatches x replicas"
        )
    size = rows // replicas
    return replica * size, (replica + 1) * size


def share(value: Any, replica: int, replicas: int, dim: int, rows: int) -> Any:
    """Replica ``replica``'s rows of every batched tensor in ``value`` (tensors, lists, dicts).

    As in :func:`split_batch`, a tensor is batched when its size along ``dim`` is
    the micro-batch's ``rows``; anything else goes whole to every replica. Which
    rows: :func:`replica_rows`.
    """
    if replicas == 1:
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() <= dim or value.shape[dim] != rows:
            return value
        start, stop = replica_rows(rows, replica, replicas)
        return value.narrow(dim, start, stop - start)
    if isinstance(value, (list, tuple)):
        return type(value)(share(v, replica, replicas, dim, rows) for v in value)
    if isinstance(value, dict):
        return {k: share(v, replica, replicas, dim, rows) for k, v in value.items()}
    return value


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


def split_microbatches(inputs: dict[str, Any], targets: Targets, m: int,
                       dim: BatchDim = 0, replicated: tuple[str, ...] | Any = ()
                       ) -> list[tuple[dict[str, Any], Targets]]:
    """``m`` micro-batches of named ``inputs`` and ``targets``: what the runtime and the
    reference both use. ``dim`` is the batch dimension (:func:`dim_of`: an int, or a dict
    by input name and ``"targets"``). Inputs named in ``replicated`` go whole to every
    micro-batch; the rest follow :func:`split_batch` along their own dimension."""
    batch = batch_rows(inputs, targets, dim, replicated)
    if m < 1 or batch % m:
        raise WorkloadError(
            f"batch size {batch} is not divisible into {m} micro-batches; "
            f"choose a micro-batch count that divides {batch}"
        )
    parts = {k: [v] * m if k in replicated else split_batch(v, m, dim_of(dim, k), batch)
             for k, v in inputs.items()}
    target_parts = split_batch(targets, m, dim_of(dim, TARGETS), batch)
    return [({k: p[i] for k, p in parts.items()}, target_parts[i]) for i in range(m)]


def check_batch(example: tuple[dict[str, Any], Targets], batch: tuple[dict[str, Any], Targets],
                microbatches: int, dim: BatchDim = 0,
                replicated: tuple[str, ...] = ()) -> None:
    """Raise :class:`WorkloadError` unless a step's named inputs and targets fit the pipeline.

    ``example`` is the batch the pipeline was built from (named inputs, targets).
    The step's inputs must have the same names, every tensor the example's dtype
    (inputs and targets alike), the targets the inputs' batch size along their batch
    dimensions (``dim``: :func:`dim_of`),
    and that batch size must divide into ``microbatches``. Checked before any rank
    sees the batch, so a batch that fails here changes nothing.
    """
    (ex_inputs, ex_targets), (inputs, targets) = example, batch
    unknown = [k for k in inputs if k not in ex_inputs]
    missing = [k for k in ex_inputs if k not in inputs and ex_inputs[k] is not None]
    if unknown or missing:
        raise WorkloadError(
            f"the batch's inputs {list(inputs)} are not the model inputs the pipeline was "
            f"built with {list(ex_inputs)}"
            + (f"; unknown: {unknown}" if unknown else "")
            + (f"; missing: {missing}" if missing else "")
            + ": give every step the same inputs by the same names")
    for name, value in inputs.items():
        _same_kind(f"input {name!r}", ex_inputs[name], value)
    ex_leaves, ex_spec = pytree.tree_flatten(ex_targets)
    leaves, spec = pytree.tree_flatten(targets)
    if spec != ex_spec:
        raise WorkloadError(f"the targets are {spec} but the pipeline was built with targets "
                            f"{ex_spec}: give every step targets of the same structure")
    for k, (ex, got) in enumerate(zip(ex_leaves, leaves, strict=True)):
        _same_kind(f"target {k}", ex, got)
    batched = {k: v for k, v in inputs.items() if k not in replicated}
    if _tensors(batched) and _tensors(targets):
        rows, target_rows = batch_rows(batched, None, dim), batch_rows({}, targets, dim)
        if rows != target_rows:
            raise WorkloadError(
                f"the inputs have batch size {rows} but the targets {target_rows} (batch_dim "
                f"{dim!r}): give as many targets as inputs")
    rows = batch_rows(inputs, targets, dim, replicated)
    if rows % microbatches:
        raise WorkloadError(
            f"batch size {rows} is not divisible into the pipeline's {microbatches} "
            f"micro-batches; give a batch whose size is a multiple of {microbatches}")


def _same_kind(what: str, example: Any, value: Any) -> None:
    """Raise unless ``value`` is a tensor of ``example``'s dtype (or both are no tensor)."""
    if isinstance(example, torch.Tensor) != isinstance(value, torch.Tensor):
        raise WorkloadError(f"{what} is a {type(value).__name__} but the pipeline was built "
                            f"with a {type(example).__name__}")
    if isinstance(value, torch.Tensor) and value.dtype != example.dtype:
        raise WorkloadError(f"{what} is {value.dtype} but the pipeline was built with "
                            f"{example.dtype}: convert it (.to({example.dtype}))")

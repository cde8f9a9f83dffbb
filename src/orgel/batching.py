"""The batch rules: which dimension of each input is the batch, how a batch is cut into
micro-batches and each replica's share, and what a step's batch must match.

One rule, every caller: the executor, the planner, the profiler, ``orgel.backend`` and
the several-graph path all cut batches with these functions. ``batch_dim`` is one int for
every input and the targets, or a dict from input name (and ``"targets"``) to its
dimension (:func:`dim_of`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

Targets = Any  # a tensor, a tuple/list of tensors, or None
#: The batch dimension: one int for every input and the targets, or a dict from input
#: name (and ``"targets"``) to its dimension; a name it leaves out is batched along 0.
BatchDim = Any  # int | Mapping[str, int]

TARGETS = "targets"


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists and mappings), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def same_kind(like: Mapping[str, Any], items: dict[str, Any]) -> Mapping[str, Any]:
    """``items`` as a mapping of ``like``'s type: a dict, or a Hugging Face ``BatchEncoding``
    (which a data collator returns, and whose pieces a closure may read as attributes);
    a plain dict where that type cannot be made from one."""
    if type(like) is dict:
        return items
    try:
        return type(like)(items)  # type: ignore[call-arg]
    except Exception:  # noqa: BLE001 - a mapping type of its own constructor
        return items


class WorkloadError(ValueError):
    """A workload is malformed; the message says what to change."""


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
        tensors = tensors_in(value)
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
        for t in tensors_in(value):
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


def micro_sizes(batch: int, m: int, unit: int = 1) -> list[int]:
    """The rows of each of ``m`` micro-batches of a batch of ``batch`` rows: the one rule.

    The batch is cut into ``m * unit`` pieces by ``torch.tensor_split``'s rule (equal
    where they divide it, else the first pieces take one row more: a DataLoader's
    smaller last batch of 6 rows in 4 micro-batches is cut 2, 2, 1, 1), and micro-batch
    ``i`` is pieces ``i * unit`` to ``(i + 1) * unit - 1``: ``unit`` is the replica count of
    a data-parallel stage, and replica ``k`` of a micro-batch runs its piece ``k``
    (:func:`replica_rows` cuts a micro-batch so). Raises :class:`WorkloadError` where a
    piece would be empty.
    """
    if m < 1:
        raise WorkloadError(f"the micro-batch count must be positive, got {m}")
    if batch < m * unit:
        each = "a row" if unit == 1 else f"a row for each of its {unit} replicas"
        raise WorkloadError(
            f"a batch of {batch} row{'s' if batch != 1 else ''} cannot fill the pipeline's "
            f"{m} micro-batches (each takes {each}): give batches of at least {m * unit} "
            "rows (a DataLoader's smaller last batch: DataLoader(..., drop_last=True))")
    pieces = _split_sizes(batch, m * unit)
    return [sum(pieces[i * unit:(i + 1) * unit]) for i in range(m)]


def _split_sizes(rows: int, k: int) -> list[int]:
    """The sizes ``torch.tensor_split`` cuts ``rows`` rows into ``k`` pieces: equal where
    ``k`` divides them, else the first pieces one row more."""
    size, extra = divmod(rows, k)
    return [size + (i < extra) for i in range(k)]


def split_batch(value: Any, sizes: list[int], dim: int, batch: int) -> list[Any]:
    """Micro-batches of ``value`` of ``sizes`` rows (:func:`micro_sizes`): the one rule for
    what is batched.

    A tensor whose size along ``dim`` is the batch size ``batch`` is cut into pieces of
    ``sizes`` rows; every other value (a scalar, a table of another size, a
    non-tensor) goes whole to every micro-batch. Tuples, lists, named tuples and
    dicts are split element by element.
    """
    m = len(sizes)
    if isinstance(value, torch.Tensor):
        if value.dim() > dim and value.shape[dim] == batch:
            return list(value.split(sizes, dim=dim))
        return [value] * m
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        parts = [split_batch(v, sizes, dim, batch) for v in value]
        return [type(value)(*(p[i] for p in parts)) for i in range(m)]
    if isinstance(value, (tuple, list)):
        parts = [split_batch(v, sizes, dim, batch) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(m)]
    if isinstance(value, Mapping):
        parts_d = {k: split_batch(v, sizes, dim, batch) for k, v in value.items()}
        return [same_kind(value, {k: p[i] for k, p in parts_d.items()}) for i in range(m)]
    return [value] * m


def replica_rows(rows: int, replica: int, replicas: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a micro-batch of ``rows`` rows that replica ``replica`` runs.

    The one rule for data-parallel replicas. A stage placed on ``replicas`` ranks
    runs *every* micro-batch on every replica, each on its own contiguous share of the
    micro-batch's rows along the batch dimension, cut as ``torch.tensor_split`` cuts:
    equal where ``replicas`` divides ``rows``, else the first replicas take one row
    more (a smaller last batch: a micro-batch of 3 rows is shared 2, 1), so replica
    ``k`` of micro-batch ``m`` runs piece ``m * replicas + k`` of the batch cut into
    ``microbatches * replicas`` pieces (:func:`micro_sizes`). Each runs its share through
    its own copy of the stage: BatchNorm normalises over those rows, and updates that
    copy's running statistics, which the end of each training step averages over the
    replicas (:mod:`orgel.runtime.buffers`). The loss of each share weighs by its
    share of the batch (:mod:`orgel.lossweights`).
    """
    sizes = _split_sizes(rows, replicas)
    start = sum(sizes[:replica])
    return start, start + sizes[replica]


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
    if isinstance(value, Mapping):
        return same_kind(value, {k: share(v, replica, replicas, dim, rows)
                                 for k, v in value.items()})
    return value


def placeholders(like: dict[str, torch.Tensor],
                 shapes: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Stand-ins for ``like``'s tensors with only a shape (a 1-element storage expanded),
    cheap to send every step: what the ranks of a forward fed by the caller get in place
    of the batch. ``shapes``: other shapes than ``like``'s own (the whole batch's)."""
    return {n: torch.zeros((), dtype=t.dtype).expand(t.shape if shapes is None else shapes[n])
            for n, t in like.items()}


def batch_placeholders(parts: list[dict[str, torch.Tensor]], dim: int,
                       whole: Collection[str]) -> dict[str, torch.Tensor]:
    """:func:`placeholders` of the batch of micro-batches ``parts``, side by side along
    ``dim``; an input in ``whole`` as the first has it."""
    first = parts[0]
    return placeholders(first, {n: t.shape if n in whole else
                                (*t.shape[:dim], sum(p[n].shape[dim] for p in parts),
                                 *t.shape[dim + 1:])
                                for n, t in first.items()})


def side_by_side(parts: list[dict[str, Any]], whole: Collection[str], dim: int) -> dict[str, Any]:
    """The ranks' micro-batch from its data-parallel replicas' pieces, in replica order.

    Where a forward runs in the caller (closures, the Python between graphs), data
    parallelism cuts each of the ranks' micro-batches ``j`` into ``dp`` pieces, ``j*dp ...
    j*dp+dp-1``; replica ``r`` of the ranks takes piece ``j*dp+r``'s rows. The ranks get the
    pieces concatenated along ``dim``; a ``whole`` input (replicated) is the first piece's.
    """
    return {n: t if len(parts) == 1 or n in whole else torch.cat([p[n] for p in parts], dim)
            for n, t in parts[0].items()}


def split_microbatches(inputs: dict[str, Any], targets: Targets, m: int,
                       dim: BatchDim = 0, replicated: tuple[str, ...] | Any = (),
                       unit: int = 1) -> list[tuple[dict[str, Any], Targets]]:
    """``m`` micro-batches of named ``inputs`` and ``targets``: what the runtime and the
    reference both use. ``dim`` is the batch dimension (:func:`dim_of`: an int, or a dict
    by input name and ``"targets"``). Inputs named in ``replicated`` go whole to every
    micro-batch; the rest follow :func:`split_batch` along their own dimension, in
    :func:`micro_sizes` of ``unit``."""
    batch = batch_rows(inputs, targets, dim, replicated)
    sizes = micro_sizes(batch, m, unit)
    parts = {k: [v] * m if k in replicated else split_batch(v, sizes, dim_of(dim, k), batch)
             for k, v in inputs.items()}
    target_parts = split_batch(targets, sizes, dim_of(dim, TARGETS), batch)
    return [({k: p[i] for k, p in parts.items()}, target_parts[i]) for i in range(m)]


def check_batch(example: tuple[dict[str, Any], Targets], batch: tuple[dict[str, Any], Targets],
                microbatches: int, dim: BatchDim = 0,
                replicated: tuple[str, ...] = (), unit: int = 1) -> None:
    """Raise :class:`WorkloadError` unless a step's named inputs and targets fit the pipeline.

    ``example`` is the batch the pipeline was built from (named inputs, targets).
    The step's inputs must have the same names, every tensor the example's dtype
    (inputs and targets alike), the targets the inputs' batch size along their batch
    dimensions (``dim``: :func:`dim_of`),
    and that batch size must fill ``microbatches`` (:func:`micro_sizes` of ``unit``).
    Checked before any rank sees the batch, so a batch that fails here changes nothing.
    """
    (ex_inputs, ex_targets), (inputs, targets) = example, batch
    unknown = [k for k in inputs if k not in ex_inputs]
    missing = [k for k in ex_inputs if k not in inputs and ex_inputs[k] is not None]
    if unknown or missing:
        raise WorkloadError(
            f"the batch's inputs {list(inputs)} are not those of the example batch the "
            f"pipeline was built with {list(ex_inputs)}"
            + (f"; not in the example: {unknown}" if unknown else "")
            + (f"; missing: {missing}" if missing else "")
            + ": give every batch the example's inputs, by the same names (or build the "
            "pipeline with an example batch that has these)")
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
    if tensors_in(batched) and tensors_in(targets):
        rows, target_rows = batch_rows(batched, None, dim), batch_rows({}, targets, dim)
        if rows != target_rows:
            raise WorkloadError(
                f"the inputs have batch size {rows} but the targets {target_rows} (batch_dim "
                f"{dim!r}): give as many targets as inputs")
    micro_sizes(batch_rows(inputs, targets, dim, replicated), microbatches, unit)


def _same_kind(what: str, example: Any, value: Any) -> None:
    """Raise unless ``value`` is a tensor of ``example``'s dtype (or both are no tensor)."""
    if isinstance(example, torch.Tensor) != isinstance(value, torch.Tensor):
        raise WorkloadError(f"{what} is a {type(value).__name__} but the pipeline was built "
                            f"with a {type(example).__name__}")
    if isinstance(value, torch.Tensor) and value.dtype != example.dtype:
        raise WorkloadError(f"{what} is {value.dtype} but the pipeline was built with "
                            f"{example.dtype}: convert it (.to({example.dtype}))")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` equals ``b`` up to float noise (relative to ``b``'s largest finite value);
    NaN and infinities must sit at the same places."""
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-4 * (1 + scale),
                          equal_nan=True)


def fingerprint(inputs: dict[str, Any], targets: Targets) -> list[tuple[str, Any, str, float]]:
    """What tells one batch from another cheaply: each tensor's name, shape, dtype and a
    weighted sum of at most 1024 of its elements spread over it (equal batches give equal
    fingerprints on every process; another batch's differ, short of a coincidence)."""
    named = {**{f"input {k!r}": v for k, v in inputs.items()}, "targets": targets}
    found = []
    for name, value in named.items():
        for path, leaf in pytree.tree_flatten_with_path(plain(value))[0]:
            if not isinstance(leaf, torch.Tensor):
                continue
            flat = leaf.detach().reshape(-1)
            picked = flat[:: max(1, flat.numel() // 1024)].to(torch.float64).nan_to_num(
                nan=0.5, posinf=1.5, neginf=-1.5)  # a NaN is equal to itself here
            weights = torch.arange(1, picked.numel() + 1, dtype=torch.float64)
            found.append((name + pytree.keystr(path), tuple(leaf.shape), str(leaf.dtype),
                          float((picked * weights).sum())))
    return found


def plain(obj: Any) -> Any:
    """``obj`` with every mapping a dict (a ``BatchEncoding``, a transformers ``ModelOutput``:
    no pytree node, or not always one) and every list or plain tuple a list, for pytree; a
    named tuple stays one (pytree names its fields)."""
    if isinstance(obj, Mapping) or hasattr(obj, "keys") and hasattr(obj, "__getitem__"):
        try:
            return {k: plain(obj[k]) for k in obj.keys()}  # noqa: SIM118 - not always a dict
        except Exception:  # noqa: BLE001 - not a mapping after all
            return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(plain(x) for x in obj))
    if isinstance(obj, (tuple, list)):
        return [plain(x) for x in obj]
    return obj


def check_same_everywhere(gather: Any, inputs: dict[str, Any], targets: Targets,
                          call: str) -> None:
    """Where every process of a pipeline calls ``call`` (torchrun, ``orgel run``'s ranks):
    raise ValueError on every process unless every process passed it the same batch
    (``gather(value)``: every process's value, in process order).
    The pipeline cuts the one batch over its ranks itself; a batch per process (a
    ``DistributedSampler``'s shard) would train one process's inputs on another's labels."""
    prints = gather(fingerprint(inputs, targets))
    others = [p for p, seen in enumerate(prints) if seen != prints[0]]
    if not others:
        return
    names = sorted({a[0] for p in others for a, b in zip(prints[p], prints[0], strict=False)
                    if a != b} or {"the inputs' names"})
    raise ValueError(
        f"{call} got another batch on process{'es' if len(others) > 1 else ''} "
        f"{', '.join(map(str, others))} than on process 0 ({', '.join(names)} differ): under "
        "torchrun every process passes the same whole batch, and the pipeline cuts it over "
        "its ranks itself. A DistributedSampler (or data split by rank) gives each process "
        "its own: load the same batches on every process (the same seed and order)")

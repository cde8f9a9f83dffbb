"""How ``orgel.backend``'s ``step`` cuts its positional arguments into micro-batches (and
marks them dynamic for its first capture)."""

from __future__ import annotations

from typing import Any

import torch


def check_cutting(microbatches: Any, dp: Any, batch_dim: Any, replicated: Any) -> list[int]:
    """Check ``orgel.backend``'s options on how ``step`` cuts its arguments (``dp`` replicas
    share the closures); the positions of ``replicated`` as a list."""
    if isinstance(dp, int) and dp > 1 and isinstance(microbatches, int) and microbatches % dp:
        raise ValueError(f"orgel.backend(dp={dp}) shares the step's {microbatches} closures "
                         f"among {dp} replicas of the pipeline: give microbatches a multiple "
                         f"of dp (say {dp * max(1, microbatches // dp)})")
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise ValueError(f"batch_dim must be a non-negative int for orgel.backend (step takes "
                         f"positional arguments), got {batch_dim!r}")
    positions = list(replicated) if isinstance(replicated, (list, tuple)) else None
    if positions is None or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                for i in positions):
        raise ValueError(f"replicated must be a list of step's argument positions (ints >= 0, "
                         f"0 is the first argument after the closure), got {replicated!r}")
    return positions


def slice_batch(batch: tuple[Any, ...], m: int, dim: int = 0, replicated: tuple[int, ...] = (),
                dp: int = 1) -> tuple[list[list[Any]], int]:
    """``step``'s arguments cut into ``m`` micro-batches, and the batch size.

    The workload's one rule (:func:`orgel.batching.split_microbatches`): along ``dim``,
    what has the batch size is cut; the arguments at the positions ``replicated`` and
    those without the dimension go whole to every micro-batch. With nothing to cut,
    every closure gets the arguments whole and the batch size is ``m``. ``dp``: the
    ranks' replicas, ``dp`` closures side by side per micro-batch of theirs (a batch of
    fewer rows than ``m`` is refused).
    """
    from orgel.batching import batch_rows, micro_sizes, split_microbatches, tensors_in
    from orgel.workload import WorkloadError

    beyond = [i for i in replicated if i >= len(batch)]
    if beyond:
        raise ValueError(f"orgel.backend(replicated={list(replicated)}) names argument "
                         f"positions {beyond} but step got {len(batch)} batch arguments "
                         "(positions count from 0 after the closure)")
    named = {argument_name(i): arg for i, arg in enumerate(batch)}
    whole = tuple(argument_name(i) for i in replicated)
    if not any(t.dim() > dim for i, a in enumerate(batch) if i not in replicated
               for t in tensors_in(a)):
        return [list(batch) for _ in range(m)], m
    try:
        rows = batch_rows(named, None, dim, whole)
        micro_sizes(rows, m // dp, dp)  # the ranks' cut (dp closures each) agrees with this one
        parts = split_microbatches(named, None, m, dim, whole)
    except WorkloadError as exc:
        raise WorkloadError(
            f"{exc}. For orgel.backend the inputs are step's arguments by position "
            "('argument i' counts from 0 after the closure): name the ones that go whole "
            "to every closure in orgel.backend(..., replicated=[i, ...])") from None
    return [list(part.values()) for part, _ in parts], rows


def shared_inputs(given: list[dict[str, torch.Tensor] | None]) -> tuple[str, ...]:
    """The model inputs every micro-batch's closure passed as the same tensor (same memory,
    shape and strides): not batched, such as a ``replicated`` argument passed on whole."""
    first = given[0]
    if first is None or len(given) < 2:
        return ()

    def where(t: torch.Tensor) -> tuple[Any, ...]:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())

    return tuple(n for n, t in first.items()
                 if all(g is not None and where(g[n]) == where(t) for g in given[1:]))


def whole_inputs(given: list[dict[str, torch.Tensor]], dim: int) -> tuple[str, ...]:
    """The inputs every micro-batch takes whole: those every closure passed as the same tensor
    (:func:`shared_inputs`: a replicated argument, a table of another size), and those
    without the batch dimension ``dim``."""
    shared = shared_inputs(list(given))
    return tuple(n for n, t in given[0].items() if n in shared or t.dim() <= dim)


def argument_name(i: int) -> str:
    """How :func:`slice_batch` names ``step``'s argument at position ``i`` (0 after the closure)."""
    return f"argument {i}"


def rows_at(rows: int, dim: int) -> torch.Tensor:
    """Placeholder targets with ``rows`` along the batch dimension ``dim``."""
    return torch.zeros((1,) * dim + (rows,))

"""Blocks are profiled with the thread count the ranks train with, and the caller's is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import orgel.profile.measure as measure_mod
from orgel.profile.workload import profile_workload, rank_threads
from orgel.workload import Workload


def mlp() -> Workload:
    """Big enough that matmuls, not Python, dominate a block (about 1 ms per forward)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(256, 8))
    return Workload(model, (torch.randn(128, 256),), torch.randn(128, 8),
                    nn.functional.mse_loss)


def test_profiling_records_and_restores_the_thread_count(cache: Path) -> None:
    """The table says which thread count its times are for, and profiling leaves the
    caller's count as it was. (That the blocks run with it is the next test; a time
    compared with a direct run would depend on the machine's load.)"""
    w = mlp()
    before = torch.get_num_threads()
    costs = profile_workload(w, microbatches=2, blocks=4, link=False, repeats=3,
                             progress=False, use_cache=False, threads=1)
    assert torch.get_num_threads() == before  # restored after profiling
    assert costs.meta["threads"] == 1
    assert len(costs.fwd) == 4 and all(t > 0 for t in costs.fwd)


def test_blocks_are_timed_with_the_ranks_thread_count(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = measure_mod.interleaved

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(measure_mod, "interleaved", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        costs = profile_workload(mlp(), microbatches=2, blocks=3, link=False, repeats=1,
                                 progress=False, threads=1)
    finally:
        after = torch.get_num_threads()
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert after == 2
    # The thread count is part of the cache key: another count measures again.
    seen.clear()
    other = profile_workload(mlp(), microbatches=2, blocks=3, link=False, repeats=1,
                             progress=False, threads=2)
    assert set(seen) == {2} and other.meta["threads"] == 2 and costs.meta["threads"] == 1


def test_threads_option_is_checked() -> None:
    with pytest.raises(ValueError, match="threads"):
        profile_workload(mlp(), microbatches=2, blocks=3, link=False, threads=0)
    assert rank_threads(1) >= 1 and rank_threads(10_000) == 1

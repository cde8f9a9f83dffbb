"""Profiled block times match a direct run: same thread count as the ranks, no inflation."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import orgel.profile.workload as profile_mod
from orgel.profile.workload import profile_workload, rank_threads
from orgel.workload import Workload, microbatches, named_inputs


def mlp() -> Workload:
    """Big enough that matmuls, not Python, dominate a block (about 1 ms per forward)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(256, 8))
    return Workload(model, (torch.randn(128, 256),), torch.randn(128, 8),
                    nn.functional.mse_loss)


def direct_forward_ms(w: Workload, m: int, repeats: int = 15) -> float:
    """Mean ms of the whole model's forward (autograd recording) on one micro-batch.

    The mean, as the profiler's times carry the machine's share pooled over
    every sample (a preemption now and then counts, as it does for a rank).
    """
    inputs, _ = microbatches(w, m)[0]
    named = named_inputs(w.model, inputs)
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        w.model(**named)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.fmean(times)


def test_block_forward_sum_matches_direct_forward(cache: Path) -> None:
    w = mlp()
    before = torch.get_num_threads()
    costs = profile_workload(w, microbatches=2, blocks=4, link=False, repeats=7,
                             progress=False, use_cache=False, threads=1)
    assert torch.get_num_threads() == before  # restored after profiling
    assert costs.meta["threads"] == 1
    torch.set_num_threads(1)
    try:
        direct = direct_forward_ms(w, 2)
        # Profile and direct timing interleaved once more, so a burst of load on a
        # shared machine hits both sides: compare medians of each.
        again = profile_workload(w, microbatches=2, blocks=4, link=False, repeats=7,
                                 progress=False, use_cache=False, threads=1)
        direct = statistics.median([direct, direct_forward_ms(w, 2)])
    finally:
        torch.set_num_threads(before)
    summed = statistics.median([sum(costs.fwd), sum(again.fwd)])
    # The blocks together do the same work as the whole forward: a sane factor, not
    # the 40-200x of profiling with a thread pool fighting for shared cores.
    assert 0.3 * direct <= summed <= 3.0 * direct, (summed, direct)


def test_blocks_are_timed_with_the_ranks_thread_count(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = profile_mod.interleaved

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profile_mod, "interleaved", spy)
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

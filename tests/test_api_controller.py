"""Local-spawn controller: forked ranks join one gloo group, serve commands, fail loudly."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from orgel.launch.errors import WorkerError
from orgel.launch.processes import LocalGroup

pytestmark = pytest.mark.slow  # starts rank processes


class _SumEngine:
    """A tiny engine: each rank holds ``rank + 1`` and sums with the others."""

    def __init__(self, rank: int) -> None:
        self.value = torch.tensor([float(rank + 1)])

    def all_sum(self, scale: float) -> float:
        t = self.value * scale
        dist.all_reduce(t)
        return float(t.item())

    def fail_on(self, rank: int) -> int:
        if dist.get_rank() == rank:
            raise ValueError("boom")
        return dist.get_rank()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def test_commands_run_on_every_rank_and_return_by_rank() -> None:
    group = LocalGroup(3, _SumEngine, threads=1)
    try:
        assert group.call("all_sum", 2.0) == [12.0, 12.0, 12.0]
        assert group.call("fail_on", -1, ranks=[0, 2]) == [0, 2]
    finally:
        group.close()
    assert all(not p.is_alive() for p in group._procs)


def test_a_rank_that_raises_closes_the_group_with_its_message() -> None:
    group = LocalGroup(2, _SumEngine, threads=1)
    with pytest.raises(WorkerError, match="rank 1 failed in fail_on: ValueError: boom") as info:
        group.call("fail_on", 1, ranks=[1])
    assert info.value.rank == 1
    with pytest.raises(WorkerError, match="create a new pipeline"):
        group.call("all_sum", 1.0)


def test_sigkill_of_a_rank_is_reported_and_the_rest_are_killed() -> None:
    group = LocalGroup(2, _SumEngine, threads=1)
    pids = group.pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match="rank 1 died during sleep .killed by signal 9."):
        group.call("sleep", 0.5)
    assert all(not p.is_alive() for p in group._procs)


def test_engine_construction_errors_reach_the_controller() -> None:
    def broken(rank: int) -> _SumEngine:
        raise RuntimeError(f"no engine on rank {rank}")

    with pytest.raises(WorkerError, match="no engine on rank"):
        LocalGroup(2, broken, threads=1)

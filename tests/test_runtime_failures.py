"""Never hang, always say why: a killed rank, a hung rank and a raising stage.

Each test spawns 3 gloo ranks running 1F1B with a short timeout; a forward
pre-hook on rank 1's stage misbehaves during the second step. The launcher must
return promptly with one report naming rank, action and peer.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from orgel.launch.errors import WorkerError
from orgel.launch.spawn import spawn
from orgel.runtime.executor import Executor
from test_runtime_nets import batch, build, ce_loss, sgd

pytestmark = pytest.mark.slow  # spawns gloo ranks

TIMEOUT = 3.0


class StageBroke(RuntimeError):
    """The error a stage raises on purpose."""


def misbehave(rank: int, world: int, mode: str) -> None:
    """Run 3 steps of 1F1B; rank 1 kills itself / hangs / raises in its 6th forward."""
    _, split_model, plan, _ = build("1f1b-3")
    calls = [0]

    def hook(module: torch.nn.Module, args: object) -> None:
        calls[0] += 1
        if rank != 1 or calls[0] != 6:
            return
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "hang":
            time.sleep(60)
        elif mode == "nan":
            args[0].data.fill_(float("nan"))  # type: ignore[index]
        else:
            raise StageBroke("stage 1 cannot go on")

    split_model.stages[1].module.register_forward_pre_hook(hook)
    ex = Executor(plan, split_model, loss_fn=ce_loss, optimizer_factory=sgd, timeout=TIMEOUT,
                  check_finite=mode == "nan")
    inputs, targets = batch("gpt")
    for _ in range(3):
        ex.step(inputs, targets)


def _fail(mode: str) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(misbehave, 3, mode, timeout=TIMEOUT)
    return str(info.value), time.monotonic() - start


def test_killed_rank_stops_the_others_with_rank_action_and_peer() -> None:
    message, elapsed = _fail("kill")
    assert message.startswith("rank 1 died during run (killed by signal 9)"), message
    # rank 0 waits for gradients from rank 1; rank 2 for activations from rank 1
    assert "rank 0 failed in run: lost rank 1 waiting for gradient" in message
    assert "rank 2 failed in run: lost rank 1 waiting for activations" in message
    assert "[while running" in message
    assert elapsed < 60  # spawn + detection; no rank waited for the full timeout chain


def test_hung_rank_times_out_everywhere() -> None:
    message, _ = _fail("hang")
    assert f"timed out after {TIMEOUT:g} s" in message
    for rank in (0, 2):
        assert f"rank {rank} failed in run: timed out" in message, message
    assert "from rank 1" in message
    assert message.endswith("rank 1 had not finished 'run': stopped"), message


def test_stage_error_is_reported_once_with_its_traceback() -> None:
    message, _ = _fail("raise")
    assert message.count("StageBroke: stage 1 cannot go on") == 2  # its line, its traceback
    assert message.count("Traceback (most recent call last)") == 1
    assert "StageBroke" in message
    assert message.splitlines()[0].startswith(
        "rank 1 failed in run: StageBroke: stage 1 cannot go on [while running F1.")
    assert message.endswith("ranks 0, 2 had not finished 'run': stopped"), message


def test_non_finite_loss_is_caught_where_it_appears() -> None:
    message, _ = _fail("nan")
    first = message.splitlines()[0]
    assert first.startswith("rank 2 failed in run: NonFiniteLoss: the loss of micro-batch ")
    assert "is nan (stage 2)" in first
    # orgel's own finding: its one line, no traceback of orgel's internals
    assert message.count("NonFiniteLoss: the loss") == 1, message
    assert "Traceback" not in message, message


def fail_first(rank: int, world: int) -> None:
    """Rank 1 raises in its first forward, while rank 0 waits for the first step's shapes."""
    _, split_model, plan, _ = build("1f1b-3")

    def hook(module: torch.nn.Module, args: object) -> None:
        raise StageBroke("stage 1 cannot start")

    if rank == 1:
        split_model.stages[1].module.register_forward_pre_hook(hook)
    ex = Executor(plan, split_model, loss_fn=ce_loss, optimizer_factory=sgd, timeout=60.0)
    inputs, targets = batch("gpt")
    ex.step(inputs, targets)


def test_a_failure_stops_ranks_waiting_on_the_store_at_once() -> None:
    # the first step exchanges shapes through the rendezvous store, whose waits do not see a
    # peer die: the failing rank's abort flag ends them (a hang check: well under 60 s)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(fail_first, 3, timeout=60.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.splitlines()[0].startswith("rank 1 failed in run: StageBroke: stage 1 cannot "
                                              "start [while running F1.0")
    assert message.count("StageBroke: stage 1 cannot start") == 2  # the line and the traceback
    assert elapsed < 30, f"the ranks took {elapsed:.0f} s to stop"

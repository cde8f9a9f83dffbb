"""A measurement that crashes the process is skipped with a note, never a crash of the caller."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

from orgel import backward
from orgel.profile import blocks, timing
from orgel.profile.trial import trial
from orgel.split.types import StageModule

pytestmark = pytest.mark.slow  # forks children


class NormConv(nn.Module):
    """A ResNet block's start, as in a diffusion UNet: GroupNorm, SiLU, convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(8, 32), nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.conv(nn.functional.silu(self.norm(x))),)


def test_trial_reports_which_job_killed_the_child_and_goes_on() -> None:
    ran: list[int] = []

    def crash() -> None:
        os.kill(os.getpid(), signal.SIGSEGV)

    def fails() -> None:
        raise ValueError("no")

    failed = trial([lambda: None, crash, fails, lambda: ran.append(1)])
    assert failed == {1: "the process died of SIGSEGV running it", 2: "ValueError: no"}
    assert ran == []  # the jobs ran in children, not here


def test_a_split_backward_that_crashes_is_timed_whole_with_a_note(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the fix in orgel.backward, W on a channels-last GroupNorm dies of
    # SIGSEGV inside PyTorch's kernel: the profile must skip it, not die with it.
    monkeypatch.setattr(backward, "_input_too", lambda node: [])
    stage = StageModule(index=0, module=NormConv(), inputs=["x"], outputs=["y"])
    x = torch.randn(2, 32, 8, 8).to(memory_format=torch.channels_last)
    m = blocks.measure_block(stage, [x], timing.Timer(torch.device("cpu"), warmup=0, repeats=1))
    assert "SIGSEGV" in m.note and "split backward" in m.note
    assert m.bwd > 0 and m.wgrad == 0
    monkeypatch.undo()  # and with the fix the halves are timed
    m = blocks.measure_block(stage, [x], timing.Timer(torch.device("cpu"), warmup=0, repeats=1))
    assert m.note == "" and 0 < m.wgrad <= m.bwd


def test_trial_works_in_a_process_with_many_descriptors_open() -> None:
    """Late in a long run a process holds descriptors past select()'s 1024: the trial's
    pipe may be one of them (the whole suite once failed there)."""
    held = []
    try:
        while not held or held[-1][0] < 1100:
            held.append(os.pipe())
        assert trial([lambda: None, lambda: None]) == {}
    finally:
        for r, w in held:
            os.close(r)
            os.close(w)

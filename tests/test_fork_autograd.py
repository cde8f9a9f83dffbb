"""Ranks forked from a process whose autograd engine started device threads.

Such ranks fail their first backward ("Unable to handle autograd's threading in combination
with fork-based multiprocessing"). With PyTorch's CUDA builds (the usual pip wheels) that
state follows any backward once TorchDynamo compiled something, GPU or not; the CPU wheel
this suite runs on never reaches it, so the tests below put the probe's answer in its place.
orgel starts the engine before its own capture (:func:`orgel.guard.autograd_first`: `orgel
demo` under the CUDA wheel of 2.13 on a CPU machine trains with it and failed in every rank
without it), and where the caller reached that state itself, forking is refused with
advice, or, for picklable work, the processes are spawned instead.
"""

from __future__ import annotations

import operator

import pytest
import torch

import orgel
import orgel.launch.forks as forks
import orgel.launch.processes as processes
from orgel.launch.spawn import spawn
from orgel.models import build


def test_a_process_that_cannot_fork_backward_is_refused_with_advice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "forked_backward_fails", lambda: True)
    w = build("gpt", batch_size=4, vocab_size=32, d_model=16, n_layers=2, n_heads=2,
              seq_len=8)
    with pytest.raises(ValueError, match="autograd cannot run in processes forked") as err:
        orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=2,
                       schedule="1f1b")
    assert "orgel run" in str(err.value) and "torchrun" in str(err.value)


def test_forked_backward_probe_passes_in_a_healthy_process() -> None:
    # this suite's CPU wheel: orgel's own capture (Dynamo) and a backward after it leave
    # forked processes able to run one
    torch.compile(torch.nn.Linear(2, 2), backend="eager")(torch.ones(1, 2)).sum().backward()
    assert not forks.forked_backward_fails()


@pytest.mark.slow
def test_picklable_work_is_spawned_where_a_fork_could_not_run_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import orgel.launch.spawn as spawning

    monkeypatch.setattr(spawning, "forks_run_backward", lambda: False)
    contexts: list[str] = []
    group = spawning.LocalGroup
    monkeypatch.setattr(spawning, "LocalGroup", lambda *a, **k: (
        contexts.append(k["context"]), group(*a, **k))[1])
    assert spawn(operator.add, 2, timeout=30.0, context="fork") == [2, 3]
    assert contexts == ["spawn"]

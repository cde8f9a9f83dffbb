"""orgel.pipeline on forked gloo ranks: reference match, checkpoints, SIGKILL, re-shard."""

from __future__ import annotations

import copy
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from orgel.explicit.api import Pipeline, load, pipeline
from orgel.launch.errors import WorkerError
from orgel.models import build
from orgel.runtime import checkpoint as ckpt

pytestmark = pytest.mark.slow
LR = 0.05


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 128, (24, 32), generator=g)
    return (tokens,), torch.roll(tokens, -1, dims=1)


def _gpt() -> tuple[torch.nn.Module, object, torch.Tensor, object]:
    model, inputs, targets, loss_fn = build("gpt", batch_size=24, seed=0, n_layers=2, d_model=32)
    return model, inputs, targets, loss_fn


def _start(ranks: int, schedule: str | None = "1f1b") -> tuple[Pipeline, torch.nn.Module, object]:
    """The GPT on ``ranks`` ranks: a FLOP-balanced chain run by ``schedule`` (no profiling),
    or with ``schedule=None`` the planner's plan."""
    model, inputs, targets, loss_fn = _gpt()
    pipe = pipeline(model, inputs, targets, loss_fn, ranks=ranks, microbatches=4,
                    optimizer=_sgd, threads=1, schedule=schedule)
    return pipe, model, loss_fn


def _reference(steps: int) -> tuple[torch.nn.Module, list[float]]:
    model, _, _, loss_fn = _gpt()
    opt = _sgd(list(model.parameters()))
    losses = []
    for s in range(steps):
        inputs, targets = _batch(s)
        opt.zero_grad()
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def _assert_close(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert list(state) == list(expected)
    for name, t in expected.items():
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-5, msg=name)


def test_two_ranks_match_the_single_process_reference() -> None:
    pipe, _, _ = _start(2, schedule=None)
    with pipe:
        losses = [pipe.step(*_batch(s)) for s in range(3)]
        reference, ref_losses = _reference(3)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_close(pipe.state_dict(), reference)
        events = pipe.timeline()
        assert {e.rank for e in events} == {0, 1}
        assert {e.kind for e in events} >= {"F", "B"}
        # load_state_dict takes the original model's names and reaches every rank
        fresh, _, _, _ = _gpt()
        pipe.load_state_dict(fresh.state_dict())
        _assert_close(pipe.state_dict(), fresh)
        # the prediction is the plan's own (the planner stored it when it chose the plan)
        predicted = pipe.predicted()
        assert predicted.step_time == pytest.approx(pipe.plan.prediction["step_time"])
        assert {e.rank for e in predicted.timeline.events} == {0, 1}
        # the planner counted SGD's momentum (one copy of the weights), not Adam's two
        costs = pipe.plan.costs
        assert costs is not None
        for st in costs.stages:
            assert st.optimizer == pytest.approx(st.params, rel=1e-6, abs=1)


def test_sigkill_mid_training_then_resume_is_bit_identical(tmp_path: Path) -> None:
    pipe, _, _ = _start(2)
    with pipe:
        for s in range(4):
            pipe.step(*_batch(s))
        uninterrupted = pipe.state_dict()

    pipe, model, loss_fn = _start(2)
    pipe.step(*_batch(0))
    pipe.step(*_batch(1))
    pipe.save(tmp_path)
    pipe.step(*_batch(2))
    # the rank dies while step 3 runs; the controller reports it and kills the other
    killer = threading.Timer(0.05, os.kill, (pipe.worker_pids[1], signal.SIGKILL))
    killer.start()
    with pytest.raises(WorkerError, match="rank 1 died"):
        for s in range(3, 50):
            pipe.step(*_batch(s))
    killer.join()

    model, inputs, targets, loss_fn = _gpt()
    resumed = load(tmp_path, model, inputs, targets, loss_fn, optimizer=_sgd, threads=1)
    with resumed:
        assert resumed.steps == 2
        for s in range(2, 4):
            resumed.step(*_batch(s))
        final = resumed.state_dict()
    for name, t in uninterrupted.items():
        assert torch.equal(final[name], t), name


def test_resume_two_rank_checkpoint_on_three_ranks_matches_reference(tmp_path: Path) -> None:
    pipe, _, _ = _start(2)
    with pipe:
        pipe.step(*_batch(0))
        pipe.step(*_batch(1))
        folder = pipe.save(tmp_path)
    assert folder == ckpt.step_dir(tmp_path, 2)
    model, inputs, targets, loss_fn = _gpt()
    resumed = load(tmp_path, model, inputs, targets, loss_fn, ranks=3, optimizer=_sgd,
                   threads=1, schedule="gpipe")
    with resumed:
        # no planner: three stages of about equal FLOPs, run by the family asked for
        assert resumed.plan.num_ranks == 3 and resumed.plan.meta["schedule"] == "gpipe"
        assert resumed.plan.meta["planner"].startswith("balanced chain")
        resumed.step(*_batch(2))
        resumed.step(*_batch(3))
        reference, _ = _reference(4)
        _assert_close(resumed.state_dict(), reference)
    # the checkpoint converts to the original model's state_dict
    out = tmp_path / "model.pt"
    ckpt.export(tmp_path, out)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(torch.load(out, weights_only=True))
    _assert_close(fresh.state_dict(), _reference(2)[0])


def test_options_are_checked_up_front() -> None:
    model, inputs, targets, loss_fn = _gpt()
    with pytest.raises(ValueError, match="ranks must be a positive int"):
        pipeline(model, inputs, targets, loss_fn, ranks=0)
    with pytest.raises(ValueError, match="dp must be a positive int that divides"):
        pipeline(model, inputs, targets, loss_fn, ranks=2, dp=3)
    with pytest.raises(ValueError, match="optimizer must be a function"):
        pipeline(model, inputs, targets, loss_fn, ranks=2, optimizer="adam")  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_dropped_pipeline_stops_its_workers_and_close_is_idempotent() -> None:
    import gc
    import time

    pipe, _, _ = _start(2)
    pids = pipe.worker_pids
    with pipe:
        pipe.step(*_batch(0))
    pipe.close()  # a second close does nothing
    assert not any(_alive(pid) for pid in pids)

    pipe, _, _ = _start(2)
    pids = pipe.worker_pids
    del pipe  # never closed: garbage collection stops the workers
    gc.collect()
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no longer counts: the worker has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_checkpoints_plan_for_another_model_says_so(tmp_path: Path) -> None:
    """The plan saved with a 2-layer GPT's checkpoint, given to a 3-layer one."""
    pipe, _, _ = _start(2)
    try:
        pipe.step(*_batch(0))
        plan = pipe.plan
        pipe.save(tmp_path)
    finally:
        pipe.close()
    bigger, inputs, targets, loss_fn = build("gpt", batch_size=24, seed=0, n_layers=3,
                                             d_model=32)
    for given in (plan, ckpt.resolve(tmp_path) / "plan.json"):
        with pytest.raises(ValueError, match=r"the plan does not match this model: \d+ of its "
                           r"graph's \d+ nodes are in no stage .*plan again"):
            pipeline(bigger, inputs, targets, loss_fn, ranks=2, microbatches=4, plan=given,
                     threads=1)


def test_save_keeps_every_checkpoint_unless_told_how_many(tmp_path: Path) -> None:
    pipe, _, _ = _start(2)
    with pipe:
        with pytest.raises(ckpt.CheckpointError, match=r"keep=0: give how many"):
            pipe.save(tmp_path, keep=0)  # refused before any rank writes
        assert not list(tmp_path.iterdir())
        for s in range(3):
            pipe.step(*_batch(s))
            pipe.save(tmp_path)  # the default removes nothing
        steps = [p.name for p in sorted(tmp_path.iterdir()) if p.name.startswith("step-")]
        assert steps == ["step-00000001", "step-00000002", "step-00000003"]
        pipe.step(*_batch(3))
        pipe.save(tmp_path, keep=2)
        steps = [p.name for p in sorted(tmp_path.iterdir()) if p.name.startswith("step-")]
        assert steps == ["step-00000003", "step-00000004"]
        assert ckpt.read_meta(tmp_path)["step"] == 4
    # each kept checkpoint holds the weights one process has after that many steps
    for n in (3, 4):
        reference, _ = _reference(n)
        _assert_close(ckpt.state_dict(ckpt.step_dir(tmp_path, n)), reference)

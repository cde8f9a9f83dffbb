"""FSDP2 inside a stage (``shard="fsdp"``): forked gloo ranks against one plain process.

Each test trains through ``orgel.pipeline`` on 4 ranks (2 stages, each on 2
ranks that shard it with torch's ``fully_shard``) and compares the losses and the
trained parameters with one process doing the same steps in plain PyTorch.
Tolerance: the sharded reductions sum the replicas' partial gradients in another
order than one process does, so losses agree to ``rel=1e-5`` and parameters to
``rtol=1e-4, atol=1e-4`` (float32). The absolute part is AdamW's: a gradient that
is zero in exact arithmetic (attention's key bias, which softmax ignores) is
rounding noise of about 1e-9 in both runs, and AdamW's ``g / sqrt(v)`` turns
that noise into steps of up to about 2e-5 here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.explicit.api import Pipeline, load
from orgel.graph.capture import capture
from orgel.launch.errors import StepError
from orgel.models import build
from orgel.plan.balanced import balanced_plan
from orgel.plan.transforms import mark_sharded
from orgel.schedule.ir import Plan
from orgel.workload import Workload, microbatches

pytestmark = pytest.mark.slow
VOCAB = 64
GPT = "examples/gpt.py:workload"


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (8, 16), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _gpt() -> tuple[nn.Module, Any, Any, Any]:
    model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                            vocab_size=VOCAB, seq_len=16)
    return model, inputs, targets, loss_fn


def _halving(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)


def _reference(model: nn.Module, loss_fn: Any, steps: int, *, accumulate: int = 1,
               max_grad_norm: float | None = None, scheduler: Any = None,
               skip: set[int] = frozenset()) -> tuple[list[float], list[float]]:  # type: ignore[assignment]
    """One process: the same steps (and accumulation, clipping, schedule) with plain
    PyTorch; the losses of every call and the gradient norm of every optimizer step.
    The calls in ``skip`` (dropped ones) are left out."""
    opt = _adamw(list(model.parameters()))
    schedule = None if scheduler is None else scheduler(opt)
    losses, norms = [], []
    done = 0
    for s in range(steps):
        if s in skip:
            continue
        x, y = _batch(s)
        loss = loss_fn(model(x), y)
        (loss / accumulate).backward()
        losses.append(loss.item())
        done += 1
        if done % accumulate == 0:
            if max_grad_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                  max_grad_norm)))
            opt.step()
            opt.zero_grad()
            if schedule is not None:
                schedule.step()
    return losses, norms


def _assert_state(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    assert list(state) == list(expected)
    for name, t in expected.items():
        assert not isinstance(state[name], torch.distributed.tensor.DTensor), name
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _plan(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any, *,
          schedule: str = "1f1b", shard: str = "fsdp") -> Plan:
    """2 stages x 2 replicas on 4 ranks (stage 0 on ranks 0 and 2, stage 1 on 1 and 3)."""
    first = microbatches(Workload(model, inputs, targets, loss_fn), 2 * 2)[0][0]
    plan = balanced_plan(capture(model, first), ranks=4, microbatches=2, dp=2,
                         schedule=schedule)
    assert plan.placement == [(0, 2), (1, 3)]
    return mark_sharded(plan, shard)


def test_a_gpt_on_two_stages_of_two_fsdp_replicas_matches_one_process() -> None:
    """1F1B, stage 0 recomputed: losses, trained state, evaluation, and each rank holds
    half of its stage's parameters (without sharding every replica holds all of them)."""
    model, inputs, targets, loss_fn = _gpt()
    reference = copy.deepcopy(model)
    plan = dataclasses.replace(_plan(model, inputs, targets, loss_fn), recompute=[True, False])
    pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=4, dp=2, plan=plan,
                          microbatches=2, optimizer=_adamw, threads=1, timeout_s=120)
    with pipe:
        _assert_sharded(pipe, reference)
        losses = [pipe.step(*_batch(s)) for s in range(3)]
        state = pipe.state_dict()
        ref_losses, _ = _reference(reference, loss_fn, 3)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_state(state, reference)
        _assert_state(pipe.copy_to(copy.deepcopy(model)).state_dict(), reference)
        # load_state_dict reaches the shards: the state read back is the state loaded
        fresh, _, _, _ = _gpt()
        pipe.load_state_dict(fresh.state_dict())
        _assert_state(pipe.state_dict(), fresh)
        pipe.load_state_dict(state)
        # evaluation reads the sharded stages' weights whole; training goes on after it
        x, y = _batch(7)
        assert pipe.evaluate(x, y) == pytest.approx(_loss(reference, loss_fn, 7), rel=1e-5)
        assert pipe.step(*_batch(3)) == pytest.approx(_loss(reference, loss_fn, 3), rel=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_tied_embedding_on_two_sharded_stages_matches_one_process(tp: int) -> None:
    """The input embedding on stage 0 and the LM head tied to it on stage 1, both sharded
    over 2 replicas: the gradient shards sum replica by replica, the copies stay one. With
    ``tp=2`` too (8 processes; it was refused): tensor parallelism splits the blocks, not
    the tied weight, so each member's shards of both copies are the same rows."""
    model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                            d_model=32, vocab_size=VOCAB, seq_len=16,
                                            tie_embeddings=True)
    reference = copy.deepcopy(model)
    plan = _plan(model, inputs, targets, loss_fn)
    with orgel.pipeline(model, inputs, targets, loss_fn, ranks=4 * tp, tp=tp, dp=2, plan=plan,
                        microbatches=2, optimizer=_adamw, threads=1, timeout_s=120,
                        max_grad_norm=0.5) as pipe:
        if tp > 1:  # TP and FSDP split the blocks (a quarter), FSDP alone the tie (a half)
            held = {k: v for part in pipe.call_ranks("tp_shards") for k, v in part.items()}
            assert held["encoder.blocks.0.attn.qkv.weight"] == (24, 32), held  # of (96, 32)
            assert held["tok_emb.weight"] == (32, 32), held  # of (64, 32), on both stages
        losses = [pipe.step(*_batch(s)) for s in range(3)]
        norm = pipe.grad_norm
        state = pipe.state_dict()
    ref_losses, ref_norms = _reference(reference, loss_fn, 3, max_grad_norm=0.5)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norm == pytest.approx(ref_norms[-1], rel=1e-4)
    _assert_state(state, reference)


def _assert_sharded(pipe: Pipeline, model: nn.Module) -> None:
    """Every stage is sharded: the ranks together hold each parameter element once (a
    replicated stage's replicas would hold it twice)."""
    assert pipe.plan.shard == ["fsdp", "fsdp"]
    held = pipe.call_ranks("held_elements")
    assert sum(held) == sum(p.numel() for p in model.parameters()), held


def _loss(model: nn.Module, loss_fn: Any, step: int) -> float:
    """One process's loss of batch ``step`` (a pipeline step reports its loss before its
    optimizer step)."""
    x, y = _batch(step)
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def _count_collectives(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make FSDP2's all-gather and reduce-scatter write a line per call into ``folder``,
    one file per process (the ranks are forked from this one: they inherit it)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

    def counting(name: str) -> Any:
        original = getattr(group, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            with open(folder / str(os.getpid()), "a") as f:
                f.write(name + "\n")
            return original(*args, **kwargs)
        return counted

    for name in ("foreach_all_gather", "foreach_reduce"):
        monkeypatch.setattr(group, name, counting(name))


def test_zero_bubble_with_accumulation_and_clipping_matches_one_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZB-H1 (split backward: I then W), accumulate=2, max_grad_norm, a learning-rate
    schedule over the sharded parameters' optimizer: the reduce-scatter
    runs after each rank's last W of the optimizer-stepping call only; the global norm
    counts every shard once. The weights are gathered once per optimizer step, not per
    micro-batch (4 calls of 2 micro-batches, accumulate=2: 2 gathers and 2 reduces)."""
    _count_collectives(monkeypatch, tmp_path)
    model, inputs, targets, loss_fn = _gpt()
    reference = copy.deepcopy(model)
    plan = _plan(model, inputs, targets, loss_fn, schedule="zb-h1")
    assert any(a.kind == "W" for a in plan.schedule[0])
    pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=4, dp=2, plan=plan,
                          microbatches=2, optimizer=_adamw, threads=1, timeout_s=120,
                          accumulate=2, max_grad_norm=0.5, scheduler=_halving)
    with pipe:
        _assert_sharded(pipe, reference)
        losses, norms = [], []
        for s in range(4):
            losses.append(pipe.step(*_batch(s)))
            if s % 2:
                norms.append(pipe.grad_norm)
        state = pipe.state_dict()
    calls = [f.read_text().split() for f in sorted(tmp_path.iterdir())]
    assert len(calls) == 4  # every rank holds a sharded stage
    for made in calls:
        assert sorted(made) == ["foreach_all_gather"] * 2 + ["foreach_reduce"] * 2, made
    ref_losses, ref_norms = _reference(reference, loss_fn, 4, accumulate=2, max_grad_norm=0.5,
                                       scheduler=_halving)
    assert ref_norms[0] > 0.5  # the clipping bites
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    _assert_state(state, reference)


def test_bf16_mixed_sharded_trains_as_the_replicated_pipeline() -> None:
    """precision="bf16-mixed": replicas on half the rows differ from one process in bfloat16
    (as without sharding), so the reference is the same plan with whole replicas; FSDP
    must train exactly as it does (both sum the replicas' float32 gradients)."""
    model, inputs, targets, loss_fn = _gpt()
    runs = []
    for shard in ("none", "fsdp"):
        plan = _plan(model, inputs, targets, loss_fn, shard=shard)
        with orgel.pipeline(copy.deepcopy(model), inputs, targets, loss_fn, ranks=4, dp=2,
                            plan=plan, microbatches=2, optimizer=_adamw, threads=1,
                            timeout_s=120, precision="bf16-mixed") as pipe:
            if shard == "fsdp":
                _assert_sharded(pipe, model)
            runs.append(([pipe.step(*_batch(s)) for s in range(2)], pipe.state_dict()))
    (losses, state), (sharded_losses, sharded_state) = runs
    assert sharded_losses == pytest.approx(losses, rel=1e-5)
    for name, t in state.items():
        torch.testing.assert_close(sharded_state[name], t, rtol=1e-4, atol=1e-4)


@pytest.mark.hf
def test_a_hugging_face_llama_sharded_matches_one_process() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model)

    def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out["logits"].reshape(-1, VOCAB), y.reshape(-1))

    x, y = _batch(0)
    plan = _plan(model, {"input_ids": x}, y, lm_loss)
    pipe = orgel.pipeline(model, {"input_ids": x}, y, lm_loss, ranks=4, dp=2, plan=plan,
                          microbatches=2, optimizer=_adamw, threads=1, timeout_s=120)
    with pipe:
        _assert_sharded(pipe, reference)
        losses = [pipe.step({"input_ids": _batch(s)[0]}, _batch(s)[1]) for s in range(3)]
        state = pipe.state_dict()
    opt = _adamw(list(reference.parameters()))
    ref_losses = []
    for s in range(3):
        bx, by = _batch(s)
        loss = lm_loss(reference(input_ids=bx), by)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _assert_state(state, reference)


def test_a_sharded_checkpoint_resumes_on_a_plain_pipeline_and_back(tmp_path: Path) -> None:
    """Saved from 4 ranks (2 stages x 2-way FSDP), resumed on 2 ranks without replicas;
    saved from there, resumed sharded again: every step matches one process."""
    model, inputs, targets, loss_fn = _gpt()
    reference = copy.deepcopy(model)
    ref_losses, _ = _reference(reference, loss_fn, 6)
    plan = _plan(model, inputs, targets, loss_fn)
    options: dict[str, Any] = {"optimizer": _adamw, "threads": 1, "timeout_s": 120}
    with orgel.pipeline(copy.deepcopy(model), inputs, targets, loss_fn, ranks=4, dp=2,
                        plan=plan, microbatches=2, **options) as pipe:
        _assert_sharded(pipe, reference)
        losses = [pipe.step(*_batch(s)) for s in range(2)]
        pipe.save(tmp_path / "sharded")
    with load(tmp_path / "sharded", copy.deepcopy(model), inputs, targets, loss_fn, ranks=2,
              **options) as plain:
        assert plain.plan.placement == [(0,), (1,)]
        losses += [plain.step(*_batch(s)) for s in range(2, 4)]
        plain.save(tmp_path / "plain")
    with load(tmp_path / "plain", copy.deepcopy(model), inputs, targets, loss_fn, ranks=4,
              plan=plan, **options) as again:
        _assert_sharded(again, reference)
        losses += [again.step(*_batch(s)) for s in range(4, 6)]
        state = again.state_dict()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _assert_state(state, reference)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_dropped_step_on_one_replica_of_a_sharded_stage_changes_nothing(
        accumulate: int) -> None:
    """A target out of range in micro-batch 0's rows of one replica of the sharded loss
    stage (rank 3): that rank computes nothing more, every rank drops the call, and
    training goes on as one process that never saw the bad batch. accumulate=1: the
    dropped call is the reducing one, and rank 3 (no gradient at all) still meets its
    peer's reduce-scatter; accumulate=2: the dropped call only accumulated, and the
    whole weights' gradients it summed are forgotten."""
    model, inputs, targets, loss_fn = _gpt()
    reference = copy.deepcopy(model)
    plan = _plan(model, inputs, targets, loss_fn)
    pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=4, dp=2, plan=plan,
                          microbatches=2, optimizer=_adamw, threads=1, timeout_s=30,
                          accumulate=accumulate)
    bad_call = 1 if accumulate == 1 else 0
    losses = []
    with pipe:
        for s in range(5):
            x, y = _batch(s)
            if s != bad_call:
                losses.append(pipe.step(x, y))
                continue
            bad = y.clone()
            bad[3, -1] = VOCAB + 5  # micro-batch 0 (rows 0-3), replica 1 (rows 2-3): rank 3
            with pytest.raises(StepError, match="rank 3 failed in step"):
                pipe.step(x, bad)
        state = pipe.state_dict()
    ref_losses, _ = _reference(reference, loss_fn, 5, accumulate=accumulate, skip={bad_call})
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _assert_state(state, reference)


def test_orgel_run_shard_fsdp_passes_its_check(capsys: pytest.CaptureFixture[str]) -> None:
    from orgel.cli import main

    code = main(["run", GPT, "--ranks", "4", "--dp", "2", "--shard", "fsdp",
                 "--microbatches", "2", "--steps", "2", "--optimizer", "adamw",
                 "--max-grad-norm", "0.5", "--check", "--tolerance", "1e-4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out


def test_shard_fsdp_marks_the_planners_replicated_stages() -> None:
    """No plan given: ``shard="fsdp"`` marks every stage the planner gives two or more
    replicas, and the pipeline trains as one process."""
    model, inputs, targets, loss_fn = _gpt()
    reference = copy.deepcopy(model)
    with orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, dp=2, shard="fsdp",
                        microbatches=2, optimizer=_adamw, threads=1, timeout_s=120) as pipe:
        plan = pipe.plan
        assert plan.shard == ["fsdp" if len(r) > 1 else "none" for r in plan.placement]
        assert "fsdp" in plan.shard
        held = pipe.call_ranks("held_elements")
        assert sum(held) == sum(p.numel() for p in reference.parameters()), held
        losses = [pipe.step(*_batch(s)) for s in range(2)]
        state = pipe.state_dict()
    ref_losses, _ = _reference(reference, loss_fn, 2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _assert_state(state, reference)


TORCHRUN_SCRIPT = '''
import copy, json, sys
import torch
import orgel
from orgel.models import build
from gaps import state_gap

model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
reference = copy.deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, dp=2, shard="fsdp",
                      microbatches=2, optimizer=sgd)
losses = [pipe.step(inputs, targets) for _ in range(2)]
state = pipe.state_dict()
opt = sgd(list(reference.parameters()))
ref = []
for _ in range(2):
    opt.zero_grad()
    loss = loss_fn(reference(*inputs), targets)
    loss.backward()
    opt.step()
    ref.append(loss.item())
diff = state_gap(state, reference.state_dict())
with open(f"{sys.argv[1]}/result{torch.distributed.get_rank()}.json", "w") as f:
    json.dump({"losses": losses, "ref": ref, "diff": diff, "shard": pipe.plan.shard,
               "held": pipe.call_ranks("held_elements"),
               "total": sum(p.numel() for p in reference.parameters())}, f)
pipe.close()
'''


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("fsdp")
def test_shard_fsdp_under_torchrun(torchrun_part: Path) -> None:
    """The same script on 2 torchrun ranks: rank 0 plans and marks the plan, every rank
    shards, and each rank's result matches one process."""
    for rank in range(2):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert "fsdp" in result["shard"]
        assert sum(result["held"]) == result["total"]  # every element held once
        assert result["losses"] == pytest.approx(result["ref"], rel=1e-5)
        assert result["diff"] < 1e-4


#: the script the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"fsdp": (TORCHRUN_SCRIPT, [])}


def test_bad_shard_options_are_refused_before_any_rank_starts() -> None:
    from orgel.cli import main

    model, inputs, targets, loss_fn = _gpt()
    with pytest.raises(ValueError, match="shard must be one of 'none', 'fsdp'"):
        orgel.pipeline(model, inputs, targets, loss_fn, ranks=4, dp=2, shard="zero3")
    with pytest.raises(ValueError, match="pass dp=2 or more"):
        orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, shard="fsdp")
    assert main(["run", GPT, "--ranks", "2", "--shard", "fsdp"]) == 2
    tied, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                           vocab_size=VOCAB, seq_len=16, tie_embeddings=True)
    plan = dataclasses.replace(_plan(tied, inputs, targets, loss_fn), shard=["fsdp", "none"])
    with pytest.raises(ValueError, match="tied parameter .* Shard every stage that holds it"):
        orgel.pipeline(tied, inputs, targets, loss_fn, ranks=4, dp=2, plan=plan,
                       microbatches=2, threads=1)

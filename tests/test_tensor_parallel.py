"""Tensor parallelism (``tp=2``): 2 pipeline ranks of 2 processes each, against one process.

The members split every attention and MLP region of their stage (DTensor). Their sums
run in another order than one process's matmuls (a row linear's output is the sum of
two half products), so losses agree to float32 rounding (``rel=1e-5``) and parameters
after a few AdamW steps to ``atol=2e-5`` (Adam divides by the root of a gradient's
square: a gradient near zero carries the rounding into the step).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from orgel.cli import main
from orgel.explicit.api import load, pipeline
from orgel.models import build

LR = 1e-3
GPT = "examples/gpt.py:workload"


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _batches(steps: int, vocab: int, rows: int, seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(steps)]


def _train_both(model: torch.nn.Module, example: dict[str, torch.Tensor], loss_fn: object,
                batches: list[torch.Tensor], key: str, max_grad_norm: float | None = None,
                report: dict[str, object] | None = None, **options: object,
                ) -> tuple[list[float], list[float], dict[str, torch.Tensor], torch.nn.Module,
                           dict[int, dict[str, tuple[int, ...]]], list[float], list[float]]:
    """Train ``model`` with tp=2 on 4 processes and a copy in one process; both results.

    ``options`` go to ``pipeline`` (``dp=2``: the 2 pipeline ranks are replicas); ``report``
    gets each process's ``tp_sequence`` after training."""
    reference = copy.deepcopy(model)
    targets = torch.roll(example[key], -1, dims=1)
    pipe = pipeline(model, example, targets, loss_fn, ranks=4, tp=2, microbatches=2,
                    optimizer=_adamw, threads=1, max_grad_norm=max_grad_norm,
                    **options)  # type: ignore[arg-type]
    try:
        assert (pipe.plan.num_ranks, pipe.plan.tp, pipe.plan.world_size) == (2, 2, 4)
        if options.get("dp") == 2:  # one stage, each replica a pipeline rank of 2
            assert pipe.plan.placement == [(0, 1)], pipe.plan.placement
            assert pipe.plan.shard == [options.get("shard", "none")]
        shards = dict(enumerate(pipe.call_ranks("tp_shards")))
        losses, norms = [], []
        for tokens in batches:
            losses.append(pipe.step({key: tokens}, torch.roll(tokens, -1, dims=1)))
            norms.append(pipe.grad_norm)
        state = pipe.state_dict()
        if report is not None:
            report["tp_sequence"] = pipe.call_ranks("tp_sequence")
    finally:
        pipe.close()
    opt = _adamw(list(reference.parameters()))
    ref_losses, ref_norms = [], []
    for tokens in batches:
        opt.zero_grad()
        loss = torch.zeros(())
        for half in tokens.chunk(2):  # the pipeline's micro-batches, summed as it does
            part = loss_fn(reference(**{key: half}), torch.roll(half, -1, dims=1)) / 2
            part.backward()
            loss = loss + part.detach()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(),
                                              max_grad_norm or float("inf"))
        opt.step()
        ref_losses.append(float(loss))
        ref_norms.append(float(norm))
    return losses, ref_losses, state, reference, shards, norms, ref_norms


def _assert_same_state(state: dict[str, torch.Tensor], reference: torch.nn.Module) -> None:
    expected = reference.state_dict()
    assert set(expected) <= set(state)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.slow
def test_gpt_on_two_stages_of_two_way_tp_trains_as_one_process() -> None:
    model, inputs, _, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                      seq_len=8, vocab_size=64)
    losses, ref_losses, state, reference, shards, norms, ref_norms = _train_both(
        model, {"tokens": inputs[0]}, loss_fn, _batches(3, 64, 8, 8), "tokens",
        max_grad_norm=0.5)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)  # each parameter counted once
    assert max(ref_norms) > 0.5  # so the clipping acted
    _assert_same_state(state, reference)
    # both members of a rank hold half of each attention and MLP weight of its stage (a
    # region the stage boundary cuts stays whole: the plan's cut is the planner's)
    assert shards[0], "the first stage splits nothing"
    assert shards[0] == shards[1] and shards[2] == shards[3]
    for held in shards.values():
        assert all(shape in {(48, 32), (48,), (32, 16), (64, 32), (64,), (32, 64)}
                   for shape in held.values()), held
    allowed = {f"encoder.blocks.{layer}.{name}" for layer in range(2) for name in (
        "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight",
        "mlp.fc.bias", "mlp.out.weight")}
    assert set(shards[0]) | set(shards[2]) <= allowed


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_gpt_on_two_replicas_of_two_way_tp_trains_as_one_process(tied: bool) -> None:
    """tp x dp: one stage on 2 replicas, each a pipeline rank of 2 processes. Each replica
    takes half of every micro-batch's rows; the gradient sum runs per plane (member t of
    each replica), a tied embedding's sum too, and the norm counts each value once."""
    model, inputs, _, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                      seq_len=8, vocab_size=64, tie_embeddings=tied)
    options: dict[str, object] = {"dp": 2}
    if tied:  # two stages on both replicas: the tied embedding's sum spans 2 stages
        from orgel.graph.capture import capture
        from orgel.plan.balanced import balanced_plan

        graph = capture(model, (inputs[0][:2],), several=False)
        plan = balanced_plan(graph, ranks=2, microbatches=2, schedule="interleaved", dp=2,
                             stages_per_rank=2)
        assert plan.placement == [(0, 1), (0, 1)], plan.placement
        options = {"plan": plan}
    losses, ref_losses, state, reference, shards, norms, ref_norms = _train_both(
        model, {"tokens": inputs[0]}, loss_fn, _batches(3, 64, 8, 8), "tokens",
        max_grad_norm=0.5, **options)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert max(ref_norms) > 0.5
    _assert_same_state(state, reference)
    assert shards[0] and all(shards[p] == shards[0] for p in range(4))  # every block split


@pytest.mark.slow
def test_gpt_fsdp_over_replicas_of_two_way_tp_trains_as_one_process() -> None:
    """tp x FSDP (2-D): one stage on 2 replicas of 2 processes; FSDP2 shards the stage's
    TP DTensors (and its whole parameters) over each plane's 2 replicas, gathers them once
    per step and reduce-scatters once; the norm counts each part once."""
    model, inputs, _, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                      seq_len=8, vocab_size=64)
    losses, ref_losses, state, reference, shards, norms, ref_norms = _train_both(
        model, {"tokens": inputs[0]}, loss_fn, _batches(3, 64, 8, 8), "tokens",
        max_grad_norm=0.5, dp=2, shard="fsdp")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert max(ref_norms) > 0.5
    _assert_same_state(state, reference)
    # every process holds a part of every parameter: a quarter of a TP-split weight (TP
    # halves it, FSDP halves that on dim 0), a half of the rest (FSDP only)
    for held in shards.values():
        assert set(held) == set(reference.state_dict())
        assert held["encoder.blocks.0.attn.qkv.weight"] == (24, 32)  # of (96, 32)
        assert held["encoder.blocks.0.attn.proj.weight"] == (16, 16)  # of (32, 32)
        assert held["tok_emb.weight"] == (32, 32)  # of (64, 32)


class ColumnTiedAcross(torch.nn.Module):
    """A weight the first stage's MLP region reads as its column and the second stage reads
    outside any region (one tensor, two stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.mid, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.relu(self.up(x)))
        x = torch.tanh(self.mid(x))
        return self.head(torch.tanh(torch.nn.functional.linear(x, self.up.weight)))


@pytest.mark.slow
def test_a_tied_weight_a_region_reads_in_one_stage_only_trains_as_one_process() -> None:
    """Tensor parallelism splits no tied parameter: the first stage's region that reads it
    runs whole, so both copies' gradients are laid out alike when they are summed (the
    first stage's copy was split by rows, the second's whole, and the sum of their parts
    trained other weights, silently)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = ColumnTiedAcross()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    opt = sgd(reference.parameters())
    with pipeline(model, (x,), y, F.cross_entropy, ranks=4, tp=2, microbatches=2,
                  schedule="1f1b", threads=1, timeout_s=60, optimizer=sgd) as pipe:
        assert pipe.plan.num_stages == 2
        for _ in range(2):
            got = pipe.step((x,), y)
            opt.zero_grad()
            want = 0.0
            for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
                loss = F.cross_entropy(reference(xm), ym) / 2
                loss.backward()
                want += loss.item()
            opt.step()
            assert got == pytest.approx(want, rel=1e-6)
        state = pipe.state_dict()
    _assert_same_state(state, reference)


@pytest.mark.slow
def test_tp_evaluates_and_keeps_outputs_as_one_process() -> None:
    """``step(..., outputs=True)`` and ``evaluate`` with tp=2: the eval-mode stages split
    their regions over the training stages' DTensor weights; losses and logits match one
    process (train mode for the step, ``model.eval()`` under no_grad after it)."""
    model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                            d_model=32, seq_len=8, vocab_size=64)
    reference = copy.deepcopy(model)
    with pipeline(model, inputs, targets, loss_fn, ranks=4, tp=2, microbatches=2,
                  optimizer=_adamw, threads=1) as pipe:
        loss, out = pipe.step(inputs, targets, outputs=True)
        ev_loss, ev_out = pipe.evaluate(inputs, targets, outputs=True)
    ref_out = reference(*inputs)
    opt = _adamw(list(reference.parameters()))
    ref_loss = sum(loss_fn(reference(x), y) / 2
                   for x, y in zip(inputs[0].chunk(2), targets.chunk(2), strict=True))
    ref_loss.backward()
    opt.step()
    assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-4, atol=1e-5)
    reference.eval()
    with torch.no_grad():
        ref_ev = reference(*inputs)
        ref_ev_loss = sum(loss_fn(reference(x), y) / 2
                          for x, y in zip(inputs[0].chunk(2), targets.chunk(2), strict=True))
    assert ev_loss == pytest.approx(float(ref_ev_loss), rel=1e-5)
    torch.testing.assert_close(ev_out, ref_ev, rtol=1e-4, atol=1e-5)


def _lm_loss(out: object, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a Hugging Face causal LM's ``logits``."""
    logits = out.logits  # type: ignore[attr-defined]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.slow
@pytest.mark.hf
def test_llama_on_two_stages_of_two_way_tp_trains_as_one_process() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)

    batches = _batches(3, 64, 4, 8)
    losses, ref_losses, state, reference, shards, _, _ = _train_both(
        model, {"input_ids": batches[0]}, _lm_loss, batches, "input_ids")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _assert_same_state(state, reference)
    assert shards[0] and shards[0] == shards[1] and shards[2] == shards[3]
    allowed = {f"model.layers.{layer}.{name}_proj.weight" for layer in range(2) for name in (
        "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "mlp.gate", "mlp.up",
        "mlp.down")}
    assert set(shards[0]) | set(shards[2]) <= allowed
    if "model.layers.0.self_attn.k_proj.weight" in shards[0]:
        assert shards[0]["model.layers.0.self_attn.k_proj.weight"] == (8, 32)  # 1 of 2 heads


@pytest.mark.slow
@pytest.mark.hf
def test_gpt2_conv1d_layers_split_and_train_as_one_process() -> None:
    """Hugging Face GPT-2's ``Conv1D`` is ``addmm(bias, x, weight)`` with the weight stored
    ``[in, out]``: its columns split along dimension 1, its rows along 0."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                  n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)

    batches = _batches(3, 64, 4, 8)
    losses, ref_losses, state, reference, shards, norms, ref_norms = _train_both(
        model, {"input_ids": batches[0]}, _lm_loss, batches, "input_ids", max_grad_norm=0.5)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    _assert_same_state(state, reference)
    want = {"attn.c_attn.weight": (32, 48), "attn.c_attn.bias": (48,),
            "attn.c_proj.weight": (16, 32), "mlp.c_fc.weight": (32, 64),
            "mlp.c_fc.bias": (64,), "mlp.c_proj.weight": (64, 32)}
    split = {**shards[0], **shards[2]}
    halves = {f"transformer.h.{layer}.{name}": shape for layer in range(2)
              for name, shape in want.items()}
    # every split weight is a Conv1D's half; a region the planner's stage boundary cuts
    # stays whole (which one depends on the profile), so not every region is split
    assert len(split) >= 6 and all(halves.get(k) == v for k, v in split.items()), split


@pytest.mark.slow
def test_orgel_run_tp_with_fsdp_replicas_checks_against_one_process(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--tp 2 --dp 2 --shard fsdp``: the flags make the mesh (tp alone, from a plan file,
    is the next test)."""
    code = main(["run", GPT, "--ranks", "4", "--tp", "2", "--dp", "2", "--shard", "fsdp",
                 "--microbatches", "2", "--steps", "2", "--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "of 2 processes each (tensor parallel)" in out and "-> OK" in out


@pytest.mark.slow
def test_orgel_run_takes_tp_from_a_plan(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A plan that says tp=2 (as ``orgel plan --tp 2`` writes) runs without --tp."""
    from orgel.graph.capture import capture
    from orgel.plan.balanced import balanced_plan
    from orgel.workload import load_workload, microbatches

    workload = load_workload(GPT)
    graph = capture(workload.model, microbatches(workload, 2)[0][0], several=False)
    plan = balanced_plan(graph, ranks=2, microbatches=2, schedule="1f1b")
    plan = dataclasses.replace(plan, tp=2)
    plan.save(tmp_path / "plan.json")
    code = main(["run", GPT, "--ranks", "4", "--plan", str(tmp_path / "plan.json"),
                 "--microbatches", "2", "--steps", "1", "--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "of 2 processes each (tensor parallel)" in out and "-> OK" in out


@pytest.mark.slow
def test_a_tp_checkpoint_resumes_with_tp_and_without(tmp_path: Path) -> None:
    """Saved with tp=2 (whole tensors, optimizer state too), resumed with tp=2 and on a
    plain pipeline of the same plan: the next step is the one the saver took."""
    def gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor], torch.Tensor, object]:
        model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                                d_model=32, seq_len=8, vocab_size=64)
        return model, inputs, targets, loss_fn

    model, inputs, targets, loss_fn = gpt()
    batches = [((t,), torch.roll(t, -1, dims=1)) for t in _batches(3, 64, 8, 8)]
    with pipeline(model, inputs, targets, loss_fn, ranks=4, tp=2, microbatches=2,
                  optimizer=_adamw, threads=1) as pipe:
        for batch in batches[:2]:
            pipe.step(*batch)
        pipe.save(tmp_path)
        last = pipe.step(*batches[2])
        state = pipe.state_dict()
        plan = pipe.plan
    model, inputs, targets, loss_fn = gpt()
    with load(tmp_path, model, inputs, targets, loss_fn, optimizer=_adamw,
              threads=1) as again:
        assert again.plan.tp == 2
        assert again.step(*batches[2]) == pytest.approx(last, rel=1e-6)
        for name, value in again.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=1e-6, atol=1e-7, msg=name)
    plain_plan = dataclasses.replace(plan, tp=1)
    model, inputs, targets, loss_fn = gpt()
    with load(tmp_path, model, inputs, targets, loss_fn, ranks=2, plan=plain_plan,
              optimizer=_adamw, threads=1) as plain:
        assert plain.step(*batches[2]) == pytest.approx(last, rel=1e-5)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.slow
def test_a_tp_fsdp_checkpoint_resumes_as_saved_and_on_one_replica_set(tmp_path: Path) -> None:
    """Saved with tp=2 x FSDP over 2 replicas (whole tensors, optimizer state too), resumed
    on the same mesh and on a plain 2-rank data-parallel pipeline: the next step is the
    saver's, and ``evaluate`` after it gives the plain pipeline's loss."""
    def gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor], torch.Tensor, object]:
        model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=1,
                                                d_model=32, seq_len=8, vocab_size=64)
        return model, inputs, targets, loss_fn

    model, inputs, targets, loss_fn = gpt()
    batches = [((t,), torch.roll(t, -1, dims=1)) for t in _batches(3, 64, 8, 8)]
    with pipeline(model, inputs, targets, loss_fn, ranks=4, tp=2, dp=2, shard="fsdp",
                  microbatches=2, optimizer=_adamw, threads=1) as pipe:
        for batch in batches[:2]:
            pipe.step(*batch)
        pipe.save(tmp_path)
        last = pipe.step(*batches[2])
        state = pipe.state_dict()
        plan = pipe.plan
    model, inputs, targets, loss_fn = gpt()
    with load(tmp_path, model, inputs, targets, loss_fn, optimizer=_adamw,
              threads=1) as again:
        assert (again.plan.tp, again.plan.shard) == (2, ["fsdp"])
        assert again.step(*batches[2]) == pytest.approx(last, rel=1e-6)
        for name, value in again.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=1e-6, atol=1e-7, msg=name)
        evaluated = again.evaluate(*batches[0])  # the weights gathered over dp, split by tp
    plain_plan = dataclasses.replace(plan, tp=1, shard=["none"])
    model, inputs, targets, loss_fn = gpt()
    with load(tmp_path, model, inputs, targets, loss_fn, ranks=2, plan=plain_plan,
              optimizer=_adamw, threads=1) as plain:
        assert plain.step(*batches[2]) == pytest.approx(last, rel=1e-5)
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=1e-4, atol=2e-5, msg=name)
        assert plain.evaluate(*batches[0]) == pytest.approx(evaluated, rel=1e-5)


NO_REGION = '''
import torch

def workload():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8)
    return model, (x,), torch.randn(4, 8), torch.nn.functional.mse_loss
'''


def test_tp_errors_say_what_to_change(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs, targets, loss_fn = build("gpt", batch_size=4, seed=0, n_layers=1,
                                            d_model=16, seq_len=8, vocab_size=32)
    with pytest.raises(ValueError, match="tp=3 does not divide ranks=4"):
        pipeline(model, inputs, targets, loss_fn, ranks=4, tp=3)
    with pytest.raises(ValueError, match="dp=4 does not divide the 2 pipeline ranks"):
        pipeline(model, inputs, targets, loss_fn, ranks=4, tp=2, dp=4)
    assert main(["run", GPT, "--ranks", "3", "--tp", "2"]) == 2
    assert "--tp 2 must divide --ranks 3" in capsys.readouterr().err
    assert main(["run", GPT, "--ranks", "4", "--tp", "2", "--dp", "4"]) == 2
    assert "--dp 4 must divide the 2 pipeline ranks" in capsys.readouterr().err
    path = tmp_path / "flat.py"
    path.write_text(NO_REGION)
    assert main(["run", f"{path}:workload", "--ranks", "2", "--tp", "2",
                 "--microbatches", "2"]) == 2
    err = capsys.readouterr().err
    assert "found no region to split" in err and "pass tp=1" in err


TORCHRUN_SCRIPT = '''
import copy, json, sys
import torch
import orgel
from orgel.models import build
from gaps import state_gap

model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                        seq_len=8, vocab_size=64)
reference = copy.deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, tp=2, microbatches=2,
                      optimizer=sgd)
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
    json.dump({"losses": losses, "ref": ref, "diff": diff, "tp": pipe.plan.tp,
               "shards": pipe.call_ranks("tp_shards")}, f)
pipe.close()
'''


#: the script the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"tp": (TORCHRUN_SCRIPT, [])}


@pytest.mark.slow
@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("tp")
def test_tp_under_torchrun(torchrun_part: Path) -> None:
    """2 torchrun processes as one pipeline rank of tp=2: rank 0 plans, both split the
    stage, and each one's result matches one process."""
    import json

    for rank in range(2):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert result["tp"] == 2
        assert all(result["shards"]), result["shards"]  # both processes split the stage
        assert result["losses"] == pytest.approx(result["ref"], rel=1e-5)
        assert result["diff"] < 1e-5

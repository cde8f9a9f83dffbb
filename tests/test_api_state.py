"""The pipeline's state under the model's own names, and errors that stay in their call.

Through ``orgel.pipeline`` on 2 forked gloo ranks, against one process doing the
same with plain PyTorch: ``state_dict`` has exactly the model's keys (a tied
alias, no non-persistent buffer, no lifted constant, the tensors no stage reads),
``load_state_dict`` has torch's strict semantics with its errors raised in the
caller, ``copy_to`` writes the trained values into the caller's model, the
checkpoint export loads strictly; a bad batch is refused in the caller, and an
error raised inside a rank for the data's own reason drops that step on every
rank while training goes on as if the batch had been skipped.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.launch.errors import StepError, WorkerError
from orgel.runtime import checkpoint as ckpt
from orgel.workload import WorkloadError

pytestmark = pytest.mark.slow
VOCAB = 16


class Net(nn.Module):
    """Tied embedding and head, a non-persistent buffer, a lifted constant, an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(3, 3)  # no stage reads it
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, 8))
        self.gain = torch.linspace(0.5, 1.5, 8)  # a plain tensor: capture lifts it

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) * self.scale + self.offset
        h = self.body(h) * self.gain
        return self.head(h)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    tokens = torch.randint(0, VOCAB, (8, 6), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _start(model: nn.Module | None = None, accumulate: int = 1) -> orgel.Pipeline:
    x, y = _batch(0)
    return orgel.pipeline(_net() if model is None else model, (x,), y, loss_fn, ranks=2,
                          microbatches=2, optimizer=_sgd, threads=1, timeout_s=30,
                          accumulate=accumulate)


def _reference(steps: list[int]) -> tuple[nn.Module, list[float]]:
    """One process training on the batches of ``steps``, in order."""
    model = _net()
    return model, _train(model, _sgd(model.parameters()), steps)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: list[int]) -> list[float]:
    losses = []
    for s in steps:
        x, y = _batch(s)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_state(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    assert list(state) == list(expected)
    for name, t in expected.items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_a_torch_compiled_model_trains_as_the_module_it_wraps() -> None:
    """``orgel.pipeline(torch.compile(model), ...)``, as a user who compiles first writes
    it: the module it wraps is the one trained (it failed, asking for keyword inputs);
    the state has that module's keys (no ``_orig_mod.``) and ``copy_to`` writes into it."""
    torch._dynamo.reset()
    model = _net()
    compiled = torch.compile(model)
    with _start(compiled) as pipe:
        losses = [pipe.step(*_batch(s)) for s in range(2)]
        reference, ref_losses = _reference([0, 1])
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_state(pipe.state_dict(), reference)
        assert pipe.copy_to() is model
        # the compiled model named as the target (it failed: its keys are _orig_mod.*)
        other = _net()
        other_compiled = torch.compile(other)
        assert pipe.copy_to(other_compiled) is other_compiled
    _assert_state(model.state_dict(), reference)
    _assert_state(other.state_dict(), reference)


def test_state_dict_copy_to_and_export_carry_exactly_the_models_keys(tmp_path: Path) -> None:
    model = _net()
    before = copy.deepcopy(model.state_dict())
    with _start(model) as pipe:
        losses = [pipe.step(*_batch(s)) for s in range(2)]
        reference, ref_losses = _reference([0, 1])
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        state = pipe.state_dict()
        # the model's keys in its order: head.weight (tied) and unused.* are in, scale
        # (non-persistent) and the lifted constant are not
        assert list(state) == list(model.state_dict())
        assert "head.weight" in state and "unused.weight" in state and "scale" not in state
        fresh = _net()
        fresh.load_state_dict(state)  # strict
        _assert_state(fresh.state_dict(), reference)
        # the caller's model is the model given: training left it as it was ...
        for name, t in before.items():
            assert torch.equal(model.state_dict()[name], t), name
        # ... until copy_to writes the trained values into it
        assert pipe.copy_to() is model
        _assert_state(model.state_dict(), reference)
        assert model.head.weight is model.emb.weight
        other = _net()
        pipe.copy_to(other)
        _assert_state(other.state_dict(), reference)
        with torch.device("meta"):
            on_meta = Net()
        with pytest.raises(ValueError, match="meta device.*orgel checkpoint export"):
            pipe.copy_to(on_meta)
        pipe.save(tmp_path)
    out = tmp_path / "model.pt"
    ckpt.export(tmp_path, out)
    exported = torch.load(out, weights_only=True)
    assert list(exported) == list(reference.state_dict())
    fresh = _net()
    fresh.load_state_dict(exported)  # strict: every key, the unused layer's included
    _assert_state(fresh.state_dict(), reference)


def test_load_state_dict_has_torchs_strict_semantics_and_errors_stay_in_the_call() -> None:
    with _start() as pipe:
        pipe.step(*_batch(0))
        target = _net()
        with torch.no_grad():
            for p in target.parameters():
                p.add_(0.25)
        good = target.state_dict()
        missing = {k: v for k, v in good.items() if k != "body.0.bias"}
        with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "body.0.bias"'):
            pipe.load_state_dict(missing)
        with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
            pipe.load_state_dict({**good, "extra": torch.zeros(1)})
        with pytest.raises(RuntimeError, match=r"size mismatch for body.2.weight"):
            pipe.load_state_dict({**good, "body.2.weight": torch.zeros(3, 3)})
        with pytest.raises(RuntimeError, match="size mismatch"):  # as torch: even not strict
            pipe.load_state_dict({"body.2.weight": torch.zeros(3, 3)}, strict=False)
        # nothing changed: the pipeline trains on as one process that trained on 0 and 1
        pipe.step(*_batch(1))
        expected = _net()
        opt = _sgd(expected.parameters())
        _train(expected, opt, [0, 1])
        _assert_state(pipe.state_dict(), expected)
        # not strict: what matches loads (the unused layer too), torch's named tuple back
        partial = {k: v for k, v in good.items() if k.startswith(("body.0.", "unused."))}
        result = pipe.load_state_dict({**partial, "extra": torch.zeros(1)}, strict=False)
        want = expected.load_state_dict({**partial, "extra": torch.zeros(1)}, strict=False)
        assert result == want and type(result) is type(want)
        _assert_state(pipe.state_dict(), expected)
        assert pipe.load_state_dict(good) == expected.load_state_dict(good)
        pipe.step(*_batch(2))  # the optimizer's state stays, as in one process
        _train(expected, opt, [2])
        _assert_state(pipe.state_dict(), expected)


def test_a_bad_batch_is_refused_in_the_caller_and_training_goes_on() -> None:
    x, y = _batch(1)
    with _start() as pipe:
        pipe.step(*_batch(0))
        bad: list[tuple[Any, Any, str]] = [
            ({"tokens": x, "mask": x}, y, r"not in the example: \['mask'\]"),
            ({}, y, r"missing: \['tokens'\]"),
            ((x.int(),), y, r"input 'tokens' is torch.int32 but the pipeline was built with "
                            r"torch.int64"),
            ((x,), y.float(), "target 0 is torch.float32"),
            ((x[:1],), y[:1],
             "a batch of 1 row cannot fill the pipeline's 2 micro-batches.*drop_last=True"),
            ((x,), y[:4], "the inputs have batch size 8 but the targets 4"),
        ]
        for inputs, targets, message in bad:
            with pytest.raises(WorkloadError, match=message):
                pipe.step(inputs, targets)
        losses = [pipe.step(*_batch(s)) for s in (1, 2)]
        reference, ref_losses = _reference([0, 1, 2])
        assert losses == pytest.approx(ref_losses[1:], rel=1e-5)
        _assert_state(pipe.state_dict(), reference)


@pytest.mark.parametrize("where", ["loss", "stage"])
def test_an_error_inside_a_rank_drops_the_step_and_training_goes_on(where: str) -> None:
    """A target out of range raises in the loss on rank 1; a token out of range in the
    embedding on rank 0 (whose peer then waits for it): in the first step (shapes still
    exchanged) and a later one, every rank drops the step and the next steps equal one
    process that skipped the bad batches."""

    def broken(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _batch(step)
        if where == "loss":
            y = y.clone()
            y[5, 2] = VOCAB + 3
        else:
            x = x.clone()
            x[1, 1] = VOCAB + 3
        return x, y

    rank, action = (1, "F1") if where == "loss" else (0, "F0")
    with _start() as pipe:
        losses = []
        for s in range(5):
            if s in (0, 2):
                with pytest.raises(StepError) as info:
                    pipe.step(*broken(s))
                message = str(info.value)
                assert message.startswith(f"rank {rank} failed in step: IndexError"), message
                assert f"[while running {action}." in message, message
                assert "the pipeline is still usable" in message
                assert message.count("Traceback (most recent call last)") == 1, message
                assert isinstance(info.value, WorkerError) and info.value.rank == rank
            else:
                losses.append(pipe.step(*_batch(s)))
        reference, ref_losses = _reference([1, 3, 4])
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        _assert_state(pipe.state_dict(), reference)
        assert pipe.steps == 3


def test_an_error_in_an_accumulating_call_drops_the_accumulation() -> None:
    """With ``accumulate=2`` a call that fails after one good call drops both: the ranks
    start the accumulation again, as one process that skipped both batches does."""
    with _start(accumulate=2) as pipe:
        pipe.step(*_batch(0))
        x, y = _batch(1)
        y = y.clone()
        y[0, 0] = VOCAB + 1
        with pytest.raises(StepError):
            pipe.step(x, y)
        assert (pipe.steps, pipe.pending) == (0, 0)
        losses = [pipe.step(*_batch(s)) for s in (2, 3)]
        assert (pipe.steps, pipe.pending) == (1, 0)
        model = _net()
        opt = _sgd(model.parameters())
        ref = []
        for s in (2, 3):
            tokens, targets = _batch(s)
            loss = loss_fn(model(tokens), targets)
            (loss / 2).backward()
            ref.append(loss.item())
        opt.step()
        assert losses == pytest.approx(ref, rel=1e-5)
        _assert_state(pipe.state_dict(), model)


@pytest.mark.hf
def test_a_peft_lora_llama_loads_the_pipelines_state_strictly() -> None:
    """A LoRA-wrapped Llama (rotary ``inv_freq``: non-persistent buffers; frozen base
    weights; tied embeddings): its state_dict loads strictly from the pipeline's, and
    ``copy_to`` gives the caller's model one process's trained values."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    def lora() -> nn.Module:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=32, tie_word_embeddings=True)
        base = LlamaForCausalLM(config)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0))
        with torch.no_grad():  # LoRA starts its B at zero: give the test something to see
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        return model

    def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out["logits"].reshape(-1, VOCAB), y.reshape(-1))

    model = lora()
    inv_freq = [n for n, _ in model.named_buffers() if n.endswith("inv_freq")]
    assert inv_freq and not set(inv_freq) & set(model.state_dict())  # non-persistent
    x, y = _batch(0)
    pipe = orgel.pipeline(model, {"input_ids": x}, y, lm_loss, ranks=2, microbatches=2,
                          optimizer=_sgd, threads=1, timeout_s=60)
    with pipe:
        losses = [pipe.step({"input_ids": _batch(s)[0]}, _batch(s)[1]) for s in range(2)]
        state = pipe.state_dict()
        pipe.copy_to()
    reference = lora()
    opt = _sgd([p for p in reference.parameters() if p.requires_grad])
    ref_losses = []
    for s in range(2):
        bx, by = _batch(s)
        opt.zero_grad()
        loss = lm_loss(reference(input_ids=bx), by)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert list(state) == list(reference.state_dict())
    fresh = lora()
    fresh.load_state_dict(state)  # strict
    _assert_state(fresh.state_dict(), reference)
    _assert_state(model.state_dict(), reference)


def test_a_dropped_step_leaves_every_tensor_as_it_was() -> None:
    """BatchNorm statistics the dropped step's forwards updated, on the rank that did not
    fail, are put back: the state after the dropped step is the state before it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                          nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    with orgel.pipeline(model, (x,), y, F.cross_entropy, ranks=2, microbatches=2,
                        optimizer=_sgd, threads=1, timeout_s=30) as pipe:
        pipe.step((x,), y)
        before = pipe.state_dict()
        bad = y.clone()
        bad[-1] = 9
        with pytest.raises(StepError, match="rank 1 failed in step: IndexError"):
            pipe.step((x * 3,), bad)
        after = pipe.state_dict()
        assert list(after) == list(before)
        for name, t in before.items():
            assert torch.equal(after[name], t), name
        assert "1.running_mean" in after

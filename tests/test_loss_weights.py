"""Padded batches train as one process on the whole batch: the loss weight rule.

A Hugging Face causal LM trained as people train it: right-padded batches of uneven
lengths, ``labels`` -100 on the padding, the model's own ``outputs.loss`` (a mean over
the loss-bearing tokens of the batch it sees). orgel runs each micro-batch (and each
replica's share) on its own, so it weights each one's loss by its share of the whole
batch's loss-bearing items (:mod:`orgel.lossweights`); the trained weights must equal
one plain PyTorch process on the whole batch, parameter by parameter.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import orgel

pytestmark = [pytest.mark.slow, pytest.mark.hf]

VOCAB, SEQ, ROWS = 96, 16, 4


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, use_cache=False,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def padded_batch(step: int, rows: int = ROWS) -> dict[str, torch.Tensor]:
    """What a padding collator gives: ids right-padded to SEQ, mask, labels -100 on padding.

    The lengths are uneven and the long rows sit in the first half of the batch, so the
    micro-batches (and replicas) hold different numbers of loss-bearing tokens."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = [SEQ, SEQ - 2, 5 + step, 4][:rows] + [SEQ // 2] * max(0, rows - 4)
    ids = torch.randint(2, VOCAB, (rows, SEQ), generator=g)
    mask = torch.zeros(rows, SEQ, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _reference(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
               accumulate: int) -> tuple[list[float], torch.nn.Module]:
    """One process, plain PyTorch: each call ``(model(**batch).loss / k).backward()``, and
    the optimizer steps every k-th call (the usual accumulation loop)."""
    one = copy.deepcopy(model)
    opt = _sgd(list(one.parameters()))
    losses = []
    for i, batch in enumerate(batches):
        loss = one(**batch).loss
        (loss / accumulate).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return losses, one


def _compare(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, value in expected.items():
        if name in state:
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("dp", "accumulate"), [(1, 1), (2, 1), (1, 2)],
                         ids=["pipeline", "dp2", "accumulate2"])
def test_a_padded_batch_through_the_models_own_loss_trains_as_one_process(
        dp: int, accumulate: int) -> None:
    model = _qwen2()
    batches = [padded_batch(step) for step in range(3 * accumulate)]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches[:1]]
    assert counts[0] > 0
    expected_losses, one = _reference(model, batches, accumulate)
    held_out = padded_batch(7)
    # the batch as a DataLoader gives it: no targets, no loss_fn (the model's own loss)
    # planned as a user's first call is; the variants take a FLOP-balanced 1F1B chain
    quick = {} if dp == accumulate == 1 else {"schedule": "1f1b"}
    with orgel.pipeline(copy.deepcopy(model), batches[0], ranks=2, microbatches=2, dp=dp,
                        accumulate=accumulate, optimizer=_sgd, threads=1, **quick) as pipe:
        assert pipe.loss_rule == "shifted"
        losses = [pipe.step(batch) for batch in batches]
        evaluated = pipe.evaluate(held_out)
        state = pipe.state_dict()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    _compare(state, one.state_dict())
    one.eval()
    with torch.no_grad():
        assert evaluated == pytest.approx(float(one(**held_out).loss), rel=1e-5)


def _graph_break(out: Any) -> Any:
    torch._dynamo.graph_break()
    return out


def prompt_only_rows(step: int) -> dict[str, torch.Tensor]:
    """A batch whose last two rows are prompts with no answer: one token each, every label
    -100 after the causal shift (supervised fine-tuning data cut at its length limit). Its
    second micro-batch (of two) holds no loss-bearing label; a plain batch after it."""
    batch = padded_batch(step)
    if step == 0:
        batch["attention_mask"][2:, 1:] = 0
        batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


@pytest.mark.parametrize(("dp", "graph_break"), [(1, False), (2, False), (1, True)],
                         ids=["pipeline", "dp2", "graph-break"])
def test_a_micro_batch_of_prompts_without_answers_trains_as_one_process(
        dp: int, graph_break: bool) -> None:
    """One process adds nothing for rows with no label; orgel's micro-batch of them has a
    loss of 0/0, which must count zero (not NaN, not refused), in the loss rule's trial on
    the example batch too, and with ``check_finite`` on. With a graph break the calling
    process computes the loss (``orgel.explicit.glued``)."""
    model = _qwen2()
    if graph_break:  # between the two layers
        model.model.layers[0].register_forward_hook(lambda m, a, out: _graph_break(out))
    batches = [prompt_only_rows(step) for step in range(2)]
    assert int((batches[0]["labels"][2:, 1:] != -100).sum()) == 0
    expected_losses, one = _reference(model, batches, 1)
    with orgel.pipeline(copy.deepcopy(model), batches[0], ranks=2, microbatches=2, dp=dp,
                        optimizer=_sgd, check_finite=True, schedule="1f1b") as pipe:
        assert pipe.loss_rule == "shifted"
        losses = [pipe.step(batch) for batch in batches]
        evaluated = pipe.evaluate(batches[0])
        state = pipe.state_dict()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    _compare(state, one.state_dict())
    one.eval()
    with torch.no_grad():
        assert evaluated == pytest.approx(float(one(**batches[0]).loss), rel=1e-5)


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, max_position_embeddings=SEQ, use_cache=False,
                          attn_implementation="eager")  # ties its embeddings
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config)


@pytest.mark.parametrize(("build", "options"), [
    (_qwen2, {"ranks": 4, "tp": 2}),
    (_qwen2, {"ranks": 4, "dp": 2, "shard": "fsdp"}),
    (_gemma2, {"ranks": 2}),
    (_gemma2, {"ranks": 4, "dp": 2, "shard": "fsdp"}),
], ids=["qwen2-tp2", "qwen2-fsdp", "gemma2-tied", "gemma2-tied-fsdp"])
def test_padded_batches_train_as_one_process_with_tp_fsdp_and_a_tied_model(
        build: object, options: dict[str, object]) -> None:
    """The same rule with tensor parallelism, FSDP-sharded replicas, and a model that ties
    its input and output embeddings (Gemma2), also on sharded stages."""
    model = build()  # type: ignore[operator]
    batches = [padded_batch(step) for step in range(3)]
    expected_losses, one = _reference(model, batches, 1)
    with orgel.pipeline(copy.deepcopy(model), batches[0], microbatches=2, optimizer=_sgd,
                        threads=1, schedule="1f1b", **options) as pipe:  # type: ignore[arg-type]
        losses = [pipe.step(batch) for batch in batches]
        state = pipe.state_dict()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    _compare(state, one.state_dict())


def _distilled(logits: Any, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Distillation as people write it: KL to the teacher's distribution per token, a mean
    over the tokens the attention mask keeps."""
    import torch.nn.functional as F

    kl = F.kl_div(F.log_softmax(logits.logits, -1), F.log_softmax(targets["teacher"], -1),
                  log_target=True, reduction="none").sum(-1)
    return (kl * targets["mask"]).sum() / targets["mask"].sum()


def test_a_distillation_loss_over_the_masked_tokens_trains_as_one_process() -> None:
    """Targets of a teacher's logits and the attention mask (an integer tensor that is no
    labels: the loss rule's trial had set it to -100 and the weight function ``loss_rule``
    gave a negative weight), weighed by ``loss_rule`` = the tokens each piece keeps."""
    teacher = _qwen2().eval()
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    data = []
    for step in range(2):
        batch = padded_batch(step)
        del batch["labels"]
        with torch.no_grad():
            data.append((batch, {"teacher": teacher(**batch).logits,
                                 "mask": batch["attention_mask"]}))
    model = _qwen2()
    one = copy.deepcopy(model)
    opt = _sgd(list(one.parameters()))
    expected = []
    for batch, targets in data:
        loss = _distilled(one(**batch), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    with orgel.pipeline(model, data[0][0], data[0][1], _distilled, ranks=2, microbatches=2,
                        optimizer=_sgd, schedule="1f1b",
                        loss_rule=lambda inputs, t: t["mask"].sum()) as pipe:
        losses = [pipe.step(batch, targets) for batch, targets in data]
        state = pipe.state_dict()
    assert losses == pytest.approx(expected, rel=1e-5)
    _compare(state, one.state_dict())


def test_the_labels_a_loss_counts_are_not_an_attention_mask() -> None:
    from orgel.lossweights import labels_of

    labels, mask = torch.tensor([[1, -100]]), torch.tensor([[1, 0]])
    assert labels_of({}, {"mask": mask, "labels": labels}) is labels
    assert labels_of({}, {"teacher": torch.ones(1, 2), "attention_mask": mask}) is None
    assert labels_of({}, (mask, labels)) is mask  # unnamed: the first, as before
    assert labels_of({"labels": labels}, {"mask": mask}) is labels

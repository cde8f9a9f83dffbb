"""The loss weight rule (orgel.lossweights) on its own: weights, and the start-up trial.

No process starts here; the pipelines that train by the rule are in test_loss_weights.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from orgel.lossweights import (
    ClassWeights,
    LossRuleError,
    batch_weights,
    calibrate,
    loss_weights,
    rule_for,
    weigh,
)
from orgel.workload import Workload

V, T = 11, 6


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, T), generator=g)
    labels = torch.randint(0, V, (4, T), generator=g)
    labels[2:, 3:] = -100  # the second half is padded more
    return ids, labels


def token_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


def token_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")


def row_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    per = F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none")
    return per.view(y.shape).sum(1).mean()


def shifted_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A causal LM's own loss: position t predicts label t + 1."""
    return token_mean(out[:, :-1], y[:, 1:])


def in_batch_negatives(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = out.mean(1)
    return F.cross_entropy(z @ z.t(), torch.arange(z.shape[0]))


@pytest.mark.parametrize(("loss_fn", "rule"), [(token_mean, "items"), (token_sum, "sum"),
                                               (row_mean, "rows"), (shifted_mean, "shifted")])
def test_the_trial_finds_how_the_loss_is_normalized(loss_fn, rule) -> None:
    ids, labels = _padded()
    assert calibrate(TinyLM(), {"ids": ids}, labels, loss_fn) == rule


@pytest.mark.parametrize("loss_fn", [token_mean, token_sum, row_mean, shifted_mean])
def test_the_weighted_pieces_make_the_whole_batchs_loss(loss_fn) -> None:
    model, (ids, labels) = TinyLM(), _padded()
    rule = calibrate(model, {"ids": ids}, labels, loss_fn)
    inputs = [{"ids": ids[:2]}, {"ids": ids[2:]}]
    targets = [labels[:2], labels[2:]]
    weights = batch_weights(rule, inputs, targets, 2, 0)  # 2 micro-batches x 2 replicas
    with torch.no_grad():
        whole = loss_fn(model(ids), labels)
        combined = sum(weigh(loss_fn(model(ids[[2 * m + r]]), labels[[2 * m + r]]),
                             weights[(m, r)]) for m in range(2) for r in range(2))
    torch.testing.assert_close(combined, whole)


@pytest.mark.parametrize("loss_fn", [token_mean, token_sum, row_mean, shifted_mean])
def test_uneven_pieces_weigh_their_share_of_the_batch(loss_fn) -> None:
    """Micro-batches of 3 and 1 rows (a smaller last batch): the weighted pieces still make
    the whole batch's loss."""
    model, (ids, labels) = TinyLM(), _padded()
    rule = calibrate(model, {"ids": ids}, labels, loss_fn)
    cut = [(0, 3), (3, 4)]
    weights = batch_weights(rule, [{"ids": ids[a:b]} for a, b in cut],
                            [labels[a:b] for a, b in cut], 1, 0)
    with torch.no_grad():
        whole = loss_fn(model(ids), labels)
        combined = sum(weigh(loss_fn(model(ids[a:b]), labels[a:b]), weights[(m, 0)])
                       for m, (a, b) in enumerate(cut))
    torch.testing.assert_close(combined, whole)


def test_a_loss_no_rule_reproduces_is_refused_at_start_up_with_what_the_trial_saw() -> None:
    ids, labels = _padded()
    with pytest.raises(LossRuleError, match="no rule reproduces the whole.*loss_rule='rows'"):
        calibrate(TinyLM(), {"ids": ids}, labels, in_batch_negatives)
    w = Workload(TinyLM(), {"ids": ids}, labels, in_batch_negatives)
    assert rule_for(w, "rows") == "rows"  # asked for: no trial


def masked_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A token mean written by hand: its gradient on a piece of no label is 0/0 (NaN)."""
    keep = (y != -100).float()
    per = F.cross_entropy(out.flatten(0, 1), y.clamp(min=0).flatten(), reduction="none")
    return (per * keep.flatten()).sum() / keep.sum()


@pytest.mark.parametrize("loss_fn", [token_mean, shifted_mean, masked_mean])
def test_a_piece_without_a_label_adds_nothing_as_its_rows_do_in_one_process(loss_fn) -> None:
    """A micro-batch of padding only (a prompt with no answer, every label -100) has a loss
    of 0/0; in one process its rows add nothing to the batch's loss or gradients. It weighs
    0, and its weighed loss is a zero whose gradient is zero (not NaN), even where the loss's
    own gradient is 0/0."""
    model, (ids, labels) = TinyLM(), _padded()
    labels[2:] = -100
    rule = calibrate(model, {"ids": ids}, labels, loss_fn)
    assert rule == ("shifted" if loss_fn is shifted_mean else "items")
    weights = batch_weights(rule, [{}, {}], [labels[:2], labels[2:]], 1, 0)
    assert weights[(1, 0)][0] == 0
    whole = loss_fn(model(ids), labels)
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pieces = []
    for m, (a, b) in enumerate([(0, 2), (2, 4)]):
        out = model(ids[a:b])
        pieces.append(weigh(loss_fn(out, labels[a:b]), weights[(m, 0)], [out]))
    assert float(pieces[1].detach()) == 0.0
    combined = sum(pieces)
    combined.backward()
    torch.testing.assert_close(combined, whole)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=n)
    assert loss_weights("rows", [(None, 2), (None, 2)]) == [(1, 2), (1, 2)]
    assert loss_weights("sum", [(None, 2), (None, 2)]) == [(1, 1), (1, 1)]
    assert loss_weights("shifted", [(labels[:2], 2), (labels[2:], 2)]) == [(1, 1), (0, 1)]


def test_the_models_own_loss_counts_its_labels_input() -> None:
    class OwnLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = TinyLM()

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.lm(ids)
            return {"logits": logits, "loss": shifted_mean(logits, labels)}

    ids, labels = _padded()
    rule = calibrate(OwnLoss(), {"ids": ids, "labels": labels}, None,
                     lambda out, _: out["loss"])
    assert rule == "shifted"


def test_without_a_loss_fn_the_models_own_loss_is_the_loss_or_it_says_what_to_pass() -> None:
    from orgel.workload import WorkloadError, model_loss

    assert model_loss({"loss": torch.tensor(2.0)}, None) == 2.0
    with pytest.raises(WorkloadError, match="put the labels in the batch.*or pass loss_fn"):
        model_loss(torch.zeros(2), None)


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(weight=torch.rand(V) + 0.1),
                                     nn.CrossEntropyLoss(weight=torch.rand(V) + 0.1,
                                                         label_smoothing=0.1)],
                         ids=["class_weights", "class_weights_smoothed"])
def test_a_class_weighted_token_loss_weighs_its_pieces_by_their_labels_weights(loss_fn) -> None:
    """``nn.CrossEntropyLoss(weight=w)`` on padded tokens divides by ``sum(w[y])`` over the
    labels that are not -100: found on the loss, and the weighed pieces (micro-batches,
    and two replicas of each) sum to the whole batch's loss and gradients."""
    model, (ids, labels) = TinyLM(), _padded()

    def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(out.flatten(0, 1), y.flatten())

    token_loss.loss_rule = "auto"  # type: ignore[attr-defined]
    with pytest.raises(LossRuleError, match="ClassWeights"):  # a function hides the weights
        calibrate(model, {"ids": ids}, labels, token_loss)
    rule = calibrate(model, {"ids": ids}, labels, token_loss, given=ClassWeights(loss_fn.weight))
    assert isinstance(rule, ClassWeights)
    weights = batch_weights(rule, [{}, {}], [labels[:2], labels[2:]], 2, 0)
    whole = token_loss(model(ids), labels)
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    combined = sum(weigh(token_loss(model(ids[2 * m + r:2 * m + r + 1]),
                                    labels[2 * m + r:2 * m + r + 1]), weights[(m, r)])
                   for m in range(2) for r in range(2))
    combined.backward()
    torch.testing.assert_close(combined, whole)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], msg=n)
    classify = nn.Linear(8, V)  # a classifier whose loss_fn is the weighted loss module
    found = rule_for(Workload(classify, {"input": torch.randn(4, 8)}, labels[:, 0], loss_fn))
    assert isinstance(found, ClassWeights)  # the loss module's own weights, by itself
    with pytest.raises(LossRuleError, match="needs the weights"):
        rule_for(Workload(TinyLM(), {"ids": ids}, labels, token_mean), "weighted")
    with pytest.raises(LossRuleError, match="must return what the piece's mean divides by"):
        batch_weights(lambda x, y: -1.0, [{}], [labels], 1, 0)

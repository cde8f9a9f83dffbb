"""A weighted mean trains as one process on the whole batch: class weights, per-row weights.

A classifier on imbalanced classes is trained with ``nn.CrossEntropyLoss(weight=w)``: the
batch's loss is ``sum(w[y] * loss) / sum(w[y])``, which no micro-batch's mean can be
weighed into by rows or by label counts. orgel finds the class weights on such a
``loss_fn`` itself and weighs each micro-batch (and replica) by its share of the batch's
``sum(w[y])`` (:class:`orgel.lossweights.ClassWeights`); any other weighted mean takes
``loss_rule=`` a function returning a part's divisor. Trained through the real launcher
against one plain PyTorch process on the whole batch, under torchrun too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.lossweights import ClassWeights, LossRuleError

pytestmark = pytest.mark.slow

CLASSES = 4
WEIGHT = torch.tensor([1.0, 5.0, 2.0, 0.5])


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, CLASSES))


def imbalanced(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose rare classes sit in the second half: the parts' weight sums differ."""
    g = torch.Generator().manual_seed(10 + step)
    labels = torch.tensor([0, 0, 3, 0, 1, 2, 1, 3][:rows])
    return torch.randn(rows, 16, generator=g), labels


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def one_process(model: nn.Module, loss_fn, batches) -> tuple[list[float], nn.Module]:
    one = copy.deepcopy(model)
    opt = _sgd(list(one.parameters()))
    losses = []
    for x, y in batches:
        loss = loss_fn(one(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, one


def _compare(state: dict[str, torch.Tensor], one: nn.Module) -> None:
    for name, value in one.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dp", [1, 2], ids=["pipeline", "dp2"])
def test_a_class_weighted_loss_trains_as_one_process(dp: int) -> None:
    loss_fn = nn.CrossEntropyLoss(weight=WEIGHT)
    model, batches = classifier(), [imbalanced(step) for step in range(2)]
    expected, one = one_process(model, loss_fn, batches)
    held_out = imbalanced(5)
    with orgel.pipeline(copy.deepcopy(model), (batches[0][0],), batches[0][1], loss_fn,
                        ranks=2, microbatches=2, dp=dp, optimizer=_sgd, schedule="1f1b",
                        threads=1) as pipe:
        assert isinstance(pipe.loss_rule, ClassWeights)  # found on the loss by itself
        losses = [pipe.step((x,), y) for x, y in batches]
        evaluated = pipe.evaluate((held_out[0],), held_out[1])
        state = pipe.state_dict()
    assert losses == pytest.approx(expected, rel=1e-5)
    _compare(state, one)
    one.eval()
    with torch.no_grad():
        assert evaluated == pytest.approx(float(loss_fn(one(held_out[0]), held_out[1])),
                                          rel=1e-5)


def row_weighted(out: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """A mean weighted by what each row of the batch carries (a sample weight column)."""
    per_row = F.cross_entropy(out, targets["y"], reduction="none")
    return (per_row * targets["w"]).sum() / targets["w"].sum()


def test_a_weighted_mean_trains_as_one_process_with_the_function_it_divides_by() -> None:
    model = classifier()
    batches = []
    for step in range(2):
        x, y = imbalanced(step)
        batches.append((x, {"y": y, "w": torch.linspace(0.2, 3.0, 8) ** (step + 1)}))
    expected, one = one_process(model, row_weighted, batches)
    with pytest.raises(LossRuleError, match="loss_rule=a function"):
        orgel.pipeline(copy.deepcopy(model), (batches[0][0],), batches[0][1], row_weighted,
                       ranks=2, microbatches=2, schedule="1f1b")
    with pytest.raises(LossRuleError, match="do not make the loss of the whole"):
        orgel.pipeline(copy.deepcopy(model), (batches[0][0],), batches[0][1], row_weighted,
                       ranks=2, microbatches=2, schedule="1f1b",
                       loss_rule=lambda inputs, t: len(t["w"]))  # rows: not its divisor
    with orgel.pipeline(copy.deepcopy(model), (batches[0][0],), batches[0][1], row_weighted,
                        ranks=2, microbatches=2, optimizer=_sgd, schedule="1f1b", threads=1,
                        loss_rule=lambda inputs, t: t["w"].sum()) as pipe:
        losses = [pipe.step((x,), y) for x, y in batches]
        state = pipe.state_dict()
    assert losses == pytest.approx(expected, rel=1e-5)
    _compare(state, one)


TORCHRUN = '''
import json, sys
sys.path.insert(0, {tests!r})
import torch
from torch import nn
import orgel
from test_weighted_loss import WEIGHT, _sgd, classifier, imbalanced, one_process

loss_fn = nn.CrossEntropyLoss(weight=WEIGHT)
model, batches = classifier(), [imbalanced(step) for step in range(2)]
expected, one = one_process(model, loss_fn, batches)
with orgel.pipeline(model, (batches[0][0],), batches[0][1], loss_fn, ranks=2, microbatches=2,
                    optimizer=_sgd, schedule="1f1b") as pipe:
    rule = repr(pipe.loss_rule)  # process 0 found it; the other took its own by name
    losses = [pipe.step((x,), y) for x, y in batches]
    state = pipe.state_dict()
gap = max(float((state[n] - v).abs().max()) for n, v in one.state_dict().items())
rank = torch.distributed.get_rank()
Path = __import__("pathlib").Path
Path(sys.argv[1], f"weighted{{rank}}.json").write_text(
    json.dumps({{"rule": rule, "losses": losses, "expected": expected, "gap": gap}}))
'''

#: the script the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"weighted-loss": (TORCHRUN.format(tests=str(Path(__file__).parent)), [])}


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("weighted-loss")
def test_a_class_weighted_loss_trains_as_one_process_under_torchrun(
        torchrun_part: Path) -> None:
    for rank in (0, 1):
        result = json.loads((torchrun_part / f"weighted{rank}.json").read_text())
        assert result["rule"].startswith("ClassWeights([1.0, 5.0, 2.0, 0.5]")
        assert result["losses"] == pytest.approx(result["expected"], rel=1e-5)
        assert result["gap"] < 1e-5

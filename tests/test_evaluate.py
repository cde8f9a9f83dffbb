"""Evaluation (forward only, eval mode) and the model's outputs through orgel.pipeline.

Each test runs a pipeline on two forked gloo ranks and compares with one
process doing the same in plain PyTorch: ``model.eval(); with torch.no_grad():``
for ``pipe.evaluate``, the model's own outputs for ``step(..., outputs=True)``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import orgel
from orgel.graph import capture
from orgel.plan.balanced import balanced_plan
from orgel.workload import Workload, microbatches

pytestmark = pytest.mark.slow


class BatchNormNet(nn.Module):
    """BatchNorm, dropout and a branch on ``self.training``: eval differs from train."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        h = torch.relu(self.fc2(h))
        if self.training:
            h = h * 1.5
        else:  # nodes only the eval-mode graph has (one named like a training node)
            h = torch.clamp(h, max=4.0) * 0.5
        logits = self.fc3(h)
        return {"logits": logits, "norm": logits.pow(2).mean()}


def _loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"], y)


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batch(step: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(8, 8, generator=g),), torch.randint(0, 4, (8,), generator=g)


def _model(p: float) -> nn.Module:
    torch.manual_seed(0)
    return BatchNormNet(p)


def _start(model: nn.Module, *, dp: int = 1) -> Any:
    inputs, targets = _batch(0)
    mb = 2
    graph = capture(model, microbatches(Workload(model, inputs, targets, _loss), mb * dp)[0][0])
    plan = balanced_plan(graph, ranks=2, microbatches=mb, schedule="1f1b", dp=dp)
    return orgel.pipeline(model, inputs, targets, _loss, ranks=2, microbatches=mb, plan=plan,
                          optimizer=_sgd, threads=1)


def _eval_reference(model: nn.Module, state: dict[str, torch.Tensor],
                    x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, Any]]:
    one = copy.deepcopy(model)
    one.load_state_dict(state)
    one.eval()
    with torch.no_grad():
        out = one(x)
        return float(_loss(out, y)), out


def test_evaluate_is_eval_mode_and_leaves_training_as_it_was() -> None:
    """Eval mode against one process; a pass a rank's own error drops leaves the pipeline
    as it was, and so does a step called under ``torch.no_grad()`` (a validation loop
    written with ``step``) or under an autocast the ranks would not run: both refused. A
    pipeline built under ``torch.no_grad()`` trains as one built outside it."""
    model = _model(0.3)
    (x,), y = _batch(5)
    with torch.no_grad():  # as a script's evaluation section might build it
        pipe = _start(copy.deepcopy(model))
    with pipe:
        assert pipe.plan.num_stages == 2
        first = pipe.step(*_batch(0))
        state = pipe.state_dict()
        # the loss needs targets: the rank's error drops the pass on every rank, as in
        # step; the pipeline goes on, and evaluates and trains exactly afterwards
        with pytest.raises(orgel.StepError,
                           match="failed in evaluate: .*NoneType(.|\n)*dropped this pass"):
            pipe.evaluate((x,))
        with torch.no_grad(), pytest.raises(RuntimeError, match="pipe.evaluate"):
            pipe.step((x,), y)
        with (torch.autocast("cpu", dtype=torch.bfloat16),
              pytest.raises(RuntimeError, match="precision='bf16-mixed'")):
            pipe.step((x,), y)
        with torch.no_grad():
            loss = pipe.evaluate((x,), y)
        again, out = pipe.evaluate((x,), y, outputs=True)
        only = pipe.evaluate((x,), outputs=True)
        assert pipe.state_dict().keys() == state.keys()
        for name, t in pipe.state_dict().items():  # no buffer update, no optimizer step
            assert torch.equal(t, state[name]), name
        second = pipe.step(*_batch(1))
        after = pipe.state_dict()
    ref_loss, ref_out = _eval_reference(model, state, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert again == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(out["logits"], ref_out["logits"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(only["logits"], ref_out["logits"], rtol=1e-5, atol=1e-6)
    # a 0-dim leaf: one per micro-batch (the reference's is the mean over the batch)
    assert isinstance(out["norm"], list) and len(out["norm"]) == 2
    halves = ref_out["logits"].chunk(2)
    for got, half in zip(out["norm"], halves, strict=True):
        torch.testing.assert_close(got, half.pow(2).mean(), rtol=1e-5, atol=1e-6)
    # eval mode really differs from train mode here (BatchNorm, dropout, the branch)
    train_mode = copy.deepcopy(model)
    train_mode.load_state_dict(state)
    with torch.no_grad():
        assert not torch.allclose(train_mode(x)["logits"], out["logits"], atol=1e-3)
    # the next step trains as if no evaluation had run (random streams included)
    with _start(copy.deepcopy(model)) as never:
        assert never.step(*_batch(0)) == first
        assert never.step(*_batch(1)) == second
        for name, t in never.state_dict().items():
            assert torch.equal(t, after[name]), name


def test_step_outputs_equal_one_process() -> None:
    model = _model(0.0)  # no dropout: one process's training forward is the same
    reference = copy.deepcopy(model)
    opt = _sgd(list(reference.parameters()))
    with _start(copy.deepcopy(model)) as pipe:
        for s in range(2):
            inputs, targets = _batch(s)
            loss, out = pipe.step(inputs, targets, outputs=True)
            halves = [reference(part) for part in inputs[0].chunk(2)]  # BatchNorm: per micro-batch
            ref_loss = sum(_loss(h, t) for h, t in zip(halves, targets.chunk(2), strict=True)) / 2
            opt.zero_grad()
            ref_loss.backward()
            opt.step()
            assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
            torch.testing.assert_close(out["logits"],
                                       torch.cat([h["logits"] for h in halves]).detach(),
                                       rtol=1e-5, atol=1e-6)
            assert [float(n) for n in out["norm"]] == pytest.approx(
                [h["norm"].item() for h in halves], rel=1e-5)
        (x,), y = _batch(2)  # a step without outputs goes on from the same state
        with torch.no_grad():
            ref_loss = sum(_loss(reference(p), t)
                           for p, t in zip(x.chunk(2), y.chunk(2), strict=True)) / 2
        assert pipe.step((x,), y) == pytest.approx(ref_loss.item(), rel=1e-5)


def test_outputs_of_a_loss_stage_on_two_replicas_come_back_in_order() -> None:
    model = _model(0.0)
    (x,), y = _batch(7)
    with _start(copy.deepcopy(model), dp=2) as pipe:
        assert pipe.plan.placement[-1] == (0, 1)
        loss, out = pipe.evaluate((x,), y, outputs=True)
        state = pipe.state_dict()
    ref_loss, ref_out = _eval_reference(model, state, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(out["logits"], ref_out["logits"], rtol=1e-5, atol=1e-6)
    assert len(out["norm"]) == 4  # 2 micro-batches x 2 replicas


@pytest.mark.hf
def test_hugging_face_llama_perplexity_and_its_model_output() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from zoo import hf_llama

    w = hf_llama(batch_size=4, seed=0)
    model, loss_fn = w.model, w.loss_fn
    first, _ = microbatches(Workload(model, w.inputs, w.targets, loss_fn), 2)[0]
    # 6 stages, 3 per rank: the mask and rotary tables go from stage 0 to later stages
    plan = balanced_plan(capture(model, first), ranks=2, microbatches=2,
                         schedule="interleaved", stages_per_rank=3)
    ids = torch.randint(0, model.config.vocab_size, w.inputs["input_ids"].shape,
                        generator=torch.Generator().manual_seed(3))
    targets = torch.roll(ids, -1, dims=1)
    with orgel.pipeline(copy.deepcopy(model), w.inputs, w.targets, loss_fn, ranks=2,
                        microbatches=2, plan=plan, optimizer=_sgd, threads=1) as pipe:
        assert pipe.plan.num_stages == 6
        pipe.step(w.inputs, w.targets)
        loss, out = pipe.evaluate({"input_ids": ids}, targets, outputs=True)
        state = pipe.state_dict()
    one = copy.deepcopy(model)
    one.load_state_dict(state, strict=False)  # the state also lists the rotary table
    one.eval()
    with torch.no_grad():
        expected = one(input_ids=ids)
        ref_loss = float(loss_fn(expected, targets))
    assert isinstance(out, CausalLMOutputWithPast)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert float(torch.tensor(loss).exp()) == pytest.approx(float(torch.tensor(ref_loss).exp()),
                                                            rel=1e-5)  # the perplexity
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)


TORCHRUN = '''
import copy, json, sys
sys.path.insert(0, {tests!r})
import torch
from test_evaluate import _batch, _eval_reference, _model, _start

model = _model(0.3)
pipe = _start(copy.deepcopy(model))
pipe.step(*_batch(0))
state = pipe.state_dict()
(x,), y = _batch(5)
loss = pipe.evaluate((x,), y)
again, out = pipe.evaluate((x,), y, outputs=True)
step_loss, step_out = pipe.step(*_batch(1), outputs=True)
ref_loss, ref_out = _eval_reference(model, state, x, y)
rank = torch.distributed.get_rank()
with open(f"{{sys.argv[1]}}/result{{rank}}.json", "w") as f:
    json.dump({{"loss": loss, "again": again, "ref": ref_loss, "spmd": pipe.spmd,
               "diff": (out["logits"] - ref_out["logits"]).abs().max().item(),
               "rows": step_out["logits"].shape[0], "norms": len(step_out["norm"])}}, f)
pipe.close()
'''


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("evaluate")
def test_under_torchrun_every_rank_gets_the_evaluation_and_the_outputs(
        torchrun_part: Path) -> None:
    for rank in (0, 1):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert result["spmd"] is True
        assert result["loss"] == pytest.approx(result["ref"], rel=1e-5)
        assert result["again"] == pytest.approx(result["ref"], rel=1e-5)
        assert result["diff"] < 1e-5
        assert (result["rows"], result["norms"]) == (8, 2)


#: the script the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"evaluate": (TORCHRUN.format(tests=str(Path(__file__).parent)), [])}


def test_a_meta_model_evaluates_with_the_values_its_ranks_made() -> None:
    with torch.device("meta"):
        model = _model(0.3)
    inputs, targets = _batch(0)
    (x,), y = _batch(4)

    def init(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            nn.init.normal_(p, std=0.3)

    with orgel.pipeline(model, inputs, targets, _loss, ranks=2, microbatches=2, init=init,
                        optimizer=_sgd, threads=1) as pipe:
        pipe.step(inputs, targets)
        loss, out = pipe.evaluate((x,), y, outputs=True)
        state = pipe.state_dict()
    ref_loss, ref_out = _eval_reference(_model(0.3), state, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    torch.testing.assert_close(out["logits"], ref_out["logits"], rtol=1e-5, atol=1e-6)


class TrainOnlyTail(nn.Module):
    """A layer that runs in training only: in eval mode its stage would have no work."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.noise = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.training:
            h = self.noise(h)
        return self.last(h)


def test_the_eval_split_shares_the_training_weights_or_says_why_it_cannot() -> None:
    from orgel.guard import untouched
    from orgel.split import split_model
    from orgel.split.evaluation import share_weights, split_like
    from orgel.split.split import SplitError

    model = BatchNormNet()
    x = torch.randn(4, 8)
    graph = capture(model, (x,))
    stage_of = {n: 0 if i < len(graph.nodes) // 2 else 1 for i, n in enumerate(graph.nodes)}
    train = split_model(graph, stage_of)
    with untouched(model):
        model.eval()
        eval_graph = capture(model, (x,))
    evaluation = split_like(eval_graph, train)
    assert len(evaluation.stages) == 2 and evaluation.loss_stage == train.loss_stage
    for stage in train.stages:  # as on a rank: the training stages hold their own copies
        for sub in stage.module.modules():
            sub._parameters = {k: nn.Parameter(p.detach().clone()) for k, p in
                               sub._parameters.items()}
    share_weights(evaluation, train, [0, 1])
    for s in (0, 1):
        trained = {id(t) for t in train.stages[s].module.state_dict(keep_vars=True).values()}
        held = evaluation.stages[s].module.state_dict(keep_vars=True)
        assert held and all(id(t) in trained for t in held.values())

    tail = TrainOnlyTail()
    graph = capture(tail, (torch.randn(2, 4),))
    train = split_model(graph, {n: ["first", "noise", "last"].index(graph.nodes[n].module)
                                for n in graph.nodes})
    with untouched(tail):
        tail.eval()
        eval_graph = capture(tail, (torch.randn(2, 4),))
    with pytest.raises(SplitError, match=r"no operation for stage\(s\) \[1\]"):
        split_like(eval_graph, train)


def test_a_loss_alone_waits_for_no_eval_capture_in_the_calling_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``evaluate`` without outputs: each rank captures the eval-mode model for its stages,
    the calling process does not (it did, for the outputs' structure only); with
    ``outputs=True`` it does, once. Where the eval-mode forward does not fit the plan, the
    ranks say so and ``evaluate`` raises it; the pipeline trains on."""
    import orgel.flow.capture as flow_capture

    made: list[int] = []
    real = flow_capture.eval_split_for

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return real(*args, **kwargs)

    model = _model(0.3)
    (x,), y = _batch(5)
    with _start(copy.deepcopy(model)) as pipe:
        monkeypatch.setattr(flow_capture, "eval_split_for", counted)  # (the ranks forked)
        pipe.step(*_batch(0))
        state = pipe.state_dict()
        loss = pipe.evaluate((x,), y)
        assert made == []
        again, out = pipe.evaluate((x,), y, outputs=True)
        assert made == [1]
        assert pipe.evaluate((x,), y) == loss and made == [1]
    ref_loss, ref_out = _eval_reference(model, state, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-5) and again == loss
    torch.testing.assert_close(out["logits"], ref_out["logits"], rtol=1e-5, atol=1e-6)

    tail = TrainOnlyTail()
    x4, y4 = torch.randn(4, 4), torch.randn(4, 4)
    graph = capture(tail, (x4[:2],))
    plan = balanced_plan(graph, ranks=3, microbatches=2, schedule="1f1b")
    with orgel.pipeline(tail, (x4,), y4, F.mse_loss, ranks=3, microbatches=2, plan=plan,
                        optimizer=_sgd, threads=1) as pipe:
        with pytest.raises(RuntimeError, match=r"evaluation is not available: .*stage\(s\)"):
            pipe.evaluate((x4,), y4)
        assert pipe.step((x4,), y4) > 0


def test_a_forward_of_several_graphs_returns_its_outputs_and_evaluates() -> None:
    """A forward of several graphs: ``step(outputs=True)`` gives the model's outputs, and
    ``evaluate`` (run in the controller on the ranks' values) is one process's eval pass
    with the trained weights."""
    from test_glue import SideOutput, _side_loss

    torch.manual_seed(1)
    model = SideOutput()
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    reference = copy.deepcopy(model)
    with orgel.pipeline(model, (x,), y, _side_loss, ranks=2, microbatches=2, threads=1,
                        optimizer=_sgd) as pipe:
        loss, (logits, h) = pipe.step((x,), y, outputs=True)
        evaluated, (eval_logits, eval_h) = pipe.evaluate((x,), y, outputs=True)
        assert pipe.evaluate((x,), y) == pytest.approx(evaluated, rel=1e-6)
        trained = pipe.state_dict()
    with torch.no_grad():
        parts = [reference(p) for p in x.chunk(2)]
    torch.testing.assert_close(logits, torch.cat([p[0] for p in parts]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h, torch.cat([p[1] for p in parts]), rtol=1e-5, atol=1e-6)
    assert loss == pytest.approx(sum(_side_loss(p, t).item()
                                     for p, t in zip(parts, y.chunk(2), strict=True)) / 2,
                                 rel=1e-5)
    reference.load_state_dict(trained)
    reference.eval()
    with torch.no_grad():
        parts = [reference(p) for p in x.chunk(2)]
    torch.testing.assert_close(eval_logits, torch.cat([p[0] for p in parts]), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(eval_h, torch.cat([p[1] for p in parts]), rtol=1e-5, atol=1e-6)
    assert evaluated == pytest.approx(sum(_side_loss(p, t).item() for p, t in
                                          zip(parts, y.chunk(2), strict=True)) / 2, rel=1e-5)
    assert not torch.equal(trained[next(iter(trained))], model.state_dict()[next(iter(trained))])

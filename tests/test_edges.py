"""Parameters without a gradient, on every path: frozen, unused, replicated, tied.

One process leaves a frozen parameter's (``requires_grad=False``) and an unused
parameter's ``.grad`` None, so AdamW skips them (no weight decay, no step count).
A pipeline with data-parallel replicas or tied copies sums gradients across
ranks; these tests check that it leaves the same parameters alone.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import orgel
from orgel.graph import capture
from orgel.models import build
from orgel.plan.balanced import balanced_plan
from orgel.runtime import checkpoint as ckpt
from orgel.runtime.optimizer import NamedParameters
from orgel.workload import Workload, microbatches
from side_by_side import train_both

ROWS, M = 8, 2
FROZEN = "encoder.blocks.0.mlp.fc"  # a layer the forward uses, with requires_grad=False


class WithAux(torch.nn.Module):
    """A GPT that also returns an auxiliary output, which the loss ignores: its head
    is trainable but no loss reaches it (one process leaves its gradient None). With
    ``early``, that head reads the tokens before the GPT does, so it lands on the first
    rank and its output crosses to the last one, which the loss is on."""

    def __init__(self, gpt: torch.nn.Module, early: bool = False) -> None:
        super().__init__()
        self.gpt = gpt
        self.early = early
        self.aux = torch.nn.Embedding(128, 4) if early else torch.nn.Linear(128, 4)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux = self.aux(tokens) if self.early else None
        logits = self.gpt(tokens)
        return logits, self.aux(logits) if aux is None else aux


def _workload(name: str) -> tuple[torch.nn.Module, Any]:
    """A GPT with a frozen layer (the tied one: its tied embedding frozen too), an unused
    trainable layer and a trainable head no loss reaches (``"early"``: on the first
    rank); its loss function."""
    w = build("gpt" if name == "early" else name, batch_size=ROWS, seed=0, n_layers=2,
              d_model=32)
    for p in w.model.get_submodule(FROZEN).parameters():
        p.requires_grad_(False)
    if name == "tied":
        w.model.get_parameter("tok_emb.weight").requires_grad_(False)
    torch.manual_seed(1)
    w.model.unused = torch.nn.Linear(8, 8)  # trainable, but the forward never calls it
    loss_fn = w.loss_fn

    def first(outputs: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> Any:
        return loss_fn(outputs[0], targets)
    return WithAux(w.model, early=name == "early"), first


def _adamw(params: NamedParameters) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params), lr=1e-2, eps=1e-6, weight_decay=0.5)


def _plan(model: torch.nn.Module, loss_fn: Any, ranks: int, dp: int) -> Any:
    inputs, targets = _batch(0)
    first, _ = microbatches(Workload(copy.deepcopy(model), (inputs,), targets, loss_fn),
                            M * dp)[0]
    graph = capture(copy.deepcopy(model), first)
    return balanced_plan(graph, ranks=ranks, microbatches=M, dp=dp)


def _batch(call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + call)
    tokens = torch.randint(0, 128, (ROWS, 32), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dp"), [("gpt", 2), ("tied", 1), ("early", 1)])
def test_frozen_and_unused_parameters_stay_as_one_process_leaves_them(name: str,
                                                                      dp: int) -> None:
    """AdamW with weight decay over every parameter, frozen and unused ones included:
    replicas (dp=2) or tied embeddings on two ranks move exactly the parameters one
    process moves; the frozen layer and the unused one keep their values, and so does
    a head whose output the loss ignores on another rank than the loss's."""
    net, loss_fn = _workload(name)
    model = copy.deepcopy(net)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt = _adamw(NamedParameters(model.named_parameters()))
    inputs, targets = _batch(0)
    with orgel.pipeline(net, (inputs,), targets, loss_fn, ranks=2, microbatches=M,
                        plan=_plan(net, loss_fn, 2, dp), optimizer=_adamw, threads=1) as pipe:
        train_both(pipe, model, loss_fn, opt, map(_batch, range(2)))
        state = pipe.state_dict()
    kept = [f"gpt.{FROZEN}.weight", f"gpt.{FROZEN}.bias", "gpt.unused.weight",
            "gpt.unused.bias", "aux.weight"] + ([] if name == "early" else ["aux.bias"])
    for n in kept + (["gpt.tok_emb.weight"] if name == "tied" else []):
        assert torch.equal(state[n], before[n]), n  # one process leaves them as they were
    expected = model.state_dict()  # Adam amplifies float noise of tiny gradients: 1e-5
    bad = {n: float((state[n] - t).abs().max()) for n, t in expected.items()
           if not torch.allclose(state[n], t, rtol=1e-5, atol=1e-5)}
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "early"])
def test_backend_leaves_a_head_its_closures_loss_ignores_alone(name: str) -> None:
    """orgel.backend: the closure's loss reads the logits, not the auxiliary head's output
    (computed on the last rank, from the logits; ``"early"``: on the first rank, from the
    tokens, its output crossing to the last): that head gets no gradient, as in one
    process, so AdamW's weight decay leaves it; every other weight as one process's."""
    torch._dynamo.reset()
    net, loss_fn = _workload(name)
    model = copy.deepcopy(net)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt = _adamw(NamedParameters(model.named_parameters()))
    pipe = orgel.backend(ranks=2, microbatches=M, optimizer=_adamw, threads=1)
    compiled = torch.compile(net, backend=pipe)

    def closure(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(compiled(tokens), targets) / M
        loss.backward()
        return loss.detach()

    try:
        for c in range(2):
            tokens, targets = _batch(c)
            pipe.step(closure, tokens, targets)
            loss_fn(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
        state = pipe.state_dict()
    finally:
        pipe.close()
    for n in ["aux.weight"] + ([] if name == "early" else ["aux.bias"]):
        assert torch.equal(state[n], before[n]), n
    bad = {n: float((state[n] - t).abs().max()) for n, t in model.state_dict().items()
           if not torch.allclose(state[n], t, rtol=1e-5, atol=1e-5)}
    assert not bad, bad


class BrokenAux(WithAux):
    """:class:`WithAux` (``early``) whose forward breaks Dynamo's graph: before the model
    (``after_aux=False``: the head's output crosses a stage boundary) or after the head
    (its output goes through the calling process's Python between graphs)."""

    def __init__(self, gpt: torch.nn.Module, after_aux: bool) -> None:
        super().__init__(gpt, early=True)
        self.after_aux = after_aux

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = tokens + 0
        if not self.after_aux:
            torch._dynamo.graph_break()
        aux = self.aux(tokens)  # first: on the first rank
        if self.after_aux:
            torch._dynamo.graph_break()
        return self.gpt(tokens), aux


@pytest.mark.slow
@pytest.mark.parametrize("after_aux", [False, True])
def test_a_forward_with_graph_breaks_leaves_an_early_head_its_loss_ignores_alone(
        after_aux: bool) -> None:
    """A forward of two graphs through ``orgel.pipeline``: the auxiliary head on the first
    rank, its output crossing to the last rank (or to the calling process, between the
    graphs), which the loss (the controller's) ignores: the head keeps no gradient, as in
    one process; every other weight as one process's."""
    torch._dynamo.reset()
    net, loss_fn = _workload("early")
    net = BrokenAux(net.gpt, after_aux)
    model = copy.deepcopy(net)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt = _adamw(NamedParameters(model.named_parameters()))
    inputs, targets = _batch(0)
    with orgel.pipeline(net, (inputs,), targets, loss_fn, ranks=2, microbatches=M,
                        schedule="1f1b", optimizer=_adamw, threads=1) as pipe:
        assert "aux.weight" in pipe._split.stages[0].param_names.values()  # on rank 0
        train_both(pipe, model, loss_fn, opt, map(_batch, range(2)))
        state = pipe.state_dict()
    assert torch.equal(state["aux.weight"], before["aux.weight"])
    bad = {n: float((state[n] - t).abs().max()) for n, t in model.state_dict().items()
           if not torch.allclose(state[n], t, rtol=1e-5, atol=1e-5)}
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "accumulate"), [("adamw", 1), ("sgd", 2)])
def test_backend_closure_without_backward_leaves_the_weights(kind: str, accumulate: int) -> None:
    """orgel.backend: a step whose closures never call backward (an evaluation batch)
    gives no gradient, so AdamW (weight decay) and momentum SGD change nothing, as
    ``opt.step()`` after no backward in one process; with ``accumulate=2`` such a call
    beside a training one leaves the training one's gradients as they are."""
    torch._dynamo.reset()
    w = build("gpt", batch_size=ROWS, seed=0, n_layers=2, d_model=32)
    ref_model = copy.deepcopy(w.model)

    def factory(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, eps=1e-6, weight_decay=0.5)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)

    ref_opt = factory(list(ref_model.parameters()))
    pipe = orgel.backend(ranks=2, microbatches=M, optimizer=factory, accumulate=accumulate,
                         threads=1)
    compiled = torch.compile(w.model, backend=pipe, dynamic=False)

    def closure_for(model: Any, train: bool, divisor: int) -> Any:
        def closure(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = w.loss_fn(model(tokens), targets) / M
            if train:
                (loss / divisor).backward()
            return loss.detach()
        return closure

    try:
        for c, train in enumerate([True, True, False, False, True, True]):
            tokens, targets = _batch(c)
            losses = pipe.step(closure_for(compiled, train, 1), tokens, targets)
            want = [closure_for(ref_model, train, accumulate)(t, y)
                    for t, y in zip(tokens.chunk(M), targets.chunk(M), strict=True)]
            torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=1e-5,
                                       atol=1e-6)
            if c % accumulate == accumulate - 1:
                ref_opt.step()
                ref_opt.zero_grad()
        state = pipe.state_dict()
        expected = ref_model.state_dict()
        bad = {n: float((state[n] - t).abs().max()) for n, t in expected.items()
               if not torch.allclose(state[n], t, rtol=1e-5, atol=1e-5)}
        assert not bad, bad
    finally:
        pipe.close()



def _by_name(params: NamedParameters, *, swap: bool = False) -> torch.optim.Optimizer:
    """Two groups by name, each with its own rate and weight decay (``swap``: the same
    two groups in the other order)."""
    decay = [p for n, p in params.named() if p.dim() >= 2 and "emb" not in n]
    plain = [p for n, p in params.named() if not (p.dim() >= 2 and "emb" not in n)]
    groups = [{"params": decay, "lr": 1e-2, "weight_decay": 0.5},
              {"params": plain, "lr": 3e-3, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups[::-1] if swap else groups, eps=1e-6)


def _halving(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)


def _gpt_plan(w: Any, ranks: int) -> Any:
    return _plan(w.model, w.loss_fn, ranks, 1)


@pytest.mark.slow
def test_resharded_groups_keep_each_parameters_hyper_parameters(tmp_path: Any) -> None:
    """Saved on 2 ranks with two groups by name (own lr and weight decay, a schedule that
    changes the rates), resumed on 3: every parameter's group hyper-parameters and
    state, and after two more steps its value, equal one process that never stopped;
    an optimizer whose groups differ from the saved ones is refused, no rank changed."""
    w = build("gpt", batch_size=ROWS, seed=0, n_layers=2, d_model=32)
    model = copy.deepcopy(w.model)
    opt = _by_name(NamedParameters(model.named_parameters()))
    sched = _halving(opt)
    options: dict[str, Any] = {"optimizer": _by_name, "scheduler": _halving, "threads": 1}

    def both(pipe: orgel.Pipeline, c: int) -> None:
        tokens, targets = _batch(c)
        loss = pipe.step(tokens, targets)
        ref = w.loss_fn(model(tokens), targets)
        ref.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        assert loss == pytest.approx(ref.item(), rel=1e-5)

    with orgel.pipeline(copy.deepcopy(w.model), w.inputs, w.targets, w.loss_fn, ranks=2,
                        microbatches=M, plan=_gpt_plan(w, 2), **options) as pipe:
        for c in range(2):
            both(pipe, c)
        pipe.save(tmp_path)
    swapped = {**options, "optimizer": lambda params: _by_name(params, swap=True)}
    with pytest.raises(ckpt.CheckpointError, match=r"is in group 0 of the optimizer but was in "
                                                    r"group 1 when the checkpoint was saved"):
        orgel.load(tmp_path, copy.deepcopy(w.model), w.inputs, w.targets, w.loss_fn,
                   ranks=3, plan=_gpt_plan(w, 3), **swapped).close()
    with orgel.load(tmp_path, copy.deepcopy(w.model), w.inputs, w.targets, w.loss_fn,
                    ranks=3, plan=_gpt_plan(w, 3), **options) as resumed:
        assert resumed.lr == pytest.approx([g["lr"] for g in opt.param_groups], rel=1e-7)
        # each rank's groups and state, as a checkpoint of the resumed pipeline holds them
        folder = resumed.save(tmp_path / "again")
        want = ckpt.named_optimizer_state(opt, list(model.named_parameters()))
        group_of = ckpt.saved_group_of(want)
        seen = set()
        for r in range(3):
            got = ckpt.read_shard(folder, r)["optimizer"]
            for gi, group in enumerate(got["groups"]):
                for name in group["params"]:
                    hyper = want["groups"][group_of[name]]
                    assert {k: v for k, v in group.items() if k != "params"} == {
                        k: v for k, v in hyper.items() if k != "params"}, (r, gi, name)
                    for k, v in want["state"][name].items():
                        torch.testing.assert_close(got["state"][name][k], v)
                    seen.add(name)
        assert seen == set(group_of)
        for c in range(2, 4):
            both(resumed, c)
        state = resumed.state_dict()
    expected = model.state_dict()
    bad = {n: float((state[n] - t).abs().max()) for n, t in expected.items()
           if not torch.allclose(state[n], t, rtol=1e-5, atol=1e-5)}
    assert not bad, bad

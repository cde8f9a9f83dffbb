"""The training loop on the ranks: schedule, groups by name, clipping, accumulation, resume.

Each run goes through ``orgel.pipeline`` (or ``orgel.backend``) on forked gloo ranks and
is compared with one process doing the same with plain torch: AdamW over two groups
chosen by name (no weight decay on biases, norms and embeddings), a warm-up + cosine
LambdaLR, ``clip_grad_norm_`` at a norm that clips, and ``(loss / k).backward()`` per
call with ``opt.step(); sched.step(); opt.zero_grad()`` every k calls.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

import orgel
from orgel.graph import capture
from orgel.models import ZooWorkload, build
from orgel.plan.balanced import balanced_plan
from orgel.runtime import checkpoint as ckpt
from orgel.runtime.optimizer import NamedParameters
from orgel.workload import Workload, microbatches

ROWS, M, K = 8, 2, 2  # batch rows, micro-batches, step calls per optimizer step
MAX_NORM = 0.2  # below the GPT's gradient norms: every step clips (asserted)
WARMUP, TOTAL = 2, 8


def _groups(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
    """Weight decay on the matrices; none on biases, norms and embeddings."""
    decay, plain = [], []
    for name, p in named:
        (plain if p.dim() < 2 or "emb" in name or "ln" in name else decay).append(p)
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def _adamw(params: NamedParameters) -> torch.optim.Optimizer:
    return _adamw_over(params.named())


def _adamw_over(named: Iterable[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    # eps 1e-5, not 1e-8: the attention's key bias has a gradient of zero in exact
    # arithmetic (softmax ignores it); its float noise (~1e-10, different for another sum
    # order) would be divided by its own size and move the bias by ~lr either way. With
    # 1e-6, another machine's kernels (2026-12-04) left weights 1.4e-6 to 2e-6 apart
    return torch.optim.AdamW(_groups(named), lr=1e-2, eps=1e-5)


def _sgd(params: NamedParameters) -> torch.optim.Optimizer:
    return _sgd_over(params.named())


def _sgd_over(named: Iterable[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    # float16 gradients differ from one process in their last bits (sums of float16
    # values in another order): Adam would divide tiny ones by their own size
    return torch.optim.SGD(_groups(named), lr=0.1, momentum=0.9)


def _warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (TOTAL - WARMUP))))


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)


def _rate(step: int) -> float:
    """``lr=``: the rate itself for optimizer step ``step``."""
    return 1e-2 * _warmup_cosine(step)


def _gpt(name: str = "gpt") -> ZooWorkload:
    return build(name, batch_size=ROWS, seed=0, n_layers=2, d_model=32)


def _batch(call: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(200 + call)
    tokens = torch.randint(0, 128, (ROWS, 32), generator=g)
    return (tokens,), torch.roll(tokens, -1, dims=1)


def _plan(w: ZooWorkload, ranks: int, dp: int = 1, precision: str = "32") -> Any:
    """A balanced chain (no profiling): the plan is given, the rest is the production path."""
    rows = M * dp
    first, _ = microbatches(Workload(copy.deepcopy(w.model), w.inputs, w.targets, w.loss_fn),
                            rows)[0]
    graph = capture(copy.deepcopy(w.model), first, precision=precision)
    return balanced_plan(graph, ranks=ranks, microbatches=M, dp=dp)


class Reference:
    """One process: the same optimizer, schedule, clipping and accumulation in plain torch."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], *,
                 scale: float | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] = _adamw_over) -> None:
        self.model, self.loss_fn = model, loss_fn
        self.opt = optimizer(model.named_parameters())
        self.sched = _schedule(self.opt)  # lr=_rate gives the pipeline the same rates
        self.scaler = (None if scale is None
                       else torch.amp.GradScaler("cpu", init_scale=scale))
        self.calls, self.norms, self.lrs, self.scales = 0, [], [], []  # type: ignore[var-annotated]

    def call(self, inputs: tuple[torch.Tensor], targets: torch.Tensor) -> float:
        if self.scaler is None:
            loss = self.loss_fn(self.model(*inputs), targets)
            (loss / K).backward()
        else:  # float16 overflows by micro-batch: accumulate over them, as the ranks do
            loss = torch.zeros(())
            for tokens, part in zip(inputs[0].chunk(M), targets.chunk(M), strict=True):
                with torch.autocast("cpu", dtype=torch.float16):
                    part_loss = self.loss_fn(self.model(tokens), part) / M
                self.scaler.scale(part_loss / K).backward()
                loss = loss + part_loss.detach()
        self.calls += 1
        if self.calls % K == 0:
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                    MAX_NORM)))
            if self.scaler is None:
                self.opt.step()
            else:
                self.scaler.step(self.opt)
                self.scaler.update()
                self.scales.append(self.scaler.get_scale())
            self.sched.step()
            self.opt.zero_grad()
            self.lrs.append(self.sched.get_last_lr())
        return loss.item()


def _assert_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert list(state) == list(expected)
    bad = {name: float((state[name] - t).abs().max()) for name, t in expected.items()
           if not torch.allclose(state[name], t, rtol=1e-5, atol=1e-6)}
    assert not bad, bad


def _train(pipe: orgel.Pipeline, ref: Reference, calls: range) -> None:
    """Step both; compare every call's loss and, at each optimizer step, lr and norm."""
    for c in calls:
        loss = pipe.step(*_batch(c))
        assert loss == pytest.approx(ref.call(*_batch(c)), rel=1e-5), c
        assert pipe.steps == ref.calls // K
        if ref.calls % K == 0:
            assert pipe.lr == pytest.approx(ref.lrs[-1], rel=1e-6)
            assert pipe.grad_norm == pytest.approx(ref.norms[-1], rel=1e-5)


@pytest.mark.slow
def test_schedule_groups_clipping_and_accumulation_match_one_process() -> None:
    w = _gpt()
    ref = Reference(copy.deepcopy(w.model), w.loss_fn)
    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=M,
                        plan=_plan(w, 2), optimizer=_adamw, scheduler=_schedule,
                        max_grad_norm=MAX_NORM, accumulate=K, threads=1) as pipe:
        assert pipe.lr == pytest.approx([1e-2 * _warmup_cosine(0)] * 2)
        assert pipe.grad_norm is None  # no optimizer step yet
        _train(pipe, ref, range(8))
        assert pipe.steps == 4 and len(pipe.lr) == 2
        assert min(ref.norms) > MAX_NORM  # every step clipped
        _assert_state(pipe.state_dict(), ref.model)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dp"), [("tied", 1), ("gpt", 2)])
def test_accumulation_with_tied_parameters_and_replicas(name: str, dp: int) -> None:
    """Tied embeddings (copies on two ranks) and two data-parallel replicas: the sums of
    the k calls' gradients happen once, at the k-th. ``lr=`` sets the rate by step."""
    w = _gpt(name)
    ref = Reference(copy.deepcopy(w.model), w.loss_fn)
    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=M,
                        plan=_plan(w, 2, dp), optimizer=_adamw, lr=_rate,
                        max_grad_norm=MAX_NORM, accumulate=K, threads=1) as pipe:
        _train(pipe, ref, range(6))
        _assert_state(pipe.state_dict(), ref.model)


@pytest.mark.slow
def test_grad_norm_is_reported_without_clipping() -> None:
    """No max_grad_norm: nothing is clipped, and pipe.grad_norm is still the global norm."""
    w = _gpt()
    model = copy.deepcopy(w.model)
    opt = _adamw_over(model.named_parameters())
    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=M,
                        plan=_plan(w, 2), optimizer=_adamw, threads=1) as pipe:
        for c in range(2):
            pipe.step(*_batch(c))
            inputs, targets = _batch(c)
            w.loss_fn(model(*inputs), targets).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad()
            assert pipe.grad_norm == pytest.approx(float(norm), rel=1e-5)
        _assert_state(pipe.state_dict(), model)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_accumulation_under_loss_scaling_unscales_once_before_clipping() -> None:
    """float16 with GradScaler: the scale overflows on purpose, then recovers; each step
    unscales the k calls' gradients once, clips and steps (or skips) as GradScaler does."""
    w = _gpt()
    init = 2.0 ** 21  # with the loss divided by k: overflows at it, not at half of it
    ref = Reference(copy.deepcopy(w.model), w.loss_fn, scale=init, optimizer=_sgd_over)
    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=M,
                        plan=_plan(w, 2, precision="16-mixed"), optimizer=_sgd,
                        scheduler=_schedule, max_grad_norm=MAX_NORM, accumulate=K,
                        precision="16-mixed", loss_scale={"init_scale": init},
                        threads=1) as pipe:
        scales, skipped = [], []
        for c in range(6):
            loss = pipe.step(*_batch(c))
            assert loss == pytest.approx(ref.call(*_batch(c)), rel=1e-5), c
            if c % K == K - 1:
                assert pipe.loss_scale is not None
                scales.append(pipe.loss_scale["scale"])
                skipped.append(pipe.loss_scale["skipped"])
                assert pipe.lr == pytest.approx(ref.lrs[-1], rel=1e-6)
        assert scales == ref.scales
        assert skipped[0] and not skipped[-1], skipped
        _assert_state(pipe.state_dict(), ref.model)


@pytest.mark.slow
def test_resume_on_three_ranks_continues_the_schedule_and_groups(tmp_path: Path) -> None:
    """Saved at optimizer step 2 on 2 ranks, resumed with orgel.load on 3: the same rates
    (the scheduler's state and the groups' scheduled lr) and, after two more steps, the same
    parameters as one process that never stopped (AdamW's moments moved by name)."""
    w = _gpt()
    ref = Reference(copy.deepcopy(w.model), w.loss_fn)
    options: dict[str, Any] = {"optimizer": _adamw, "scheduler": _schedule,
                               "max_grad_norm": MAX_NORM, "accumulate": K, "threads": 1}
    with orgel.pipeline(copy.deepcopy(w.model), w.inputs, w.targets, w.loss_fn, ranks=2,
                        microbatches=M, plan=_plan(w, 2), **options) as pipe:
        _train(pipe, ref, range(5))
        with pytest.raises(ckpt.CheckpointError, match="middle of an accumulation"):
            pipe.save(tmp_path)
        _train(pipe, ref, range(5, 6))  # pipe.steps == 3
        pipe.save(tmp_path)
        saved_lr = pipe.lr
    resumed = orgel.load(tmp_path, copy.deepcopy(w.model), w.inputs, w.targets, w.loss_fn,
                         ranks=3, plan=_plan(w, 3), **options)
    with resumed:
        assert resumed.num_ranks == 3 and resumed.steps == 3
        assert resumed.lr == pytest.approx(saved_lr, rel=1e-7)
        _train(resumed, ref, range(6, 10))
        _assert_state(resumed.state_dict(), ref.model)


@pytest.mark.slow
def test_backend_schedule_clipping_and_accumulation_match_one_process() -> None:
    """orgel.backend: the closure's loss (divided by micro-batches, as the closure owns
    it) counts ``1/k`` per call; the optimizer, schedule and clipping as in one process."""
    torch._dynamo.reset()
    w = _gpt()
    ref_model = copy.deepcopy(w.model)
    ref_opt = _adamw_over(ref_model.named_parameters())
    ref_sched = _schedule(ref_opt)
    pipe = orgel.backend(ranks=2, microbatches=M, optimizer=_adamw, scheduler=_schedule,
                         max_grad_norm=MAX_NORM, accumulate=K, threads=1, schedule="1f1b")
    compiled = torch.compile(w.model, backend=pipe, dynamic=False)

    def closure_for(model: Any, divisor: int) -> Any:
        def closure(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = w.loss_fn(model(tokens), targets) / M
            (loss / divisor).backward()
            return loss.detach()
        return closure

    try:
        for c in range(4):
            (tokens,), targets = _batch(c)
            losses = pipe.step(closure_for(compiled, 1), tokens, targets)
            want = [closure_for(ref_model, K)(t, y)
                    for t, y in zip(tokens.chunk(M), targets.chunk(M), strict=True)]
            torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=1e-5,
                                       atol=1e-6)
            if c % K == K - 1:
                norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_NORM))
                ref_opt.step()
                ref_sched.step()
                ref_opt.zero_grad()
                assert norm > MAX_NORM
                assert pipe.grad_norm == pytest.approx(norm, rel=1e-5)
                assert pipe.lr == pytest.approx(ref_sched.get_last_lr(), rel=1e-6)
        assert pipe.steps == 2
        _assert_state(pipe.state_dict(), ref_model)
    finally:
        pipe.close()


def test_loop_options_are_refused_in_the_caller() -> None:
    w = _gpt()

    def start(**options: Any) -> None:
        orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, optimizer=_adamw, **options)

    with pytest.raises(ValueError, match="scheduler= or lr=, not both"):
        start(scheduler=_schedule, lr=_rate)
    with pytest.raises(ValueError, match="not a torch.optim.lr_scheduler.LRScheduler"):
        start(scheduler=lambda opt: opt)
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        start(scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau)
    # LBFGS's step needs a closure: it crashed each rank at the first step
    with pytest.raises(ValueError, match="LBFGS, whose step needs a closure"):
        orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, optimizer=torch.optim.LBFGS)
    # a factory that returns no optimizer failed inside a rank ("no attribute param_groups")
    with pytest.raises(ValueError, match="optimizer returned list, not an optimizer"):
        orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, optimizer=list)
    # an optimizer over the caller's model.parameters(), not the rank's: under torchrun the
    # stages are copies, and it trained nothing
    with pytest.raises(ValueError, match="over 29 tensors it was not given"):
        orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn,
                       optimizer=lambda params: torch.optim.SGD(w.model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="lr must be a function step -> learning rate"):
        start(lr=0.1)
    with pytest.raises(ValueError, match="accumulate must be a positive int"):
        start(accumulate=0)
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        start(max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="accumulate must be a positive int"):
        orgel.backend(accumulate=1.5)  # type: ignore[arg-type]


def test_the_planner_counts_an_optimizer_that_groups_by_name() -> None:
    from orgel.profile.memory import optimizer_factor

    assert optimizer_factor(_adamw) == pytest.approx(4.0)
    params = NamedParameters([("a.weight", torch.nn.Parameter(torch.ones(2, 2))),
                              ("a.bias", torch.nn.Parameter(torch.ones(2)))])
    assert params.names == ["a.weight", "a.bias"] and len(params) == 2
    assert [n for n, _ in params.named()] == params.names
    assert [len(g["params"]) for g in _groups(params.named())] == [1, 1]


@pytest.mark.slow
def test_ranks_with_different_group_structures_are_refused() -> None:
    """A factory that leaves out a group a rank holds nothing of (the embeddings, on the
    last stage's rank) would shift the groups' indices: refused, naming the counts."""
    w = _gpt()

    def drops_empty(params: NamedParameters) -> torch.optim.Optimizer:
        emb = [p for n, p in params.named() if "emb" in n]
        rest = [p for n, p in params.named() if "emb" not in n]
        return torch.optim.SGD([g for g in ({"params": emb}, {"params": rest}) if g["params"]],
                               lr=0.1)

    with pytest.raises(ValueError, match=r"different number of parameter groups.*\{0: 2, 1: 1\}"):
        orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=M,
                       plan=_plan(w, 2), optimizer=drops_empty, threads=1)


class _NanGradient(torch.nn.Module):
    """A finite loss whose gradient is NaN in one parameter: ``sqrt`` at 0 has an infinite
    slope, and the zero that multiplies it makes the gradient NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 4)
        self.odd = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.second(h) + 0.0 * torch.sqrt(self.odd - self.odd)


@pytest.mark.slow
def test_clipping_with_a_nan_gradient_norm_matches_one_process() -> None:
    """With a NaN in the gradient the global norm is NaN, and ``clip_grad_norm_`` scales
    every gradient by NaN: the step leaves every weight NaN in one process. orgel clipped
    nothing there (``min(1.0, nan)`` is 1.0), so its other weights trained on, unclipped,
    to values one process never has."""
    torch.manual_seed(0)
    model = _NanGradient()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with orgel.pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=2, microbatches=2,
                        optimizer=_sgd, max_grad_norm=1.0, threads=1) as pipe:
        pipe.step((x,), y)
        assert math.isnan(pipe.grad_norm)
        state = pipe.state_dict()
    opt = _sgd_over(ref.named_parameters())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    assert all(v.isnan().all() for v in ref.state_dict().values())  # what one process does
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, equal_nan=True, msg=name)


@pytest.mark.slow
def test_a_parameter_unfrozen_after_the_build_is_refused_at_the_next_step() -> None:
    """A fine-tuning recipe that unfreezes a layer after N steps: one process trains it from
    then on, the ranks would not (they train what the pipeline was built with). The step is
    refused in the caller, saying what to do; frozen again, training goes on exactly. The
    same for a model switched to eval mode."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model[0].weight.requires_grad_(False)
    one = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    opt = sgd([p for p in one.parameters() if p.requires_grad])
    loss_fn = torch.nn.functional.cross_entropy
    with orgel.pipeline(model, (x,), y, loss_fn, ranks=2, microbatches=2, schedule="1f1b",
                        optimizer=sgd, threads=1) as pipe:
        pipe.step((x,), y)
        model[0].weight.requires_grad_(True)
        with pytest.raises(ValueError, match=r"\['0.weight'\] were frozen or unfrozen.*"
                                             r"pipe.copy_to\(model\)"):
            pipe.step((x,), y)
        model[0].weight.requires_grad_(False)
        # a model left in eval mode (after the user's own evaluation): one process would
        # train in eval mode, the ranks in the mode they were built in
        model.eval()
        with pytest.raises(ValueError, match=r"\['Sequential', '0', '1', '2'\] were "
                                             r"switched between training and eval mode.*"
                                             r"built in training mode"):
            pipe.step((x,), y)
        pipe.evaluate((x,), y)  # evaluates in eval mode whatever the model's
        model.train()
        pipe.step((x,), y)
        state = pipe.state_dict()
    for _ in range(2):
        loss_fn(one(x), y).backward()
        opt.step()
        opt.zero_grad()
    for name, value in one.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_model_built_in_eval_mode_is_warned_and_told_to_switch_before_the_build() -> None:
    """Hugging Face's ``from_pretrained`` returns a model in eval mode, and a loop calls
    ``model.train()`` after building the pipeline: the build warns that the model trains as
    it is (in eval mode, as one process would), and the step after ``model.train()`` is
    refused saying to call it before the build."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5),
                                torch.nn.Linear(32, 4)).eval()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss_fn = torch.nn.functional.cross_entropy
    with pytest.warns(UserWarning, match="the model is in eval mode"):
        pipe = orgel.pipeline(model, (x,), y, loss_fn, ranks=2, microbatches=2,
                              schedule="1f1b", threads=1)
    with pipe:
        model.train()
        with pytest.raises(ValueError, match=r"call model.train\(\) before building the "
                                             r"pipeline.*built from a model in eval mode"):
            pipe.step((x,), y)

"""Compiled stages (:mod:`orgel.runtime.compiled`): Inductor's forward, backward and the
backward's input and weight halves give the eager stage's gradients, in one process and
through ``orgel run --compile --check`` on local ranks against one process.

Inductor compiles slowly on a small CPU, so the models are tiny and each test compiles a
handful of graphs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from orgel.cli import main
from orgel.graph.capture import capture
from orgel.graph.measure import place
from orgel.plan.balanced import balanced_plan
from orgel.runtime.compiled import CompiledStage, partition_backward, split_backward
from orgel.split import split_plan

#: Inductor starts the C++ compiler: every test here starts processes
pytestmark = pytest.mark.slow

GPT = "examples/gpt.py:workload"
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")])]


def _gpt_stage(device: str, layers: int = 2) -> tuple[Any, list[object]]:
    """A tiny GPT captured and split as one stage (the runtime's own ``StageModule``, its
    module on ``device``), and its arguments for a batch of 4 sequences."""
    from orgel.models.gpt import GPT as Model
    from orgel.models.gpt import GPTConfig

    torch.manual_seed(0)
    model = Model(GPTConfig(vocab_size=64, d_model=32, n_layers=layers, n_heads=4, seq_len=16))
    tokens = torch.randint(0, 64, (4, 16))
    graph = capture(model, {"tokens": tokens})
    split = split_plan(graph, balanced_plan(graph, ranks=1, microbatches=1))
    stage = split.stages[0]
    place(stage.module, torch.device(device))
    named = split.with_sizes({"tokens": tokens.to(device)})
    return stage, [named[n] for n in stage.inputs]


def _stage(device: str) -> tuple[torch.nn.Module, list[object], torch.Tensor]:
    """The tiny GPT's one stage module, its arguments, and targets."""
    stage, args = _gpt_stage(device)
    return stage.module, args, torch.randint(0, 64, (4, 16), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_stage_trains_as_the_eager_one(device: str) -> None:
    """Three SGD steps, each stage's gradients after a full backward (``B``) and after the
    split one (``I`` now, ``W`` later), against the same steps in eager mode."""
    eager, args, targets = _stage(device)
    compiled_module = copy.deepcopy(eager)
    compiled = CompiledStage(compiled_module)

    def loss_of(out: object) -> torch.Tensor:
        logits = out[0] if isinstance(out, (tuple, list)) else out
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    for step, split in enumerate([False, True, False]):
        loss_e = loss_of(eager(*args))
        loss_e.backward()
        loss_c = loss_of(compiled(*args))
        if split:  # I now (no input takes a gradient here), W after
            with split_backward() as pending:
                loss_c.backward()
            assert all(q.grad is None for q in compiled_module.parameters())
            for work in pending:
                work()
        else:
            loss_c.backward()
        assert abs(loss_e.item() - loss_c.item()) < 1e-4, step
        for (name, p), q in zip(eager.named_parameters(), compiled_module.parameters(),
                                strict=True):
            assert q.grad is not None, name
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
        with torch.no_grad():
            for p, q in zip(eager.parameters(), compiled_module.parameters(), strict=True):
                p -= 0.5 * p.grad
                q -= 0.5 * q.grad
                p.grad = q.grad = None
    assert compiled.compile_s > 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_input_and_weight_halves_add_up_to_the_backward(device: str) -> None:
    """A stage whose input takes a gradient: ``I`` returns it with no parameter gradient,
    the ``W`` closures it leaves add the parameters' gradients, equal to a full backward's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                              torch.nn.Linear(16, 8)).to(device)
    gm = torch.fx.symbolic_trace(net)
    compiled = CompiledStage(copy.deepcopy(gm))
    x = torch.randn(4, 8, device=device, requires_grad=True)
    grad = torch.randn(4, 8, device=device)
    gm(x).backward(grad)
    xc = x.detach().clone().requires_grad_()
    out = compiled(xc)
    with split_backward() as pending:
        (dx,) = torch.autograd.grad(out, [xc], grad)
    torch.testing.assert_close(dx, x.grad)
    assert all(p.grad is None for p in compiled.module.parameters())
    assert len(pending) == 1
    pending[0]()
    for p, q in zip(gm.parameters(), compiled.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


def test_the_halves_of_a_convolution_whose_input_takes_a_gradient() -> None:
    """A convolution's backward is one operation giving the input's gradient (for ``I``)
    and the weight's (for ``W``): ``I`` hands ``W`` the weight's part, not the operation's
    tuple, which Inductor cannot return from a graph (found by ``benchmarks/fuzz.py
    --compile``: a U-Net's second stage under ZB-H1 stopped at its first step)."""
    torch.manual_seed(0)
    net = torch.fx.symbolic_trace(torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3)))
    compiled = CompiledStage(copy.deepcopy(net))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    grad = torch.randn(2, 2, 6, 6)
    net(x).backward(grad)
    xc = x.detach().clone().requires_grad_()
    with split_backward() as pending:
        (dx,) = torch.autograd.grad(compiled(xc), [xc], grad)
    torch.testing.assert_close(dx, x.grad)
    for work in pending:
        work()
    for p, q in zip(net.parameters(), compiled.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


def test_the_weight_half_holds_only_what_the_input_half_does_not() -> None:
    """The backward graph's nodes go to ``I`` or ``W``, none to both (nothing computed twice),
    and ``W`` reads the frontier ``I`` hands it, no placeholder of the backward."""
    from torch._functorch.aot_autograd import aot_function

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _example: object) -> object:
        graphs.append(gm)
        return gm

    w = torch.randn(6, 6, requires_grad=True)
    fn = aot_function(lambda w, x: (torch.tanh(x @ w) @ w).sum(), fw_compiler=lambda g, _: g,
                      bw_compiler=keep)
    fn(w, torch.randn(3, 6, requires_grad=True)).backward()
    i_gm, w_gm, count = partition_backward(graphs[0], 1)
    assert count == 1
    compute = {n.target for g in (i_gm, w_gm) for n in g.graph.nodes
               if n.op == "call_function"}
    assert compute
    i_nodes = [n.name for n in i_gm.graph.nodes if n.op == "call_function"]
    w_nodes = [n.name for n in w_gm.graph.nodes if n.op == "call_function"]
    assert not set(i_nodes) & set(w_nodes)
    assert all(n.name.startswith("frontier_") for n in w_gm.graph.nodes
               if n.op == "placeholder")


@pytest.mark.parametrize("schedule,extra", [("dualpipev", []),
                                            ("1f1b", ["--dp", "2", "--recompute"]),
                                            ("zb-h1", ["--recompute", "layer"])])
def test_compiled_stages_train_as_one_process(schedule: str, extra: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`orgel run --compile --check` on 2 local ranks: the split backward's halves
    (DualPipeV's I and W; ZB-H1 runs the same halves, tests/test_cuda.py), data parallelism
    and recompute (each stage whole; each layer, tagged for the partitioner, under ZB-H1's
    halves), against one eager process."""
    code = main(["run", GPT, "--ranks", "2", "--schedule", schedule, "--microbatches", "4",
                 "--steps", "2", "--compile", "--check", "--optimizer", "adamw",
                 "--lr", "1e-3", "--max-grad-norm", "0.5", "--device", "cpu",
                 "--timeout", "300", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "-> OK" in out and "compiling the stages took" in out


def _stack_training(compile: bool, schedule: str, **parallel: Any
                    ) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """A small MLP stack on 4 processes (``parallel``: tp or dp and shard), two AdamW steps;
    the compile seconds."""
    import orgel
    from test_checkpointing import Stack

    torch.manual_seed(0)
    model = Stack(layers=2, width=16)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    with orgel.pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=4,
                        microbatches=2, schedule=schedule, compile=compile, timeout_s=600,
                        optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), **parallel) as pipe:
        if parallel.get("tp", 1) > 1:
            assert any(pipe.call_ranks("tp_shards"))  # the MLPs are split over the members
        if "shard" in parallel:
            assert set(pipe.plan.shard) == {parallel["shard"]}
        losses = [pipe.step((x,), y) for _ in range(2)]
        return losses, pipe.state_dict(), sum(pipe.compile_s or [0.0])


@pytest.mark.parametrize("schedule,parallel", [
    ("1f1b", {"tp": 2}), ("zb-h1", {"tp": 2, "sequence_parallel": True}),
    ("zb-h1", {"dp": 2, "shard": "fsdp"})],
    ids=["tp-1f1b", "tp-sp-zb-h1", "fsdp-zb-h1"])
def test_compiled_stages_with_tp_or_fsdp_train_as_the_eager_ones(
        schedule: str, parallel: dict[str, Any]) -> None:
    """A DTensor weight enters the compiled graphs as its local part (the collectives stay
    in them): 1F1B's whole backward, and ZB-H1's input and weight halves, whose weight
    half adds each weight's gradient as a DTensor again. An FSDP-sharded stage is gathered
    before its compiled forward (FSDP2's hook would, eagerly), and the step's reduce-scatter
    takes the whole weights' gradients as it does from the eager stage. With sequence
    parallelism the ops between the regions run on DTensor slices inside the graphs."""
    losses, state, seconds = _stack_training(True, schedule, **parallel)
    want_losses, want, _ = _stack_training(False, schedule, **parallel)
    assert seconds > 0
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for name, t in want.items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


def _broken_gpt_training(compile: bool, schedule: str, precision: str = "32"
                         ) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """A GPT with a graph break after its first block (the Python between the graphs runs
    in the controller) on 2 ranks, two AdamW steps; the compile seconds."""
    import orgel
    from orgel.models import build

    model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                            d_model=32, seq_len=8, vocab_size=64)
    model.encoder.blocks[0].register_forward_hook(
        lambda m, a, out: (torch._dynamo.graph_break(), out)[1])
    with orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2,
                        schedule=schedule, compile=compile, timeout_s=600, precision=precision,
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)) as pipe:
        losses = [pipe.step(inputs, targets) for _ in range(2)]
        return losses, pipe.state_dict(), sum(pipe.compile_s or [0.0])


def test_compiled_stages_with_graph_breaks_train_as_the_eager_ones() -> None:
    """A stage that holds an exchange with the controller runs cut at it: the pieces
    compiled, the exchange eager between them (orgel.runtime.compiled.SegmentedStage).
    Under ZB-H1 each piece's weight half runs at W: a piece that reads only the
    controller's values and weights lies on no path from the stage's outputs to its inputs,
    and without a leaf of its own the input half left its weights without gradients."""
    losses, state, seconds = _broken_gpt_training(True, "zb-h1")
    want_losses, want, _ = _broken_gpt_training(False, "zb-h1")
    assert seconds > 0
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for name, t in want.items():
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-5, msg=name)


def _lengths_training(compile: bool) -> tuple[list[float], dict[str, torch.Tensor],
                                              list[list[float]]]:
    """A tiny GPT on 2 ranks under ZB-H1, one AdamW step on each of three sequence lengths;
    each rank's compile seconds after every step."""
    import orgel
    from orgel.models import build

    model, (tokens,), targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                               d_model=32, seq_len=12, vocab_size=64)
    with orgel.pipeline(model, (tokens,), targets, loss_fn, ranks=2, microbatches=2,
                        schedule="zb-h1", compile=compile, timeout_s=600,
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3)) as pipe:
        losses, seconds = [], []
        for length in (12, 8, 5):
            losses.append(pipe.step((tokens[:, :length],), targets[:, :length]))
            seconds.append(list(pipe.compile_s or []))
        return losses, pipe.state_dict(), seconds


def test_compiled_stages_compile_once_more_for_any_new_sequence_length() -> None:
    """The first length compiles static graphs; the second compiles graphs symbolic in
    the length (forward, backward and its input and weight halves); the third runs those
    and compiles nothing. Every step trains as the eager pipeline does."""
    losses, state, seconds = _lengths_training(True)
    want_losses, want, _ = _lengths_training(False)
    first, second, third = seconds
    assert all(b > a > 0 for a, b in zip(first, second, strict=True)), seconds
    assert third == second, seconds
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for name, t in want.items():
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=1e-5, msg=name)


def test_a_graph_inductor_cannot_compile_symbolically_compiles_for_each_size() -> None:
    """A graph whose output needs a symbol that only a product of sizes carries (rows
    ``4*s`` viewed as ``4 x s``): Inductor refuses it symbolically ("expected [s] to have
    been codegen-ed", as it refused a Qwen2 stage's input half with a graph break), so it
    is compiled statically for each call's sizes, once each."""
    from contextlib import contextmanager

    from torch._dynamo.source import ConstantSource
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from orgel.runtime.compiled_shapes import Graph

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    rows = env.create_symintnode(env.create_symbol(10, ConstantSource("rows")), hint=10)
    with mode:
        fake = torch.empty(4 * rows, 8)
    compiles = []

    @contextmanager
    def counting() -> Any:
        compiles.append(1)
        yield

    with tracing(TracingContext(mode)):
        gm = make_fx(lambda x: (x.view(4, -1, 8) * 2,))(fake)
        graph = Graph(gm, [fake], counting)
    for n, want in [(10, 2), (6, 3), (6, 3), (10, 3)]:  # 2: the refused symbolic try
        x = torch.randn(4 * n, 8)
        (out,) = graph([x])
        torch.testing.assert_close(out, x.view(4, n, 8) * 2)
        assert len(compiles) == want, n


def test_compiled_stages_with_graph_breaks_under_autocast() -> None:
    """Under bf16-mixed the graphs of a forward with graph breaks run inside one autocast
    region; its entry and exit run eagerly between the compiled pieces (a piece returned
    the region's context object, which AOTAutograd refuses: every step failed). Inductor
    keeps float32 between the operations it fuses, so the run is near the eager one, not
    bit-identical to it."""
    losses, state, seconds = _broken_gpt_training(True, "1f1b", "bf16-mixed")
    want_losses, want, _ = _broken_gpt_training(False, "1f1b", "bf16-mixed")
    assert seconds > 0
    assert losses == pytest.approx(want_losses, abs=2e-2)
    for name, t in want.items():
        torch.testing.assert_close(state[name], t, rtol=0, atol=5e-3, msg=name)


def test_layer_and_selective_recompute_keep_less_in_a_compiled_stage() -> None:
    """The partitioner's tags: a compiled forward keeps fewer bytes for its backward under
    ``"layer"`` and ``"selective"`` than without recompute, and the gradients are the
    eager stage's (the recompute runs the same ops again)."""
    stage, args = _gpt_stage("cpu", layers=3)
    eager = stage.module
    eager(*args)[0].float().pow(2).mean().backward()
    want = {n: p.grad.clone() for n, p in eager.named_parameters()}
    saved = {}
    for policy in (False, "layer", "selective"):
        module = copy.deepcopy(eager)
        module.zero_grad(set_to_none=True)
        compiled = CompiledStage(module, policy, stage.layers)
        assert (compiled.tags is None) == (policy is False)
        compiled(*args)[0].float().pow(2).mean().backward()
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-3, atol=1e-5, msg=name)
        saved[policy] = compiled.saved_bytes[0]
    assert saved["layer"] < saved[False] and saved["selective"] < saved[False], saved


def _backend_training(compile: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    import orgel
    from test_checkpointing import Stack

    torch.manual_seed(0)
    model = Stack(layers=2, width=16)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    pipe = orgel.backend(ranks=2, microbatches=2, schedule="1f1b", compile=compile,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1), timeout_s=600)
    compiled = torch.compile(model, backend=pipe)

    def closure(xs: torch.Tensor, ys: torch.Tensor) -> float:
        loss = torch.nn.functional.mse_loss(compiled(xs), ys) / 2
        loss.backward()
        return float(loss)

    with pipe:
        losses = [sum(pipe.step(closure, x, y)) for _ in range(2)]
        if compile:
            assert sum(pipe.pipe.compile_s) > 0
        return losses, pipe.state_dict()


def test_orgel_backend_compiles_the_stages_too() -> None:
    """``orgel.backend(compile=True)``: the stages of the graph Dynamo handed it run through
    Inductor on the ranks, and train as the eager ones."""
    losses, state = _backend_training(True)
    want_losses, want = _backend_training(False)
    assert losses == pytest.approx(want_losses, rel=1e-6)
    for name, t in want.items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_a_stage_with_max_pooling_compiles_in_a_fresh_process() -> None:
    """Inductor's decomposition of ``max_pool2d`` calls into ``torch._inductor.lowering``,
    which only compiling imports: a rank whose first compiled op was a max-pool failed with
    "module 'torch._inductor' has no attribute 'lowering'" (a U-Net's first stage)."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from orgel.runtime.compiled import CompiledStage\n"
            "net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.MaxPool2d(2))\n"
            "x = torch.randn(2, 3, 8, 8)\n"
            "torch.testing.assert_close(CompiledStage(net)(x), net(x))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


class _Tokens(torch.nn.Module):
    """A class token and a position embedding, as a ViT adds them."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 4))
        self.pos = torch.nn.Parameter(torch.randn(1, 3, 4))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.lin(x)


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
def test_gradients_the_compiled_backward_returns_as_views_accumulate_apart(split: bool) -> None:
    """On one-row micro-batches Inductor returns the class token's gradient as a view of
    the position embedding's: accumulated over two micro-batches, each must be what eager
    autograd gives (the second micro-batch was added to both through the shared storage,
    and a ViT trained on 4 one-row micro-batches drifted 5e-2 from one process)."""
    torch.manual_seed(0)
    eager = torch.fx.symbolic_trace(_Tokens())
    stage = CompiledStage(copy.deepcopy(eager))
    for _ in range(2):
        x = torch.randn(1, 2, 4)
        eager(x).pow(2).sum().backward()
        loss = stage(x).pow(2).sum()
        if split:
            with split_backward() as pending:
                loss.backward()
            for work in pending:
                work()
        else:
            loss.backward()
    for (name, p), q in zip(eager.named_parameters(), stage.module.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_a_compiled_stage_reads_weights_replaced_after_its_first_call() -> None:
    """The stage finds where each weight lives once but reads the tensor there at every
    call: a weight replaced by another object (a state dict loaded with ``assign=True``,
    FSDP2's whole weights) is the one the next call computes with."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    stage = CompiledStage(module)
    x = torch.randn(2, 4)
    torch.testing.assert_close(stage(x), module(x))
    fresh = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    module.load_state_dict(fresh, assign=True)
    out = stage(x)
    torch.testing.assert_close(out, module(x))
    out.sum().backward()
    assert module[0].weight.grad is not None  # the new object's gradient


def test_a_compiled_stage_keeps_no_micro_batchs_inputs_alive() -> None:
    """The function AOTAutograd traces is kept with the compiled graphs; it must not hold
    the first call's arguments (a micro-batch's activations, for the stage's lifetime)."""
    import gc
    import weakref

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    stage = CompiledStage(module)
    x = torch.randn(4, 8, requires_grad=True)
    first = weakref.ref(x)
    stage(x).sum().backward()
    del x
    gc.collect()
    assert first() is None

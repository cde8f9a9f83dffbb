"""A forward Dynamo captures as several graphs trains through ``orgel.pipeline`` exactly.

Each model here has graph breaks; ``archzoo.check.orgel_check`` runs it through
the production path (capture joins the graphs, plan, split, spawn, one step
with the Python between graphs in the controller) and compares every tensor
with gradient accumulation in one process.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import orgel
from archzoo.check import orgel_check
from orgel.graph import CaptureError, GraphBreakError, capture, glue
from orgel.models import ZooWorkload
from orgel.plan.balanced import balanced_plan
from orgel.plan.transforms import split_backward, with_recompute


class BranchEveryMicrobatch(nn.Module):
    """Parameters before and after a branch on the data; each micro-batch may take either."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._branch(torch.tanh(self.a(x)))
        return self.c(self._scaled(F.gelu(self.b(h))))

    def _branch(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # a graph break; each branch reads no parameter
            return h * 2
        return h - 1

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h / (1.0 + float(h.abs().mean().item()))  # another break, a Python float


class SideOutput(nn.Module):
    """Graph 0's output also reaches the loss directly, past the later graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        self.seen += 1
        print_value = h.detach().norm().item()  # a graph break
        assert print_value >= 0
        return self.b(torch.relu(h)), h


def _side_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    logits, h = out
    return F.cross_entropy(logits, y) + 0.1 * h.pow(2).mean()


class ParamBranch(nn.Module):
    """The branch taken reads different parameters: micro-batches must agree on it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.up = nn.Linear(4, 4)
        self.down = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h[0, 0] > 0:
            return self.up(h)
        return self.down(h)


@torch._dynamo.disable
def _eagerly(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer(h)


class EagerParts(nn.Module):
    """Layers Dynamo runs outside every graph: a tied embedding (the head, in a graph, reads
    the same weight) and a LayerNorm no graph reads. The controller trains them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(_eagerly(self.emb, ids)))
        h = self.b(_eagerly(self.norm, h))
        return self.head(torch.relu(h))


def _eager_parts() -> ZooWorkload:
    torch.manual_seed(3)
    ids = torch.randint(0, 16, (8, 5))
    return ZooWorkload(EagerParts(), (ids,), torch.randint(0, 16, (8, 5)),
                       lambda out, y: F.cross_entropy(out.flatten(0, 1), y.reshape(-1)))


def _branching() -> ZooWorkload:
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    x[4:] = -x[4:].abs() - 3.0  # the second micro-batch takes the other branch
    x[:4] = x[:4].abs() + 3.0
    return ZooWorkload(BranchEveryMicrobatch(), (x,), torch.randint(0, 4, (8,)),
                       F.cross_entropy)


def _side() -> ZooWorkload:
    torch.manual_seed(1)
    return ZooWorkload(SideOutput(), (torch.randn(6, 8),), torch.randint(0, 4, (6,)), _side_loss)


def test_capture_joins_the_graphs_with_exchanges() -> None:
    w = _branching()
    with pytest.raises(GraphBreakError, match="h.sum"):
        capture(w.model, (w.inputs[0][:4],), several=False)
    graph = capture(w.model, (w.inputs[0][:4],))
    assert graph.glue is not None
    # three graphs read parameters (a; b; c); the branches and the float math are glue
    assert len(graph.glue.calls) == 3
    exchanges = [n for n in graph.graph_module.graph.nodes if n.target is glue.exchange]
    assert [n.args[1] for n in exchanges] == [1, 2]
    assert any("several graphs" in note or "3 graphs" in note for note in graph.notes)
    assert {"a.weight", "b.weight", "c.weight"} <= set(graph.params)


@pytest.mark.slow
def test_branches_that_differ_per_microbatch_train_exactly() -> None:
    outcome = orgel_check("branching", _branching)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


class IfAtTheEnd(nn.Module):
    """One graph reads the parameters; a Python ``if`` on its output ends the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        if out.sum() > 0:
            out = out * 2
        return out


def _if_at_the_end() -> ZooWorkload:
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    x[4:] = -x[4:]  # the micro-batches may take different branches
    return ZooWorkload(IfAtTheEnd(), (x,), torch.randint(0, 4, (8,)), F.cross_entropy)


@pytest.mark.slow
def test_a_python_if_at_the_end_of_forward_trains_exactly() -> None:
    """The forward is one graph and the Python after it (it raised "nothing to join")."""
    outcome = orgel_check("if at the end", _if_at_the_end)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.slow
def test_recomputed_stages_with_exchanges_train_exactly() -> None:
    def plan_for(w: ZooWorkload) -> object:
        graph = capture(copy.deepcopy(w.model), (w.inputs[0][:2],))
        plan = balanced_plan(graph, ranks=3, microbatches=4)
        return with_recompute(plan, [True] * plan.num_stages)

    outcome = orgel_check("branching", _branching, ranks=3, m=4, plan_for=plan_for)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


class TableFirst(nn.Module):
    """Graph 0 makes a table from the input's sizes alone (as rotary embeddings do): below
    its exchange lies no parameter and no input of the stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.arange(x.shape[-1], dtype=x.dtype).sin()
        torch._dynamo.graph_break()
        return self.b(torch.tanh(self.a(x) + table))


def _table_first() -> ZooWorkload:
    torch.manual_seed(2)
    return ZooWorkload(TableFirst(), (torch.randn(8, 8),), torch.randint(0, 4, (8,)),
                       F.cross_entropy)


@pytest.mark.slow
def test_an_exchange_below_no_input_or_parameter_runs_in_a_split_backward() -> None:
    """Zero bubble's ``I`` walks only towards a stage's inputs and ``W`` towards its
    parameters: the exchange after graph 0 lay on neither path, so its backward never ran,
    and the controller and the ranks waited for each other until the timeout."""
    def plan_for(w: ZooWorkload) -> object:
        graph = capture(copy.deepcopy(w.model), (w.inputs[0][:4],))
        return split_backward(balanced_plan(graph, ranks=2, microbatches=2))

    outcome = orgel_check("table first", _table_first, plan_for=plan_for, timeout_s=60.0)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


class TwoBreaks(nn.Module):
    """A table graph, then two graphs of layers: exchanges on more than one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.arange(x.shape[-1], dtype=x.dtype).sin()
        torch._dynamo.graph_break()
        h = self._part(x, table, 0)
        torch._dynamo.graph_break()
        return self.head(self._part(h, table, 3))

    def _part(self, h: torch.Tensor, table: torch.Tensor, start: int) -> torch.Tensor:
        for layer in self.layers[start:start + 3]:
            h = torch.tanh(layer(h) + table)
        return h


@pytest.mark.slow
def test_a_looped_zero_bubble_schedule_with_exchanges_trains_exactly() -> None:
    """Two stages per rank, split backward: each rank's ``I`` passes find their exchanges."""
    def build() -> ZooWorkload:
        torch.manual_seed(2)
        return ZooWorkload(TwoBreaks(), (torch.randn(8, 8),), torch.randint(0, 4, (8,)),
                           F.cross_entropy)

    def plan_for(w: ZooWorkload) -> object:
        graph = capture(copy.deepcopy(w.model), (w.inputs[0][:4],))
        return split_backward(balanced_plan(graph, ranks=2, microbatches=2,
                                            schedule="looped-bfs", stages_per_rank=2))

    outcome = orgel_check("two breaks", build, plan_for=plan_for, timeout_s=60.0)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.slow
def test_an_earlier_graphs_output_in_the_loss_and_a_buffer_train_exactly() -> None:
    outcome = orgel_check("side_output", _side)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


def test_capture_lists_the_parameters_trained_outside_every_graph() -> None:
    w = _eager_parts()
    graph = capture(w.model, (w.inputs[0][:2],))
    assert graph.glue is not None
    assert sorted(graph.glue.eager) == ["emb.weight", "norm.bias", "norm.weight"]
    assert all(p.grad is None for p in w.model.parameters())  # the check's backward is undone


@pytest.mark.slow
def test_parameters_trained_outside_every_graph_train_exactly() -> None:
    # emb.weight is also the head's (a stage holds it: the controller's gradient is added
    # there); norm.* are in no stage (rank 0 keeps and steps them)
    outcome = orgel_check("eager_parts", _eager_parts)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace
    outcome = orgel_check("eager_parts", _eager_parts, ranks=3, m=4)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.slow
def test_parameters_trained_outside_every_graph_train_exactly_on_fsdp_replicas() -> None:
    """Two FSDP-sharded stages, two replicas each: every replica of the stage that holds
    emb.weight adds its shard of the controller's gradient and sends its shard of the new
    value back (the home replica alone took the whole gradient, and the controller crashed
    copying its shard in)."""
    outcome = orgel_check("eager_parts", _eager_parts, ranks=4, dp=2, shard="fsdp")
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


@pytest.mark.slow
def test_parameters_trained_outside_every_graph_resume_from_a_checkpoint(tmp_path) -> None:
    w = _eager_parts()
    opt = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731 - state to save
    kw = {"ranks": 2, "microbatches": 2, "optimizer": opt, "timeout_s": 60.0}
    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, **kw) as pipe:
        pipe.step(w.inputs, w.targets)
        pipe.save(tmp_path)
        second = pipe.step(w.inputs, w.targets)
        state = pipe.state_dict()
    # the caller's model was never trained: its norm is still the initial one
    assert torch.equal(w.model.norm.weight, torch.ones(8))
    with orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, **kw) as pipe:
        assert pipe.load(tmp_path) == 1
        assert pipe.step(w.inputs, w.targets) == second
        resumed = pipe.state_dict()
    assert resumed.keys() == state.keys()
    for key in state:
        assert torch.equal(resumed[key], state[key]), key


class Inner(nn.Module):
    """A layer of the model's own code (Dynamo compiles its frame, unlike torch.nn's)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w


class ThroughFunction(torch.autograd.Function):
    """A custom Function whose forward breaks the graph and runs a layer (with grad off)."""

    @staticmethod
    def forward(ctx: object, h: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        if h.sum() > 0:  # a graph break: the layer's graph runs inside Function.forward
            h = h * 2
        return layer(h)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class GradOffGraph(nn.Module):
    """Capture fails half-way (under vmap, then a graph run with gradients off)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.vmap(torch.tanh)(self.a(x))
        return ThroughFunction.apply(h, self.inner) + h


def test_a_graph_run_with_gradients_off_is_refused() -> None:
    with pytest.raises(CaptureError, match="runs with gradients off"):
        capture(GradOffGraph(), (torch.randn(2, 8),))


class Routed(nn.Module):
    """Only the rows the data chooses go on (selected between graphs, as a MoE's loop over
    the tokens each expert got): the second graph's shapes differ per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = _rows_chosen(self.a(x), x[:, 0] > 0)
        return self.b(chosen).sum(0, keepdim=True).expand(x.shape[0], 4)


@torch._dynamo.disable
def _rows_chosen(h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return h[keep]


def _routed() -> ZooWorkload:
    torch.manual_seed(4)
    x = torch.randn(4, 4)
    x[:, 0] = torch.tensor([1.0, 1.0, 1.0, -1.0])  # micro-batch 0 keeps 2 rows, 1 keeps 1
    return ZooWorkload(Routed(), (x,), torch.randn(4, 4), F.mse_loss)


@pytest.mark.slow
def test_shapes_that_depend_on_the_data_train_exactly() -> None:
    # micro-batch 1's second graph gets [1, 4] where the capture had [2, 4]: it runs in the
    # controller (orgel.explicit.fallback)
    outcome = orgel_check("routed", _routed)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


def _param_branch() -> ZooWorkload:
    torch.manual_seed(2)
    x = torch.randn(4, 4)
    model = ParamBranch()
    with torch.no_grad():
        first = model.a(x)[0, 0]
    x[2:] = x[:2]
    x[2, :] = -x[2, :]  # flips the sign of h[0, 0] on the second micro-batch
    with torch.no_grad():
        assert (model.a(x[2:])[0, 0] > 0) != (first > 0)
    return ZooWorkload(model, (x,), torch.randn(4, 4), F.mse_loss)


@pytest.mark.slow
def test_microbatches_on_different_parameter_paths_train_exactly() -> None:
    outcome = orgel_check("param_branch", _param_branch)
    assert outcome.status == "exact", outcome.line() + "\n" + outcome.trace


def test_a_plain_rank_engine_refuses_a_split_with_exchanges() -> None:
    from orgel.split import split_plan
    from orgel.worker.engine import RankEngine

    graph = capture(BranchEveryMicrobatch(), (torch.randn(2, 8),))
    plan = balanced_plan(graph, ranks=2, microbatches=1)
    with pytest.raises(CaptureError, match="only through orgel.pipeline"):
        RankEngine(0, plan, split_plan(graph, plan), optimizer=None, loss_fn=F.mse_loss)


@pytest.mark.slow
def test_accumulating_steps_of_a_forward_of_several_graphs_train_exactly() -> None:
    # the micro-batches take either arm of a branch between graphs; with accumulate=2 the
    # optimizer steps on every second call, each call counting 1/2
    w = _branching()
    reference = copy.deepcopy(w.model)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    pipe = orgel.pipeline(w.model, w.inputs, w.targets, w.loss_fn, ranks=2, microbatches=2,
                          accumulate=2, optimizer=sgd, timeout_s=120.0)
    try:
        losses = [pipe.step(w.inputs, w.targets) for _ in range(4)]
        assert pipe.steps == 2 and pipe.calls == 4
        got = pipe.state_dict()
    finally:
        pipe.close()
    # a closed pipeline the caller drops is freed, with its copy of the model: neither the
    # autograd graphs of its steps nor the graphs Dynamo compiled for it hold it
    dropped = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert dropped() is None
    opt = sgd(reference.parameters())
    want = []
    (x,), y = w.inputs, w.targets
    for call in range(4):  # the same two micro-batches of 4 rows, each loss counting 1/2
        loss = sum(w.loss_fn(reference(x[i:i + 4]), y[i:i + 4]) / 2 for i in (0, 4))
        (loss / 2).backward()
        want.append(float(loss))
        if call % 2:
            opt.step()
            opt.zero_grad()
    assert losses == pytest.approx(want, abs=1e-5)
    for name, value in reference.state_dict().items():
        assert torch.allclose(got[name], value, atol=1e-5), name


class EmbedBreak(nn.Module):
    """An embedding in graph 0 (on rank 0), a buffer written there, a graph break, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 16)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(self.emb(ids)))
        self.seen += 1
        if h.detach().abs().sum().item() < 0:  # a graph break (never taken)
            h = -h
        return self.b(h)


@pytest.mark.slow
def test_a_failing_microbatch_drops_the_step_and_training_goes_on() -> None:
    """A forward of several graphs: ``loss_fn`` raising in the calling process, and a rank's
    own work raising (a token id past the embedding, on rank 0), each reach the caller
    (the rank's as ``StepError``); every rank drops that step (the buffer its forwards
    wrote put back, Adam's state untouched) and the pipeline trains on as one process that
    skipped those batches."""
    torch.manual_seed(4)
    model = EmbedBreak()
    reference = copy.deepcopy(model)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if bool((y < 0).any()):
            raise ValueError("a negative label")
        return F.cross_entropy(out.flatten(0, 1), y.reshape(-1))

    def reference_loss(ids: torch.Tensor, y: torch.Tensor, net: nn.Module = reference
                       ) -> torch.Tensor:
        return sum(loss_fn(net(ids[i:i + 2]), y[i:i + 2]) / 2 for i in (0, 2))

    batches = [(torch.randint(0, 16, (4, 3)), torch.randint(0, 16, (4, 3))) for _ in range(2)]
    adam = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    opt = adam(reference.parameters())
    pipe = orgel.pipeline(model, (batches[0][0],), batches[0][1], loss_fn, ranks=2,
                          microbatches=2, optimizer=adam, schedule="1f1b", timeout_s=60.0)
    try:
        pipe.step(*batches[0])
        reference_loss(*batches[0]).backward()
        opt.step()
        bad_labels = batches[1][1].clone()
        bad_labels[3, 0] = -1  # micro-batch 1's
        with pytest.raises(ValueError, match="a negative label"):
            pipe.step(batches[1][0], bad_labels)
        assert pipe.steps == 1
        bad_ids = batches[1][0].clone()
        bad_ids[0, 0] = 99
        with pytest.raises(orgel.StepError, match="rank 0"):
            pipe.step(bad_ids, batches[1][1])
        assert pipe.steps == 1
        with torch.no_grad():  # an evaluation after the dropped steps: the first step's values
            want = float(reference_loss(*batches[1], net=copy.deepcopy(reference).eval()))
        assert pipe.evaluate(*batches[1]) == pytest.approx(want, rel=1e-5)
        pipe.step(*batches[1])
        assert pipe.steps == 2
        got = pipe.state_dict()
    finally:
        pipe.close()
    opt.zero_grad()
    reference_loss(*batches[1]).backward()
    opt.step()
    assert int(got["seen"]) == 4  # two micro-batches a step, two steps
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)

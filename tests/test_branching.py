"""Micro-batches whose forwards run other graphs than the captured one train exactly.

A forward of several graphs is captured on one micro-batch; a micro-batch that
takes another branch (or, in transformers 4.57's Mixtral, routes its tokens to
other experts) runs whole in the controller on the ranks' values
(:mod:`orgel.explicit.fallback`). Each test trains a few steps through
``orgel.pipeline`` on 2 forked ranks and compares the losses and every tensor with
one process doing the same, micro-batch by micro-batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import orgel
from archzoo.check import relative_diff


class MeanBranch(nn.Module):
    """``if h.mean() > 0:`` picks one of two layers: each arm reads its own parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.up = nn.Linear(16, 16)
        self.down = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.mean() > 0:  # a graph break: the arm differs per micro-batch
            h = self.up(h)
        else:
            h = self.down(h)
        return self.head(torch.relu(h))

    def by_input(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The rest of a forward that picks its arm by the input's mean (a graph break)."""
        if x.mean() > 0:
            h = self.up(h)
        else:
            h = self.down(h)
        return self.head(torch.relu(h))


class Heads(nn.Module):
    """Attention-like heads on both sides of a graph break: ``n_heads`` (4), an int of the
    model, equals the rows of the first batch's micro-batches, so Dynamo, which leaves
    every int of that value symbolic, makes it a graph argument."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads = 4
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def _mix(self, h: torch.Tensor) -> torch.Tensor:
        b, t, c = h.shape
        return h.view(b, t, self.n_heads, c // self.n_heads).softmax(-1).reshape(b, t, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._mix(torch.tanh(self.a(x)))
        torch._dynamo.graph_break()
        h = self._mix(torch.tanh(self.b(h)))
        return self.head(h.mean(1))


def _rows(model: MeanBranch, up: bool, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` rows whose forward takes the ``up`` arm (or the other)."""
    while True:
        x = torch.randn(n, 8, generator=gen) * 3
        with torch.no_grad():
            if bool(torch.tanh(model.a(x)).mean() > 0) == up:
                return x


def _reference(model: nn.Module, batches: list[tuple[Any, torch.Tensor]], m: int,
               loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
               optimizer: Callable[[Any], torch.optim.Optimizer]
               ) -> tuple[list[float], list[list[Any]]]:
    """One process: each step's micro-batches in order, loss / m, then the optimizer.

    Returns each step's loss and its micro-batches' outputs.
    """
    opt = optimizer(list(model.parameters()))
    losses, outputs = [], []
    for inputs, y in batches:
        total = 0.0
        rows = y.shape[0] // m
        outputs.append([])
        for i in range(m):
            part = {k: v[i * rows:(i + 1) * rows] for k, v in inputs.items()}
            out = model(**part)
            loss = loss_fn(out, y[i * rows:(i + 1) * rows]) / m
            loss.backward()
            total += float(loss.detach())
            outputs[-1].append(out)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, outputs


def _check(model: nn.Module, batches: list[tuple[dict[str, torch.Tensor], torch.Tensor]],
           loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], off: list[list[int]] | None,
           m: int = 2, plan: Any = None, outputs: bool = False) -> list[list[int] | None]:
    """Train ``batches`` through orgel.pipeline and in one process; compare everything.

    Returns each step's :attr:`~orgel.explicit.glued.GluedPipeline.off_path` (None for a
    forward of one graph); ``off``, if given, is what they must be. ``outputs``: the
    model returns one tensor; each step's (``step(..., outputs=True)``) is compared too.
    """
    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    reference = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    inputs, targets = batches[0]
    losses, left, outs = [], [], []
    with orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=m,
                        optimizer=optimizer, timeout_s=120.0, plan=plan) as pipe:
        for x, y in batches:
            if outputs:
                loss, out = pipe.step(x, y, outputs=True)
                outs.append(out)
            else:
                loss = pipe.step(x, y)
            losses.append(loss)
            left.append(getattr(pipe, "off_path", None))
        got = pipe.state_dict()
    expected, expected_outs = _reference(reference, batches, m, loss_fn, optimizer)
    if off is not None:
        assert left == off
    assert losses == pytest.approx(expected, rel=1e-5)
    for out, parts in zip(outs, expected_outs, strict=False):
        assert relative_diff(out, torch.cat(parts)) <= 1e-5
    want = reference.state_dict()
    assert list(got) == list(want)
    # max|a-b| / (1 + max|b|): AdamW turns a gradient element near zero into a full step,
    # so an elementwise relative check would judge float32 rounding there
    worst = {key: relative_diff(got[key], t) for key, t in want.items()}
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    for key, t in model.state_dict().items():  # the caller's model is left as it was
        assert torch.equal(t, before[key]), key
    return left


@pytest.mark.slow
def test_microbatches_taking_either_arm_of_a_branch_train_exactly() -> None:
    torch.manual_seed(0)
    model = MeanBranch()
    gen = torch.Generator().manual_seed(1)
    arms = [(True, False), (False, True), (False, False)]  # captured: micro-batch 0, "up"
    batches = []
    for arms_of_step in arms:
        x = torch.cat([_rows(model, up, 4, gen) for up in arms_of_step])
        batches.append(({"x": x}, torch.randint(0, 4, (8,), generator=gen)))
    # the third step runs both micro-batches in the controller: "up" gets no gradient, and
    # AdamW (weight decay) leaves it alone, as in one process
    _check(model, batches, F.cross_entropy, off=[[1], [0], [0, 1]], outputs=True)


@pytest.mark.slow
def test_a_branch_taken_at_a_batch_size_not_captured_trains_exactly() -> None:
    """The forward's graphs take any batch size (captured with symbolic sizes); a micro-batch
    of a new size that takes the other arm runs in the controller while the ranks finish
    its part on stand-ins of that size."""
    torch.manual_seed(0)
    model = MeanBranch()
    gen = torch.Generator().manual_seed(2)
    batches = []
    for rows, arms_of_step in [(4, (True, True)), (6, (True, False)), (3, (False, True))]:
        x = torch.cat([_rows(model, up, rows, gen) for up in arms_of_step])
        batches.append(({"x": x}, torch.randint(0, 4, (2 * rows,), generator=gen)))
    _check(model, batches, F.cross_entropy, off=[[], [1], [0]])


@pytest.mark.slow
@pytest.mark.hf
def test_mixtral_trains_exactly() -> None:
    """A small Mixtral (4 experts, top-2) from a config, two AdamW steps.

    Under transformers 4.x its expert loop (``for expert_idx in expert_hit``) runs one
    graph per expert some token chose, on as many rows as chose it: micro-batches differ
    from the captured one and run in the controller. 5.x computes the experts without
    that loop: Dynamo captures one graph, and the usual pipeline trains it.
    """
    import transformers

    from archzoo.hf import _tokens, hf_mixtral
    from orgel.graph import capture
    from orgel.plan.balanced import balanced_plan

    w = hf_mixtral()
    ids, targets = w.inputs["input_ids"], w.targets
    more_ids, more_targets = _tokens(11)
    batches = [({"input_ids": ids}, targets), ({"input_ids": more_ids}, more_targets)]
    half = {"input_ids": ids[: ids.shape[0] // 2]}
    graph = capture(copy.deepcopy(w.model), half)
    several = transformers.__version__.startswith("4.")
    assert (graph.glue is not None) == several
    plan = balanced_plan(graph, ranks=2, microbatches=2)
    left = _check(w.model, batches, w.loss_fn, off=None, plan=plan)
    if several:  # the routing differs per micro-batch: some ran in the controller
        assert any(left), left
    else:
        assert left == [None, None]


@pytest.mark.slow
@pytest.mark.hf
def test_a_hook_that_breaks_a_hugging_face_layer_runs_every_step() -> None:
    """A graph break in a forward hook on the first layer of a Qwen2 (the composition
    matrix's break cell), whose every micro-batch must stay on the captured graphs.

    Under transformers 4.57 each decoder layer enters Dynamo as a frame of its own, and
    under nested graph breaks Dynamo guards a module's hooks only where its trace ran one:
    from the second call on, the code compiled for layer 1 ran for layer 0 too, without
    its hook, so every micro-batch left the captured graphs for the calling process
    (exact, not pipelined). orgel guards hooks (``orgel.graph.dynamo.dynamo_settings``).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    calls: list[int] = []

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        calls.append(1)
        torch._dynamo.graph_break()
        return out

    model.model.layers[0].register_forward_hook(hook)
    gen = torch.Generator().manual_seed(0)
    batches = [({"input_ids": ids}, ids) for ids in
               (torch.randint(0, 64, (4, 8), generator=gen) for _ in range(2))]

    def loss_fn(out: Any, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    _check(model, batches, loss_fn, off=[[], []])
    assert len(calls) >= 4, calls  # the caller's model (one process) ran it each call


class NormedBranch(MeanBranch):
    """A BatchNorm (its stage updates buffers), then a branch on the input's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.by_input(x, self.norm(self.a(x)))


@pytest.mark.slow
def test_a_microbatch_off_the_path_with_batchnorm_stages_is_a_clear_error() -> None:
    from orgel.explicit.fallback import GlueError

    torch.manual_seed(0)
    x = torch.randn(8, 8)
    x[:4] += 3.0  # micro-batch 0 (captured) takes "up", micro-batch 1 "down"
    x[4:] -= 3.0
    y = torch.randint(0, 4, (8,))
    pipe = orgel.pipeline(NormedBranch(), (x,), y, F.cross_entropy, ranks=2, microbatches=2,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), timeout_s=60.0)
    try:
        with pytest.raises(GlueError, match=r"update buffers in place \(.*norm\.running_mean"):
            pipe.step((x,), y)
    finally:
        pipe.close()


@pytest.mark.slow
def test_with_tp_a_microbatch_off_the_path_trains_exactly() -> None:
    """With tensor parallelism the calling process runs a micro-batch that left the
    captured graphs on the ranks' values, each member sending its own shard (a gather
    mid-step would wait for partners elsewhere in the step), and hands each member its
    part of the gradients: a step on the path, then one with micro-batch 1 off it, then
    one with both off, against one process."""
    torch.manual_seed(0)
    model = MeanBranch()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    on = torch.cat([_rows(model, True, 4, gen), _rows(model, True, 4, gen)])
    off = torch.cat([_rows(model, True, 4, gen), _rows(model, False, 4, gen)])
    both = torch.cat([_rows(model, False, 4, gen), _rows(model, False, 4, gen)])
    y = torch.randint(0, 4, (8,), generator=gen)
    batches = [({"x": x}, y) for x in (on, off, both)]

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    with orgel.pipeline(model, {"x": on}, y, F.cross_entropy, ranks=4, tp=2, microbatches=2,
                        schedule="1f1b", optimizer=sgd, timeout_s=60.0) as pipe:
        assert pipe.plan.tp == 2
        assert any(pipe.call_ranks("tp_shards"))  # a region is split
        losses, left = [], []
        for inputs, target in batches:
            losses.append(pipe.step(inputs, target))
            left.append(pipe.off_path)
        got = pipe.state_dict()
    expected, _ = _reference(reference, batches, 2, F.cross_entropy, sgd)
    assert left == [[], [1], [0, 1]]
    assert losses == pytest.approx(expected, rel=1e-5)
    worst = {k: relative_diff(got[k], t) for k, t in reference.state_dict().items()}
    assert max(worst.values()) <= 1e-5, worst


@pytest.mark.slow
def test_check_finite_names_the_microbatch_whose_loss_is_not_finite() -> None:
    """``check_finite=True`` with graph breaks: the controller computes the loss, and the
    step fails at a NaN loss (on the captured path or off it), naming the micro-batch."""
    from orgel.launch.errors import NonFiniteLoss

    torch.manual_seed(0)
    model = MeanBranch()
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([_rows(model, True, 4, gen), _rows(model, True, 4, gen)])
    y = torch.randint(0, 4, (8,), generator=gen)
    for m, arm in ((1, True), (0, False)):  # micro-batch 0 off the captured path
        pipe = orgel.pipeline(model, {"x": x}, y, F.cross_entropy, ranks=2, microbatches=2,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.1), timeout_s=60.0,
                              check_finite=True)
        try:
            pipe.step({"x": x}, y)  # finite: trains
            bad = x.clone()
            bad[m * 4:(m + 1) * 4] = _rows(model, arm, 4, gen)
            bad[m * 4] = float("inf") if arm else float("nan")
            with pytest.raises(NonFiniteLoss, match=f"the loss of micro-batch {m} is nan"):
                pipe.step({"x": bad}, y)
        finally:
            pipe.close()


@pytest.mark.slow
def test_an_int_of_the_model_equal_to_the_first_batchs_rows_stays_that_int() -> None:
    """``n_heads`` is 4 and so are the first batch's micro-batch rows: later batches of 3
    and 6 rows keep 4 heads, and every micro-batch stays on the captured graphs. (It was
    taken for the rows: a micro-batch of 3 rows then left the graphs, and the ranks' stand-ins
    reshaped into 3 heads and failed the step.)"""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4)
    batches = [({"x": torch.randn(2 * rows, 5, 8, generator=gen)},
                torch.randint(0, 4, (2 * rows,), generator=gen)) for rows in (4, 3, 6)]
    _check(Heads(), batches, F.cross_entropy, off=[[], [], []])


class HeadsLocal(Heads):
    """:class:`Heads` whose head count crosses the graph break as a local variable."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.n_heads
        h = torch.tanh(self.a(x))
        b, t, c = h.shape
        h = h.view(b, t, heads, c // heads).softmax(-1).reshape(b, t, c)
        torch._dynamo.graph_break()
        h = torch.tanh(self.b(h))
        b, t, c = h.shape  # (the sizes of graph 0 handed on would make the capture static)
        h = h.view(b, t, heads, c // heads).softmax(-1).reshape(b, t, c)
        return self.head(h.mean(1))


@pytest.mark.slow
def test_an_int_handed_across_a_break_equal_to_the_rows_stays_that_int() -> None:
    """The Python between graphs hands the head count (4) to the next graph in a local
    variable, where nothing but its value ties it to a model input: the capture tells it
    from the rows (also 4) on a probe forward with the rows one longer, where it stays 4.
    Later batches of 3 and 6 rows train on the captured graphs. (It was taken for the rows,
    and a batch of 3 rows failed on the ranks.)"""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4)
    batches = [({"x": torch.randn(2 * rows, 5, 8, generator=gen)},
                torch.randint(0, 4, (2 * rows,), generator=gen)) for rows in (4, 3, 6)]
    _check(HeadsLocal(), batches, F.cross_entropy, off=[[], [], []])


@pytest.mark.slow
@pytest.mark.parametrize("rows", [(1, 3, 2), (3, 1)], ids=["captured on one row", "then one row"])
def test_micro_batches_of_one_row_and_more_share_the_captured_graphs(rows: tuple[int, ...]
                                                                      ) -> None:
    """A forward with graph breaks captured on micro-batches of one row takes batches of
    more rows on its graphs, and one captured on more rows takes micro-batches of one row
    (a DataLoader's smaller last batch): Dynamo's size-oblivious sizes, as the one-graph
    capture has them. (A size of 1 was a fixed size: the first refused later batches with
    a ShapeError, the second ran each one-row micro-batch in the calling process.)"""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    batches = [({"x": torch.randn(2 * n, 5, 8, generator=gen)},
                torch.randint(0, 4, (2 * n,), generator=gen)) for n in rows]
    _check(Heads(), batches, F.cross_entropy, off=[[] for _ in rows])

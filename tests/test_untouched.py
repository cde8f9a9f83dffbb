"""``orgel.pipeline`` leaves the caller's model and torch's global state exactly as it found them.

Capture, measurement and profiling run the model in train mode; before
:func:`orgel.guard.untouched` every BatchNorm model came back from
``orgel.pipeline`` with moved running statistics and ``num_batches_tracked``
at 7, and the pipelined training started from them.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from archzoo.check import changes, orgel_check, snapshot
from orgel.guard import untouched
from orgel.models import ZooWorkload
from test_glue import GradOffGraph


def _conv_bn() -> ZooWorkload:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for cin in (3, 8, 8):
        layers += [nn.Conv2d(cin, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    g = torch.Generator().manual_seed(0)
    return ZooWorkload(model, (torch.randn(4, 3, 8, 8, generator=g),),
                       torch.randint(0, 10, (4,), generator=g), _ce)


def _ce(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


@pytest.mark.slow
def test_batchnorm_model_is_untouched_and_its_statistics_match_one_process() -> None:
    outcome = orgel_check("conv_bn", _conv_bn)  # snapshot before/after, then one step
    assert outcome.status == "exact", outcome.line()
    assert outcome.worst["1.num_batches_tracked"] == 0.0  # each micro-batch counted once
    assert outcome.worst["1.running_mean"] <= 1e-6


def test_untouched_puts_back_buffers_modes_grads_and_rng() -> None:
    w = _conv_bn()
    w.model[0].weight.grad = torch.ones_like(w.model[0].weight)
    before = snapshot(w.model)
    with untouched(w.model):
        w.model.eval()
        w.model[0].weight.requires_grad_(False)
        w.model.train()
        _ce(w.model(*w.inputs), w.targets).backward()
        torch.rand(3)
    assert changes(before, snapshot(w.model)) == []


def test_untouched_undoes_an_exception_half_way() -> None:
    """A failure inside a vmap with grad off must not poison torch for the next call."""
    w = _conv_bn()
    before = snapshot(w.model)
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    with pytest.raises(KeyError), untouched(w.model):
        w.model(*w.inputs)  # moves the BatchNorm statistics
        torch.set_grad_enabled(False)
        torch._C._functorch._vmap_increment_nesting(2, "error")
        raise KeyError("boom")
    assert torch.is_grad_enabled()
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == depth
    assert changes(before, snapshot(w.model)) == []
    torch.randn(2)  # a random op outside vmap works again


def test_untouched_reports_a_parameter_changed_in_place() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="weight"), untouched(model), torch.no_grad():
        model.weight.mul_(2)


@pytest.mark.slow
def test_a_failed_pipeline_then_a_good_one_in_the_same_process() -> None:
    import orgel
    from orgel.graph import CaptureError

    torch.manual_seed(0)
    bad = GradOffGraph()  # fails half-way: under vmap, then a graph with gradients off
    x = torch.randn(4, 8)
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    with pytest.raises(CaptureError, match=r"h\.sum(.|\n)*runs with gradients off"):
        orgel.pipeline(bad, (x,), torch.randn(4, 8), F.mse_loss, ranks=2, microbatches=2)
    assert torch.is_grad_enabled()
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == depth
    outcome = orgel_check("conv_bn", _conv_bn)
    assert outcome.status == "exact", outcome.line()


@pytest.mark.slow
def test_recomputed_batchnorm_updates_its_statistics_once_per_microbatch() -> None:
    """A recomputed stage replays its forward; BatchNorm must not count the replay."""
    import dataclasses

    from orgel.graph import capture
    from orgel.plan.balanced import balanced_plan
    from orgel.workload import Workload, microbatches

    def plan_for(w: ZooWorkload) -> object:
        model = copy.deepcopy(w.model)
        first = microbatches(Workload(model, w.inputs, w.targets, w.loss_fn), 2)[0][0]
        plan = balanced_plan(capture(model, first), ranks=2, microbatches=2)
        return dataclasses.replace(plan, recompute=[True] * plan.num_stages)

    outcome = orgel_check("conv_bn_recompute", _conv_bn, plan_for=plan_for)
    assert outcome.status == "exact", outcome.line()
    assert outcome.worst["1.num_batches_tracked"] == 0.0


# -- torch's own state: nothing of it replaced, nothing of the caller's dropped ------------


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def test_a_capture_does_not_read_dynamos_record_of_compiled_sizes() -> None:
    """Dynamo records, per process, the sizes each code object was compiled with, and reads
    that record at a code object's first compile: a capture starts from a record of its own,
    so an earlier compile of shared code cannot make it trace a size as a symbol; what it
    records joins the caller's record after, as any compile's would."""
    from collections import defaultdict

    from torch._dynamo import pgo

    from orgel.graph import capture
    from orgel.graph.reuse import forget_all

    reads: list[object] = []

    class Watched(defaultdict):  # type: ignore[type-arg]
        def __getitem__(self, key: object) -> object:
            reads.append(key)
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            reads.append(key)
            return super().__contains__(key)

        def get(self, key: object, default: object = None) -> object:
            reads.append(key)
            return super().get(key, default)

    forget_all()  # (a trace kept from an earlier capture of the same layers would not compile)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    before = pgo._CODE_STATE
    record = pgo._CODE_STATE = Watched(pgo.CodeState)
    try:
        graph = capture(model, (torch.randn(4, 6),))
    finally:
        pgo._CODE_STATE = before
    assert graph.nodes
    assert reads == []
    assert record  # the captured frame's entry joined it


@pytest.mark.slow
def test_backend_first_step_leaves_autograd_alone_and_trains_as_one_process() -> None:
    """The first step runs micro-batch 0's closure once more to find the graph, stopping it
    at its backward: the closure sees torch's own ``backward`` and ``autograd.grad`` (none
    replaced), and its own layer after the model gets each micro-batch's gradient once."""
    import orgel

    real = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    head = nn.Linear(4, 1)  # the closure's own, after the pipelined model
    ref_model, ref_head = copy.deepcopy(model), copy.deepcopy(head)
    pipe = orgel.backend(ranks=2, microbatches=2, optimizer=_sgd, threads=1, timeout_s=60)
    compiled = torch.compile(model, backend=pipe, dynamic=False)
    seen = []

    def make(net: nn.Module) -> object:
        def closure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            seen.append((torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad))
            loss = F.mse_loss(head_of[net](net(x)), y) / 2
            torch.autograd.grad(loss, list(head_of[net].parameters()), retain_graph=True)
            loss.backward()
            return loss.detach()

        return closure

    head_of = {compiled: head, ref_model: ref_head}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    try:
        losses = pipe.step(make(compiled), x, y)
        seen_here = len(seen)
        ref_opt = _sgd(list(ref_model.parameters()))
        want = [make(ref_model)(xm, ym) for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True)]
        ref_opt.step()
        assert seen_here == 3  # micro-batch 0 to its backward, then both micro-batches
        assert all(s == real for s in seen)
        torch.testing.assert_close(torch.stack(losses), torch.stack(want))
        torch.testing.assert_close(head.weight.grad, ref_head.weight.grad)
        state = pipe.state_dict()
        for name, t in ref_model.state_dict().items():
            torch.testing.assert_close(state[name], t, msg=name)
    finally:
        pipe.close()


@pytest.mark.slow
def test_backend_first_step_gives_a_leaf_reached_before_any_saved_tensor_one_gradient() -> None:
    """The first step's search stops the backward at its first node that saved a tensor:
    a leaf of the closure's own that the backward reaches before any (``loss + w.sum()``:
    sums and adds save none) would get micro-batch 0's gradient from that search too.
    The search looks at every leaf of the process, stand-ins an earlier trace left alive
    included (a fake leaf with a fake gradient, whose values cannot be read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import orgel

    with FakeTensorMode():
        left = torch.zeros(10, requires_grad=True)
        left.grad = torch.ones(10)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    w = nn.Parameter(torch.randn(3))  # the closure's own: a penalty on it, as people add
    ref_model, ref_w = copy.deepcopy(model), nn.Parameter(w.detach().clone())
    pipe = orgel.backend(ranks=2, microbatches=2, optimizer=_sgd, threads=1, timeout_s=60)
    compiled = torch.compile(model, backend=pipe, dynamic=False)

    def make(net: nn.Module, leaf: torch.Tensor) -> object:
        def closure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(net(x), y) / 2 + leaf.sum()
            loss.backward()
            return loss.detach()

        return closure

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    try:
        pipe.step(make(compiled, w), x, y)
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            make(ref_model, ref_w)(xm, ym)
        torch.testing.assert_close(w.grad, ref_w.grad)
        assert left.grad is not None and left.grad.shape == (10,)
    finally:
        pipe.close()


@pytest.mark.slow
def test_closing_a_backend_drops_the_code_compiled_with_it_and_nothing_else() -> None:
    """Each backend compiles the model's frames anew: closed, its entries go (else a process
    that makes backend after backend of one model class reaches Dynamo's recompile limit),
    and the caller's own compiled code of the same frames stays."""
    import orgel

    compiles: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiles.append(gm)
        return gm

    torch.manual_seed(0)
    own = torch.compile(nn.Sequential(nn.Linear(8, 4)), backend=counting, dynamic=False)
    x = torch.randn(8, 8)
    own(x)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    pipe = orgel.backend(ranks=2, microbatches=2, optimizer=_sgd, threads=1, timeout_s=60)
    compiled = torch.compile(model, backend=pipe, dynamic=False)

    def closure(x: torch.Tensor) -> None:
        compiled(x).sum().backward()

    def compiled_with_pipe() -> int:
        from torch._dynamo.convert_frame import input_codes

        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
        codes = [c for c in (ref() for ref in list(input_codes.seen)) if c is not None]
        return sum(getattr(e.backend, "compiler_fn", None) is pipe
                   for c in codes for e in entries(c))

    try:
        pipe.step(closure, x)
        assert compiled_with_pipe() > 0
    finally:
        pipe.close()
    assert compiled_with_pipe() == 0
    before = len(compiles)
    own(x)
    assert len(compiles) == before  # the caller's entry is still there


@pytest.mark.slow
def test_pipelining_a_model_with_graph_breaks_keeps_the_callers_compiled_code() -> None:
    """The capture of a forward with graph breaks converts the model's own frames; it drops
    what it compiled there and nothing of the caller's (no ``torch._dynamo.reset()``)."""
    import orgel
    from orgel.models import build

    compiles: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiles.append(gm)
        return gm

    model, inputs, targets, loss_fn = build("graphbreak", batch_size=4, seed=0)
    own = torch.compile(model, backend=counting, dynamic=False)  # the same frames as orgel's
    scale = torch.compile(lambda t: torch.sin(t) * 2, backend=counting, dynamic=False)
    own(*inputs)
    scale(inputs[0])
    before = len(compiles)
    pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2,
                          optimizer=_sgd)
    try:
        assert pipe.glue.calls  # the graph-break path
        pipe.step(inputs, targets)
    finally:
        pipe.close()
    own(*inputs)
    scale(inputs[0])
    assert len(compiles) == before


def test_cuda_unused_replaces_nothing_and_puts_the_environment_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from orgel.guard import cuda_unused

    available = torch.cuda.is_available
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    with cuda_unused():
        assert torch.cuda.is_available is available
        assert not torch.cuda.is_available()
    assert torch.cuda.is_available is available
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ


class _Witness(nn.Module):
    """Records what ``torch.cuda.is_available`` is while its forward runs (the capture)."""

    seen: list[object] = []

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Witness.seen.append(torch.cuda.is_available)
        return self.b(torch.relu(self.a(x)))


@pytest.mark.slow
def test_capture_sees_torch_cuda_is_available_itself() -> None:
    import orgel

    torch.manual_seed(0)
    available = torch.cuda.is_available
    _Witness.seen.clear()
    pipe = orgel.pipeline(_Witness(), (torch.randn(4, 4),), torch.randn(4, 2), F.mse_loss,
                          ranks=2, microbatches=2, optimizer=_sgd)
    pipe.close()
    assert _Witness.seen and all(f is available for f in _Witness.seen)
    assert torch.cuda.is_available is available


TP_SCRIPT = '''
import json, sys
import torch
import orgel
from orgel.models import build

model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32,
                                        seq_len=8, vocab_size=64)
pipe = orgel.pipeline(model, inputs, targets, loss_fn, ranks=2, tp=2, microbatches=2)
flags = [torch._C._get_dtensor_allow_implicit_replication()]
pipe.step(inputs, targets)
flags.append(torch._C._get_dtensor_allow_implicit_replication())
pipe.evaluate(inputs, targets)
flags.append(torch._C._get_dtensor_allow_implicit_replication())
with open(f"{sys.argv[1]}/flags{torch.distributed.get_rank()}.json", "w") as f:
    json.dump({"flags": flags, "tp": pipe.plan.tp}, f)
pipe.close()
'''


#: the script the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"untouched-tp": (TP_SCRIPT, [])}


@pytest.mark.slow
@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("untouched-tp")
def test_tp_under_torchrun_leaves_implicit_replication_off(torchrun_part: Path) -> None:
    """Under torchrun the ranks are the caller's processes: DTensor's implicit replication
    is on only while orgel's passes run."""
    import json

    for rank in range(2):
        result = json.loads((torchrun_part / f"flags{rank}.json").read_text())
        assert result == {"flags": [False, False, False], "tp": 2}

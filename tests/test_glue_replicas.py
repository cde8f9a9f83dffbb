"""A forward of several graphs where micro-batches leave the captured ones, with replicas.

A branch on the data calls a layer the capture never saw: the calling process runs such
a micro-batch whole on the ranks' values (each FSDP replica sends its own shard) and its
gradients join the ranks' (before the replicas' sums; after FSDP's reduce-scatter, each
replica its shard), with tensor parallelism too. So do the gradients of a weight that
tensor parallelism splits and the Python between graphs reads (each member its part).
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


class OtherGraph(nn.Module):
    """A branch on the data that calls another layer: the micro-batches that take it run
    a graph the capture never saw."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.sum() > 0:
            return self.b(h)
        return self.c(h)


class SplitThenBranch(OtherGraph):
    """:class:`OtherGraph` behind an MLP that tensor parallelism splits."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(self.down(torch.relu(self.up(x)))))
        if x.sum() > 0:
            return self.b(h)
        return self.c(h)


def _half_off() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose second half takes the layer the first half's capture never saw."""
    torch.manual_seed(0)
    x = torch.randn(8, 8).abs()
    x[4:] = -x[4:]
    return x, torch.randint(0, 4, (8,))


def _one_process(model: nn.Module, opt: torch.optim.Optimizer, calls: list[torch.Tensor],
                 y: torch.Tensor) -> list[float]:
    """One SGD step of ``model`` in this process over ``calls`` (each in the 4 shares of
    the pipelines below: 2 micro-batches x 2 replicas, each loss a quarter of its call's,
    and its gradient over ``len(calls)``); each call's loss."""
    opt.zero_grad()
    losses = []
    for x in calls:
        total = 0.0
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = F.cross_entropy(model(xm), ym) / 4
            (loss / len(calls)).backward()
            total += loss.item()
        losses.append(total)
    opt.step()
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(("shard", "accumulate", "tp"),
                         [("none", 1, 1), ("fsdp", 1, 1), ("fsdp", 2, 1), ("fsdp", 1, 2)])
def test_microbatches_off_the_captured_graphs_train_exactly_with_replicas(
        shard: str, accumulate: int, tp: int) -> None:
    """With ``dp=2`` the gradients the calling process computes (micro-batches that left
    the captured graphs) join the replicas' sums: those were launched as each replica's
    backward ended, before the calling process's gradients were added, and their result
    replaced them (the first layer did not train). Under FSDP each replica sends its
    shard of the values, and takes its shard of those gradients after the reduce-scatter
    (or, on a call that only accumulates, one replica takes them whole before it). With
    ``tp=2`` too (an MLP split, its first layer's FSDP shards rows from here and there)."""
    x, y = _half_off()
    model = SplitThenBranch() if tp > 1 else OtherGraph()
    reference = copy.deepcopy(model)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    opt = sgd(reference.parameters())
    pipe = orgel.pipeline(model, (x,), y, F.cross_entropy, ranks=2 * tp, tp=tp, dp=2,
                          shard=shard, microbatches=2, schedule="1f1b", threads=1,
                          timeout_s=60, optimizer=sgd, accumulate=accumulate)
    # some micro-batches off the path; then all of them
    calls = [x, -x.abs()] if accumulate == 1 else [x, -x.abs(), -x.abs(), x]
    with pipe:
        for i in range(0, len(calls), accumulate):
            group = calls[i:i + accumulate]
            got = [float(pipe.step((batch,), y)) for batch in group]
            assert got == pytest.approx(_one_process(reference, opt, group, y), rel=1e-6)
        state = pipe.state_dict()
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


@torch._dynamo.disable
def _eager_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


class EagerReadsSplit(nn.Module):
    """An MLP region tensor parallelism splits, whose first weight the Python between
    graphs reads too (Glue.eager): the controller's gradient of it is added part by part."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(torch.tanh(x + _eager_linear(x, self.up.weight).sum(1, keepdim=True)))


@pytest.mark.slow
def test_a_split_weight_the_python_between_graphs_reads_trains_exactly() -> None:
    """``up.weight`` is split by tensor parallelism and FSDP (rows from here and there) and
    read by the Python between graphs: each member and replica adds its part of the
    controller's gradient and sends its part of the new value back."""
    torch.manual_seed(0)
    model = EagerReadsSplit()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    opt = sgd(reference.parameters())
    with orgel.pipeline(model, (x,), y, F.cross_entropy, ranks=4, tp=2, dp=2,
                        shard="fsdp", microbatches=2, schedule="1f1b", threads=1, timeout_s=60,
                        optimizer=sgd) as pipe:
        assert pipe.glue is not None and pipe.glue.eager == ["up.weight"]
        assert pipe.call_ranks("tp_shards")[0]["up.weight"] == (4, 8)  # of (16, 8)
        for _ in range(3):
            got = float(pipe.step((x,), y))
            assert got == pytest.approx(_one_process(reference, opt, [x], y)[0], rel=1e-6)
        state = pipe.state_dict()
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


class Broken(nn.Module):
    """Two layers with a graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


@pytest.mark.slow
@pytest.mark.parametrize("example, rows", [(8, (8, 12)), (4, (4, 8, 12))],
                         ids=["replicas of 2 rows", "replicas of one row"])
def test_replicas_train_from_the_one_capture_of_a_microbatch_at_any_batch_size(
        monkeypatch: pytest.MonkeyPatch, example: int, rows: tuple[int, ...]) -> None:
    """With ``dp=2`` the plan and the stages read one capture of a micro-batch, with symbolic
    sizes (a forward of several graphs included; it was captured static, and again of one
    replica's rows): a later batch of other rows trains on the captured graphs, exactly.
    Replicas of one row too (they were captured static, and a later batch of more rows
    was refused with a ShapeError)."""
    import orgel.flow.capture as flow_capture

    captures: list[int] = []
    capture = flow_capture.capture_microbatch

    def counted(*args: object, **kwargs: object) -> object:
        captures.append(1)
        return capture(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(flow_capture, "capture_microbatch", counted)
    torch.manual_seed(0)
    model = Broken()
    reference = copy.deepcopy(model)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    opt = sgd(reference.parameters())
    x, y = torch.randn(example, 8), torch.randint(0, 4, (example,))
    pipe = orgel.pipeline(model, (x,), y, F.cross_entropy, ranks=2, dp=2, microbatches=2,
                          schedule="1f1b", threads=1, timeout_s=60, optimizer=sgd)
    with pipe:
        assert pipe.glue.calls and len(captures) == 1
        for n in rows:  # replicas of n // 4 rows
            batch, target = torch.randn(n, 8), torch.randint(0, 4, (n,))
            got = pipe.step((batch,), target)
            assert pipe.off_path == []  # every micro-batch ran on the ranks
            want = _one_process(reference, opt, [batch], target)
            assert float(got) == pytest.approx(want[0], rel=1e-6)
        state = pipe.state_dict()
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


TORCHRUN_FSDP = '''
import copy, json, os, sys
import torch
import torch.nn.functional as F
import orgel
from test_glue_replicas import OtherGraph, _half_off, _one_process

x, y = _half_off()
model = OtherGraph()
reference = copy.deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.1)
opt = sgd(reference.parameters())
losses, want, off = [], [], []
with orgel.pipeline(model, (x,), y, F.cross_entropy, ranks=2, dp=2, shard="fsdp",
                    microbatches=2, schedule="1f1b", timeout_s=60, optimizer=sgd) as pipe:
    for batch in (x, -x.abs()):
        losses.append(float(pipe.step((batch,), y)))
        want += _one_process(reference, opt, [batch], y)
        off.append(list(pipe.off_path))
    state = pipe.state_dict()
diff = max(float((state[n] - t).abs().max()) for n, t in reference.state_dict().items())
with open(os.path.join(sys.argv[1], f"result{os.environ['RANK']}.json"), "w") as f:
    json.dump({"losses": losses, "want": want, "off": off, "diff": diff}, f)
'''


@pytest.mark.slow
@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("glue-replicas-fsdp")
def test_under_torchrun_microbatches_off_the_captured_graphs_train_exactly_with_fsdp(
        torchrun_part: Path) -> None:
    """The same under torchrun (the session's shared job of 2 processes): process 0, the
    controller, asks each process for its FSDP shard over TCP, and every process gets the
    losses and weights one process trains."""
    for rank in (0, 1):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert result["off"] == [[2, 3], [0, 1, 2, 3]], result
        assert result["losses"] == pytest.approx(result["want"], rel=1e-6)
        assert result["diff"] <= 1e-5, result


TORCHRUN_PARTS = {"glue-replicas-fsdp": (TORCHRUN_FSDP, [])}

"""Capture: roles of graph inputs, per-node facts measured on a real forward, graph breaks."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn

from orgel.graph import CaptureError, GraphBreakError, OpGraph, capture


class Toy(nn.Module):
    """Tied embedding, a no_grad region, BatchNorm, a tuple op and a structured output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.l1 = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, extra: torch.Tensor) -> dict[str, object]:
        h = self.emb(ids)
        with torch.no_grad():
            z = extra * 2
        h = self.l1(h) + z
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        a, b = h.chunk(2, dim=-1)
        return {"logits": self.head(torch.cat([b, a], -1)), "n": 3, "extra": extra}


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 10, (2, 3), generator=gen), torch.randn(2, 3, 8, generator=gen)


@pytest.fixture(scope="module")
def toy() -> tuple[Toy, OpGraph]:
    torch.manual_seed(0)
    model = Toy()
    return model, capture(model, _inputs())


def _node(graph: OpGraph, op: str, module: str) -> object:
    return next(n for n in graph.nodes.values() if n.op == op and n.module == module)


def test_inputs_params_and_buffers_are_matched_by_identity(toy: tuple[Toy, OpGraph]) -> None:
    model, g = toy
    assert g.method == "dynamo"
    assert g.model_inputs == ["ids", "extra"]
    assert set(g.params) == {n for n, _ in model.named_parameters()}
    assert g.params["l1.weight"] is model.l1.weight
    assert set(g.buffers) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    # Tied: one parameter, read by the embedding and by the head.
    assert g.aliases == {"emb.weight": ["emb.weight", "head.weight"]}
    users = g.param_users()["emb.weight"]
    assert [g.nodes[u].module for u in users] == ["emb", "head"]


def test_node_facts_are_measured(toy: tuple[Toy, OpGraph]) -> None:
    _, g = toy
    lin = _node(g, "linear", "l1")
    assert lin.shape == (2, 3, 8) and lin.dtype == "float32" and lin.nbytes == 2 * 3 * 8 * 4
    assert lin.params == ("l1.weight", "l1.bias") and lin.param_bytes == (64 + 8) * 4
    assert lin.flops == 2 * 6 * 8 * 8  # FlopCounterMode: 2 * rows * in * out
    # linear saves its input (the embedding output) for backward; weights are not counted.
    assert lin.saved_bytes == 2 * 3 * 8 * 4
    bn = _node(g, "batch_norm", "bn")
    assert bn.saved_bytes == 2 * 3 * 8 * 4 + 2 * 8 * 4  # input + save_mean + save_invstd
    assert bn.params == ("bn.running_mean", "bn.running_var", "bn.weight", "bn.bias")
    no_grad = [n for n in g.nodes.values() if not n.grad_enabled]
    assert [n.op for n in no_grad] == ["mul"] and not no_grad[0].requires_grad
    chunk = _node(g, "chunk", "")
    assert not chunk.is_tensor and chunk.nbytes == 2 * 3 * 8 * 4
    assert g.summary()["param_bytes"] == sum(p.numel() * 4 for p in g.params.values())


def test_outputs_rebuild_the_model_structure(toy: tuple[Toy, OpGraph]) -> None:
    model, g = toy
    kinds = [k for k, _ in g.output_spec.leaves]
    assert kinds == ["value", "const", "value"]
    assert g.outputs[1] == "extra"  # a model input passed through, named by its keyword
    t = [torch.ones(1), torch.zeros(1)]
    out = g.unflatten(g.outputs)(t)
    assert out["n"] == 3 and out["logits"] is t[0] and out["extra"] is t[1]


def test_capture_leaves_the_model_unchanged() -> None:
    torch.manual_seed(0)
    model = Toy()
    before = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    capture(model, _inputs())
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n
    assert torch.equal(torch.get_rng_state(), rng)


def test_export_route_gives_the_same_facts(toy: tuple[Toy, OpGraph]) -> None:
    model, g = toy
    e = capture(model, _inputs(), method="export")
    assert e.method == "export"
    assert len(e.nodes) == len(g.nodes)
    assert e.aliases == g.aliases
    assert sorted(n.saved_bytes for n in e.nodes.values()) == sorted(
        n.saved_bytes for n in g.nodes.values()
    )
    assert [n.grad_enabled for n in e.nodes.values()] == [n.grad_enabled for n in g.nodes.values()]
    with pytest.raises(ValueError, match="method must be one of"):
        capture(model, _inputs(), method="jit")


class Skips(nn.Module):
    """A long skip (enc → dec) and a fan-out (a feeds three consumers)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.mid = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.dec = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.enc(x)
        return self.dec(self.mid(a) + a) * a


def test_all_edges_are_kept() -> None:
    g = capture(Skips(), (torch.randn(2, 4),))
    enc = _node(g, "linear", "enc")
    users = g.users()[enc.name]
    assert len(users) == 3  # mid.0, the skip add, the final mul
    assert {g.nodes[u].module for u in users} == {"mid.0", ""}


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.mean().item() > 0:  # the graph break
            h = h * 2
        return h


def test_graph_break_names_reason_line_and_fix() -> None:
    with pytest.raises(GraphBreakError) as info:
        capture(Breaks(), (torch.randn(2, 4),), several=False)
    message = str(info.value)
    line = inspect.getsourcelines(Breaks.forward)[1] + 2
    assert f"test_capture.py:{line}" in message
    assert "h.mean().item()" in message
    assert "graph break" in message and "torch.where" in message


def test_auto_falls_back_to_export_when_dynamo_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``orgel.graph.capture`` the attribute is the function; the module lives in sys.modules.
    capture_module = importlib.import_module("orgel.graph.capture")

    def broken(model: nn.Module, named: dict, autocast: object = None) -> None:
        raise RuntimeError("dynamo internal error")

    monkeypatch.setattr(capture_module, "_dynamo_graph", broken)
    g = capture(Skips(), (torch.randn(2, 4),))
    assert g.method == "export" and "dynamo internal error" in g.notes[0]
    with pytest.raises(CaptureError, match="torch.compile could not capture"):
        capture(Skips(), (torch.randn(2, 4),), method="dynamo")


def test_capturing_leaves_the_callers_compiled_models_alone() -> None:
    """No ``torch._dynamo.reset()``: a model the user compiled keeps its compiled code over
    more captures than Dynamo keeps entries for one code object (8)."""
    from orgel.models.gpt import GPT, GPTConfig

    compiles = []

    def backend(gm: torch.fx.GraphModule, _example: object) -> object:
        compiles.append(gm)
        return gm

    mine = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()),
                         backend=backend)
    mine(torch.randn(2, 3))
    for _ in range(9):
        model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, seq_len=8))
        graph = capture(model, {"tokens": torch.randint(0, 32, (2, 8))})
        assert graph.nodes
    mine(torch.randn(2, 3))
    assert len(compiles) == 1

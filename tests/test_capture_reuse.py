"""A model class is traced once per process; Dynamo's guards and orgel's key say when again."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from orgel.graph import GraphBreakError, capture, reuse
from orgel.graph.sizes import mark_sizes


class Net(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.drop = nn.Dropout(0.1)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.mid(self.emb(ids)))))


def _ids(rows: int = 2, length: int = 5) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, 16, (rows, length), generator=torch.Generator().manual_seed(0))}


def _traces(model: nn.Module, rows: int = 2) -> int:
    return reuse.capturer_for(model, _ids(rows), None, True)[0].traces


@pytest.fixture(autouse=True)
def _fresh() -> None:
    reuse.forget_all()


def test_a_second_model_of_the_class_reuses_the_trace_with_its_own_tensors() -> None:
    torch.manual_seed(0)
    first, second = Net(), Net()
    capture(first, _ids())
    assert _traces(first) == 1
    graph = capture(second, _ids())
    assert _traces(second) == 1  # reused
    assert graph.params["mid.weight"] is second.mid.weight
    assert set(graph.params) == {n for n, _ in second.named_parameters()}
    assert all(isinstance(d, str) for d in graph.shapes.inputs["ids"])  # still symbolic


def test_other_sizes_are_traced_apart_so_the_graph_describes_them() -> None:
    """A symbolic graph's example values hold the sizes it was traced at (hints)."""
    from orgel.graph.tensor_parallel import tp_regions
    from orgel.models.gpt import build_gpt

    for rows in (4, 2):
        w = build_gpt(batch_size=rows, d_model=32, n_heads=4, n_layers=1, seq_len=8,
                      vocab_size=64)
        graph = capture(w.model, w.inputs)
        assert tp_regions(graph.graph_module)[0].row_shape == (rows, 8, 32)
    capture(Net(), _ids(rows=4))
    assert _traces(Net(), rows=4) == 1 and _traces(Net(), rows=2) == 0


def test_the_first_model_is_freed() -> None:
    model = Net()
    capture(model, _ids())
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_tied_and_untied_models_are_traced_apart() -> None:
    untied = capture(Net(), _ids())
    tied_model = Net(tied=True)
    tied = capture(tied_model, _ids())
    assert not untied.aliases
    assert tied.aliases == {"emb.weight": ["emb.weight", "head.weight"]}
    assert set(tied.params) == {"emb.weight", "mid.weight", "mid.bias"}


def test_a_hook_added_later_is_seen() -> None:
    model = Net()
    capture(model, _ids(), several=False)

    def breaks(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return out

    model.mid.register_forward_hook(breaks)
    with pytest.raises(GraphBreakError):
        capture(model, _ids(), several=False)
    # a model with hooks never fills the cache
    assert all(key[0] is not Net or capturer.traces <= 1 for key, capturer in reuse._KEPT.items())


def test_eval_mode_and_new_guards_trace_again() -> None:
    model = Net()
    capture(model, _ids())
    model.eval()
    graph = capture(model, _ids())
    assert _traces(model) == 2  # dropout reads the training flag: a trace of its own
    dropout = next(n for n in graph.graph_module.graph.nodes if "dropout" in str(n.target))
    assert dropout.args[2] is False  # F.dropout(x, p, training=False)
    capturer = reuse.capturer_for(model, _ids(), None, True)[0]
    gm = capturer.run(model, mark_sizes(_ids()))[0]
    rows = next(n.meta["example_value"] for n in gm.graph.nodes
                if isinstance(n.meta.get("example_value"), torch.SymInt))
    assert int(rows) > 0  # code that read a size as a number: a guard the model did not make
    graph = capture(model, _ids())  # so the next capture traces afresh
    assert _traces(model) == 1
    assert not graph.shapes.guards, graph.shapes.guards

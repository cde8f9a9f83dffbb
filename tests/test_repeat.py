"""A deep stack of alike layers captured two layers deep and copied: the same graph facts
as tracing every layer, or the whole model traced where the layers are not one pattern."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from orgel.costs.devices import DEVICES
from orgel.graph import capture
from orgel.graph.repeat import repeated_layers
from orgel.profile.roofline import estimate_costs
from orgel.workload import named_inputs, on_meta


def _facts(graph: Any) -> list[Any]:
    return sorted((n.op, n.module, n.flops, n.saved_bytes, n.nbytes, tuple(sorted(n.params)))
                  for n in graph.nodes.values())


def _both(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Any, Any]:
    named = named_inputs(model, inputs)
    return (capture(model, named, dynamic=False),
            capture(model, named, dynamic=False, shallow="costs" if on_meta(model) else True))


def _hf(kind: str, layers: int) -> torch.nn.Module:
    import transformers as hf

    with torch.device("meta"):
        if kind == "llama":
            return hf.LlamaForCausalLM(hf.LlamaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                attn_implementation="sdpa"))
        if kind == "gpt2":
            return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=128, n_embd=64, n_layer=layers,
                                                    n_head=4, use_cache=False,
                                                    bos_token_id=0, eos_token_id=0))
        return hf.Gemma2ForCausalLM(hf.Gemma2Config(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_meta_hugging_face_stack_copied_from_two_layers_is_the_whole_trace(kind: str) -> None:
    model = _hf(kind, 5)
    full, shallow = _both(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    assert any("traced two of the 5 layers" in note for note in shallow.notes), shallow.notes
    assert _facts(shallow) == _facts(full)
    assert list(shallow.nodes) == list(full.nodes)  # named alike: a plan of one fits the other
    # the planner's table of both is the same, block by block
    a, b = (estimate_costs(g, DEVICES["h100-80gb"], blocks=6) for g in (full, shallow))
    assert (a.fwd, a.activations, a.params, a.edges) == (b.fwd, b.activations, b.params, b.edges)


def test_layers_the_config_sets_apart_are_traced_whole() -> None:
    # Gemma2 alternates sliding-window and full attention by the layer's index
    assert repeated_layers(_hf("gemma2", 4)) is None


class Scaled(torch.nn.Module):
    """Code between the layers, once per layer (a scale), and every layer's output returned."""

    def __init__(self, every: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
        self.every = every

    def forward(self, x: torch.Tensor) -> Any:
        outs = []
        for layer in self.layers:
            x = layer(x)
            if not self.every:
                x = x * 0.5
            outs.append(x)
        return tuple(outs) if self.every else x


@pytest.mark.parametrize("every", [False, True])
def test_a_stack_that_is_not_one_pattern_is_traced_whole(every: bool) -> None:
    full, shallow = _both(Scaled(every), {"x": torch.randn(2, 8)})
    assert not any("traced two" in note for note in shallow.notes)
    assert _facts(shallow) == _facts(full)


class ByIndex(torch.nn.Module):
    """Alike layers whose forward reads its index (a scale by depth, as some models do)."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) / (self.layer_idx + 1)


class Deep(torch.nn.Module):
    def __init__(self, by_index: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            ByIndex(i if by_index else 0) for i in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("by_index", [False, True])
def test_a_copy_that_computes_otherwise_than_the_model_is_traced_whole(by_index: bool) -> None:
    # two layers traced look alike either way; copied, the stack that scales by the layer's
    # index would scale every later layer as layer 1 does: the check against the model's
    # own forward refuses that copy
    torch.manual_seed(0)
    full, shallow = _both(Deep(by_index), {"x": torch.randn(2, 8)})
    copied = any("traced two of the 6 layers" in note for note in shallow.notes)
    assert copied != by_index, shallow.notes
    assert by_index == any("do not compute what the model does" in n for n in shallow.notes)
    assert _facts(shallow) == _facts(full) and list(shallow.nodes) == list(full.nodes)
    consts = sorted(str(n.constant) for n in shallow.nodes.values() if n.constant is not None)
    assert consts == sorted(str(n.constant) for n in full.nodes.values()
                            if n.constant is not None)


@pytest.mark.parametrize("by_index", [False, True])
def test_a_copy_with_symbolic_rows_is_checked_on_two_rows(by_index: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # the check runs the forward twice (in a rank, with one thread): where the graph takes
    # any number of rows it runs on two of them, and still refuses a copy that differs
    import importlib

    capturing = importlib.import_module("orgel.graph.capture")  # the module, not the function
    seen: list[int] = []
    check = capturing._computes_as_model
    monkeypatch.setattr(capturing, "_computes_as_model", lambda model, named, *a: (
        seen.append(int(named["x"].shape[0])), check(model, named, *a))[1])
    torch.manual_seed(0)
    model = Deep(by_index)
    graph = capture(model, named_inputs(model, {"x": torch.randn(6, 8)}), shallow=True)
    assert seen == [2]
    copied = any("traced two of the 6 layers" in note for note in graph.notes)
    assert copied != by_index, graph.notes


def test_a_stack_whose_layer_reuses_another_layers_tensor_is_traced_whole() -> None:
    # copied, layer 5 would get a Linear of its own and training would untie the two (the
    # zoo's shared_across_far_layers trains it against one process)
    model = Deep(False)
    assert repeated_layers(model) is not None
    model.layers[5].lin = model.layers[0].lin
    assert repeated_layers(model) is None


def test_a_stack_with_frozen_first_layers_is_traced_whole() -> None:
    # the copies would take layer 1's facts: values that carry no gradient
    model = Deep(False)
    for layer in model.layers[:3]:
        layer.requires_grad_(False)
    assert repeated_layers(model) is None


class Zipped(torch.nn.Module):
    """A stack of alike tables, each reading its own input (DLRM's embedding tables): two
    of them traced, ``zip(..., strict=True)`` raises, which Dynamo reports as a graph break."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.Embedding(16, 8) for _ in range(4))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                d: torch.Tensor) -> torch.Tensor:
        bags = [t(ids).mean(dim=1) for t, ids in zip(self.tables, (a, b, c, d), strict=True)]
        return torch.stack(bags, dim=1).sum(dim=1)


@pytest.mark.parametrize("meta", [False, True])
def test_a_stack_whose_forward_fails_two_layers_deep_is_traced_whole(meta: bool) -> None:
    # on the meta device a graph break is refused (no Python between graphs there), so the
    # failure of two layers must not be taken for one of the whole forward
    with torch.device("meta" if meta else "cpu"):
        model = Zipped()
    inputs = {k: torch.randint(0, 16, (2, 3)) for k in "abcd"}
    named = named_inputs(model, inputs)
    for shallow in (True, "costs"):
        graph = capture(model, named, dynamic=False, shallow=shallow)
        assert graph.glue is None
        assert any("two of them failed to trace" in n for n in graph.notes), graph.notes
        assert _facts(graph) == _facts(capture(model, named, dynamic=False))

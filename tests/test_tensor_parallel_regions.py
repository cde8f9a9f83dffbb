"""tp_regions on captured graphs: the column/row regions of a GPT's and a Llama's layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from orgel.graph.capture import capture
from orgel.graph.tensor_parallel import tp_regions
from orgel.models.gpt import build_gpt


def _names(graph, leaves):  # placeholder names -> the model's parameter names
    return tuple(graph.attr_of[leaf] for leaf in leaves)


def test_gpt_layers_give_an_attention_and_an_mlp_region_each() -> None:
    w = build_gpt(batch_size=2, d_model=32, n_heads=4, n_layers=2, seq_len=8, vocab_size=64)
    graph = capture(w.model, w.inputs)
    regions = tp_regions(graph.graph_module)
    assert len(regions) == 4  # the LM head reads no column output: it stays whole
    for layer, (attn, mlp) in enumerate(zip(regions[::2], regions[1::2], strict=True)):
        p = f"encoder.blocks.{layer}"
        assert _names(graph, attn.column_params) == (f"{p}.attn.qkv.weight", f"{p}.attn.qkv.bias")
        assert _names(graph, attn.row_params) == (f"{p}.attn.proj.weight", f"{p}.attn.proj.bias")
        inner = [n for n in graph.graph_module.graph.nodes if n.name in attn.inner]
        assert "scaled_dot_product_attention" in {getattr(n.target, "__name__", "") for n in inner}
        assert _names(graph, mlp.column_params) == (f"{p}.mlp.fc.weight", f"{p}.mlp.fc.bias")
        assert _names(graph, mlp.row_params) == (f"{p}.mlp.out.weight", f"{p}.mlp.out.bias")
        assert len(mlp.inner) == 1  # gelu
        for r in (attn, mlp):
            assert r.row_shape == (2, 8, 32)
            assert r.allreduce_elements() == 2 * 8 * 32
            assert r.allreduce_bytes() == 4 * 2 * 8 * 32


@pytest.mark.hf
def test_llama_layers_give_qkv_and_gate_up_regions() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    graph = capture(model, {"input_ids": torch.randint(0, 64, (2, 8))})
    regions = tp_regions(graph.graph_module)
    assert len(regions) == 4
    for layer in range(2):
        attn, mlp = regions[2 * layer], regions[2 * layer + 1]
        p = f"model.layers.{layer}"
        assert _names(graph, attn.column_params) == tuple(
            f"{p}.self_attn.{x}_proj.weight" for x in "qkv")
        assert _names(graph, attn.row_params) == (f"{p}.self_attn.o_proj.weight",)
        assert len(attn.columns) == 3 and attn.row_bias is None
        assert _names(graph, mlp.column_params) == (f"{p}.mlp.gate_proj.weight",
                                                    f"{p}.mlp.up_proj.weight")
        assert _names(graph, mlp.row_params) == (f"{p}.mlp.down_proj.weight",)
        assert mlp.allreduce_elements() == 2 * 8 * 32


@pytest.mark.hf
def test_gpt2_conv1d_layers_give_regions_with_their_weights_transposed() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                  n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    graph = capture(model, {"input_ids": torch.randint(0, 64, (2, 8))})
    regions = tp_regions(graph.graph_module)
    assert len(regions) == 4
    for layer in range(2):
        attn, mlp = regions[2 * layer], regions[2 * layer + 1]
        p = f"transformer.h.{layer}"
        assert _names(graph, attn.column_params) == (f"{p}.attn.c_attn.weight",
                                                     f"{p}.attn.c_attn.bias")
        assert _names(graph, mlp.row_params) == (f"{p}.mlp.c_proj.weight",
                                                 f"{p}.mlp.c_proj.bias")
        for r in (attn, mlp):  # addmm weights are [in, out]: the split dimensions swap
            assert r.weight_dim(r.column_params[0], column=True) == 1
            assert r.weight_dim(r.column_params[1], column=True) == 0  # the bias
            assert r.weight_dim(r.row_weight, column=False) == 0
        assert mlp.allreduce_elements() == 2 * 8 * 32  # addmm's [rows, out]: the same sum


class _Escaping(nn.Module):
    """An MLP whose hidden activation is also returned: no region (it would escape)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)
        self.tied = nn.Linear(8, 16)
        self.back = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.relu(self.fc(x))
        y = self.out(h)
        z = self.back(self.tied(y) * 2)
        return y, h, z + self.tied.weight.sum()


def test_an_escaping_value_or_a_weight_read_elsewhere_makes_no_region() -> None:
    graph = capture(_Escaping(), (torch.randn(3, 8),))
    assert tp_regions(graph.graph_module) == []


class _StageTail(nn.Module):
    """A stage that starts between an MLP's two linears: ``out`` reads a received hidden
    activation, the residual stream comes in too, and an LM head ends the stage."""

    def __init__(self) -> None:
        super().__init__()
        self.out_w = nn.Parameter(torch.randn(8, 16))
        self.norm = nn.LayerNorm(8)
        self.head_w = nn.Parameter(torch.randn(32, 8))

    def forward(self, residual: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        x = residual + torch.nn.functional.linear(hidden, self.out_w)
        return torch.nn.functional.linear(self.norm(x), self.head_w)


def test_a_region_never_takes_in_the_residual_stream() -> None:
    """``out`` and the LM head look like a column and a row, but the add between them
    reads the residual stream (a stage input with a gradient): that is no region."""
    gm = torch.fx.symbolic_trace(_StageTail())
    assert tp_regions(gm, {"residual": True, "hidden": True}) == []
    # were the residual a value without a gradient (a mask, say), it would be one
    assert len(tp_regions(gm, {"residual": False, "hidden": True})) == 1

"""Model zoo, Hugging Face test workloads, demo corpus and examples: run, capture, contracts."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import zoo
from orgel.data import WordTokenizer, generate_corpus, load_corpus, text_batches
from orgel.models import NAMES, ZooWorkload, build
from orgel.models.gpt import BENCHMARK_CONFIG, GPTConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Losses that mix samples of a batch (contrastive negatives, BatchNorm statistics):
# splitting the batch changes the result, so micro-batched training is not exact.
BATCH_COUPLED = ("clip", "resnet")


def capture_run(
    w: ZooWorkload, *, fullgraph: bool = True
) -> tuple[list[torch.fx.GraphModule], Any]:
    """The fx graphs dynamo captures for one forward of ``w.model``, and that forward's output."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        output = zoo.call(torch.compile(w.model, backend=backend, fullgraph=fullgraph), w.inputs)
    finally:
        torch._dynamo.reset()
    return graphs, output


def capture(w: ZooWorkload, *, fullgraph: bool = True) -> list[torch.fx.GraphModule]:
    """The fx graphs dynamo captures for one forward of ``w.model``."""
    return capture_run(w, fullgraph=fullgraph)[0]


def batch_rows(x: Any, rows: slice) -> Any:
    """Rows ``rows`` of every tensor in ``x`` (tensor, tuple or dict)."""
    if isinstance(x, dict):
        return {k: v[rows] for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(v[rows] for v in x)
    return x[rows]


# ---------------------------------------------------------------- every workload


@pytest.mark.parametrize("name", zoo.NAMES)
def test_forward_backward_gives_finite_scalar_and_grads(name: str) -> None:
    w = zoo.workload(name, batch_size=4)
    loss = zoo.loss_of(w)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    missing = [n for n, p in w.model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{name}: parameters without gradient: {missing[:5]}"


@pytest.mark.parametrize("name", zoo.CAPTURABLE)
def test_captures_as_one_graph_with_same_output(name: str) -> None:
    # The backend runs the captured graph itself, so the output below is the graph's.
    w = zoo.workload(name, batch_size=2)
    graphs, output = capture_run(w)
    assert len(graphs) == 1
    torch.testing.assert_close(w.loss_fn(output, w.targets), zoo.loss_of(w))


def test_graphbreak_model_breaks_the_graph() -> None:
    w = zoo.workload("graphbreak")
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # Unsupported or UserError
        capture(w, fullgraph=True)
    assert len(capture(w, fullgraph=False)) >= 2


@pytest.mark.parametrize("name", [n for n in zoo.NAMES if n not in BATCH_COUPLED])
def test_loss_is_a_batch_mean(name: str) -> None:
    # Micro-batching relies on it: the mean of the two halves' losses is the full loss.
    w = zoo.workload(name, batch_size=4)
    halves = [
        w.loss_fn(zoo.call(w.model, batch_rows(w.inputs, s)), batch_rows(w.targets, s))
        for s in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, zoo.loss_of(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", BATCH_COUPLED)
def test_batch_coupled_losses_do_depend_on_the_split(name: str) -> None:
    w = zoo.workload(name, batch_size=4)
    halves = [
        w.loss_fn(zoo.call(w.model, batch_rows(w.inputs, s)), batch_rows(w.targets, s))
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert not torch.allclose((halves[0] + halves[1]) / 2, zoo.loss_of(w))


# ---------------------------------------------------------------- registry


@pytest.mark.parametrize("name", NAMES)
def test_build_is_seeded_and_sized(name: str) -> None:
    a, b, c = (build(name, batch_size=3, seed=s) for s in (7, 7, 8))
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert any(
        not torch.equal(x, y)
        for x, y in zip(a.model.state_dict().values(), c.model.state_dict().values(), strict=True)
    )
    tensors = list(a.inputs.values()) if isinstance(a.inputs, dict) else list(a.inputs)
    assert all(t.shape[0] == 3 for t in tensors) and a.targets.shape[0] == 3
    torch.testing.assert_close(zoo.loss_of(a), zoo.loss_of(b))


def test_registry_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="choose one of: gpt"):
        build("gtp")
    with pytest.raises(TypeError, match="valid: .*d_model"):
        build("gpt", d_modle=8)
    with pytest.raises(ValueError, match="n_heads"):
        build("gpt", d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        build("vit", batch_size=0)
    with pytest.raises(ValueError, match="fixes"):
        build("tied", tie_embeddings=False)


def test_gpt_config_and_tied_embeddings() -> None:
    w = build("gpt", batch_size=2, vocab_size=50, d_model=16, n_layers=3, n_heads=2, seq_len=8)
    assert len(w.model.encoder.blocks) == 3
    assert zoo.call(w.model, w.inputs).shape == (2, 8, 50)
    assert w.model.lm_head.weight is not w.model.tok_emb.weight
    tied = build("tied").model
    assert tied.lm_head.weight is tied.tok_emb.weight
    # A fresh LM starts near uniform: loss close to ln(vocab).
    assert abs(zoo.loss_of(build("tied")).item() - math.log(GPTConfig().vocab_size)) < 0.5
    assert (BENCHMARK_CONFIG.n_layers, BENCHMARK_CONFIG.d_model) == (8, 256)
    assert (BENCHMARK_CONFIG.seq_len, BENCHMARK_CONFIG.vocab_size) == (128, 1000)


def _dependencies(gm: torch.fx.GraphModule, data: set[str]) -> dict[str, set[str]]:
    """For each node, the data-input placeholders it (transitively) reads."""
    deps: dict[torch.fx.Node, set[str]] = {}
    for node in gm.graph.nodes:
        own = {node.name} & data if node.op == "placeholder" else set()
        deps[node] = own.union(*(deps[a] for a in node.all_input_nodes))
    return {n.name: d for n, d in deps.items()}


@pytest.mark.parametrize(("name", "max_joined"), [("clip", 1), ("dlrm", 12), ("mmt", 4)])
def test_branches_read_only_their_own_input(name: str, max_joined: int) -> None:
    w = zoo.workload(name)
    (gm,) = capture(w)
    data = {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name[2:-1] in w.inputs}
    assert len(data) == len(w.inputs)
    deps = _dependencies(gm, data)
    joined = [n for n, d in deps.items() if len(d) > 1 and n != "output"]
    assert len(joined) <= max_joined, joined
    for placeholder in data:  # every input has a branch of its own
        assert sum(d == {placeholder} for d in deps.values()) >= 3


def test_clip_towers_join_at_the_logits_and_text_can_be_frozen() -> None:
    w = zoo.workload("clip")
    (gm,) = capture(w)
    data = {"l_tokens_", "l_pixels_"}
    joined = [n for n, d in _dependencies(gm, data).items() if d == data and n != "output"]
    assert joined == ["matmul"]  # image @ text.t(): the only op that reads both towers
    w.model.text_tower.requires_grad_(False)
    zoo.loss_of(w).backward()
    assert all(p.grad is None for p in w.model.text_tower.parameters())
    assert all(p.grad is not None for p in w.model.image_tower.parameters())


def test_resnet_batchnorm_updates_running_stats() -> None:
    w = build("resnet")
    before = w.model.stem[1].running_mean.clone()
    zoo.loss_of(w)
    assert not torch.equal(before, w.model.stem[1].running_mean)


# ---------------------------------------------------------------- demo corpus


def test_shipped_corpus_is_the_generated_one() -> None:
    text = load_corpus()
    assert text == generate_corpus()
    assert 20_000 < len(text.encode()) < 100_000


def test_tokenizer_roundtrip_and_unknown_words() -> None:
    tok = WordTokenizer.from_text("the cat saw the dog. the end", vocab_size=4)
    assert tok.vocab == ["<unk>", "the", ".", "cat"]
    assert tok.encode("The cat saw a dog.") == [1, 3, 0, 0, 0, 2]
    assert tok.decode(tok.encode("the cat. the")) == "the cat. the"
    with pytest.raises(ValueError, match="at least 2"):
        WordTokenizer.from_text("x", vocab_size=1)


def test_text_batches_are_shifted_seeded_and_in_vocab() -> None:
    a = text_batches(3, 10, vocab_size=50, seed=4)
    x, y = next(a)
    assert x.shape == y.shape == (3, 10) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 50
    x2, _ = next(text_batches(3, 10, vocab_size=50, seed=4))
    assert torch.equal(x, x2)
    assert not torch.equal(next(a)[0], x)
    with pytest.raises(ValueError, match="seq_len"):
        next(text_batches(1, 10**7, vocab_size=50))


# ---------------------------------------------------------------- examples


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` by file path, as the CLI does."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_EXAMPLES = {
    "gpt": {"seq_len": 16, "d_model": 32, "n_layers": 2},
    "vit": {"image_size": 16, "d_model": 32, "n_layers": 1},
    "clip": {"image_size": 16, "image_layers": 1, "text_layers": 1},
    "unet": {"image_size": 16, "base_width": 8, "depth": 2},
}


@pytest.mark.parametrize("name", sorted(TINY_EXAMPLES))
def test_example_workload_trains_and_captures(name: str) -> None:
    w = load_example(name).workload(batch_size=4, **TINY_EXAMPLES[name])
    zoo.loss_of(w).backward()
    assert len(capture(w)) == 1


def test_example_main_prints_losses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["clip.py", "--steps", "2", "--batch-size", "4"])
    load_example("clip").main()
    out = capsys.readouterr().out
    assert "step    1  loss" in out and "2 steps in" in out

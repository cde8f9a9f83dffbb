"""Models built on the meta device: capture without memory, each rank makes only its own stages.

The references never hold a meta model's values whole either: a chain of linear
layers is trained one layer at a time (forward keeping the boundary
activations, backward layer by layer), each layer made as a rank makes it.

Here: capture and values in one process, and training on forked ranks and under
torchrun. A model larger than a rank's memory limit is in ``test_meta_memory.py``,
the buffers a constructor computes in ``test_meta_buffers.py``; both use the helpers
defined here (``Chain``, ``chain_init``, ``initialized``, ``reference_in_pieces``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from orgel.batching import WorkloadError
from orgel.explicit.api import pipeline
from orgel.graph import capture
from orgel.models import build
from orgel.runtime import checkpoint as ckpt
from orgel.split import split_model
from orgel.split.materialize import (
    MaterializeError,
    Weights,
    materialize_stages,
    module_seed,
)
from orgel.workload import on_meta

LR = 0.1


class Chain(torch.nn.Module):
    """``layers`` linear layers of width ``width`` with ReLUs between them."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def chain_init(module: torch.nn.Module) -> None:
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=module.in_features ** -0.5)
        torch.nn.init.normal_(module.bias, std=0.1)


def initialized(module: torch.nn.Module, name: str, seed: int,
                init: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """``module`` given its values as the documented rule says: reset, then init, seeded."""
    with torch.no_grad():
        torch.manual_seed(module_seed(seed, name))
        reset = getattr(module, "reset_parameters", None)
        if reset is not None:
            reset()
        init(module)
    return module


def _batch(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)


def reference_in_pieces(layer: Callable[[int], torch.nn.Linear], layers: int, x: torch.Tensor,
                        y: torch.Tensor, microbatches: int
                        ) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """One SGD step of :class:`Chain` holding one layer at a time: (loss, updated layers).

    Micro-batch by micro-batch as the pipeline runs them (gradients added in that
    order); ``layer(i)`` makes layer ``i`` with its starting values.
    """
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    acts = [[xm] for xm in xs]
    with torch.no_grad():
        for i in range(layers):
            lin = layer(i)
            for a in acts:
                h = lin(a[-1])
                a.append(torch.relu(h) if i < layers - 1 else h)
            del lin
    grads, loss = [], 0.0
    for a, ym in zip(acts, ys, strict=True):
        out = a[-1].detach().requires_grad_(True)
        mb_loss = torch.nn.functional.mse_loss(out, ym) / microbatches
        mb_loss.backward()
        loss += float(mb_loss.detach())
        grads.append(out.grad)
    updated: list[dict[str, torch.Tensor]] = [{} for _ in range(layers)]
    for i in reversed(range(layers)):
        lin = layer(i)
        for m, a in enumerate(acts):
            inp = a[i].detach().requires_grad_(True)
            h = lin(inp)
            (torch.relu(h) if i < layers - 1 else h).backward(grads[m])
            grads[m] = inp.grad
        with torch.no_grad():
            updated[i] = {f"layers.{i}.{k}": p - LR * p.grad for k, p in lin.named_parameters()}
        del lin
    return loss, updated


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


# -- capture and values, in one process -------------------------------------------------------


def test_capture_of_a_meta_model_has_the_facts_of_a_real_capture() -> None:
    real, inputs, _, _ = build("gpt", batch_size=4, seed=0, n_layers=2, d_model=32)
    with torch.device("meta"):
        meta, _, _, _ = build("gpt", batch_size=4, seed=0, n_layers=2, d_model=32)
    assert on_meta(meta) and not on_meta(real)
    a, b = capture(real, inputs), capture(meta, inputs)
    facts = ("op", "shape", "dtype", "nbytes", "param_bytes", "flops", "saved_bytes",
             "requires_grad", "constant")
    assert list(a.nodes) == list(b.nodes)
    for name in a.nodes:
        assert [getattr(a.nodes[name], f) for f in facts] == \
            [getattr(b.nodes[name], f) for f in facts], name
    assert all(p.is_meta for p in meta.parameters())  # nothing was allocated for it
    # `torch.arange(n, device=tokens.device)` traced on meta runs where the batch is
    assert "meta" not in str(b.graph_module.code)


def test_init_values_follow_the_module_names_not_the_stages() -> None:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Chain(4, 16)
    source = Weights(model, init=chain_init, seed=11)
    alone = source.tensors(["layers.2.weight"])["layers.2.weight"]
    every = source.tensors([n for n, _ in model.named_parameters()])
    expected = initialized(torch.nn.Linear(16, 16), "layers.2", 11, chain_init)
    assert isinstance(alone, torch.nn.Parameter) and alone.device.type == "cpu"
    assert torch.equal(alone, expected.weight) and torch.equal(every["layers.2.weight"], alone)
    assert torch.equal(every["layers.2.bias"], expected.bias)
    assert all(p.is_meta for p in model.parameters())  # the model itself keeps no values


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(ids))))


def test_a_tied_parameter_is_one_object_per_rank_under_its_original_names() -> None:
    with torch.device("meta"):
        model = Tied()
    ids = torch.randint(0, 10, (4, 3))
    graph = capture(model, (ids,))
    names = list(graph.nodes)
    cut = names.index(next(n for n in names if graph.nodes[n].op == "relu"))
    split = split_model(graph, [0 if i <= cut else 1 for i in range(len(names))])
    assert split.tied == ["emb.weight"]
    source = Weights(model, init=lambda m: None, seed=3)
    made = materialize_stages(split, [0, 1], source)
    first = dict(split.stages[0].module.named_parameters())
    second = dict(split.stages[1].module.named_parameters())
    assert first["emb.weight"] is second["emb.weight"]  # one Parameter on this rank
    assert set(first) | set(second) == {"emb.weight", "mid.weight", "mid.bias"}
    assert made == sum(t.numel() * 4 for t in (first["emb.weight"], first["mid.weight"],
                                               first["mid.bias"]))
    # the last module of model.apply's order that holds it gives its values (as in one
    # process): the head's Linear.reset_parameters under the head's seed
    head = initialized(torch.nn.Linear(8, 10, bias=False), "head", 3, lambda m: None)
    assert torch.equal(first["emb.weight"], head.weight)
    # a rank holding only the head gets the same values
    alone = Weights(model, init=lambda m: None, seed=3).tensors(["emb.weight"])
    assert torch.equal(alone["emb.weight"], head.weight)


def test_weights_are_read_by_name_from_a_dict_a_torch_save_file_and_safetensors(
        tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    real = Tied()
    state = {k: v.clone() for k, v in real.state_dict().items() if k != "emb.weight"}
    torch.save(state, tmp_path / "w.pt")
    save_file(state, str(tmp_path / "a.safetensors"))  # the tied weight only as head.weight
    with torch.device("meta"):
        model = Tied()
    for weights in (state, tmp_path / "w.pt", str(tmp_path / "a.safetensors"), tmp_path):
        got = Weights(model, weights=weights).tensors(["emb.weight", "mid.bias"])
        assert torch.equal(got["emb.weight"], real.emb.weight), weights
        assert torch.equal(got["mid.bias"], real.mid.bias), weights
        assert isinstance(got["mid.bias"], torch.nn.Parameter)


def test_bad_input_says_what_to_change() -> None:
    with torch.device("meta"):
        model = Tied()
    ids = torch.randint(0, 10, (4, 3))
    with pytest.raises(MaterializeError, match="pass init=.*or weights="):
        pipeline(model, (ids,), ids, lambda o, t: o.sum(), ranks=2)
    with pytest.raises(MaterializeError, match=r"no tensor for 1 .*\['mid.bias'\]"):
        Weights(model, weights={"emb.weight": torch.zeros(10, 8),
                                "mid.weight": torch.zeros(8, 8)}).tensors(["mid.bias"])
    with pytest.raises(MaterializeError, match=r"mid.weight with shape \(8, 9\).*\(8, 8\)"):
        Weights(model, weights={"mid.weight": torch.zeros(8, 9)}).tensors(["mid.weight"])
    with pytest.raises(MaterializeError, match="init left mid.weight unset"):
        _bare_init()
    with pytest.raises(ValueError, match="for a model built on the meta device"):
        pipeline(Tied(), (ids,), ids, lambda o, t: o.sum(), ranks=2, init=chain_init)
    # a forward that opens torch.autocast on its tensors' device (transformers 4.x's
    # rotary embedding), which torch refuses for "meta" even outside orgel
    with torch.device("meta"):
        casting = AutocastOff()
    x = torch.randn(4, 8)
    with pytest.raises(WorkloadError, match="opens torch.autocast on the meta device.*CPU"):
        pipeline(casting, (x,), x, torch.nn.functional.mse_loss, ranks=2,
                 weights=AutocastOff().state_dict())


class AutocastOff(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=self.a.weight.device.type, enabled=False):
            return self.a(x)


def _bare_init() -> None:
    class Bare(torch.nn.Module):  # no reset_parameters, and init does not set it
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(8, 8, device="meta"))

    holder = torch.nn.Module()
    holder.mid = Bare()
    Weights(holder, init=lambda m: None).tensors(["mid.weight"])


# -- training on forked ranks ----------------------------------------------------------------


@pytest.mark.slow
def test_weights_from_safetensors_train_exactly_on_two_ranks(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    layers, width = 4, 32
    for i in range(layers):  # written one layer per file, as sharded checkpoints are
        lin = initialized(torch.nn.Linear(width, width), f"layers.{i}", 9, chain_init)
        save_file({f"layers.{i}.{k}": p.detach() for k, p in lin.named_parameters()},
                  str(tmp_path / f"part{i}.safetensors"))
    with torch.device("meta"):
        model = Chain(layers, width)
    x, y = _batch(width)

    def stored(i: int) -> torch.nn.Linear:
        lin = torch.nn.Linear(width, width)
        part = load_file(str(tmp_path / f"part{i}.safetensors"))
        lin.load_state_dict({k.rsplit(".", 1)[1]: v for k, v in part.items()})
        return lin

    with pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=2, microbatches=2,
                  optimizer=_sgd, threads=1, weights=tmp_path) as pipe:
        loss = pipe.step((x,), y)
        state = pipe.state_dict()
        folder = pipe.save(tmp_path / "ckpt")  # each rank writes its own shard
    ref_loss, updated = reference_in_pieces(stored, layers, x, y, 2)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert list(state) == [n for n, _ in model.named_parameters()]  # the original names
    saved = ckpt.read_names(folder, list(state))["params"]
    for part in updated:
        for name, t in part.items():
            torch.testing.assert_close(state[name], t, rtol=1e-6, atol=1e-7, msg=name)
            assert torch.equal(saved[name], state[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [2, "auto"])
def test_a_meta_gpt_is_profiled_block_by_block_and_trains_like_one_process(
        cache: Path, microbatches: int | str) -> None:
    def init(m: torch.nn.Module) -> None:
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)

    with torch.device("meta"):
        model, _, _, _ = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
    reference, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2,
                                                d_model=32)
    seen: set[int] = set()
    for name, module in reference.named_modules():  # no tied weights: any order
        if id(module) not in seen and (module._parameters or module._buffers):
            seen.add(id(module))
            initialized(module, name, 4, init)
    torch.manual_seed(4)
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=microbatches,
                  optimizer=_sgd, threads=1, init=init) as pipe:  # profiled block by block
        losses = [pipe.step(inputs, targets) for _ in range(2)]
        state = pipe.state_dict()
        assert pipe.plan.costs is not None or pipe.plan.prediction  # planned from a profile
        if microbatches == "auto":  # each count tried (2, 4, 8) profiled at its size
            assert len(list(cache.rglob("blocks-*.json"))) == 3
    assert list(cache.rglob("*.json"))  # profiled here (an empty cache), not read back
    opt = _sgd(list(reference.parameters()))
    for loss in losses:
        opt.zero_grad()
        expected = loss_fn(reference(*inputs), targets)
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert list(state) == list(reference.state_dict())
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)


TORCHRUN_SCRIPT = '''
import json, sys
import torch
import orgel.explicit.api as api
from test_meta import Chain, _batch, _sgd, chain_init

with torch.device("meta"):
    model = Chain(4, 32)
x, y = _batch(32)
torch.manual_seed(5 + torch.distributed.get_rank() if torch.distributed.is_initialized() else 5)
pipe = api.pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=2, microbatches=2,
                    optimizer=_sgd, init=chain_init)
loss = pipe.step((x,), y)
state = {k: v.tolist() for k, v in pipe.state_dict().items()}
made = pipe.call_ranks("memory")[pipe._ranks.engine.rank]["made"]
with open(f"{sys.argv[1]}/rank{torch.distributed.get_rank()}.json", "w") as f:
    json.dump({"loss": loss, "state": state, "made": made}, f)
pipe.close()
'''


#: the script the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"meta": (TORCHRUN_SCRIPT, [])}


@pytest.mark.slow
@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("meta")
def test_under_torchrun_each_rank_makes_its_own_stages_with_rank_zeros_seed(
        torchrun_part: Path) -> None:
    import json

    results = [json.loads((torchrun_part / f"rank{r}.json").read_text()) for r in range(2)]
    x, y = _batch(32)
    ref_loss, updated = reference_in_pieces(  # rank 0's seed (5), every rank
        lambda i: initialized(torch.nn.Linear(32, 32), f"layers.{i}", 5, chain_init), 4, x, y, 2)
    layer = (32 * 32 + 32) * 4
    made = [r["made"] for r in results]  # each rank its own layers, together the model
    assert sum(made) == 4 * layer and all(0 < m < 4 * layer for m in made)
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-6)
        for part in updated:
            for name, t in part.items():
                torch.testing.assert_close(torch.tensor(r["state"][name]), t, rtol=1e-6,
                                           atol=1e-7, msg=name)

"""Models built on the meta device: capture without memory, each rank makes only its own stages.

The references never hold a meta model's values whole either: a chain of linear
layers is trained one layer at a time (forward keeping the boundary
activations, backward layer by layer), each layer made as a rank makes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from orgel.explicit.api import pipeline
from orgel.graph import capture
from orgel.models import build
from orgel.plan.balanced import balanced_plan
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


def _bare_init() -> None:
    class Bare(torch.nn.Module):  # no reset_parameters, and init does not set it
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(8, 8, device="meta"))

    holder = torch.nn.Module()
    holder.mid = Bare()
    Weights(holder, init=lambda m: None).tensors(["mid.weight"])


# -- training on forked ranks ----------------------------------------------------------------


def _vm_data() -> int:
    """This process's private writable memory (``VmData``: heap, anonymous maps, stacks)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def _free_heap() -> int:
    """Bytes malloc holds free in its arenas (glibc ``mallinfo2().fordblks``; 0 elsewhere).

    They count in ``VmData`` but are reused without growing it: a limit must
    leave them out, or a process forked from one that freed memory could use them
    on top of its budget.
    """
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    mallinfo2.restype = Mallinfo2
    return int(mallinfo2().fordblks)


def limit_data(budget: int, held: int = 0) -> dict[str, int]:
    """Let this process hold at most ``budget`` more bytes of data than it uses now.

    Sets ``RLIMIT_DATA`` (soft and hard: nothing in the process can raise it
    again) to the data in use (``VmData`` less malloc's free bytes less ``held``,
    bytes already made that the budget must count) plus ``budget``. Linux >= 4.7
    counts private writable mappings against it (heap, anonymous maps, thread
    stacks), not the ``PROT_NONE`` reservations of torch and gloo that make
    ``RLIMIT_AS`` useless here; an allocation past it fails (torch:
    ``RuntimeError: ... can't allocate memory``; Python: ``MemoryError``).
    """
    import resource

    data, free = _vm_data(), _free_heap()
    limit = data - free - held + budget
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    return {"data": data, "free": free, "held": held, "limit": limit}


class InitUnderLimit:
    """``chain_init`` that first limits each rank's memory (:func:`limit_data`).

    A rank makes its stages' tensors module by module, each module's right
    before ``init`` runs on it, after the process group and its threads exist:
    on its first call in a process other than the test's, this sets the limit,
    counting the module it was given as already held, and writes what it set to
    ``folder/<pid>.json``.
    """

    def __init__(self, budget: int, folder: Path) -> None:
        self.budget, self.folder = budget, folder
        self.controller, self.limited = os.getpid(), -1

    def __call__(self, module: torch.nn.Module) -> None:
        pid = os.getpid()
        if pid not in (self.controller, self.limited):
            self.limited = pid
            held = sum(t.numel() * t.element_size()
                       for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])
            (self.folder / f"{pid}.json").write_text(json.dumps(limit_data(self.budget, held)))
        chain_init(module)


def _one_process_under(budget: int, layers: int, width: int, x: torch.Tensor,
                       y: torch.Tensor) -> tuple[str, int, str]:
    """Build and train the whole chain in one forked process under ``budget``, as a rank is.

    Returns (how far it got: "building", "training" or "trained", the layers it
    made, the error).
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    read, write = ctx.Pipe(duplex=False)

    def run() -> None:
        made: list[torch.nn.Module] = []
        where = "building"
        try:
            limit_data(budget)
            for i in range(layers):
                made.append(initialized(torch.nn.Linear(width, width), f"layers.{i}", 5,
                                        chain_init))
            where = "training"
            with torch.device("meta"):
                chain = Chain(layers, width)
            chain.layers = torch.nn.ModuleList(made)
            opt = _sgd_momentum(list(chain.parameters()))
            for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
                (torch.nn.functional.mse_loss(chain(xm), ym) / 2).backward()
            opt.step()
            write.send(("trained", len(made), ""))
        except (MemoryError, RuntimeError) as exc:
            count = len(made)
            made.clear()
            write.send((where, count, f"{type(exc).__name__}: {str(exc)[:200]}"))

    proc = ctx.Process(target=run)
    proc.start()
    try:
        if not read.poll(180):
            raise TimeoutError("the one-process control did not answer in 180 s")
        result: tuple[str, int, str] = read.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return result


def _sgd_momentum(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum: state as large as the parameters; its first step is plain SGD's."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmData (Linux)")
def test_a_model_larger_than_a_ranks_memory_limit_trains_exactly_on_four_ranks(
        tmp_path: Path) -> None:
    """A chain 3 times a rank's memory limit trains on 4 ranks; one process under it fails.

    32 linear layers of 2048x2048: 512 MiB of parameters, 1.5 GiB with their
    gradients and SGD's momentum. Each rank limits itself as it starts making
    its stages (:class:`InitUnderLimit`: ``RLIMIT_DATA``, enforced by the
    kernel) to 512 MiB more data than it held, and trains its 8 layers (384 MiB
    of state) in it: measured here, a rank needs 416-464 MiB (the heap it
    inherits decides), the rest being the step's temporaries (such as a layer's
    gradient of the second micro-batch before it is added) and freed heap a
    later tensor does not fit in. One process under the same limit cannot even
    make the whole chain (it stops at the 32nd layer: the parameters alone are
    the limit). The step's loss and every updated parameter match a reference
    that holds one layer at a time (momentum's first step is plain SGD's). The
    parameters come back through ``call_ranks`` (torch hands tensors over in
    shared memory, which the limit does not count); ``pipe.save`` would not fit:
    a shard copies the rank's parameters and optimizer state before writing.
    ``RLIMIT_AS`` would count torch's and gloo's virtual reservations, not tensors.
    """
    layers, width, ranks, budget = 32, 2048, 4, 512 << 20
    with torch.device("meta"):
        model = Chain(layers, width)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert full >= budget  # the parameters alone; with gradients and momentum 3 times it
    x, y = _batch(width)
    where, made_layers, error = _one_process_under(budget, layers, width, x, y)
    assert where != "trained" and ("can't allocate memory" in error or "MemoryError" in error), \
        (where, made_layers, error)
    plan = balanced_plan(capture(model, (x[:4],)), ranks=ranks, microbatches=2)
    limits = tmp_path / "limits"
    limits.mkdir()
    torch.manual_seed(5)
    with pipeline(model, (x,), y, torch.nn.functional.mse_loss, ranks=ranks, microbatches=2,
                  optimizer=_sgd_momentum, threads=1, plan=plan,
                  init=InitUnderLimit(budget, limits)) as pipe:
        pids = set(pipe.worker_pids)
        loss = pipe.step((x,), y)
        memory = pipe.call_ranks("memory")
        got = {n: t.clone() for part in pipe.call_ranks("named_params") for n, t in part}
    set_in = {int(f.stem): json.loads(f.read_text()) for f in limits.glob("*.json")}
    assert set(set_in) == pids  # every rank was limited, nothing else
    for r, m in enumerate(memory):
        assert 0 < m["made"] <= full / ranks, (r, m)
        assert 3 * m["made"] < budget, (r, m)  # its state fits, with room for the step
    assert sum(m["made"] for m in memory) == full
    ref_loss, updated = reference_in_pieces(
        lambda i: initialized(torch.nn.Linear(width, width), f"layers.{i}", 5, chain_init),
        layers, x, y, 2)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert sorted(got) == sorted(n for part in updated for n in part)
    for part in updated:
        for name, t in part.items():
            torch.testing.assert_close(got[name], t, rtol=1e-6, atol=1e-7, msg=name)


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
def test_a_meta_gpt_is_profiled_block_by_block_and_trains_like_one_process(cache: Path) -> None:
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
    with pipeline(model, inputs, targets, loss_fn, ranks=2, microbatches=2, optimizer=_sgd,
                  threads=1, init=init) as pipe:  # no plan: profiled one block at a time
        losses = [pipe.step(inputs, targets) for _ in range(2)]
        state = pipe.state_dict()
        assert pipe.plan.costs is not None or pipe.plan.prediction  # planned from a profile
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


@pytest.mark.slow
def test_under_torchrun_each_rank_makes_its_own_stages_with_rank_zeros_seed(
        tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    from orgel.launch.processes import free_port

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
             str(tmp_path)], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
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


# -- buffers a constructor computes (masks, position ids) ---------------------------------------


class CausalAttention(torch.nn.Module):
    """Single-head attention with a registered causal mask (bool), as many GPTs have."""

    def __init__(self, d: int, length: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(length, length, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~self.mask, float("-inf"))
        return x + self.proj(torch.softmax(scores, dim=-1) @ v)


class Positions(torch.nn.Module):
    """Position embeddings read through registered position ids (int64)."""

    def __init__(self, d: int, length: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(length, d)
        self.register_buffer("ids", torch.arange(length), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table(self.ids)


class MaskedGPT(torch.nn.Module):
    def __init__(self, vocab: int = 16, d: int = 16, length: int = 6) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = Positions(d, length)
        self.blocks = torch.nn.ModuleList(CausalAttention(d, length) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.pos(self.emb(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def masked_init(m: torch.nn.Module) -> None:
    """Weights as usual, and the buffers the constructors compute: one in place, one assigned."""
    if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(m.weight, std=0.1)
    if isinstance(m, CausalAttention):
        m.mask.copy_(torch.tril(torch.ones_like(m.mask)))
    if isinstance(m, Positions):
        m.ids = torch.arange(m.ids.numel())


def _lm_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())


def test_a_buffer_init_does_not_write_is_reported_by_name() -> None:
    with torch.device("meta"):
        model = MaskedGPT()

    def weights_only(m: torch.nn.Module) -> None:  # sets no buffer
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.1)

    source = Weights(model, init=weights_only)
    with pytest.raises(MaterializeError, match=r"init left blocks\.0\.mask unset \(a torch\.bool"
                       r" tensor .*causal mask.*m\.mask\.copy_"):
        source.tensors(["blocks.0.qkv.weight", "blocks.0.mask"])
    with pytest.raises(MaterializeError, match=r"init left pos\.ids unset \(a torch\.int64"):
        source.tensors(["pos.ids"])

    def through_data(m: torch.nn.Module) -> None:  # writes that bypass the version counter
        if isinstance(m, Positions):
            m.ids.data.copy_(torch.arange(m.ids.numel()))

    made = Weights(model, init=through_data).tensors(["pos.ids"])["pos.ids"]
    assert made.tolist() == list(range(6))
    made = Weights(model, init=masked_init).tensors(["blocks.1.mask", "pos.ids"])
    assert torch.equal(made["blocks.1.mask"], torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert made["pos.ids"].tolist() == list(range(6))


@pytest.mark.slow
def test_a_meta_gpt_with_a_causal_mask_buffer_trains_like_one_process(cache: Path) -> None:
    ids = torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(ids, -1, dims=1)
    with torch.device("meta"):
        model = MaskedGPT()
    with pytest.raises(MaterializeError, match=r"init left (pos\.ids|blocks\.\d\.mask) unset"):
        pipeline(model, (ids,), targets, _lm_loss, ranks=2, microbatches=2, optimizer=_sgd,
                 threads=1, init=lambda m: None)  # in the caller, before any rank starts
    reference = MaskedGPT()
    for name, module in reference.named_modules():
        if module._parameters or module._buffers:
            initialized(module, name, 6, masked_init)
    torch.manual_seed(6)
    with pipeline(model, (ids,), targets, _lm_loss, ranks=2, microbatches=2, optimizer=_sgd,
                  threads=1, init=masked_init) as pipe:
        losses = [pipe.step((ids,), targets) for _ in range(2)]
        state = pipe.state_dict()
    opt = _sgd(list(reference.parameters()))
    for loss in losses:
        opt.zero_grad()
        expected = _lm_loss(reference(ids), targets)
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    assert list(state) == list(reference.state_dict())
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(state[name], t, rtol=1e-5, atol=1e-6, msg=name)

"""A meta model larger than a rank's memory limit trains exactly on four ranks.

Each rank limits its own memory (``RLIMIT_DATA``, enforced by the kernel) as it starts
making its stages; one process under the same limit cannot even make the model. The
reference holds one layer at a time (``reference_in_pieces`` and the chain helpers come
from ``test_meta.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from orgel.explicit.api import pipeline
from orgel.graph import capture
from orgel.plan.balanced import balanced_plan
from test_meta import LR, Chain, _batch, chain_init, initialized, reference_in_pieces


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
    shared memory, which the limit does not count), and ``pipe.save`` writes each rank's
    shard under the limit (it writes the rank's own tensors, no copy of them).
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
        saved = pipe.save(tmp_path / "checkpoints")  # under the same limit
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
    for r in range(ranks):  # the checkpoint holds what the ranks hold
        shard = torch.load(saved / f"rank{r}.pt", weights_only=True)
        for name, t in shard["params"].items():
            assert torch.equal(t, got[name]), name

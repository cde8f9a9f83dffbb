"""``orgel.backend`` under torchrun: the same script on every process, one process's training.

Process 0 runs the closures (its batch is the one trained) with its rank in a thread beside
them; every other process follows its steps (:mod:`orgel.transparent.job`): one graph (with
``tp``), and graph breaks with ``accumulate``. Each test runs a script under torchrun and
checks every process's results against one process doing the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from test_api_torchrun import _torchrun

pytestmark = pytest.mark.slow

SCRIPT = '''
import copy, json, os, sys
import torch
import orgel
from orgel.models import build
from gaps import state_gap

model, inputs, targets, loss_fn = build("gpt", batch_size=8, seed=0, n_layers=2, d_model=32)
reference = copy.deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.05)
pipe = orgel.backend(ranks=int(os.environ["WORLD_SIZE"]), microbatches=2, optimizer=sgd,
                     schedule="1f1b", timeout_s=120, **json.loads(sys.argv[2]))
compiled = torch.compile(model, backend=pipe)


def closure(x, y):
    loss = loss_fn(compiled(x), y) / 2
    pipe.scale(loss).backward()  # float16: GradScaler's scaler.scale(loss) (else loss)
    return float(loss.detach())


(x,) = inputs
got = [sum(pipe.step(closure, x, targets)) for _ in range(2)]
try:  # each process its own batch, as a DistributedSampler gives it: refused on every one
    pipe.step(closure, x.roll(int(os.environ["RANK"]), 0), targets)
    sharded = ""
except ValueError as exc:
    sharded = str(exc)
state = pipe.state_dict()
folder = pipe.save(sys.argv[1])
with torch.no_grad():
    evaluated = float(loss_fn(compiled(x), targets))  # here, on the values the ranks trained


def failing(x, y):
    raise ValueError("the closure of step 3 fails")


try:
    pipe.step(failing, x, targets)
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
got.append(sum(pipe.step(closure, x, targets)))  # every rank dropped step 3: it trains on
state = pipe.state_dict()
pipe.close()
opt = sgd(list(reference.parameters()))
half = json.loads(sys.argv[2]).get("precision") == "16-mixed"
scaler = torch.amp.GradScaler("cpu", enabled=half)
want = []
for _ in range(3):
    opt.zero_grad()
    total = 0.0
    for xm, ym in zip(x.chunk(2), targets.chunk(2)):
        with torch.autocast("cpu", dtype=torch.float16, enabled=half):
            out = reference(xm)
        loss = loss_fn(out, ym) / 2
        scaler.scale(loss).backward()
        total += float(loss.detach())
    scaler.step(opt)
    scaler.update()
    want.append(total)
    if len(want) == 2:  # where the pipeline evaluated
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.float16, enabled=half):  # as precision=
                out = reference(x)
            ref_eval = float(loss_fn(out, targets))
diff = state_gap(state, reference.state_dict())
with open(f"{sys.argv[1]}/result{os.environ['RANK']}.json", "w") as f:
    json.dump({"got": got, "want": want, "diff": diff, "steps": pipe.steps, "eval": evaluated,
               "ref_eval": ref_eval, "folder": str(folder), "error": error,
               "sharded": sharded}, f)
'''


def _check(out: Path, processes: int, options: dict[str, Any]) -> None:
    tol = 1e-5 if options.get("precision") == "16-mixed" else 1e-6
    for rank in range(processes):
        result = json.loads((out / f"result{rank}.json").read_text())
        assert result["got"] == pytest.approx(result["want"], rel=tol), rank
        assert result["diff"] < tol, rank
        assert result["steps"] == 3
        assert result["eval"] == pytest.approx(result["ref_eval"], rel=tol)
        assert result["folder"] == str(out / "step-00000002")
        # every process raises the closure's error (process 0's closure)
        assert "ValueError: the closure of step 3 fails" in result["error"], (rank, result)
        assert result["sharded"].startswith("pipe.step got another batch on process"), result
        assert "(input 'argument 0' differ)" in result["sharded"], result


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.parametrize("options", [
    pytest.param({}, marks=pytest.mark.torchrun_part("backend-two-ranks"), id="two-ranks"),
    pytest.param({"precision": "16-mixed"}, marks=pytest.mark.torchrun_part("backend-fp16"),
                 id="fp16")])
def test_orgel_backend_trains_under_torchrun_as_one_process(
        torchrun_part: Path, options: dict[str, Any]) -> None:
    """Three steps match one process on every process (losses, every weight, an evaluation
    outside step on the trained values); one checkpoint folder; a closure that raises on
    process 0 raises on every process, every rank drops that step, and the next step trains
    as one process's third; nothing hangs. A batch per process is refused on every process
    before the closures run. In float16
    the closures scale their losses (``pipe.scale``) as GradScaler does in one process."""
    _check(torchrun_part, 2, options)


def test_orgel_backend_with_tp_trains_under_torchrun_as_one_process(tmp_path: Path) -> None:
    """The same on 4 processes, two ranks of two-way tensor parallelism."""
    out = tmp_path / "ckpt"
    code, log = _torchrun(tmp_path, SCRIPT, str(out), json.dumps({"tp": 2}), processes=4)
    assert code == 0, log[-3000:]
    _check(out, 4, {"tp": 2})


WIDE = '''
import copy, json, os, sys
import torch
from torch import nn
import orgel
from gaps import state_gap

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(65536, 8), nn.Tanh(), nn.Linear(8, 131072))
reference = copy.deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.05)
pipe = orgel.backend(ranks=2, microbatches=4, optimizer=sgd, schedule="1f1b", timeout_s=60)
compiled = torch.compile(model, backend=pipe)
x, y = torch.randn(16, 65536), torch.randn(16, 131072)


def closure(xm, ym):
    loss = torch.nn.functional.mse_loss(compiled(xm), ym) / 4
    loss.backward()
    return float(loss.detach())


got = pipe.step(closure, x, y)
state = pipe.state_dict()
pipe.close()
opt = sgd(list(reference.parameters()))
want = []
for xm, ym in zip(x.chunk(4), y.chunk(4)):
    loss = torch.nn.functional.mse_loss(reference(xm), ym) / 4
    loss.backward()
    want.append(float(loss.detach()))
opt.step()
diff = state_gap(state, reference.state_dict())
with open(f"{sys.argv[1]}/result{os.environ['RANK']}.json", "w") as f:
    json.dump({"got": got, "want": want, "diff": diff}, f)
'''


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("backend-wide")
def test_a_first_step_whose_inputs_overfill_the_pipes_trains(torchrun_part: Path) -> None:
    """Under torchrun the inputs go to the ranks by value: each micro-batch here is 1 MiB,
    more than a pipe holds, so its send blocks until the input stage reads it in the step.
    On the first step the closures send them once the ranks run, while process 0 issues
    the step (it once sent them itself before issuing it, and waited forever). Each
    micro-batch's outputs (2 MiB) stay on the last rank until the closure's loss reads
    them (:mod:`orgel.explicit.lazy`), over torchrun's connections."""
    for rank in range(2):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert result["got"] == pytest.approx(result["want"], rel=1e-5), rank
        assert result["diff"] < 1e-6, rank


GRAPH_BREAK = '''
import copy, json, os, sys
import torch
import torch.nn.functional as F
from torch import nn
import orgel
from gaps import state_gap


class Break(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        scale = 2.0 if h.abs().mean().item() > 0 else 0.5  # a graph break
        return self.c(torch.tanh(self.b(h * scale)))


torch.manual_seed(0)
model = Break()
reference = copy.deepcopy(model)
sgd = lambda params: torch.optim.SGD(params, lr=0.05)
pipe = orgel.backend(ranks=2, microbatches=2, optimizer=sgd, schedule="1f1b", timeout_s=120,
                     accumulate=2)
compiled = torch.compile(model, backend=pipe)


def closure(x, y):
    loss = F.mse_loss(compiled(x), y) / 2
    loss.backward()
    return float(loss.detach())


g = torch.Generator().manual_seed(1)
batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]
first = sum(pipe.step(closure, *batches[0]))  # the first call of an accumulation, then:


def failing(x, y):
    compiled(x)
    raise ValueError("a closure fails between the model and its backward")


try:
    pipe.step(failing, *batches[1])
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
pending = pipe.pending  # every rank dropped the step, and the accumulation restarts
got = [sum(pipe.step(closure, x, y)) for x, y in batches]
state, steps = pipe.state_dict(), pipe.steps
pipe.close()
opt = sgd(list(reference.parameters()))
want = []
for call, (x, y) in enumerate(batches):
    total = 0.0
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        loss = F.mse_loss(reference(xm), ym) / 4  # two micro-batches, accumulate=2
        loss.backward()
        total += 2 * float(loss.detach())
    want.append(total)
    if call % 2:
        opt.step()
        opt.zero_grad()
diff = state_gap(state, reference.state_dict())
with open(f"{sys.argv[1]}/result{os.environ['RANK']}.json", "w") as f:
    json.dump({"got": got, "want": want, "diff": diff, "steps": steps, "first": first,
               "error": error, "pending": pending}, f)
'''


@pytest.mark.xdist_group("torchrun-pool")
@pytest.mark.torchrun_part("backend-graph-break")
def test_graph_breaks_train_under_torchrun_with_accumulation(torchrun_part: Path) -> None:
    """A compiled model with a graph break: process 0's closures run the Python between its
    graphs; with ``accumulate=2`` four step calls make two optimizer steps, as one process
    accumulating the same. Before them, a first call and then a closure that raises: every
    process raises its error, every rank drops that step and the call before it (the
    accumulation restarts), so the four calls train as if neither had been made."""
    for rank in range(2):
        result = json.loads((torchrun_part / f"result{rank}.json").read_text())
        assert result["got"] == pytest.approx(result["want"], rel=1e-6), rank
        assert result["diff"] < 1e-6, rank
        assert result["steps"] == 2
        assert result["first"] == pytest.approx(result["want"][0], rel=1e-6), rank
        assert result["error"] == ("ValueError: a closure fails between the model and its "
                                   "backward"), rank
        assert result["pending"] == 0, rank


#: the scripts the shared torchrun job runs (``torchrun_pool.py``)
TORCHRUN_PARTS = {"backend-two-ranks": (SCRIPT, ["{}"]),
                  "backend-fp16": (SCRIPT, [json.dumps({"precision": "16-mixed"})]),
                  "backend-wide": (WIDE, []), "backend-graph-break": (GRAPH_BREAK, [])}
